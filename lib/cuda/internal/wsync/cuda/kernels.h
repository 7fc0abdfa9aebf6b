// Launchers of the device kernels, in CUB style: each enqueues its work on
// the given stream and returns; none allocates or synchronizes. Errors are
// launch errors (Internal, with CUDA's message). Pointers are device
// pointers; "width" is the element width in bytes (1, 2, 4 or 8). A library
// built without CUDA has no launchers: use device_codec.h, which reports
// Unavailable instead.
//
// The per-element logic is in logic.h (tested on the CPU); a tensor's blocks
// and chunks are described by logic::Layout.
#pragma once

#include <cstddef>
#include <cstdint>

#include "wsync/codec/block_logic.h"
#include "wsync/cuda/commit_jobs.h"
#include "wsync/cuda/encode_jobs.h"
#include "wsync/cuda/logic.h"
#include "wsync/cuda/sparse_jobs.h"
#include "wsync/cuda/tile_jobs.h"
#include "wsync/util/status.h"

namespace wsync::cuda {

using Stream = void*;  // a cudaStream_t; nullptr is the legacy default stream

// counts[b] = elements of block b that differ between base and target, for
// b < Blocks(); counts[Blocks()] = 0, so that an exclusive scan of
// Blocks() + 1 entries ends with the total.
Status LaunchDiffCounts(const void* base, const void* target, int width, logic::Layout layout, uint32_t* counts,
                        Stream stream);

// Exclusive prefix sum of n values (CUB). With temp == nullptr, sets
// *temp_bytes to the scratch needed and enqueues nothing.
Status ExclusiveScan(void* temp, size_t* temp_bytes, const uint32_t* in, uint32_t* out, size_t n, Stream stream);

// Writes every differing element, in order, at offsets[block] + its rank in
// the block: pos (chunk-relative), delta = target - base (mod 2^w) and old
// = base. offsets: the exclusive scan of LaunchDiffCounts's counts.
Status LaunchDiffScatter(const void* base, const void* target, int width, logic::Layout layout,
                         const uint32_t* offsets, uint32_t* pos, void* delta, void* old, Stream stream);

// chunk_offsets[c] = offsets[c * ChunkBlocks()] for c < Chunks(), and the
// total at Chunks().
Status LaunchChunkOffsets(const uint32_t* offsets, logic::Layout layout, uint32_t* chunk_offsets, Stream stream);

// Per-chunk sampled exponent histograms of the base (bins per chunk; see
// codec::kSampleStride), zeroed first.
Status LaunchSampleHistogram(const void* base, int width, logic::Layout layout, int shift, uint32_t mask,
                             uint32_t bins, uint32_t* hist, Stream stream);

// XXH3-64 of every 1 MiB block of nbytes bytes (codec/checksum.h).
Status LaunchBlockDigests(const void* data, size_t nbytes, uint64_t* digests, Stream stream);

// One region of a batched digest launch: the digests of its 1 MiB blocks go
// to out[0, ChecksumBlockCount(nbytes)), and they are the launch's blocks
// [first_block, first_block + ChecksumBlockCount(nbytes)).
struct DigestJob {
  const void* data;
  uint64_t nbytes;
  uint64_t* out;
  uint64_t first_block;
};

// LaunchBlockDigests of many regions in one launch (a region's CTAs are few,
// and a launch per region leaves the device mostly idle). jobs: a device
// array of njobs, ascending first_block, ending at total_blocks.
Status LaunchBlockDigests(const DigestJob* jobs, size_t njobs, uint64_t total_blocks, Stream stream);

// counts[c * Blocks() + b]: elements of class c in block b under the block's
// chunk's spec (specs: one per chunk), c < kMaxClasses; counts has
// kMaxClasses * Blocks() + 1 entries (the last set to 0). Its exclusive scan
// is the rank prefix of LaunchRanks and LaunchRankPositions.
Status LaunchClassCounts(const void* base, int width, logic::Layout layout, const codec::ClassSpec* specs,
                         uint32_t* counts, Stream stream);

// rank[i] of change i (chunk-relative pos[i], base value old[i], in the
// chunk found from chunk_offsets): elements of its class before it in its
// chunk.
Status LaunchRanks(const void* base, int width, logic::Layout layout, const codec::ClassSpec* specs,
                   const uint32_t* prefix, const uint32_t* chunk_offsets, const uint32_t* pos, const void* old,
                   size_t m, uint32_t* rank, Stream stream);

// The inverse: entry i names chunk[i], class cls[i] and rank[i]; writes its
// chunk-relative position and the base value there. A rank beyond its
// class's elements sets *error to i + 1 (the first such wins).
Status LaunchRankPositions(const void* base, int width, logic::Layout layout, const codec::ClassSpec* specs,
                           const uint32_t* prefix, const uint32_t* chunk, const uint8_t* cls, const uint32_t* rank,
                           size_t m, uint32_t* pos, void* old, uint32_t* error, Stream stream);

// Decodes every job's position stream: for its changes rank[entry + j] (the
// position itself when spec.k == 1), cls[] and chunk[] (= chunk_in_tensor),
// the inputs of LaunchRankPositions; counts[job * kMaxClasses + c] per
// class; error[job] a codec::sparse::SparseError.
Status LaunchSparseRanks(const SparseJob* jobs, size_t njobs, const uint8_t* patch, uint32_t* rank, uint8_t* cls,
                         uint32_t* chunk, uint64_t* counts, uint32_t* error, Stream stream);

// Then every job's positions and values: with spec.k == 1 the positions are
// its ranks; else LaunchRankPositions's positions and old values by class
// (pos[entry + j], old at byte), merged into ascending mpos and mold. Writes
// index[entry + j] = first_element + position and the deltas at `byte` of
// delta; error[job] as above (jobs must have decoded their ranks).
Status LaunchSparseValues(const SparseJob* jobs, size_t njobs, const uint8_t* patch, const uint32_t* rank,
                          const uint64_t* counts, const uint32_t* pos, const uint8_t* old, uint32_t* mpos,
                          uint8_t* mold, uint64_t* index, uint8_t* delta, uint32_t* error, Stream stream);

// Codes every job's chunk in mode 1 (RunSparseEncodeJob; lg: the
// codec::sparse::kLog2Table in device memory): results[job] says whether it
// did and the bytes of its streams.
Status LaunchSparseEncode(const SparseEncodeJob* jobs, size_t njobs, const uint32_t* lg,
                          codec::sparse::SparseEncodeResult* results, Stream stream);

// Copies every segment's bytes to out + at (segments in device memory).
Status LaunchPackSegments(const PackSegment* segments, size_t nsegments, uint8_t* out, Stream stream);

// Slot j of image (slot elements each) from jobs[j] (GatherTileElement),
// j < njobs; jobs in device memory.
Status LaunchGatherTiles(const TileJob* jobs, size_t njobs, int width, uint64_t slot, void* image, Stream stream);
// The reverse (ScatterTileElement): every job's chunk from its slot to its
// placement.
Status LaunchScatterTiles(const TileJob* jobs, size_t njobs, int width, uint64_t slot, const void* image,
                          Stream stream);

// out[i] = x[index[i]].
Status LaunchGather(const void* x, int width, const uint64_t* index, size_t m, void* out, Stream stream);

// x[index[i]] += delta[i] (mod 2^w), or -= with undo. Indices are distinct.
Status LaunchScatterAdd(void* x, int width, const uint64_t* index, const void* delta, size_t m, bool undo,
                        Stream stream);

// The writes of a staged version, changes [0, total) of jobs (a device
// array, ascending first): LaunchCommitCheck sets *first_foreign to the
// lowest change whose element no longer holds the value it was staged
// against (HoldsStaged; it must hold ~0 before: untouched when every change
// holds), LaunchCommitWrite writes every change (WriteStaged).
Status LaunchCommitCheck(const CommitJob* jobs, size_t njobs, uint64_t total, unsigned long long* first_foreign,
                         Stream stream);
Status LaunchCommitWrite(const CommitJob* jobs, size_t njobs, uint64_t total, Stream stream);

// FP32 -> BF16, round to nearest even (codec/bf16.h), n elements.
Status LaunchCastFp32ToBf16(const uint32_t* in, uint16_t* out, size_t n, Stream stream);

}  // namespace wsync::cuda
