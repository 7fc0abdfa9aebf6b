// One chunk as its decoder has it between stages: what the chunk codec's
// first stage (chunk_codec.h's DecodeChunkPositions) makes of a position
// stream without the base, and what the staged API (staged.h) hands its
// callers. Below both, so that neither includes the other.
#pragma once

#include <cstdint>
#include <vector>

#include "wsync/codec/block_logic.h"

namespace wsync::codec::staged {

// One chunk as decoded so far.
struct DecodedChunk {
  ClassSpec spec;
  bool values_pending = false;  // DecodeValues still to run
  bool ranked = false;          // positions are per-class ranks (resolve with the base)
  std::vector<uint32_t> pos;    // ascending, once known
  std::vector<uint64_t> class_counts;  // while ranked: changes per class
  std::vector<uint32_t> ranks;         // while ranked: ascending ranks, class after class
  std::vector<uint8_t> delta;          // once decoded: pos.size() elements of the width

  // Back to a default-constructed chunk, keeping the vectors' capacity (a
  // reused DecodedChunk then neither allocates nor faults in fresh pages).
  void Clear() {
    spec = ClassSpec{};
    values_pending = false;
    ranked = false;
    pos.clear();
    class_counts.clear();
    ranks.clear();
    delta.clear();
  }
};

}  // namespace wsync::codec::staged
