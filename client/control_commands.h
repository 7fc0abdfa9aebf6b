// The control-plane subcommands of `wsync`: status, versions, leases, nodes.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>

#include "wsync/util/status.h"

namespace wsync::cli {

void AddControlCommands(CLI::App& app, std::function<Status()>* run);

}  // namespace wsync::cli
