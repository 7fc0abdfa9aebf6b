// Coding of one chunk of one tensor (private). The chunk grammar is in
// docs/patch-format.md ("Chunk streams").
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "block_ops.h"
#include "wsync/codec/codec.h"
#include "wsync/codec/decoded_chunk.h"
#include "wsync/codec/dtype.h"
#include "wsync/codec/sparse_decode.h"
#include "wsync/util/status.h"

namespace wsync::codec::internal {

// Values are part of the patch format: never renumber.
enum class ChunkMode : uint8_t {
  kEmpty = 0,   // nothing changed
  kSparse = 1,  // per-class gaps, range coded
  kBitmap = 2,  // change bitmap, zstd
  kRuns = 3,    // alternating run lengths, range coded
  kDense = 4,   // every element's delta as byte planes, zstd
};
inline constexpr int kChunkModeCount = 5;

// The change of a chunk: ascending positions and their nonzero deltas
// (new - old mod 2^w).
template <typename T>
struct SparseDelta {
  std::vector<uint32_t> pos;
  std::vector<T> delta;
  void Clear() {
    pos.clear();
    delta.clear();
  }
};

struct ChunkCodecOptions {
  int zstd_level = 3;
  bool condition = true;  // use the base's exponent classes
  ExponentField exponent;
  int max_classes = EncodeOptions{}.max_classes;  // the chooser's limit, 1..kMaxClasses
};

struct EncodedChunk {
  ChunkMode mode = ChunkMode::kEmpty;
  uint64_t changed = 0;
  std::string pos;  // position stream (the only stream of a dense chunk)
  std::string val;  // value stream
};

// Appends the change from base to target (n elements each) to *out.
template <typename T>
void DiffChunk(const T* base, const T* target, size_t n, SparseDelta<T>* out);

// ---- Encoding, in stages (the device codec computes the inputs of the last
// stage on the GPU; EncodeChunk runs them all on the host).

// Elements the class chooser's histogram counts in a chunk of n elements.
size_t SampledElements(size_t n);

// The base's exponent histogram over every kSampleStride-th full block;
// hist has exponent.mask + 1 bins. Nothing for integer types (mask 0).
template <typename T>
void SampleHistogram(const T* base, size_t n, ExponentField exponent, uint32_t* hist);

// Chunks of at least this many elements choose their classes from the
// changes in the sampled blocks (enough of them for an estimate); smaller
// ones from every change.
inline constexpr size_t kSampledChoiceElements = size_t{1} << 17;
inline bool ClassesFromSampledChanges(size_t n) { return n >= kSampledChoiceElements; }

// The classes of a chunk from its sampled histogram (null: unconditioned) and
// the base's values at the changed positions (`old`, parallel to d.pos; of a
// large chunk only those in sampled blocks count).
template <typename T>
ClassSpec ChooseClasses(size_t n, const uint32_t* sample_hist, const SparseDelta<T>& d, const T* old,
                        const ChunkCodecOptions& options);

// The chunk in the smallest mode the host coder weighs for its change,
// given the value stream and, when sparse mode is tried (m * 2 <= n), the
// sparse position stream, both as the host codes them (the device's coder,
// sparse_encode.h, makes them too): the other modes' streams are coded here.
template <typename T>
EncodedChunk ChooseMode(size_t n, const SparseDelta<T>& d, const ClassSpec& spec, int zstd_level, std::string sparse,
                        std::string val);

// Whether EncodeChunkStaged needs the per-class ranks of the changes.
bool NeedsRanks(size_t n, size_t m, const ClassSpec& spec);

// Rank of every change among the chunk's elements of its class.
template <typename T>
void RanksByClass(const T* base, size_t n, const std::vector<uint32_t>& pos, const ClassSpec& spec,
                  std::vector<uint32_t>* rank);

// Codes the change in the smallest mode. old: the base's values at d.pos
// (may be null iff spec.k == 1); rank: from RanksByClass when NeedsRanks.
template <typename T>
EncodedChunk EncodeChunkStaged(size_t n, const SparseDelta<T>& d, const T* old, const ClassSpec& spec,
                               const uint32_t* rank, int zstd_level);

// All stages on the host. base (may be null) is the chunk's old values.
template <typename T>
EncodedChunk EncodeChunk(const T* base, size_t n, const SparseDelta<T>& d,
                         const ChunkCodecOptions& options);

// The classes of a chunk from its base and target: ChooseClasses on the
// sampled blocks' histogram and changes (every change in a small chunk).
template <typename T>
ClassSpec ChooseChunkClasses(const T* base, const T* target, size_t n, const ChunkCodecOptions& options);

// All stages on the host from base and target in one sweep (sweep.h): the
// given classes (null: ChooseChunkClasses), then diff and ranks together.
// segment_done(begin, len) runs after each swept segment of the chunk, while
// it is in cache (the caller digests it).
template <typename T>
EncodedChunk EncodeChunkPair(const T* base, const T* target, size_t n, const ChunkCodecOptions& options,
                             const ClassSpec* classes, const std::function<void(size_t, size_t)>& segment_done);

// ---- Decoding, in stages.

// What a chunk's position stream says without the base: the staged API's
// DecodedChunk (its delta field unused at this level).
using ChunkPositions = staged::DecodedChunk;

// Stage 1: checks the chunk and decodes its positions as far as possible
// without the base. An empty or dense chunk is decoded completely into *out
// (values_pending false).
template <typename T>
Status DecodeChunkPositions(ChunkMode mode, uint64_t changed, std::string_view pos, std::string_view val,
                            size_t n, ExponentField exponent, ChunkPositions* cp, SparseDelta<T>* out);

// Stage 2 (ranked chunks): turns ranks into positions by sweeping the base's
// class masks. DataLoss when a rank lies beyond its class.
template <typename T>
Status ResolveRanks(const T* base, size_t n, ChunkPositions* cp);

// Stage 3: decodes the values. old: the base's values at cp.pos (needed iff
// cp.spec.k > 1).
template <typename T>
Status DecodeChunkValues(std::string_view val, const ChunkPositions& cp, const T* old, SparseDelta<T>* out);

// All stages on the host. base may be null; if the chunk is conditioned on
// the base, FailedPrecondition. Every other failure is DataLoss saying what
// was wrong.
template <typename T>
Status DecodeChunk(ChunkMode mode, uint64_t changed, std::string_view pos, std::string_view val,
                   const T* base, size_t n, ExponentField exponent, SparseDelta<T>* out);

// Where a sparse chunk's (mode 1) streams lie, for the decoders written as
// agents (sparse_decode.h): its classes and both rANS streams, pointing into
// pos and val. DataLoss as DecodeChunkPositions for a malformed class header
// or word count.
Status LocateSparseStreams(std::string_view pos, std::string_view val, ExponentField exponent,
                           sparse::ChunkStreams* out);

// Whether a chunk's decoding needs the base (its class count is > 1).
bool ChunkNeedsBase(ChunkMode mode, std::string_view pos);

// Applies a decoded change in place.
template <typename T>
void ScatterAdd(T* x, const SparseDelta<T>& d);

// Keyframe chunk: byte planes of the values, zstd.
template <typename T>
void EncodeKeyframeChunk(const T* values, size_t n, int zstd_level, std::string* out);
template <typename T>
Status DecodeKeyframeChunk(std::string_view stream, size_t n, T* out);

}  // namespace wsync::codec::internal
