// The patch format's common ground: tensor views and sets validated,
// entries and tiles of a set, checksums, streams of segments, and
// InspectPatch. Encode, apply and merge are beside it (encode.cc,
// apply*.cc, merge.cc).
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "chunk_codec.h"
#include "format.h"
#include "patch_common.h"
#include "wsync/codec/checksum.h"
#include "wsync/codec/codec.h"
#include "wsync/util/thread_pool.h"
#include "wsync/util/text.h"

namespace wsync::codec {
namespace {

using internal::ChunkEntry;
using internal::ChunkMode;
using internal::Container;
using internal::EntriesFor;
using internal::SaturatingBytes;
using internal::SaturatingProduct;
using internal::TensorEntry;

}  // namespace

namespace internal {

uint64_t SaturatingProduct(const std::vector<uint64_t>& shape) {
  uint64_t n = 1;
  for (uint64_t d : shape) {
    if (d != 0 && n > UINT64_MAX / d) return UINT64_MAX;
    n *= d;
  }
  return n;
}

uint64_t SaturatingBytes(uint64_t numel, DType dtype) {
  uint64_t w = DTypeWidth(dtype);
  if (w == 0) return UINT64_MAX;
  return numel > UINT64_MAX / w ? UINT64_MAX : numel * w;
}

Status ValidateTensor(const TensorView& t, bool need_data) {
  if (DTypeWidth(t.dtype) == 0) return InvalidArgumentError("tensor " + Quoted(t.name) + ": invalid dtype");
  if (t.shape.size() > internal::kMaxDims) {
    return InvalidArgumentError("tensor " + Quoted(t.name) + ": rank " + std::to_string(t.shape.size()) + " exceeds 16");
  }
  if (t.NumBytes() > internal::kMaxTensorBytes) {
    return InvalidArgumentError("tensor " + Quoted(t.name) + ": too large");
  }
  if (need_data && t.NumBytes() > 0 && t.data == nullptr) {
    return InvalidArgumentError("tensor " + Quoted(t.name) + ": no data");
  }
  if (t.name.size() > internal::kMaxNameBytes) {
    return InvalidArgumentError("tensor name of " + std::to_string(t.name.size()) + " bytes is too long");
  }
  return Status::Ok();
}

Status ValidateSet(std::span<const TensorView> set, bool need_data) {
  if (set.size() > internal::kMaxTensors) return InvalidArgumentError("too many tensors");
  std::unordered_set<std::string_view> names;
  for (const TensorView& t : set) {
    WSYNC_RETURN_IF_ERROR(ValidateTensor(t, need_data));
    if (!names.insert(t.name).second) return InvalidArgumentError("tensor " + Quoted(t.name) + " appears twice");
  }
  return Status::Ok();
}

StatusOr<TensorEntry> EntryFor(const TensorView& t, uint32_t chunk_bytes, const TileGrid* grid) {
  TensorEntry e;
  e.name = t.name;
  e.dtype = t.dtype;
  e.shape = t.shape;
  e.numel = t.NumElements();
  e.nbytes = t.NumBytes();
  if (grid != nullptr) {
    e.row_cuts = grid->row_cuts;
    e.col_cuts = grid->col_cuts;
  }
  Status s = LayTiles(&e, chunk_bytes, UINT64_MAX);
  if (!s.ok()) return InvalidArgumentError("tensor " + Quoted(t.name) + ": " + s.message());
  return e;
}

TensorEntry EntryFor(const TensorView& t, uint32_t chunk_bytes) {
  // Without cuts there is nothing to refuse.
  return std::move(EntryFor(t, chunk_bytes, nullptr)).value();
}

std::vector<Task> TasksOf(const std::vector<TensorEntry>& tensors) {
  std::vector<Task> tasks;
  for (size_t t = 0; t < tensors.size(); ++t) {
    for (size_t c = 0; c < tensors[t].chunks.size(); ++c) tasks.push_back({t, c});
  }
  return tasks;
}

uint64_t EntryChecksum(const TensorEntry& e, const uint8_t* data, ThreadPool* pool) {
  if (!e.gridded()) return TensorChecksum(data, e.nbytes, pool);
  // Chunks of one block each lay out exactly the checksum blocks (e's grid
  // was checked when e was laid out).
  const TileGrid grid{e.name, e.row_cuts, e.col_cuts};
  const TensorEntry blocks =
      std::move(EntryFor(TensorView{e.name, e.dtype, e.shape, data}, kChecksumBlockBytes, &grid)).value();
  const size_t width = DTypeWidth(e.dtype);
  const Placement at = Identity(blocks, data);
  std::vector<uint64_t> digests(blocks.tiles.size());
  ParallelFor(pool, digests.size(), [&](size_t i) {
    thread_local std::vector<uint8_t> scratch;
    const Tile& tile = blocks.tiles[i];
    digests[i] = BlockDigest(ChunkBytes(tile, at, width, &scratch), tile.n * width);
  });
  return CombineBlockDigests(digests);
}

std::string ChunkWhere(const TensorEntry& t, size_t c) {
  return "tensor " + Quoted(t.name) + " chunk " + std::to_string(c);
}


// The entries of a set with the options' grids.
StatusOr<std::vector<TensorEntry>> EntriesFor(std::span<const TensorView> set, const EncodeOptions& options) {
  std::unordered_map<std::string_view, const TileGrid*> grids;
  for (const TileGrid& g : options.grids) {
    if (!grids.emplace(g.tensor, &g).second) return InvalidArgumentError("two tile grids for tensor " + Quoted(g.tensor));
  }
  std::vector<TensorEntry> out;
  for (const TensorView& t : set) {
    auto it = grids.find(t.name);
    WSYNC_ASSIGN_OR_RETURN(TensorEntry e, EntryFor(t, options.chunk_bytes, it == grids.end() ? nullptr : it->second));
    if (it != grids.end()) grids.erase(it);
    out.push_back(std::move(e));
  }
  if (!grids.empty()) {
    return InvalidArgumentError("tile grid for tensor " + Quoted(grids.begin()->second->tensor) + ", which the set lacks");
  }
  return out;
}

Status AbsentChunk(const TensorEntry& t, size_t chunk) {
  return FailedPreconditionError(ChunkWhere(t, chunk) +
                                 " is not in this patch (a selection for other pieces); pull the whole patch "
                                 "or one selected for these pieces");
}

}  // namespace internal


uint64_t TensorView::NumElements() const { return SaturatingProduct(shape); }
uint64_t TensorView::NumBytes() const { return SaturatingBytes(NumElements(), dtype); }
uint64_t MutableTensorView::NumElements() const { return SaturatingProduct(shape); }
uint64_t MutableTensorView::NumBytes() const { return SaturatingBytes(NumElements(), dtype); }
uint64_t TensorInfo::DenseBytes() const { return SaturatingBytes(SaturatingProduct(shape), dtype); }

uint64_t SetChecksum(std::span<const TensorView> tensors, ThreadPool* pool) {
  std::vector<uint64_t> sums;
  for (const auto& t : tensors) sums.push_back(TensorChecksum(t.data, t.NumBytes(), pool));
  return internal::SetChecksumOf(sums);
}

uint64_t SetChecksumOf(std::span<const uint64_t> tensor_checksums) {
  return internal::SetChecksumOf(std::vector<uint64_t>(tensor_checksums.begin(), tensor_checksums.end()));
}

StatusOr<uint64_t> TensorChecksumOf(const TensorView& t, const TileGrid* grid, ThreadPool* pool) {
  EncodeOptions o;
  if (grid != nullptr) o.grids.push_back(*grid);
  WSYNC_ASSIGN_OR_RETURN(auto entries, EntriesFor(std::span<const TensorView>(&t, 1), o));
  return internal::EntryChecksum(entries[0], static_cast<const uint8_t*>(t.data), pool);
}

StatusOr<std::vector<uint64_t>> TensorChecksums(std::span<const TensorView> tensors, std::span<const TileGrid> grids,
                                                ThreadPool* pool) {
  EncodeOptions o;
  o.grids.assign(grids.begin(), grids.end());
  WSYNC_ASSIGN_OR_RETURN(auto entries, EntriesFor(tensors, o));
  std::vector<uint64_t> sums;
  for (size_t t = 0; t < entries.size(); ++t) {
    sums.push_back(internal::EntryChecksum(entries[t], static_cast<const uint8_t*>(tensors[t].data), pool));
  }
  return sums;
}

StatusOr<uint64_t> SetChecksum(std::span<const TensorView> tensors, std::span<const TileGrid> grids, ThreadPool* pool) {
  WSYNC_ASSIGN_OR_RETURN(auto sums, TensorChecksums(tensors, grids, pool));
  return internal::SetChecksumOf(sums);
}

StatusOr<std::vector<std::string_view>> SplitSegments(std::string_view stream) {
  std::vector<std::string_view> out;
  while (!stream.empty() || out.empty()) {
    StatusOr<internal::Preamble> pre = internal::ReadPreamble(stream);
    if (!pre.ok()) return pre.status().WithContext("segment " + std::to_string(out.size()) + " of the stream");
    if (pre->TotalBytes() > stream.size()) {
      return DataLossError("segment " + std::to_string(out.size()) + " of the stream: its preamble says " +
                           std::to_string(pre->TotalBytes()) + " bytes, " + std::to_string(stream.size()) +
                           " remain (truncated)");
    }
    out.push_back(stream.substr(0, pre->TotalBytes()));
    stream.remove_prefix(pre->TotalBytes());
  }
  return out;
}

StatusOr<std::string> JoinSegments(std::span<const std::string_view> segments, uint64_t base_set_checksum) {
  if (segments.empty()) return InvalidArgumentError("no segments to join");
  Container joined;
  std::string payload;
  std::unordered_set<std::string> names;
  for (size_t i = 0; i < segments.size(); ++i) {
    StatusOr<Container> c = internal::ReadContainer(segments[i], /*verify_checksum=*/true);
    if (!c.ok()) return c.status().WithContext("segment " + std::to_string(i));
    if (i == 0) {
      joined.kind = c->kind;
      joined.chunk_bytes = c->chunk_bytes;
      joined.base_version = c->base_version;
      joined.target_version = c->target_version;
      joined.base_set_checksum = base_set_checksum;
    } else if (c->kind != joined.kind || c->chunk_bytes != joined.chunk_bytes ||
               c->base_version != joined.base_version || c->target_version != joined.target_version) {
      return InvalidArgumentError("segment " + std::to_string(i) +
                                  " differs from segment 0 in kind, chunk size or versions");
    }
    for (TensorEntry& t : c->tensors) {
      if (!names.insert(t.name).second) {
        return InvalidArgumentError("tensor " + Quoted(t.name) + " is in two segments");
      }
      joined.tensors.push_back(std::move(t));
    }
    payload.append(c->payload);
  }
  return internal::WriteContainer(joined, payload);
}


StatusOr<PatchInfo> InspectPatch(std::string_view patch, bool verify_patch_checksum) {
  WSYNC_ASSIGN_OR_RETURN(Container c, internal::ReadContainer(patch, verify_patch_checksum));
  PatchInfo info;
  info.kind = c.kind;
  info.format_version = internal::kFormatVersion;
  info.chunk_bytes = c.chunk_bytes;
  info.base_version = c.base_version;
  info.target_version = c.target_version;
  info.base_set_checksum = c.base_set_checksum;
  info.total_bytes = patch.size();
  info.header_bytes = c.header_bytes;
  std::vector<uint64_t> targets;
  for (const TensorEntry& e : c.tensors) {
    TensorInfo t;
    t.name = e.name;
    t.dtype = e.dtype;
    t.shape = e.shape;
    t.target_checksum = e.target_checksum;
    t.chunks = static_cast<uint32_t>(e.chunks.size());
    targets.push_back(e.target_checksum);
    t.row_cuts = e.row_cuts;
    t.col_cuts = e.col_cuts;
    for (const ChunkEntry& ch : e.chunks) {
      if (ch.absent) {
        ++t.absent_chunks;
        continue;
      }
      if (c.kind == PatchKind::kKeyframe) {
        t.value_bytes += ch.pos_len;
        continue;
      }
      t.changed += ch.changed;
      ++t.mode_counts[static_cast<int>(ch.mode)];
      if (ch.mode == ChunkMode::kDense) {
        t.value_bytes += ch.pos_len;
      } else {
        t.position_bytes += ch.pos_len;
        t.value_bytes += ch.val_len;
      }
      if (internal::ChunkNeedsBase(ch.mode, c.PosStream(ch))) ++t.conditioned_chunks;
    }
    if (c.kind == PatchKind::kKeyframe) t.changed = e.numel;
    info.tensors.push_back(std::move(t));
  }
  info.target_set_checksum = internal::SetChecksumOf(targets);
  return info;
}


}  // namespace wsync::codec
