// The patch container: preamble, zstd-compressed directory, payload of chunk
// streams (private). Grammar in docs/patch-format.md.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "chunk_codec.h"
#include "wsync/codec/codec.h"

namespace wsync::codec::internal {

inline constexpr char kMagic[8] = {'W', 'S', 'Y', 'N', 'C', 'P', 'A', 'T'};
inline constexpr uint16_t kFormatVersion = 4;
inline constexpr size_t kPreambleBytes = 40;
inline constexpr size_t kChecksumOffset = 32;
inline constexpr uint32_t kMinChunkBytes = 1u << 20;
inline constexpr uint32_t kMaxChunkBytes = 1u << 26;
inline constexpr uint64_t kMaxTensors = 1u << 20;
inline constexpr uint64_t kMaxNameBytes = 1u << 16;
inline constexpr uint64_t kMaxDims = 16;
inline constexpr uint64_t kMaxTensorBytes = uint64_t{1} << 46;
inline constexpr uint64_t kMaxDirectoryBytes = uint64_t{1} << 28;
inline constexpr uint64_t kMaxPayloadBytes = uint64_t{1} << 50;
inline constexpr uint64_t kMaxCuts = 1u << 16;  // per dimension of a tile grid
// Chunk entry mode bytes beside ChunkMode's: a keyframe's chunk, and a chunk
// a selection left out.
inline constexpr uint8_t kKeyframeChunkMode = 5;
inline constexpr uint8_t kAbsentChunkMode = 255;

// Where a chunk lies in its tensor's two-dimensional view: elements
// [first, first + n) of its cell's row-major order.
struct Tile {
  uint64_t row0 = 0;       // the cell's first row
  uint64_t col0 = 0;       // the cell's first column
  uint64_t cell_cols = 0;  // the cell's width
  uint64_t first = 0;
  uint64_t n = 0;
  uint64_t block = 0;      // its first checksum block in the tensor (cell blocks)
  uint64_t FirstRow() const { return row0 + first / cell_cols; }
  uint64_t LastRow() const { return row0 + (first + n - 1) / cell_cols; }
};

struct ChunkEntry {
  ChunkMode mode = ChunkMode::kEmpty;  // patches only
  uint64_t changed = 0;                // patches only
  uint64_t offset = 0;                 // of the first stream in the payload
  uint64_t pos_len = 0;                // keyframes: the one stream
  uint64_t val_len = 0;
  bool absent = false;                 // left out by a selection
  uint64_t digest = 0;                 // gridded tensors: XXH3_64 of the tile's target bytes
};

struct TensorEntry {
  std::string name;
  DType dtype = DType::kBF16;
  std::vector<uint64_t> shape;
  uint64_t numel = 0;
  uint64_t nbytes = 0;
  uint64_t target_checksum = 0;
  uint64_t rows = 0, cols = 0;           // the two-dimensional view
  std::vector<uint64_t> row_cuts, col_cuts;
  std::vector<ChunkEntry> chunks;
  std::vector<Tile> tiles;               // parallel to chunks
  uint64_t checksum_blocks = 0;          // 1 MiB blocks of its cells, in cell order
  bool gridded() const { return !row_cuts.empty() || !col_cuts.empty(); }
};

// The two-dimensional view of a shape: rows = shape[0] (1 for a scalar),
// columns = the rest.
void ViewOf(const std::vector<uint64_t>& shape, uint64_t numel, uint64_t* rows, uint64_t* cols);

// Checks t's grid against its view and lays out its chunks (t->chunks and
// t->tiles) and its checksum blocks, refusing more than max_chunks before
// allocating. DataLoss naming the field (the caller adds the tensor).
// REQUIRES: chunk_bytes a multiple of kChecksumBlockBytes.
Status LayTiles(TensorEntry* t, uint32_t chunk_bytes, uint64_t max_chunks);

struct Container {
  PatchKind kind = PatchKind::kPatch;
  uint32_t chunk_bytes = 0;
  uint64_t base_version = 0;
  uint64_t target_version = 0;
  uint64_t base_set_checksum = 0;
  std::vector<TensorEntry> tensors;
  std::string_view payload;  // into the parsed bytes
  size_t header_bytes = 0;

  // Elements in chunk c of tensor t.
  size_t ChunkElements(const TensorEntry& t, size_t c) const { return static_cast<size_t>(t.tiles[c].n); }
  std::string_view PosStream(const ChunkEntry& c) const { return payload.substr(c.offset, c.pos_len); }
  std::string_view ValStream(const ChunkEntry& c) const {
    return payload.substr(c.offset + c.pos_len, c.val_len);
  }
};

// Serializes a container whose chunk entries' lengths describe `payload`
// (offsets are recomputed).
std::string WriteContainer(const Container& c, std::string_view payload);

// The fixed 40 bytes a container starts with.
struct Preamble {
  PatchKind kind = PatchKind::kPatch;
  uint32_t chunk_bytes = 0;
  uint32_t directory_zlen = 0;
  uint32_t directory_len = 0;
  uint64_t payload_len = 0;
  uint64_t checksum = 0;
  uint64_t HeaderBytes() const { return kPreambleBytes + directory_zlen; }
  uint64_t TotalBytes() const { return HeaderBytes() + payload_len; }
};

// Parses and checks the preamble at the start of data (which may go on).
StatusOr<Preamble> ReadPreamble(std::string_view data);

// Parses and validates everything but the chunk streams. head_only: data
// holds at least the preamble and the directory and may end anywhere after
// them (a container still arriving) or go on past the container (the next
// segment of a stream); payload is what of it is there, and the checksum is
// not verified.
StatusOr<Container> ReadContainer(std::string_view data, bool verify_checksum, bool head_only = false);

// Hash64 over a list of tensor checksums: the set checksum.
uint64_t SetChecksumOf(const std::vector<uint64_t>& checksums);

}  // namespace wsync::codec::internal
