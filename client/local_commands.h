// Subcommands of `wsync` that talk to a local daemon over its unix socket:
// publish (through a source), dump (from a sink), serve-buffers (a stand-in
// inference server that owns a sink's shared memory).
#pragma once

#include <CLI/CLI.hpp>

#include <functional>

#include "wsync/util/status.h"

namespace wsync::cli {

void AddLocalCommands(CLI::App& app, std::function<Status()>* run);

// `wsync publish`: registers a safetensors file's tensors (copied into
// memory passed to the source) with the source at `local` and publishes
// them as `version`; prints what the source answered.
Status PublishFile(const std::string& local, const std::string& file, uint64_t version, int64_t wait_ms = 0,
                   int device = -1, bool after_copy = false);

}  // namespace wsync::cli
