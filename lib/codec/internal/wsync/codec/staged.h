// The patch codec cut at its entropy stage, for producers that compute a
// change elsewhere: the device codec (cuda/) diffs, histograms and ranks on
// the GPU and hands the compact results to these classes, which run the same
// entropy coders as EncodePatch and Apply. The host functions run the
// very same stages, so both paths give identical bytes by construction; the
// tests check it.
//
// Encoding a chunk: ChooseClasses (from the base's sampled exponent
// histogram and the old values at the changes) -> ranks of the changes within
// their classes when NeedsRanks -> SetChunk. Decoding a chunk: DecodePositions
// -> (ranked chunks) positions from the ranks and the base's classes ->
// DecodeValues (with the old values when spec.k > 1).
//
// Element arrays are bit patterns of the chunk's width (1, 2, 4 or 8 bytes),
// little-endian, as in the tensors.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "wsync/codec/block_logic.h"
#include "wsync/codec/codec.h"
#include "wsync/codec/decoded_chunk.h"
#include "wsync/codec/sparse_decode.h"
#include "wsync/codec/tile_map.h"

namespace wsync::codec::staged {

// A chunk of a tensor set: the unit of coding.
struct Chunk {
  size_t tensor = 0;          // index in the set
  size_t index = 0;           // chunk index in the tensor
  uint64_t first_element = 0;  // in the tensor's chunk order (its cells in turn; flat order without a grid)
  size_t elements = 0;
  DType dtype = DType::kBF16;
  size_t width = 2;
};

// A cell of a tensor's tile grid (docs/patch-format.md, "Tiles"): the box
// rows [row0, row0 + rows) x columns [col0, col0 + cols) of the tensor's
// two-dimensional view (tensor_cols wide), coded as a flat run of its
// elements in row-major order: its chunks are the writer's chunks
// [first_chunk, first_chunk + chunks), each chunk_bytes but the last. A
// tensor without a grid is one cell. The cell's bytes are contiguous in the
// tensor when cols == tensor_cols.
struct Cell {
  size_t tensor = 0;
  uint64_t row0 = 0, col0 = 0, rows = 0, cols = 0, tensor_cols = 0;
  size_t first_chunk = 0, chunks = 0;
  uint64_t elements() const { return rows * cols; }
  bool contiguous() const { return cols == tensor_cols; }
};

// Bins of the sampled exponent histogram of a dtype (exponent mask + 1); 0
// for integer types, which are never conditioned.
size_t HistogramBins(DType dtype);

// Elements counted by the sampled histogram of a chunk of n elements: the
// full blocks b = 0, kSampleStride, 2 kSampleStride, ...
size_t SampledElements(size_t n);

// One chunk's change, in host memory.
struct ChunkChange {
  size_t count = 0;
  const uint32_t* pos = nullptr;  // ascending, chunk-relative
  const void* delta = nullptr;    // new - old mod 2^w, all nonzero
  const void* old = nullptr;      // the base's values at pos; null: unconditioned
};

// Builds a patch chunk by chunk. SetChunk may run concurrently for distinct
// chunks; everything else is single-threaded.
class PatchWriter {
 public:
  // The layout of a patch from base to target tensors (names, dtypes,
  // shapes; data is not read), with options.grids as EncodePatch lays
  // them. InvalidArgument as EncodePatch.
  static StatusOr<PatchWriter> Create(std::span<const TensorView> tensors, const EncodeOptions& options);
  PatchWriter(PatchWriter&&) noexcept;
  PatchWriter& operator=(PatchWriter&&) noexcept;
  ~PatchWriter();

  const std::vector<Chunk>& chunks() const;
  // Every tensor's cells, tensor after tensor, each tensor's in its chunk
  // order: together they cover the chunks once, in order.
  const std::vector<Cell>& cells() const;
  // Whether chunk i is a tile of a gridded tensor (then SetTileDigest).
  bool gridded(size_t i) const;
  // The chunk whose classes chunk i takes (ClassSourceChunk within its
  // tensor, as a writer index).
  size_t ClassSource(size_t i) const;

  // The classes of chunk i. hist: the base's sampled histogram
  // (HistogramBins entries), or null for no conditioning. The change's
  // positions, old values and deltas are the evidence (of a chunk of at
  // least 2^17 elements, only those in the sampled blocks count).
  // EncodePatch gives chunk c of a tensor the classes chosen for its chunk
  // ClassSourceChunk(c) (block_logic.h); a writer doing the same writes the
  // same bytes.
  ClassSpec ChooseClasses(size_t i, const uint32_t* hist, const ChunkChange& change) const;

  // Whether SetChunk needs the ranks of the changes for this spec.
  bool NeedsRanks(size_t i, size_t count, const ClassSpec& spec) const;

  // Codes chunk i. rank[j]: elements of change j's class before it in the
  // chunk (required when NeedsRanks). InvalidArgument on a violated contract
  // (positions out of order or range, zero delta, missing old values/ranks).
  Status SetChunk(size_t i, const ChunkChange& change, const ClassSpec& spec, const uint32_t* rank);

  // Sets chunk i to sparse position and value streams made elsewhere for a
  // change of `changed` elements that the host coder codes in sparse mode
  // alone (sparse::SparseOnly, which the caller decided: the change itself
  // is not needed); sparse_encode.h's EncodeSparseChunk makes the streams
  // SetChunk would. InvalidArgument when the count rules sparse mode alone
  // out, or the streams' framing is malformed or their classes not spec's.
  Status SetSparseCoded(size_t i, uint64_t changed, const ClassSpec& spec, std::string_view pos,
                        std::string_view val);

  // Codes chunk i given its sparse position and value streams made
  // elsewhere (sparse_encode.h's EncodeSparseChunk makes those SetChunk
  // would): the chunk is them when the host coder weighs no other mode
  // (sparse::SparseOnly), else the smallest of them and the other modes
  // SetChunk weighs, coded here from the change. Gives SetChunk's bytes.
  // InvalidArgument as SetChunk, when sparse mode is not tried
  // (sparse::SparseTried), or when the streams' framing (class header, word
  // counts) is malformed or their classes not spec's; their content is not
  // checked.
  Status SetSparseChunk(size_t i, const ChunkChange& change, const ClassSpec& spec, std::string_view pos,
                        std::string_view val);

  // Tensor digests (checksum.h) of the target, and of the base; a gridded
  // tensor's are taken over its cells in turn.
  Status SetChecksums(std::span<const uint64_t> target, std::span<const uint64_t> base);

  // A gridded chunk's tile digest: XXH3_64 of its target bytes in chunk
  // order (for 1 MiB chunks, the digest of the cell's checksum block that
  // the chunk is). InvalidArgument for a chunk of an ungridded tensor.
  Status SetTileDigest(size_t i, uint64_t digest);

  // The patch. REQUIRES: every chunk, every tile digest and the checksums
  // set.
  StatusOr<std::string> Finish();

 private:
  struct Impl;
  explicit PatchWriter(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// One chunk at one placement: what Apply runs for it.
struct Work {
  size_t chunk = 0;  // the reader's chunk index
  size_t dst = 0;    // in the Destination's list: a whole tensor, or a runtime tensor holding pieces
  size_t group = 0;  // the placed tensor it is part of (an ungridded tensor's checksum verifies its group)
  TileMap map;       // where its elements lie in dst
};

// The works of one part, each group's in chunk order.
struct ApplyPlan {
  std::vector<Work> works;
  std::vector<size_t> group_tensor;      // per group: its tensor in the patch
  std::vector<std::string> group_where;  // per group: how errors name it
  bool whole = true;                     // every tensor at its own destination
};

class PatchReader;

// What codec::Apply would run to apply these parts of a version (as_parts:
// Apply's list form, else one patch) into the destination, with its checks
// and its errors (a piece cutting a chunk, a tensor in two parts, a chunk a
// selection lacks, ...). Works hold no data pointers.
StatusOr<std::vector<ApplyPlan>> PlanApply(std::span<const PatchReader* const> parts, const Destination& destination,
                                           const ApplyOptions& options, bool as_parts);

// Reads a patch or keyframe, gridded or a selection too. The bytes must
// outlive the reader.
// Its chunks decode into DecodedChunk (decoded_chunk.h).
class PatchReader {
 public:
  static StatusOr<PatchReader> Open(std::string_view patch, bool verify_checksum = true);
  PatchReader(PatchReader&&) noexcept;
  PatchReader& operator=(PatchReader&&) noexcept;
  ~PatchReader();

  PatchKind kind() const;
  uint32_t chunk_bytes() const;
  uint64_t base_version() const;
  uint64_t target_version() const;
  uint64_t base_set_checksum() const;
  size_t tensor_count() const;
  uint64_t target_checksum(size_t tensor) const;
  const std::string& tensor_name(size_t tensor) const;
  const std::vector<Chunk>& chunks() const;
  // No tensor has a tile grid and no chunk is absent (not a selection):
  // every chunk is a flat range of a whole tensor.
  bool flat() const;
  bool gridded(size_t tensor) const;
  // The tile grids of its gridded tensors (as EncodeOptions::grids).
  std::vector<TileGrid> grids() const;
  // Chunk i of a gridded tensor: XXH3_64 of its target bytes in chunk order.
  uint64_t tile_digest(size_t i) const;

  // For every tensor of the patch, the index of the destination tensor of
  // the same name, with checks and errors as Apply's.
  StatusOr<std::vector<size_t>> Match(std::span<const MutableTensorView> dst, bool allow_extra) const;

  // Patches: stage 1 of chunk i (no base needed). DataLoss names the chunk.
  Status DecodePositions(size_t i, DecodedChunk* out) const;
  // Patches, once positions are known: the values. old: the base's values at
  // out->pos (needed iff spec.k > 1).
  Status DecodeValues(size_t i, const void* old, DecodedChunk* out) const;
  // Patches: where chunk i's streams lie (pointing into the patch) when it
  // is sparse-coded, for decoders elsewhere (sparse_decode.h); false for
  // every other mode. DataLoss names the chunk, as DecodePositions.
  StatusOr<bool> LocateSparse(size_t i, sparse::ChunkStreams* out) const;
  // Changed elements of chunk i (as its directory entry says; at most its
  // elements once Open succeeded).
  uint64_t changed(size_t i) const;
  // Keyframes: chunk i's values into out (elements * width bytes).
  Status DecodeKeyframe(size_t i, void* out) const;

 private:
  friend StatusOr<std::vector<ApplyPlan>> PlanApply(std::span<const PatchReader* const>, const Destination&,
                                                    const ApplyOptions&, bool);
  struct Impl;
  explicit PatchReader(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Resolves a ranked chunk whose positions were found elsewhere:
// pos_by_class/old_by_class hold the position and old value of every rank in
// out->ranks order (so each class's positions ascend). Merges them into
// out->pos and *old_sorted (resized to pos.size() * width bytes). DataLoss
// when a position repeats or a class's positions do not ascend.
Status MergeRankedPositions(const uint32_t* pos_by_class, const void* old_by_class, size_t width,
                            DecodedChunk* out, std::vector<uint8_t>* old_sorted);

}  // namespace wsync::codec::staged
