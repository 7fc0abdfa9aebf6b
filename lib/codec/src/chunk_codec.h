// Coding of one chunk of one tensor (private). The chunk grammar is in
// docs/patch-format.md ("Chunk streams").
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "block_ops.h"
#include "wsync/codec/dtype.h"
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

// Encodes the change `d` of a chunk of n elements in the smallest mode.
// base (may be null) is the chunk's old values, used for the class contexts.
template <typename T>
EncodedChunk EncodeChunk(const T* base, size_t n, const SparseDelta<T>& d,
                         const ChunkCodecOptions& options);

// Decodes a chunk into *out (cleared first). base may be null; if the chunk
// is conditioned on the base, FailedPrecondition. Every other failure is
// DataLoss saying what was wrong.
template <typename T>
Status DecodeChunk(ChunkMode mode, uint64_t changed, std::string_view pos, std::string_view val,
                   const T* base, size_t n, ExponentField exponent, SparseDelta<T>* out);

// Whether a chunk's decoding needs the base (its class count is > 1).
bool ChunkNeedsBase(ChunkMode mode, std::string_view pos);

// Applies (or, with undo, reverts) a decoded change in place.
template <typename T>
void ScatterAdd(T* x, const SparseDelta<T>& d, bool undo);

// Keyframe chunk: byte planes of the values, zstd.
template <typename T>
void EncodeKeyframeChunk(const T* values, size_t n, int zstd_level, std::string* out);
template <typename T>
Status DecodeKeyframeChunk(std::string_view stream, size_t n, T* out);

}  // namespace wsync::codec::internal
