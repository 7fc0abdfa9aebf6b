// Subcommands of `wsync` that talk to a local daemon over its unix socket:
// publish (through a source), dump (from a sink), serve-buffers (a stand-in
// inference server that owns a sink's shared memory).
#pragma once

#include <CLI/CLI.hpp>

#include <functional>

#include "wsync/util/status.h"

namespace wsync::cli {

void AddLocalCommands(CLI::App& app, std::function<Status()>* run);

}  // namespace wsync::cli
