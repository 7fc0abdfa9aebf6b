// The host's half of applying patches into pieces and tile grids on the
// device (codec::Apply's works: a chunk at a placement, staged::PlanApply).
// Works go in batches of one element width and chunk size; each work's
// chunk is gathered from its placement into a slot of the batch's image (a
// flat array of chunk-sized slots, zero past the chunk's elements), decoded
// against it, its change added there and the result digested there. The
// destination is written only once every work of every part verified, by
// scatter-adding the changes at their placements: all or nothing, and only
// the patch and the compact change cross PCIe. Keyframe parts are decoded
// and verified on the host, and their slots scattered to their placements
// last. Host code; runs without a GPU (the kernels' per-element bodies are
// tile_jobs.h's).
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
#include "wsync/util/thread_pool.h"

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

// The digests of a work's result (its chunk's n * width bytes) as Mismatch
// takes them: a gridded chunk's tile digest (XXH3_64 of all its bytes), else
// one per 1 MiB checksum block.
std::vector<uint64_t> ResultDigests(bool gridded, const uint8_t* bytes, size_t nbytes);

// The first work or group whose result differs from the patch, named as
// codec::Apply names it, or nothing. digests[p][w]: ResultDigests of work w
// of part p.
std::optional<std::string> Mismatch(std::span<const codec::staged::PatchReader* const> readers,
                                    std::span<const codec::staged::ApplyPlan> plans,
                                    const std::vector<std::vector<std::vector<uint64_t>>>& digests);

// A keyframe part's works decoded on the host (each its chunk's n * width
// bytes) and their ResultDigests; DataLoss naming a chunk that does not
// decode.
struct DecodedWorks {
  std::vector<std::vector<uint8_t>> values;
  std::vector<std::vector<uint64_t>> digests;
};
StatusOr<DecodedWorks> DecodeKeyframeWorks(const codec::staged::PatchReader& r, const codec::staged::ApplyPlan& plan,
                                           ThreadPool* pool);

// Appends a decoded work's change at its placement: destination element
// indices (PlacedElement) and deltas (width bytes each).
void AppendChange(const codec::staged::Work& w, const codec::staged::DecodedChunk& dc,
                  std::vector<uint64_t>* index, std::vector<uint8_t>* delta);

}  // namespace wsync::cuda::placed
