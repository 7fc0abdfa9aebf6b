// The host's half of applying patches into pieces and tile grids on the
// device (codec::Apply's works: a chunk at a placement, staged::PlanApply).
// Works go in batches of one element width and chunk size; each work's
// chunk is gathered from its placement into a slot of the batch's image (a
// flat array of chunk-sized slots, zero past the chunk's elements), decoded
// against it, its change added there and the result digested there. The
// destination is written only once every work of every part verified, by
// scatter-adding the changes at their placements: all or nothing, and only
// the patch and the compact change cross PCIe. Host code; runs without a
// GPU (the gather's per-element body is WSYNC_HD, for the kernel).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "wsync/codec/staged.h"
#include "wsync/codec/tile_map.h"
#include "wsync/cuda/tile_jobs.h"

namespace wsync::cuda::placed {

// Work `work` of part `part`.
struct Ref {
  size_t part = 0, work = 0;
};

struct Batch {
  size_t width = 0;
  uint64_t slot = 0;  // elements per slot: the parts' chunk_bytes / width
  std::vector<Ref> works;
};

// The works of every part in batches of one width and slot size, each
// batch's image at most `budget` bytes (or one work), in part and work
// order within a width.
std::vector<Batch> Batches(std::span<const codec::staged::PatchReader* const> readers,
                           std::span<const codec::staged::ApplyPlan> plans, size_t budget);

// The first work or group whose result differs from the patch, named as
// codec::Apply names it, or nothing. digests[p][w]: the block digests of
// work w of part p's result (one per 1 MiB of its chunk's bytes), in order.
// REQUIRES: every gridded chunk of the parts is one block (chunk_bytes of
// 1 MiB), so that its tile digest is that block's.
std::optional<std::string> Mismatch(std::span<const codec::staged::PatchReader* const> readers,
                                    std::span<const codec::staged::ApplyPlan> plans,
                                    const std::vector<std::vector<std::vector<uint64_t>>>& digests);

// Whether every gridded tensor of the parts is coded in chunks of one
// checksum block (1 MiB): what Mismatch needs.
bool TilesAreBlocks(std::span<const codec::staged::PatchReader* const> readers);

// Appends a decoded work's change at its placement: destination element
// indices (PlacedElement) and deltas (width bytes each).
void AppendChange(const codec::staged::Work& w, const codec::staged::DecodedChunk& dc,
                  std::vector<uint64_t>* index, std::vector<uint8_t>* delta);

}  // namespace wsync::cuda::placed
