#include "format.h"

#include <cstring>

#include "wsync/util/bytes.h"
#include "wsync/codec/checksum.h"
#include "zstd_util.h"
#include "wsync/util/text.h"

namespace wsync::codec::internal {

uint64_t SetChecksumOf(const std::vector<uint64_t>& checksums) {
  return Hash64(checksums.data(), checksums.size() * sizeof(uint64_t));
}

std::string WriteContainer(const Container& c, std::string_view payload) {
  std::string dir;
  ByteWriter d(&dir);
  d.Varint(c.base_version);
  d.Varint(c.target_version);
  d.Varint(c.tensors.size());
  for (const TensorEntry& t : c.tensors) {
    d.Varint(t.name.size());
    d.Bytes(t.name);
    d.U8(static_cast<uint8_t>(t.dtype));
    d.Varint(t.shape.size());
    for (uint64_t dim : t.shape) d.Varint(dim);
    d.U64(t.target_checksum);
    for (const ChunkEntry& ch : t.chunks) {
      if (c.kind == PatchKind::kKeyframe) {
        d.Varint(ch.pos_len);
        continue;
      }
      d.U8(static_cast<uint8_t>(ch.mode));
      if (ch.mode == ChunkMode::kEmpty) continue;
      d.Varint(ch.changed);
      d.Varint(ch.pos_len);
      d.Varint(ch.val_len);
    }
  }
  if (c.kind == PatchKind::kPatch) d.U64(c.base_set_checksum);

  std::string zdir;
  ZstdCompress(dir, 19, &zdir);

  std::string out;
  out.reserve(kPreambleBytes + zdir.size() + payload.size());
  ByteWriter w(&out);
  w.Bytes(std::string_view(kMagic, sizeof(kMagic)));
  w.U16(kFormatVersion);
  w.U8(static_cast<uint8_t>(c.kind));
  w.U8(0);
  w.U32(c.chunk_bytes);
  w.U32(static_cast<uint32_t>(zdir.size()));
  w.U32(static_cast<uint32_t>(dir.size()));
  w.U64(0);  // payload length, below
  w.U64(0);  // checksum, below
  out.append(zdir);
  out.append(payload);
  uint64_t payload_len = payload.size();
  std::memcpy(out.data() + 24, &payload_len, 8);
  // Checksum of every byte but the checksum field itself.
  uint64_t sum = Hash64(out.data(), kChecksumOffset) ^
                 Hash64(out.data() + kPreambleBytes, out.size() - kPreambleBytes);
  std::memcpy(out.data() + kChecksumOffset, &sum, 8);
  return out;
}

StatusOr<Container> ReadContainer(std::string_view data, bool verify_checksum) {
  Container c;
  ByteReader r(data, "patch preamble");
  std::string_view magic;
  uint16_t version = 0;
  uint8_t kind = 0, reserved = 0;
  uint32_t zdir_len = 0, dir_len = 0;
  uint64_t payload_len = 0, checksum = 0;
  if (data.size() < kPreambleBytes) {
    return DataLossError("patch of " + std::to_string(data.size()) + " bytes is shorter than its " +
                         std::to_string(kPreambleBytes) + "-byte preamble");
  }
  r.Bytes(8, &magic, "magic");
  if (magic != std::string_view(kMagic, sizeof(kMagic))) {
    return DataLossError("not a wsync patch (bad magic)");
  }
  r.U16(&version, "format version");
  if (version != kFormatVersion) {
    return UnimplementedError("patch format version " + std::to_string(version) +
                              " is not supported (this build reads version " +
                              std::to_string(kFormatVersion) + ")");
  }
  r.U8(&kind, "kind");
  r.U8(&reserved, "reserved");
  r.U32(&c.chunk_bytes, "chunk bytes");
  r.U32(&zdir_len, "directory length");
  r.U32(&dir_len, "directory raw length");
  r.U64(&payload_len, "payload length");
  r.U64(&checksum, "checksum");
  if (kind != static_cast<uint8_t>(PatchKind::kPatch) && kind != static_cast<uint8_t>(PatchKind::kKeyframe)) {
    return DataLossError("patch preamble: unknown kind " + std::to_string(kind));
  }
  c.kind = static_cast<PatchKind>(kind);
  if (reserved != 0) return DataLossError("patch preamble: reserved byte is not zero");
  if (c.chunk_bytes < kMinChunkBytes || c.chunk_bytes > kMaxChunkBytes ||
      (c.chunk_bytes & (c.chunk_bytes - 1)) != 0) {
    return DataLossError("patch preamble: chunk size " + std::to_string(c.chunk_bytes) +
                         " is not a power of two in [1 MiB, 64 MiB]");
  }
  if (dir_len > kMaxDirectoryBytes) {
    return DataLossError("patch preamble: directory of " + std::to_string(dir_len) + " bytes exceeds the limit");
  }
  const uint64_t expected = kPreambleBytes + uint64_t{zdir_len} + payload_len;
  if (payload_len > data.size() || expected != data.size()) {
    return DataLossError("patch is " + std::to_string(data.size()) + " bytes, its preamble says " +
                         std::to_string(kPreambleBytes) + " + " + std::to_string(zdir_len) + " + " +
                         std::to_string(payload_len) + " (truncated or padded)");
  }
  if (verify_checksum) {
    uint64_t sum = Hash64(data.data(), kChecksumOffset) ^
                   Hash64(data.data() + kPreambleBytes, data.size() - kPreambleBytes);
    if (sum != checksum) return DataLossError("patch checksum mismatch: the patch is corrupted");
  }

  // Check the frame's declared size before allocating for it.
  WSYNC_RETURN_IF_ERROR(ZstdCheckFrameSize(data.substr(kPreambleBytes, zdir_len), dir_len, "patch directory"));
  std::string dir(dir_len, '\0');
  WSYNC_RETURN_IF_ERROR(
      ZstdDecompressExact(data.substr(kPreambleBytes, zdir_len), dir.data(), dir.size(), "patch directory"));
  c.payload = data.substr(kPreambleBytes + zdir_len);
  c.header_bytes = kPreambleBytes + zdir_len;

  ByteReader d(dir, "patch directory");
  uint64_t count;
  d.Varint(&c.base_version, "base version");
  d.Varint(&c.target_version, "target version");
  if (!d.VarintAtMost(&count, kMaxTensors, "tensor count")) return d.status();
  uint64_t offset = 0;
  c.tensors.reserve(count);
  for (uint64_t i = 0; i < count; ++i) {
    TensorEntry t;
    uint64_t name_len, ndim;
    std::string_view name;
    uint8_t dtype;
    if (!d.VarintAtMost(&name_len, kMaxNameBytes, "tensor name length") ||
        !d.Bytes(name_len, &name, "tensor name") || !d.U8(&dtype, "dtype")) {
      return d.status().WithContext("tensor " + std::to_string(i));
    }
    t.name = std::string(name);
    const std::string where = "tensor " + Quoted(t.name);
    if (!IsValidDType(dtype)) return DataLossError(where + ": unknown dtype code " + std::to_string(dtype));
    t.dtype = static_cast<DType>(dtype);
    if (!d.VarintAtMost(&ndim, kMaxDims, "rank")) return d.status().WithContext(where);
    t.numel = 1;
    for (uint64_t k = 0; k < ndim; ++k) {
      uint64_t dim;
      if (!d.VarintAtMost(&dim, kMaxTensorBytes, "dimension")) return d.status().WithContext(where);
      t.shape.push_back(dim);
      if (dim != 0 && t.numel > kMaxTensorBytes / dim) {
        return DataLossError(where + ": shape exceeds " + std::to_string(kMaxTensorBytes) + " elements");
      }
      t.numel *= dim;
    }
    const size_t width = DTypeWidth(t.dtype);
    if (t.numel > kMaxTensorBytes / width) return DataLossError(where + ": tensor too large");
    t.nbytes = t.numel * width;
    if (!d.U64(&t.target_checksum, "target checksum")) return d.status().WithContext(where);
    const uint64_t nchunks = ChunkCount(t.nbytes, c.chunk_bytes);
    // Every chunk entry takes at least one byte: a directory that claims
    // more chunks than it has bytes is rejected before anything is sized.
    if (nchunks > d.remaining()) {
      return DataLossError(where + ": " + std::to_string(nchunks) + " chunks but only " +
                           std::to_string(d.remaining()) + " directory bytes left");
    }
    t.chunks.resize(nchunks);
    for (uint64_t k = 0; k < nchunks; ++k) {
      ChunkEntry& ch = t.chunks[k];
      const std::string cwhere = where + " chunk " + std::to_string(k);
      ch.offset = offset;
      if (c.kind == PatchKind::kKeyframe) {
        if (!d.VarintAtMost(&ch.pos_len, payload_len - offset, "stream length")) {
          return d.status().WithContext(cwhere);
        }
      } else {
        uint8_t mode = 0;
        if (!d.U8(&mode, "mode")) return d.status().WithContext(cwhere);
        if (mode >= kChunkModeCount) return DataLossError(cwhere + ": unknown mode " + std::to_string(mode));
        ch.mode = static_cast<ChunkMode>(mode);
        if (ch.mode != ChunkMode::kEmpty) {
          const size_t n = c.ChunkElements(t, k);
          if (!d.VarintAtMost(&ch.changed, n, "changed count") ||
              !d.VarintAtMost(&ch.pos_len, payload_len - offset, "position stream length") ||
              !d.VarintAtMost(&ch.val_len, payload_len - offset - ch.pos_len, "value stream length")) {
            return d.status().WithContext(cwhere);
          }
        }
      }
      offset += ch.pos_len + ch.val_len;
    }
    c.tensors.push_back(std::move(t));
  }
  if (c.kind == PatchKind::kPatch && !d.U64(&c.base_set_checksum, "base set checksum")) return d.status();
  if (d.remaining() != 0) return DataLossError("patch directory: " + std::to_string(d.remaining()) + " trailing bytes");
  if (offset != payload_len) {
    return DataLossError("patch payload is " + std::to_string(payload_len) + " bytes, the directory describes " +
                         std::to_string(offset));
  }
  return c;
}

}  // namespace wsync::codec::internal
