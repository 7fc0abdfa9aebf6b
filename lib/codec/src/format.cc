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

void ViewOf(const std::vector<uint64_t>& shape, uint64_t numel, uint64_t* rows, uint64_t* cols) {
  *rows = shape.empty() ? 1 : shape[0];
  *cols = *rows == 0 ? 0 : numel / *rows;
}

namespace {

Status CheckCuts(const std::vector<uint64_t>& cuts, uint64_t limit, const char* what) {
  uint64_t prev = 0;
  for (uint64_t cut : cuts) {
    if (cut <= prev || cut >= limit) {
      return DataLossError(std::string(what) + " cut " + std::to_string(cut) + " is not ascending inside (0, " +
                           std::to_string(limit) + ")");
    }
    prev = cut;
  }
  return Status::Ok();
}

// Band boundaries: 0, the cuts, the end.
std::vector<uint64_t> Bands(const std::vector<uint64_t>& cuts, uint64_t end) {
  std::vector<uint64_t> b{0};
  b.insert(b.end(), cuts.begin(), cuts.end());
  b.push_back(end);
  return b;
}

}  // namespace

Status LayTiles(TensorEntry* t, uint32_t chunk_bytes, uint64_t max_chunks) {
  ViewOf(t->shape, t->numel, &t->rows, &t->cols);
  t->chunks.clear();
  t->tiles.clear();
  if (t->row_cuts.size() > kMaxCuts || t->col_cuts.size() > kMaxCuts) return DataLossError("tile grid: too many cuts");
  WSYNC_RETURN_IF_ERROR(CheckCuts(t->row_cuts, t->rows, "tile grid: row"));
  WSYNC_RETURN_IF_ERROR(CheckCuts(t->col_cuts, t->cols, "tile grid: column"));
  if (t->numel == 0) return Status::Ok();
  const uint64_t per = chunk_bytes / DTypeWidth(t->dtype);
  const std::vector<uint64_t> rb = Bands(t->row_cuts, t->rows), cb = Bands(t->col_cuts, t->cols);
  // Every cell holds at least one chunk: bound the cells before counting.
  const uint64_t cells = (rb.size() - 1) * (cb.size() - 1);
  if (cells > max_chunks) {
    return DataLossError(std::to_string(cells) + " tiles but room for " + std::to_string(max_chunks) + " chunks");
  }
  uint64_t count = 0;
  for (size_t i = 0; i + 1 < rb.size(); ++i) {
    for (size_t j = 0; j + 1 < cb.size(); ++j) {
      count += ((rb[i + 1] - rb[i]) * (cb[j + 1] - cb[j]) + per - 1) / per;
      if (count > max_chunks) {
        return DataLossError(std::to_string(count) + "+ chunks but only " + std::to_string(max_chunks) +
                             " directory bytes left");
      }
    }
  }
  t->chunks.resize(count);
  t->tiles.reserve(count);
  // Checksum blocks: 1 MiB runs of each cell's bytes, cell after cell. A
  // chunk starts at a multiple of chunk_bytes in its cell, so at a block.
  const uint64_t width = DTypeWidth(t->dtype);
  uint64_t blocks = 0;
  for (size_t i = 0; i + 1 < rb.size(); ++i) {
    for (size_t j = 0; j + 1 < cb.size(); ++j) {
      const uint64_t w = cb[j + 1] - cb[j], cell = (rb[i + 1] - rb[i]) * w;
      for (uint64_t first = 0; first < cell; first += per) {
        t->tiles.push_back(Tile{rb[i], cb[j], w, first, std::min(per, cell - first),
                                blocks + first * width / kChecksumBlockBytes});
      }
      blocks += ChecksumBlockCount(cell * width);
    }
  }
  t->checksum_blocks = blocks;
  return Status::Ok();
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
    d.Varint(t.row_cuts.size());
    for (uint64_t cut : t.row_cuts) d.Varint(cut);
    d.Varint(t.col_cuts.size());
    for (uint64_t cut : t.col_cuts) d.Varint(cut);
    for (const ChunkEntry& ch : t.chunks) {
      if (ch.absent) {
        d.U8(kAbsentChunkMode);
        continue;
      }
      if (c.kind == PatchKind::kKeyframe) {
        d.U8(kKeyframeChunkMode);
        d.Varint(ch.pos_len);
      } else {
        d.U8(static_cast<uint8_t>(ch.mode));
        if (ch.mode != ChunkMode::kEmpty) {
          d.Varint(ch.changed);
          d.Varint(ch.pos_len);
          d.Varint(ch.val_len);
        }
      }
      if (t.gridded()) d.U64(ch.digest);
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

StatusOr<Preamble> ReadPreamble(std::string_view data) {
  Preamble p;
  ByteReader r(data, "patch preamble");
  std::string_view magic;
  uint16_t version = 0;
  uint8_t kind = 0, reserved = 0;
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
  r.U32(&p.chunk_bytes, "chunk bytes");
  r.U32(&p.directory_zlen, "directory length");
  r.U32(&p.directory_len, "directory raw length");
  r.U64(&p.payload_len, "payload length");
  r.U64(&p.checksum, "checksum");
  if (kind != static_cast<uint8_t>(PatchKind::kPatch) && kind != static_cast<uint8_t>(PatchKind::kKeyframe)) {
    return DataLossError("patch preamble: unknown kind " + std::to_string(kind));
  }
  p.kind = static_cast<PatchKind>(kind);
  if (reserved != 0) return DataLossError("patch preamble: reserved byte is not zero");
  if (p.chunk_bytes < kMinChunkBytes || p.chunk_bytes > kMaxChunkBytes || (p.chunk_bytes & (p.chunk_bytes - 1)) != 0) {
    return DataLossError("patch preamble: chunk size " + std::to_string(p.chunk_bytes) +
                         " is not a power of two in [1 MiB, 64 MiB]");
  }
  if (p.directory_len > kMaxDirectoryBytes) {
    return DataLossError("patch preamble: directory of " + std::to_string(p.directory_len) +
                         " bytes exceeds the limit");
  }
  if (p.payload_len > kMaxPayloadBytes) {
    return DataLossError("patch preamble: payload of " + std::to_string(p.payload_len) + " bytes exceeds the limit");
  }
  return p;
}

StatusOr<Container> ReadContainer(std::string_view data, bool verify_checksum, bool head_only) {
  Container c;
  WSYNC_ASSIGN_OR_RETURN(const Preamble pre, ReadPreamble(data));
  c.kind = pre.kind;
  c.chunk_bytes = pre.chunk_bytes;
  const uint32_t zdir_len = pre.directory_zlen, dir_len = pre.directory_len;
  const uint64_t payload_len = pre.payload_len;
  if (head_only) {
    if (data.size() < pre.HeaderBytes()) {
      return DataLossError("patch head: " + std::to_string(data.size()) + " bytes of its " +
                           std::to_string(pre.HeaderBytes()) + "-byte preamble and directory");
    }
    data = data.substr(0, std::min<uint64_t>(data.size(), pre.TotalBytes()));
  } else if (pre.TotalBytes() != data.size()) {
    return DataLossError("patch is " + std::to_string(data.size()) + " bytes, its preamble says " +
                         std::to_string(kPreambleBytes) + " + " + std::to_string(zdir_len) + " + " +
                         std::to_string(payload_len) + " (truncated or padded)");
  }
  if (verify_checksum && !head_only) {
    uint64_t sum = Hash64(data.data(), kChecksumOffset) ^
                   Hash64(data.data() + kPreambleBytes, data.size() - kPreambleBytes);
    if (sum != pre.checksum) return DataLossError("patch checksum mismatch: the patch is corrupted");
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
    uint8_t dtype = 0;
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
    uint64_t ncuts;
    for (auto* cuts : {&t.row_cuts, &t.col_cuts}) {
      if (!d.VarintAtMost(&ncuts, std::min<uint64_t>(kMaxCuts, d.remaining()), "tile grid cut count")) {
        return d.status().WithContext(where);
      }
      cuts->resize(ncuts);
      for (uint64_t& cut : *cuts) {
        if (!d.Varint(&cut, "tile grid cut")) return d.status().WithContext(where);
      }
    }
    // Every chunk entry takes at least one byte: a directory that claims
    // more chunks than it has bytes is rejected before anything is sized.
    Status laid = LayTiles(&t, c.chunk_bytes, d.remaining());
    if (!laid.ok()) return laid.WithContext(where);
    for (uint64_t k = 0; k < t.chunks.size(); ++k) {
      ChunkEntry& ch = t.chunks[k];
      const std::string cwhere = where + " chunk " + std::to_string(k);
      ch.offset = offset;
      uint8_t mode = 0;
      if (!d.U8(&mode, "mode")) return d.status().WithContext(cwhere);
      if (mode == kAbsentChunkMode) {
        ch.absent = true;
        continue;
      }
      if (c.kind == PatchKind::kKeyframe) {
        if (mode != kKeyframeChunkMode) return DataLossError(cwhere + ": mode " + std::to_string(mode) + " in a keyframe");
        if (!d.VarintAtMost(&ch.pos_len, payload_len - offset, "stream length")) {
          return d.status().WithContext(cwhere);
        }
      } else {
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
      if (t.gridded() && !d.U64(&ch.digest, "tile digest")) return d.status().WithContext(cwhere);
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
