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
#include "wsync/buffers/safetensors.h"
#include "wsync/codec/codec.h"

namespace wsync::bench {

// One rank's runtime tensors: their storage and pieces.
// Move-only: the layout's views point into the tensors' storage, which a
// copy would share.
struct TpRank {
  TpRank() = default;
  TpRank(TpRank&&) = default;
  TpRank& operator=(TpRank&&) = default;
  TpRank(const TpRank&) = delete;
  TpRank& operator=(const TpRank&) = delete;

  std::vector<buffers::OwnedTensor> tensors;
  std::vector<codec::RuntimeTensor> layout;
  std::vector<buffers::OwnedTensor> pristine;  // the base version, to reset to between timed applies
};

// Rank r of `tp` of these canonical tensors, laid out as vLLM lays out
// Llama-style checkpoints; its tensors zeroed.
StatusOr<TpRank> MakeTpRank(const std::vector<buffers::OwnedTensor>& canonical, int tp, int r);
// Copies the pieces of `canonical` into the rank's tensors.
void FillTpRank(TpRank* rank, const std::vector<buffers::OwnedTensor>& canonical);

struct TpBenchOptions {
  SynthOptions synth;       // the model when `dir` is empty
  std::string dir;          // else: consecutive pairs of these snapshots (ratios only)
  std::vector<int> tp = {4};
  int repeat = 5;
  unsigned threads = 2;
};

int RunTpBench(const TpBenchOptions& options);

}  // namespace wsync::bench
