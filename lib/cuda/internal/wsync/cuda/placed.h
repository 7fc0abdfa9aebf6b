// The host's half of applying patches into pieces and tile grids on the
// device (codec::Apply's works: a chunk at a placement, staged::PlanApply).
// Works go in batches of one element width and chunk size; each work's
// chunk is gathered from its placement into a slot of the batch's image (a
// flat array of chunk-sized slots, zero past the chunk's elements), decoded
// against it, its change added there and the result digested there. The
// destination is written only once every work of every part verified: each
// changed element, checked to still hold the value it was staged against,
// gets its new value (Writes, commit_jobs.h): all or nothing, and only the
// patch and the compact change cross PCIe. Whole tensors are identity
// placements. Keyframe parts are decoded and verified on the host, and
// their slots scattered to their placements last. Host code; runs without a GPU (the kernels' per-element bodies are
// tile_jobs.h's).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>
#include <span>
#include <string>
#include <vector>

#include "wsync/codec/sparse_decode.h"
#include "wsync/codec/staged.h"
#include "wsync/codec/tile_map.h"
#include "wsync/cuda/sparse_jobs.h"
#include "wsync/cuda/tile_jobs.h"
#include "wsync/util/first_error.h"
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

// A destination's staged writes: its changed elements (PlacedElement), the
// values they held when staged and the values they become (width bytes
// each), in the order the works were staged.
struct Writes {
  size_t width = 0;
  std::vector<uint64_t> index;
  std::vector<uint8_t> old, value;
  uint64_t bytes() const { return index.size() * 8 + old.size() + value.size(); }
};

// Appends a work's changes (chunk-relative positions) at their placements:
// old and value hold its changed elements before and after (pos order,
// width bytes each).
void AppendWrites(const codec::staged::Work& w, std::span<const uint32_t> pos, const uint8_t* old,
                  const uint8_t* value, Writes* out);

// Per work of every part ([part][work]): its chunk's streams when the
// device decodes it (a patch's chunk with changes, sparse-coded), else
// nothing. A chunk LocateSparse refuses is recorded in *error under the
// work's index across the parts (part p's first work after every earlier
// part's).
using SparseWorks = std::vector<std::vector<std::optional<codec::sparse::ChunkStreams>>>;
SparseWorks LocateSparseWorks(std::span<const codec::staged::PatchReader* const> readers,
                              std::span<const codec::staged::ApplyPlan> plans, FirstError* error);

// The device's decoding of a batch's sparse-coded works (sparse_jobs.h),
// against the batch's image: a job per work, its changes at entries
// [entry, entry + changed) of the batch's arrays (values at `byte`), its
// positions written as image indices (slot * b.slot + position). Stream
// offsets are into the parts copied back to back: part p's bytes (`bytes`)
// at offsets[p].
struct SparseBatch {
  std::vector<SparseJob> jobs;
  std::vector<size_t> slot;  // each job's slot in the batch
  uint64_t entries = 0, bytes = 0;
  bool conditioned = false;  // some job's classes need the base: ranks resolved in the image
};
SparseBatch PlanSparseBatch(std::span<const codec::staged::PatchReader* const> readers,
                            std::span<const codec::staged::ApplyPlan> plans, const Batch& b, const SparseWorks& sparse,
                            std::span<const std::string_view> bytes, std::span<const uint64_t> offsets);

}  // namespace wsync::cuda::placed
