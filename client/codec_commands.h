// The offline codec subcommands of `wsync`: diff, apply, merge, keyframe,
// inspect. Each returns a Status; main prints it as one line.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>

#include "wsync/util/status.h"

namespace wsync::cli {

// Adds the subcommands to `app`; the chosen one's action is stored in *run.
void AddCodecCommands(CLI::App& app, std::function<Status()>* run);

}  // namespace wsync::cli
