// Patch and keyframe encode, apply, merge and inspect: the set-level driver
// over the chunk codec. Chunks are the unit of parallel work.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <unordered_set>

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
using internal::SparseDelta;
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

TensorEntry EntryFor(const TensorView& t, uint32_t chunk_bytes) {
  TensorEntry e;
  e.name = t.name;
  e.dtype = t.dtype;
  e.shape = t.shape;
  e.numel = t.NumElements();
  e.nbytes = t.NumBytes();
  e.chunks.resize(internal::ChunkCount(e.nbytes, chunk_bytes));
  return e;
}

std::vector<Task> TasksOf(const std::vector<TensorEntry>& tensors) {
  std::vector<Task> tasks;
  for (size_t t = 0; t < tensors.size(); ++t) {
    for (size_t c = 0; c < tensors[t].chunks.size(); ++c) tasks.push_back({t, c});
  }
  return tasks;
}

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

// Matches the container's tensors to destination views by name.
StatusOr<std::vector<const MutableTensorView*>> MatchTensors(const Container& c,
                                                             std::span<const MutableTensorView> dst,
                                                             bool allow_extra) {
  std::unordered_map<std::string_view, const MutableTensorView*> by_name;
  for (const auto& t : dst) {
    if (!by_name.emplace(t.name, &t).second) {
      return InvalidArgumentError("destination tensor " + Quoted(t.name) + " appears twice");
    }
  }
  std::vector<const MutableTensorView*> out;
  std::unordered_set<std::string_view> seen;
  for (const TensorEntry& e : c.tensors) {
    if (!seen.insert(e.name).second) return DataLossError("patch names tensor " + Quoted(e.name) + " twice");
    auto it = by_name.find(e.name);
    if (it == by_name.end()) {
      return FailedPreconditionError("tensor " + Quoted(e.name) + " of the patch is not in the destination");
    }
    const MutableTensorView& d = *it->second;
    if (d.dtype != e.dtype || d.shape != e.shape) {
      return FailedPreconditionError("tensor " + Quoted(e.name) + ": destination is " +
                                     std::string(DTypeName(d.dtype)) + " of another shape or dtype than the patch's " +
                                     std::string(DTypeName(e.dtype)));
    }
    if (d.data == nullptr && e.nbytes > 0) return InvalidArgumentError("tensor " + Quoted(e.name) + ": no data");
    out.push_back(&d);
  }
  if (!allow_extra && dst.size() != c.tensors.size()) {
    for (const auto& t : dst) {
      if (!seen.count(t.name)) {
        return FailedPreconditionError("destination tensor " + Quoted(t.name) + " is not in the patch");
      }
    }
  }
  return out;
}

std::string ChunkWhere(const TensorEntry& t, size_t c) {
  return "tensor " + Quoted(t.name) + " chunk " + std::to_string(c);
}

}  // namespace internal

namespace {

using internal::ChunkWhere;
using internal::Digests;
using internal::EntryFor;
using internal::SaturatingBytes;
using internal::SaturatingProduct;
using internal::ValidateOptions;
using internal::ValidateSet;
using internal::FirstError;
using internal::MatchTensors;
using internal::Finish;
using internal::ForEachChunk;
using internal::Task;
using internal::TasksOf;
using internal::WithWidth;

// Type-erased decoded change of one chunk.
struct Decoded {
  SparseDelta<uint8_t> d8;
  SparseDelta<uint16_t> d16;
  SparseDelta<uint32_t> d32;
  SparseDelta<uint64_t> d64;
  template <typename T>
  SparseDelta<T>& Get() {
    if constexpr (sizeof(T) == 1) return d8;
    else if constexpr (sizeof(T) == 2) return d16;
    else if constexpr (sizeof(T) == 4) return d32;
    else return d64;
  }
};

bool HoldsBase(const Container& c, const std::vector<const MutableTensorView*>& dst, ThreadPool* pool) {
  std::vector<TensorView> views;
  for (const auto* d : dst) views.push_back(d->AsConst());
  return SetChecksum(views, pool) == c.base_set_checksum;
}

Status WrongBase(const Container& c) {
  return FailedPreconditionError("the destination does not hold the patch's base version " +
                                 std::to_string(c.base_version) +
                                 " (base checksum differs); destination unchanged");
}

Status ApplyKeyframe(const Container& c, const std::vector<const MutableTensorView*>& dst,
                     const ApplyOptions& options) {
  const std::vector<Task> tasks = TasksOf(c.tensors);
  Digests digests(c.tensors);
  FirstError error;
  // Pass 1: decode into scratch and verify; the destination is untouched.
  ForEachChunk(options.pool, c, tasks, [&](size_t i, const TensorEntry& t, size_t chunk, size_t n, auto zero) {
    using T = decltype(zero);
    std::vector<T> scratch(n);
    Status s = internal::DecodeKeyframeChunk<T>(c.PosStream(t.chunks[chunk]), n, scratch.data());
    if (!s.ok()) return error.Record(i, s.WithContext(ChunkWhere(t, chunk)));
    digests.DigestChunk(tasks[i].tensor, chunk, reinterpret_cast<const uint8_t*>(scratch.data()), n * sizeof(T),
                        c.chunk_bytes);
  });
  WSYNC_RETURN_IF_ERROR(error.status());
  for (size_t t = 0; t < c.tensors.size(); ++t) {
    if (digests.Tensor(t) != c.tensors[t].target_checksum) {
      return DataLossError("tensor '" + c.tensors[t].name +
                           "': keyframe content does not match its checksum; destination not modified");
    }
  }
  // Pass 2: decode into the destination (deterministic: same bytes).
  ForEachChunk(options.pool, c, tasks, [&](size_t i, const TensorEntry& t, size_t chunk, size_t n, auto zero) {
    using T = decltype(zero);
    T* out = reinterpret_cast<T*>(dst[tasks[i].tensor]->data + chunk * static_cast<size_t>(c.chunk_bytes));
    error.Record(i, internal::DecodeKeyframeChunk<T>(c.PosStream(t.chunks[chunk]), n, out));
  });
  return error.status();
}

Status ApplyDelta(const Container& c, const std::vector<const MutableTensorView*>& dst,
                  const ApplyOptions& options) {
  const std::vector<Task> tasks = TasksOf(c.tensors);
  std::vector<Decoded> decoded(tasks.size());
  std::vector<uint8_t> applied(tasks.size(), 0);
  Digests digests(c.tensors);
  FirstError error;
  auto chunk_ptr = [&](size_t i) {
    return dst[tasks[i].tensor]->data + tasks[i].chunk * static_cast<size_t>(c.chunk_bytes);
  };
  // One pass, chunk by chunk while the chunk is in cache: decode (reading
  // the base), add the deltas, digest the result. A chunk that fails to
  // decode is left untouched.
  ForEachChunk(options.pool, c, tasks, [&](size_t i, const TensorEntry& t, size_t chunk, size_t n, auto zero) {
    using T = decltype(zero);
    const ChunkEntry& ch = t.chunks[chunk];
    T* x = reinterpret_cast<T*>(chunk_ptr(i));
    SparseDelta<T>& d = decoded[i].Get<T>();
    Status s = internal::DecodeChunk<T>(ch.mode, ch.changed, c.PosStream(ch), c.ValStream(ch), x, n,
                                        ExponentFieldOf(t.dtype), &d);
    if (!s.ok()) return error.Record(i, s.WithContext(ChunkWhere(t, chunk)));
    internal::ScatterAdd<T>(x, d, /*undo=*/false);
    applied[i] = 1;
    digests.DigestChunk(tasks[i].tensor, chunk, reinterpret_cast<const uint8_t*>(x), n * sizeof(T), c.chunk_bytes);
  });
  // Undoes every chunk applied so far: the destination is as it was.
  auto undo = [&] {
    ForEachChunk(options.pool, c, tasks, [&](size_t i, const TensorEntry&, size_t, size_t, auto zero) {
      using T = decltype(zero);
      if (applied[i]) internal::ScatterAdd<T>(reinterpret_cast<T*>(chunk_ptr(i)), decoded[i].Get<T>(), true);
    });
  };
  if (error.failed()) {
    // A patch that decodes badly: say whether the destination is the wrong
    // version or the patch is bad.
    undo();
    if (!HoldsBase(c, dst, options.pool)) return WrongBase(c);
    return error.status();
  }
  for (size_t t = 0; t < c.tensors.size(); ++t) {
    if (digests.Tensor(t) == c.tensors[t].target_checksum) continue;
    undo();
    if (!HoldsBase(c, dst, options.pool)) return WrongBase(c);
    return DataLossError("tensor '" + c.tensors[t].name +
                         "': result does not match the patch's checksum (the patch is corrupted); "
                         "change undone, destination unchanged");
  }
  return Status::Ok();
}

// The change of applying `first` then `second`: the union of positions,
// deltas added mod 2^w at common ones, zero sums dropped.
template <typename T>
SparseDelta<T> ComposeDeltas(const SparseDelta<T>& first, const SparseDelta<T>& second) {
  SparseDelta<T> out;
  size_t x = 0, y = 0;
  while (x < first.pos.size() || y < second.pos.size()) {
    if (y == second.pos.size() || (x < first.pos.size() && first.pos[x] < second.pos[y])) {
      out.pos.push_back(first.pos[x]);
      out.delta.push_back(first.delta[x++]);
    } else if (x == first.pos.size() || second.pos[y] < first.pos[x]) {
      out.pos.push_back(second.pos[y]);
      out.delta.push_back(second.delta[y++]);
    } else {
      const T sum = static_cast<T>(first.delta[x] + second.delta[y]);
      if (sum != 0) {
        out.pos.push_back(first.pos[x]);
        out.delta.push_back(sum);
      }
      ++x;
      ++y;
    }
  }
  return out;
}

}  // namespace

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
    c.tensors.push_back(EntryFor(t, c.chunk_bytes));
  }
  const std::vector<Task> tasks = TasksOf(c.tensors);
  auto codec_options = [&](const TensorEntry& e) {
    return internal::ChunkCodecOptions{options.zstd_level, options.condition_on_base, ExponentFieldOf(e.dtype),
                                       options.max_classes};
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
    const size_t offset = tasks[i].chunk * static_cast<size_t>(c.chunk_bytes);
    WithWidth(DTypeWidth(e.dtype), [&](auto zero) {
      using T = decltype(zero);
      classes[i] = internal::ChooseChunkClasses(reinterpret_cast<const T*>(base[tasks[i].tensor].data + offset),
                                                reinterpret_cast<const T*>(target[tasks[i].tensor].data + offset),
                                                c.ChunkElements(e, tasks[i].chunk), codec_options(e));
    });
  });
  std::vector<internal::EncodedChunk> encoded(tasks.size());
  const bool hash_base = !options.base_set_checksum.has_value();
  Digests base_digests(c.tensors), target_digests(c.tensors);  // base_digests stay unused when given
  ForEachChunk(options.pool, c, tasks, [&](size_t i, const TensorEntry& e, size_t ci, size_t n, auto zero) {
    using T = decltype(zero);
    const size_t ti = tasks[i].tensor;
    const size_t offset = ci * static_cast<size_t>(c.chunk_bytes);
    const T* b = reinterpret_cast<const T*>(base[ti].data + offset);
    const T* t = reinterpret_cast<const T*>(target[ti].data + offset);
    // The chunk of a one-chunk tensor chooses its own classes here, right
    // before its sweep: a small one is then still in cache.
    const ClassSpec* source = e.chunks.size() > 1 ? &classes[i - (ci - ClassSourceChunk(ci))] : nullptr;
    internal::ChunkDigester target_digest(&target_digests, ti, ci, c.chunk_bytes);
    std::optional<internal::ChunkDigester> base_digest;
    if (hash_base) base_digest.emplace(&base_digests, ti, ci, c.chunk_bytes);
    encoded[i] = internal::EncodeChunkPair(b, t, n, codec_options(e), source, [&](size_t begin, size_t len) {
      if (base_digest) base_digest->Update(reinterpret_cast<const uint8_t*>(b + begin), len * sizeof(T));
      target_digest.Update(reinterpret_cast<const uint8_t*>(t + begin), len * sizeof(T));
    });
    if (base_digest) base_digest->Finish();
    target_digest.Finish();
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
  for (const auto& t : target) c.tensors.push_back(EntryFor(t, c.chunk_bytes));
  const std::vector<Task> tasks = TasksOf(c.tensors);
  std::vector<internal::EncodedChunk> encoded(tasks.size());
  Digests digests(c.tensors);
  ForEachChunk(options.pool, c, tasks, [&](size_t i, const TensorEntry&, size_t ci, size_t n, auto zero) {
    using T = decltype(zero);
    const size_t ti = tasks[i].tensor;
    const T* t = reinterpret_cast<const T*>(target[ti].data + ci * static_cast<size_t>(c.chunk_bytes));
    internal::EncodeKeyframeChunk(t, n, options.zstd_level, &encoded[i].pos);
    digests.DigestChunk(ti, ci, reinterpret_cast<const uint8_t*>(t), n * sizeof(T), c.chunk_bytes);
  });
  for (size_t t = 0; t < c.tensors.size(); ++t) c.tensors[t].target_checksum = digests.Tensor(t);
  return Finish(c, tasks, encoded);
}

Status ApplyPatch(std::string_view patch, std::span<const MutableTensorView> tensors,
                  const ApplyOptions& options) {
  WSYNC_ASSIGN_OR_RETURN(Container c, internal::ReadContainer(patch, options.verify_patch_checksum));
  WSYNC_ASSIGN_OR_RETURN(auto dst, MatchTensors(c, tensors, options.allow_extra_tensors));
  if (c.kind == PatchKind::kKeyframe) return ApplyKeyframe(c, dst, options);
  return ApplyDelta(c, dst, options);
}

StatusOr<std::string> MergePatches(std::string_view first, std::string_view second,
                                   std::span<const TensorView> base, const EncodeOptions& options) {
  WSYNC_RETURN_IF_ERROR(ValidateOptions(options));
  WSYNC_ASSIGN_OR_RETURN(Container a, internal::ReadContainer(first, true));
  WSYNC_ASSIGN_OR_RETURN(Container b, internal::ReadContainer(second, true));
  if (b.kind != PatchKind::kPatch) return InvalidArgumentError("the second input of a merge must be a patch, not a keyframe");
  if (a.chunk_bytes != b.chunk_bytes || a.tensors.size() != b.tensors.size()) {
    return FailedPreconditionError("patches cover different tensor sets or chunk sizes");
  }
  std::vector<uint64_t> a_targets;
  for (size_t t = 0; t < a.tensors.size(); ++t) {
    const TensorEntry& x = a.tensors[t];
    const TensorEntry& y = b.tensors[t];
    if (x.name != y.name || x.dtype != y.dtype || x.shape != y.shape) {
      return FailedPreconditionError("tensor " + std::to_string(t) + " differs between the patches (" + Quoted(x.name) +
                                     " vs " + Quoted(y.name) + ")");
    }
    a_targets.push_back(x.target_checksum);
  }
  if (internal::SetChecksumOf(a_targets) != b.base_set_checksum) {
    return FailedPreconditionError("patches do not chain: the second's base is not the first's target");
  }
  const bool keyframe = a.kind == PatchKind::kKeyframe;
  // Base tensors by position in the patch, when given.
  std::vector<const TensorView*> base_of(a.tensors.size(), nullptr);
  if (!base.empty() && !keyframe) {
    std::unordered_map<std::string_view, const TensorView*> by_name;
    for (const auto& t : base) by_name[t.name] = &t;
    std::vector<TensorView> ordered;
    for (size_t t = 0; t < a.tensors.size(); ++t) {
      auto it = by_name.find(a.tensors[t].name);
      if (it == by_name.end() || it->second->dtype != a.tensors[t].dtype || it->second->shape != a.tensors[t].shape) {
        return FailedPreconditionError("base tensor " + Quoted(a.tensors[t].name) + " is missing or of another dtype or shape");
      }
      base_of[t] = it->second;
      ordered.push_back(*it->second);
    }
    if (SetChecksum(ordered, options.pool) != a.base_set_checksum) {
      return FailedPreconditionError("the given base is not the first patch's base version");
    }
  }
  const bool have_base = !base.empty() && !keyframe;

  Container out;
  out.kind = a.kind;
  out.chunk_bytes = a.chunk_bytes;
  out.base_version = a.base_version;
  out.target_version = b.target_version;
  out.base_set_checksum = a.base_set_checksum;
  for (size_t t = 0; t < b.tensors.size(); ++t) {
    TensorEntry e = b.tensors[t];
    for (auto& ch : e.chunks) ch = ChunkEntry{};
    out.tensors.push_back(std::move(e));
  }
  const std::vector<Task> tasks = TasksOf(out.tensors);
  std::vector<internal::EncodedChunk> encoded(tasks.size());
  FirstError error;
  ForEachChunk(options.pool, a, tasks, [&](size_t i, const TensorEntry& ea, size_t ci, size_t n, auto zero) {
    using T = decltype(zero);
    const size_t ti = tasks[i].tensor;
    const ChunkEntry& ca = ea.chunks[ci];
    const ChunkEntry& cb = b.tensors[ti].chunks[ci];
    const ExponentField ef = ExponentFieldOf(ea.dtype);
    const std::string where = ChunkWhere(ea, ci);
    SparseDelta<T> db;
    if (keyframe) {
      std::vector<T> values(n);
      Status s = internal::DecodeKeyframeChunk<T>(a.PosStream(ca), n, values.data());
      if (s.ok()) s = internal::DecodeChunk<T>(cb.mode, cb.changed, b.PosStream(cb), b.ValStream(cb), values.data(), n, ef, &db);
      if (!s.ok()) return error.Record(i, s.WithContext(where));
      internal::ScatterAdd(values.data(), db, false);
      internal::EncodeKeyframeChunk(values.data(), n, options.zstd_level, &encoded[i].pos);
      return;
    }
    const T* bj = have_base ? reinterpret_cast<const T*>(base_of[ti]->data) + ci * (a.chunk_bytes / sizeof(T)) : nullptr;
    SparseDelta<T> da;
    Status s = internal::DecodeChunk<T>(ca.mode, ca.changed, a.PosStream(ca), a.ValStream(ca), bj, n, ef, &da);
    if (!s.ok()) return error.Record(i, s.WithContext("first patch " + where));
    std::vector<T> version_k;
    if (internal::ChunkNeedsBase(cb.mode, b.PosStream(cb)) && bj != nullptr) {
      version_k.assign(bj, bj + n);
      internal::ScatterAdd(version_k.data(), da, false);
    }
    s = internal::DecodeChunk<T>(cb.mode, cb.changed, b.PosStream(cb), b.ValStream(cb),
                                 version_k.empty() ? nullptr : version_k.data(), n, ef, &db);
    if (!s.ok()) return error.Record(i, s.WithContext("second patch " + where));
    internal::ChunkCodecOptions co{options.zstd_level, options.condition_on_base && bj != nullptr, ef,
                                   options.max_classes};
    encoded[i] = internal::EncodeChunk(bj, n, ComposeDeltas(da, db), co);
  });
  WSYNC_RETURN_IF_ERROR(error.status());
  return Finish(out, tasks, encoded);
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
    for (const ChunkEntry& ch : e.chunks) {
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
