// Tensor-parallel sinks: what a sink holding one rank's shards
// receives and how long it applies, against a sink holding the whole model,
// in one run; and what the tile grid of the served layouts costs the patch.
//
// The layouts are vLLM's for Llama-style checkpoints (fused qkv and gate_up
// split by rows, o_proj and down_proj by columns, the vocabulary by rows
// padded to 64, everything else whole), built here from the tensor names
// (wsync.layouts is the reference for engines; tests/python checks it
// against vLLM's loading rules). Key/value heads are split, not replicated:
// the degrees measured must divide them.
#pragma once

#include <string>
#include <vector>

#include "synth.h"

namespace wsync::bench {

struct TpBenchOptions {
  SynthOptions synth;       // the model when `dir` is empty
  std::string dir;          // else: consecutive pairs of these snapshots (ratios only)
  std::vector<int> tp = {4};
  int repeat = 5;
  unsigned threads = 2;
};

int RunTpBench(const TpBenchOptions& options);

}  // namespace wsync::bench
