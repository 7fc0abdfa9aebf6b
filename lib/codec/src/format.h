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
inline constexpr uint16_t kFormatVersion = 2;
inline constexpr size_t kPreambleBytes = 40;
inline constexpr size_t kChecksumOffset = 32;
inline constexpr uint32_t kMinChunkBytes = 1u << 20;
inline constexpr uint32_t kMaxChunkBytes = 1u << 26;
inline constexpr uint64_t kMaxTensors = 1u << 20;
inline constexpr uint64_t kMaxNameBytes = 1u << 16;
inline constexpr uint64_t kMaxDims = 16;
inline constexpr uint64_t kMaxTensorBytes = uint64_t{1} << 46;
inline constexpr uint64_t kMaxDirectoryBytes = uint64_t{1} << 28;

struct ChunkEntry {
  ChunkMode mode = ChunkMode::kEmpty;  // patches only
  uint64_t changed = 0;                // patches only
  uint64_t offset = 0;                 // of the first stream in the payload
  uint64_t pos_len = 0;                // keyframes: the one stream
  uint64_t val_len = 0;
};

struct TensorEntry {
  std::string name;
  DType dtype = DType::kBF16;
  std::vector<uint64_t> shape;
  uint64_t numel = 0;
  uint64_t nbytes = 0;
  uint64_t target_checksum = 0;
  std::vector<ChunkEntry> chunks;
};

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
  size_t ChunkElements(const TensorEntry& t, size_t c) const {
    const size_t per = chunk_bytes / DTypeWidth(t.dtype);
    return static_cast<size_t>(std::min<uint64_t>(per, t.numel - c * per));
  }
  std::string_view PosStream(const ChunkEntry& c) const { return payload.substr(c.offset, c.pos_len); }
  std::string_view ValStream(const ChunkEntry& c) const {
    return payload.substr(c.offset + c.pos_len, c.val_len);
  }
};

// Number of chunks of a tensor of nbytes bytes.
inline uint64_t ChunkCount(uint64_t nbytes, uint32_t chunk_bytes) {
  return (nbytes + chunk_bytes - 1) / chunk_bytes;
}

// Serializes a container whose chunk entries' lengths describe `payload`
// (offsets are recomputed).
std::string WriteContainer(const Container& c, std::string_view payload);

// Parses and validates everything but the chunk streams.
StatusOr<Container> ReadContainer(std::string_view data, bool verify_checksum);

// Hash64 over a list of tensor checksums: the set checksum.
uint64_t SetChecksumOf(const std::vector<uint64_t>& checksums);

}  // namespace wsync::codec::internal
