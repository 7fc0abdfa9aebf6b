// Encoding patches and keyframes of a set, whole or segment by segment, and
// the encode side's helpers (patch_encode.h).
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_set>
#include <utility>
#include <vector>

#include "block_hasher.h"
#include "chunk_codec.h"
#include "format.h"
#include "patch_common.h"
#include "patch_encode.h"
#include "wsync/codec/checksum.h"
#include "wsync/codec/codec.h"
#include "wsync/util/thread_pool.h"
#include "wsync/util/text.h"

namespace wsync::codec {
namespace internal {
namespace {

std::string Concatenate(std::vector<std::string>& streams) {
  size_t total = 0;
  for (const auto& s : streams) total += s.size();
  std::string out;
  out.reserve(total);
  for (auto& s : streams) {
    out.append(s);
    std::string().swap(s);
  }
  return out;
}

}  // namespace

Status ValidateOptions(const EncodeOptions& o) {
  if (o.chunk_bytes < internal::kMinChunkBytes || o.chunk_bytes > internal::kMaxChunkBytes ||
      (o.chunk_bytes & (o.chunk_bytes - 1)) != 0) {
    return InvalidArgumentError("chunk size " + std::to_string(o.chunk_bytes) +
                                " is not a power of two in [1 MiB, 64 MiB]");
  }
  if (o.zstd_level < 1 || o.zstd_level > 19) {
    return InvalidArgumentError("zstd level " + std::to_string(o.zstd_level) + " is not in 1..19");
  }
  if (o.max_classes < 1 || o.max_classes > codec::kMaxClasses) {
    return InvalidArgumentError("max classes " + std::to_string(o.max_classes) + " is not in 1.." +
                                std::to_string(codec::kMaxClasses));
  }
  return Status::Ok();
}

// Fills chunk entries from encoded chunks in task order and writes the file.
std::string Finish(Container& c, const std::vector<Task>& tasks, std::vector<internal::EncodedChunk>& encoded) {
  std::vector<std::string> streams;
  streams.reserve(tasks.size() * 2);
  for (size_t i = 0; i < tasks.size(); ++i) {
    ChunkEntry& e = c.tensors[tasks[i].tensor].chunks[tasks[i].chunk];
    e.mode = encoded[i].mode;
    e.changed = encoded[i].changed;
    e.pos_len = encoded[i].pos.size();
    e.val_len = encoded[i].val.size();
    streams.push_back(std::move(encoded[i].pos));
    streams.push_back(std::move(encoded[i].val));
  }
  std::string payload = Concatenate(streams);
  return internal::WriteContainer(c, payload);
}

}  // namespace internal

namespace {

using internal::Container;
using internal::Digests;
using internal::EntriesFor;
using internal::Finish;
using internal::ForEachChunk;
using internal::Task;
using internal::TasksOf;
using internal::TensorEntry;
using internal::ValidateOptions;
using internal::ValidateSet;
using internal::WithWidth;

}  // namespace

StatusOr<std::string> EncodePatch(std::span<const TensorView> base, std::span<const TensorView> target,
                                  const EncodeOptions& options) {
  WSYNC_RETURN_IF_ERROR(ValidateOptions(options));
  WSYNC_RETURN_IF_ERROR(ValidateSet(base));
  WSYNC_RETURN_IF_ERROR(ValidateSet(target));
  if (base.size() != target.size()) {
    return InvalidArgumentError("base has " + std::to_string(base.size()) + " tensors, target " +
                                std::to_string(target.size()));
  }
  Container c;
  c.kind = PatchKind::kPatch;
  c.chunk_bytes = options.chunk_bytes;
  c.base_version = options.base_version;
  c.target_version = options.target_version;
  for (size_t i = 0; i < base.size(); ++i) {
    const TensorView& b = base[i];
    const TensorView& t = target[i];
    if (b.name != t.name) {
      return InvalidArgumentError("tensor " + std::to_string(i) + ": base is " + Quoted(b.name) + ", target is " +
                                  Quoted(t.name));
    }
    if (b.dtype != t.dtype || b.shape != t.shape) {
      return InvalidArgumentError("tensor " + Quoted(b.name) + ": base and target differ in dtype or shape");
    }
  }
  WSYNC_ASSIGN_OR_RETURN(c.tensors, EntriesFor(target, options));
  const std::vector<Task> tasks = TasksOf(c.tensors);
  auto codec_options = [&](const TensorEntry& e) {
    return internal::ChunkCodecOptions{options.zstd_level, options.condition_on_base, ExponentFieldOf(e.dtype),
                                       options.max_classes};
  };
  // A chunk's base and target bytes in chunk order (gathered when the
  // chunk is a tile narrower than its tensor).
  struct Scratch {
    std::vector<uint8_t> base, target;
  };
  auto chunk_pair = [&](size_t i, size_t width, Scratch* s) {
    const TensorEntry& e = c.tensors[tasks[i].tensor];
    const internal::Tile& tile = e.tiles[tasks[i].chunk];
    return std::pair{internal::ChunkBytes(tile, internal::Identity(e, base[tasks[i].tensor].data), width, &s->base),
                     internal::ChunkBytes(tile, internal::Identity(e, target[tasks[i].tensor].data), width, &s->target)};
  };
  // In tensors of more than one chunk, the classes of the chunks that others
  // take theirs from (ClassSourceChunk), chosen first.
  std::vector<ClassSpec> classes(tasks.size());
  std::vector<size_t> sources;
  for (size_t i = 0; i < tasks.size(); ++i) {
    if (c.tensors[tasks[i].tensor].chunks.size() > 1 && ClassSourceChunk(tasks[i].chunk) == tasks[i].chunk) {
      sources.push_back(i);
    }
  }
  ParallelFor(options.pool, sources.size(), [&](size_t s) {
    const size_t i = sources[s];
    const TensorEntry& e = c.tensors[tasks[i].tensor];
    WithWidth(DTypeWidth(e.dtype), [&](auto zero) {
      using T = decltype(zero);
      thread_local Scratch scratch;
      auto [b, t] = chunk_pair(i, sizeof(T), &scratch);
      classes[i] = internal::ChooseChunkClasses(reinterpret_cast<const T*>(b), reinterpret_cast<const T*>(t),
                                                c.ChunkElements(e, tasks[i].chunk), codec_options(e));
    });
  });
  std::vector<internal::EncodedChunk> encoded(tasks.size());
  const bool hash_base = !options.base_set_checksum.has_value();
  Digests base_digests(c.tensors), target_digests(c.tensors);  // base_digests stay unused when given
  ForEachChunk(options.pool, c, tasks, [&](size_t i, const TensorEntry& e, size_t ci, size_t n, auto zero) {
    using T = decltype(zero);
    const size_t ti = tasks[i].tensor;
    thread_local Scratch scratch;
    auto [bb, tb] = chunk_pair(i, sizeof(T), &scratch);
    const T* b = reinterpret_cast<const T*>(bb);
    const T* t = reinterpret_cast<const T*>(tb);
    // The chunk of a one-chunk tensor chooses its own classes here, right
    // before its sweep: a small one is then still in cache.
    const ClassSpec* source = e.chunks.size() > 1 ? &classes[i - (ci - ClassSourceChunk(ci))] : nullptr;
    // Digested in the sweep, while in cache: the tile (gridded tensors) and
    // the checksum blocks it covers. A chunk of at most one block is its
    // block: one digest serves both.
    const bool tile_is_block = n * sizeof(T) <= kChecksumBlockBytes;
    std::optional<internal::BlockHasher> tile_digest;
    if (e.gridded() && !tile_is_block) tile_digest.emplace();
    internal::ChunkDigester target_digest(&target_digests, ti, internal::FirstBlock(e, ci));
    std::optional<internal::ChunkDigester> base_digest;
    if (hash_base) base_digest.emplace(&base_digests, ti, internal::FirstBlock(e, ci));
    encoded[i] = internal::EncodeChunkPair(b, t, n, codec_options(e), source, [&](size_t begin, size_t len) {
      if (tile_digest) tile_digest->Update(t + begin, len * sizeof(T));
      if (base_digest) base_digest->Update(reinterpret_cast<const uint8_t*>(b + begin), len * sizeof(T));
      target_digest.Update(reinterpret_cast<const uint8_t*>(t + begin), len * sizeof(T));
    });
    if (base_digest) base_digest->Finish();
    target_digest.Finish();
    if (tile_digest) c.tensors[ti].chunks[ci].digest = tile_digest->Digest();
    if (e.gridded() && tile_is_block) {
      c.tensors[ti].chunks[ci].digest = target_digests.blocks[ti][internal::FirstBlock(e, ci)];
    }
  });
  std::vector<uint64_t> base_sums;
  for (size_t t = 0; t < c.tensors.size(); ++t) {
    c.tensors[t].target_checksum = target_digests.Tensor(t);
    if (hash_base) base_sums.push_back(base_digests.Tensor(t));
  }
  c.base_set_checksum = hash_base ? internal::SetChecksumOf(base_sums) : *options.base_set_checksum;
  return Finish(c, tasks, encoded);
}

StatusOr<std::string> EncodeKeyframe(std::span<const TensorView> target, const EncodeOptions& options) {
  WSYNC_RETURN_IF_ERROR(ValidateOptions(options));
  WSYNC_RETURN_IF_ERROR(ValidateSet(target));
  Container c;
  c.kind = PatchKind::kKeyframe;
  c.chunk_bytes = options.chunk_bytes;
  c.base_version = 0;
  c.target_version = options.target_version;
  WSYNC_ASSIGN_OR_RETURN(c.tensors, EntriesFor(target, options));
  const std::vector<Task> tasks = TasksOf(c.tensors);
  std::vector<internal::EncodedChunk> encoded(tasks.size());
  Digests digests(c.tensors);
  ForEachChunk(options.pool, c, tasks, [&](size_t i, const TensorEntry& e, size_t ci, size_t n, auto zero) {
    using T = decltype(zero);
    const size_t ti = tasks[i].tensor;
    thread_local std::vector<uint8_t> scratch;
    const uint8_t* bytes = internal::ChunkBytes(e.tiles[ci], internal::Identity(e, target[ti].data), sizeof(T), &scratch);
    internal::EncodeKeyframeChunk(reinterpret_cast<const T*>(bytes), n, options.zstd_level, &encoded[i].pos);
    if (e.gridded()) c.tensors[ti].chunks[ci].digest = BlockDigest(bytes, n * sizeof(T));
    digests.DigestChunk(ti, internal::FirstBlock(e, ci), bytes, n * sizeof(T));
  });
  for (size_t t = 0; t < c.tensors.size(); ++t) c.tensors[t].target_checksum = digests.Tensor(t);
  return Finish(c, tasks, encoded);
}

std::vector<std::pair<size_t, size_t>> SegmentGroups(std::span<const TensorView> tensors, uint64_t bytes) {
  std::vector<std::pair<size_t, size_t>> out;
  size_t begin = 0;
  uint64_t sum = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    sum += tensors[i].NumBytes();
    if (bytes != 0 && sum >= bytes && i + 1 < tensors.size()) {
      out.push_back({begin, i + 1});
      begin = i + 1;
      sum = 0;
    }
  }
  if (begin < tensors.size() || out.empty()) out.push_back({begin, tensors.size()});
  return out;
}

StatusOr<std::string> EncodeSegmented(std::span<const TensorView> base, std::span<const TensorView> target,
                                      const EncodeOptions& options, uint64_t segment_bytes,
                                      std::span<const uint64_t> base_tensor_checksums,
                                      const std::function<Status(size_t, std::string_view)>& on_segment) {
  WSYNC_RETURN_IF_ERROR(ValidateSet(base, /*need_data=*/true));
  if (base.size() != target.size()) {
    return InvalidArgumentError("base has " + std::to_string(base.size()) + " tensors, target " +
                                std::to_string(target.size()));
  }
  std::vector<uint64_t> sums(base_tensor_checksums.begin(), base_tensor_checksums.end());
  if (sums.empty()) {
    WSYNC_ASSIGN_OR_RETURN(sums, TensorChecksums(base, options.grids, options.pool));
  } else if (sums.size() != base.size()) {
    return InvalidArgumentError(std::to_string(sums.size()) + " base tensor checksums for " +
                                std::to_string(base.size()) + " tensors");
  }
  std::vector<std::string> segments;
  const auto groups = SegmentGroups(target, segment_bytes);
  for (size_t k = 0; k < groups.size(); ++k) {
    const auto [b, e] = groups[k];
    EncodeOptions o = options;
    o.grids.clear();
    std::unordered_set<std::string_view> names;
    for (size_t i = b; i < e; ++i) names.insert(target[i].name);
    for (const TileGrid& g : options.grids) {
      if (names.count(g.tensor)) o.grids.push_back(g);
    }
    o.base_set_checksum = internal::SetChecksumOf(std::vector<uint64_t>(sums.begin() + b, sums.begin() + e));
    WSYNC_ASSIGN_OR_RETURN(std::string segment, EncodePatch(base.subspan(b, e - b), target.subspan(b, e - b), o));
    if (on_segment) WSYNC_RETURN_IF_ERROR(on_segment(k, segment));
    segments.push_back(std::move(segment));
  }
  std::vector<std::string_view> views(segments.begin(), segments.end());
  return JoinSegments(views, internal::SetChecksumOf(sums));
}

}  // namespace wsync::codec
