// Merging two chained patches into one (patch(j->k) + patch(k->l) = patch(j->l)).
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "chunk_codec.h"
#include "format.h"
#include "patch_common.h"
#include "patch_encode.h"
#include "wsync/codec/codec.h"
#include "wsync/util/first_error.h"
#include "wsync/util/text.h"

namespace wsync::codec {
namespace {

using internal::AbsentChunk;
using internal::ChunkEntry;
using internal::ChunkWhere;
using internal::Container;
using internal::Finish;
using internal::ForEachChunk;
using internal::SparseDelta;
using internal::Task;
using internal::TasksOf;
using internal::TensorEntry;
using internal::ValidateOptions;

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
    if (x.row_cuts != y.row_cuts || x.col_cuts != y.col_cuts) {
      return FailedPreconditionError("tensor " + Quoted(x.name) + " has different tile grids in the two patches");
    }
    for (const TensorEntry* e : {&x, &y}) {
      for (size_t k = 0; k < e->chunks.size(); ++k) {
        if (e->chunks[k].absent) return AbsentChunk(*e, k);
      }
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
    for (size_t t = 0; t < a.tensors.size(); ++t) {
      auto it = by_name.find(a.tensors[t].name);
      if (it == by_name.end() || it->second->dtype != a.tensors[t].dtype || it->second->shape != a.tensors[t].shape) {
        return FailedPreconditionError("base tensor " + Quoted(a.tensors[t].name) + " is missing or of another dtype or shape");
      }
      base_of[t] = it->second;
    }
    if (internal::EntriesSetChecksum(a.tensors, [&](size_t t) { return base_of[t]->data; }, options.pool) !=
        a.base_set_checksum) {
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
    for (auto& ch : e.chunks) ch = ChunkEntry{.digest = ch.digest};  // the digests of l
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
      internal::ScatterAdd(values.data(), db);
      internal::EncodeKeyframeChunk(values.data(), n, options.zstd_level, &encoded[i].pos);
      return;
    }
    thread_local std::vector<uint8_t> scratch;
    const T* bj = have_base ? reinterpret_cast<const T*>(internal::ChunkBytes(
                                  ea.tiles[ci], internal::Identity(ea, base_of[ti]->data), sizeof(T), &scratch))
                            : nullptr;
    SparseDelta<T> da;
    Status s = internal::DecodeChunk<T>(ca.mode, ca.changed, a.PosStream(ca), a.ValStream(ca), bj, n, ef, &da);
    if (!s.ok()) return error.Record(i, s.WithContext("first patch " + where));
    std::vector<T> version_k;
    if (internal::ChunkNeedsBase(cb.mode, b.PosStream(cb)) && bj != nullptr) {
      version_k.assign(bj, bj + n);
      internal::ScatterAdd(version_k.data(), da);
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

}  // namespace wsync::codec
