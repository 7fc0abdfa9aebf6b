// The offline codec subcommands of `wsync`: diff, apply, merge, keyframe,
// inspect. Each returns a Status; main prints it as one line.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>

#include "wsync/buffers/safetensors.h"
#include "wsync/codec/codec.h"
#include "wsync/util/status.h"

namespace wsync::cli {

// Adds the subcommands to `app`; the chosen one's action is stored in *run.
void AddCodecCommands(CLI::App& app, std::function<Status()>* run);

// Zero tensors shaped as a keyframe's tensors (its directory), to apply it into.
std::vector<buffers::OwnedTensor> KeyframeShapedTensors(const codec::PatchInfo& info);

}  // namespace wsync::cli
