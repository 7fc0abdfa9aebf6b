// Patch and keyframe encode, apply, merge and inspect: the set-level driver
// over the chunk codec. Chunks are the unit of parallel work.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <set>
#include <unordered_set>

#include "chunk_codec.h"
#include "format.h"
#include "patch_common.h"
#include "wsync/codec/checksum.h"
#include "wsync/codec/codec.h"
#include "wsync/util/bytes.h"
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
using internal::Placement;

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
  auto data = [&](size_t t) { return static_cast<const uint8_t*>(dst[t]->data); };
  return internal::EntriesSetChecksum(c.tensors, data, pool) == c.base_set_checksum;
}

Status WrongBase(const Container& c) {
  return FailedPreconditionError("the destination does not hold the patch's base version " +
                                 std::to_string(c.base_version) +
                                 " (base checksum differs); destination unchanged");
}

// ---- The apply engine: chunks at placements.
//
// A whole-set apply places every chunk of every tensor at the destination
// tensor of its name; a sink holding pieces places the chunks inside its
// pieces in its runtime tensors (a replicated box: several placements of
// one chunk). Both run the same sequence: decode against the bytes at the
// placement, add, verify, undo everything on any failure.

// One chunk at one placement.
struct Work {
  size_t tensor = 0;  // in the container
  size_t chunk = 0;
  Placement at;
  size_t group = 0;   // ungridded tensors: the placed tensor its checksum verifies
};

struct Plan {
  std::vector<Work> works;
  std::vector<size_t> group_tensor;      // per group: its container tensor
  std::vector<std::string> group_where;  // per group: how errors name it
  bool whole = true;                     // every tensor at its own destination

  std::vector<uint64_t> GroupBytes(const Container& c) const {
    std::vector<uint64_t> out;
    for (size_t t : group_tensor) out.push_back(c.tensors[t].nbytes);
    return out;
  }
};

Status AbsentChunk(const TensorEntry& t, size_t chunk) {
  return FailedPreconditionError(ChunkWhere(t, chunk) +
                                 " is not in this patch (a selection for other pieces); pull the whole patch "
                                 "or one selected for these pieces");
}

Plan WholePlan(const Container& c, const std::vector<const MutableTensorView*>& dst) {
  Plan p;
  for (size_t t = 0; t < c.tensors.size(); ++t) {
    p.group_tensor.push_back(t);
    p.group_where.push_back("tensor " + Quoted(c.tensors[t].name));
    for (size_t k = 0; k < c.tensors[t].chunks.size(); ++k) {
      p.works.push_back(Work{t, k, internal::Identity(c.tensors[t], dst[t]->data), t});
    }
  }
  return p;
}

// A rectangle of a two-dimensional view.
struct Rect {
  uint64_t r0 = 0, r1 = 0, c0 = 0, c1 = 0;
  bool Contains(const Rect& o) const { return o.r0 >= r0 && o.r1 <= r1 && o.c0 >= c0 && o.c1 <= c1; }
  bool Overlaps(const Rect& o) const { return o.r0 < r1 && r0 < o.r1 && o.c0 < c1 && c0 < o.c1; }
  std::string Text() const {
    return "rows [" + std::to_string(r0) + ", " + std::to_string(r1) + ") columns [" + std::to_string(c0) + ", " +
           std::to_string(c1) + ")";
  }
};

// The bounding rectangle of a chunk (exact for the containment and overlap
// tests against rectangles aligned with its cell's grid).
Rect TileRect(const internal::Tile& t) {
  Rect r{t.FirstRow(), t.LastRow() + 1, t.col0, t.col0 + t.cell_cols};
  if (r.r1 == r.r0 + 1) {
    r.c0 = t.col0 + t.first % t.cell_cols;
    r.c1 = r.c0 + t.n;
  }
  return r;
}

std::string PieceWhere(const RuntimeTensor& rt, size_t j) {
  return "runtime tensor " + Quoted(rt.view.name) + " piece " + std::to_string(j) + " (of " +
         Quoted(rt.pieces[j].canonical) + ")";
}

// The piece's rectangles in the canonical and the runtime tensors' views.
// InvalidArgument saying what does not fit.
Status PieceRects(const Piece& p, const std::vector<uint64_t>& cshape, const std::vector<uint64_t>& rshape,
                  Rect* canonical, Rect* runtime) {
  const size_t rank = cshape.size();
  if (p.start.size() != rank || p.extent.size() != rank || p.runtime_start.size() != rank) {
    return InvalidArgumentError("box of rank " + std::to_string(p.extent.size()) + " for a canonical tensor of rank " +
                                std::to_string(rank));
  }
  if (rshape.size() != rank) {
    return InvalidArgumentError("runtime tensor of rank " + std::to_string(rshape.size()) +
                                " for a canonical tensor of rank " + std::to_string(rank));
  }
  for (size_t d = 0; d < rank; ++d) {
    const std::string dim = "dimension " + std::to_string(d);
    if (p.extent[d] == 0) return InvalidArgumentError(dim + ": empty box");
    if (p.start[d] > cshape[d] || p.extent[d] > cshape[d] - p.start[d]) {
      return InvalidArgumentError(dim + ": box [" + std::to_string(p.start[d]) + ", +" + std::to_string(p.extent[d]) +
                                  ") outside the canonical tensor's " + std::to_string(cshape[d]));
    }
    if (p.runtime_start[d] > rshape[d] || p.extent[d] > rshape[d] - p.runtime_start[d]) {
      return InvalidArgumentError(dim + ": box at " + std::to_string(p.runtime_start[d]) + " of extent " +
                                  std::to_string(p.extent[d]) + " outside the runtime tensor's " +
                                  std::to_string(rshape[d]));
    }
    if (d >= 2 && (p.extent[d] != cshape[d] || rshape[d] != cshape[d])) {
      return InvalidArgumentError(dim + ": only dimensions 0 and 1 may be split or placed; a box spans every "
                                  "further dimension whole, of equal size in both tensors");
    }
  }
  uint64_t inner = 1;
  for (size_t d = 2; d < rank; ++d) inner *= cshape[d];
  if (rank == 0) {
    *canonical = *runtime = Rect{0, 1, 0, 1};
  } else if (rank == 1) {
    *canonical = Rect{p.start[0], p.start[0] + p.extent[0], 0, 1};
    *runtime = Rect{p.runtime_start[0], p.runtime_start[0] + p.extent[0], 0, 1};
  } else {
    *canonical = Rect{p.start[0], p.start[0] + p.extent[0], p.start[1] * inner, (p.start[1] + p.extent[1]) * inner};
    *runtime = Rect{p.runtime_start[0], p.runtime_start[0] + p.extent[0], p.runtime_start[1] * inner,
                    (p.runtime_start[1] + p.extent[1]) * inner};
  }
  return Status::Ok();
}

// Refuses pieces of a runtime tensor whose runtime rectangles overlap.
Status CheckRuntimeRects(const RuntimeTensor& rt, const std::vector<Rect>& rects) {
  for (size_t a = 0; a < rects.size(); ++a) {
    for (size_t b = 0; b < a; ++b) {
      if (rects[a].Overlaps(rects[b])) {
        return InvalidArgumentError(PieceWhere(rt, a) + " overlaps piece " + std::to_string(b) + " in the runtime tensor");
      }
    }
  }
  return Status::Ok();
}

// The works that apply a container into pieces. need_data: the runtime
// tensors' data must be set.
// other_parts: pieces of tensors the container lacks belong to other parts
// of the version (skipped) rather than being an error.
StatusOr<Plan> PiecesPlan(const Container& c, std::span<const RuntimeTensor> runtime, bool need_data,
                          bool other_parts = false) {
  std::unordered_map<std::string_view, size_t> index;
  for (size_t t = 0; t < c.tensors.size(); ++t) index.emplace(c.tensors[t].name, t);
  Plan p;
  p.whole = false;
  for (const RuntimeTensor& rt : runtime) {
    if (need_data && rt.view.NumBytes() > 0 && rt.view.data == nullptr) {
      return InvalidArgumentError("runtime tensor " + Quoted(rt.view.name) + ": no data");
    }
    uint64_t rows, cols;
    internal::ViewOf(rt.view.shape, rt.view.NumElements(), &rows, &cols);
    std::vector<Rect> rects;
    for (size_t j = 0; j < rt.pieces.size(); ++j) {
      const Piece& piece = rt.pieces[j];
      auto it = index.find(piece.canonical);
      if (it == index.end()) {
        if (other_parts) continue;
        return FailedPreconditionError(PieceWhere(rt, j) + ": the patch has no such tensor");
      }
      const TensorEntry& t = c.tensors[it->second];
      if (t.dtype != rt.view.dtype) {
        return FailedPreconditionError(PieceWhere(rt, j) + ": the runtime tensor is " +
                                       std::string(DTypeName(rt.view.dtype)) + ", the patch's tensor " +
                                       std::string(DTypeName(t.dtype)));
      }
      Rect cr, rr;
      Status s = PieceRects(piece, t.shape, rt.view.shape, &cr, &rr);
      if (!s.ok()) return s.WithContext(PieceWhere(rt, j));
      rects.push_back(rr);
      const size_t group = p.group_tensor.size();
      p.group_tensor.push_back(it->second);
      p.group_where.push_back(PieceWhere(rt, j));
      const Placement at{rt.view.data, cols, static_cast<int64_t>(rr.r0) - static_cast<int64_t>(cr.r0),
                         static_cast<int64_t>(rr.c0) - static_cast<int64_t>(cr.c0)};
      if (!t.gridded() && !cr.Contains(Rect{0, t.rows, 0, t.cols})) {
        return FailedPreconditionError(PieceWhere(rt, j) + " holds " + cr.Text() + " of a tensor the patch does not " +
                                       "grid: the source must encode with the tile grid of this layout (GridsFor)");
      }
      for (size_t k = 0; k < t.chunks.size(); ++k) {
        const Rect tile = TileRect(t.tiles[k]);
        if (cr.Contains(tile)) {
          p.works.push_back(Work{it->second, k, at, group});
        } else if (cr.Overlaps(tile)) {
          return FailedPreconditionError(PieceWhere(rt, j) + " holds " + cr.Text() + ", which cuts " +
                                         ChunkWhere(t, k) + " (" + tile.Text() +
                                         "): the source's tile grid does not include this layout (GridsFor)");
        }
      }
    }
    WSYNC_RETURN_IF_ERROR(CheckRuntimeRects(rt, rects));
  }
  return p;
}

Status CheckPresent(const Container& c, const Plan& p) {
  for (const Work& w : p.works) {
    if (c.tensors[w.tensor].chunks[w.chunk].absent) return AbsentChunk(c.tensors[w.tensor], w.chunk);
  }
  return Status::Ok();
}

// Verifies what the works wrote (their digests, and each group's tensor
// checksum), naming the first mismatch.
class Verifier {
 public:
  Verifier(const Container& c, const Plan& p) : c_(c), p_(p), tiles_(p.works.size()), groups_(p.GroupBytes(c)) {}

  // Records the result bytes of work i (chunk order).
  void Record(size_t i, const uint8_t* bytes) {
    const Work& w = p_.works[i];
    const TensorEntry& t = c_.tensors[w.tensor];
    const size_t len = t.tiles[w.chunk].n * DTypeWidth(t.dtype);
    if (t.gridded()) {
      tiles_[i] = BlockDigest(bytes, len);
    } else {
      groups_.DigestChunk(w.group, internal::FirstBlock(t, w.chunk), bytes, len);
    }
  }

  // The first mismatch, as the work or group index.
  std::optional<std::string> Mismatch() const {
    for (size_t i = 0; i < p_.works.size(); ++i) {
      const Work& w = p_.works[i];
      const TensorEntry& t = c_.tensors[w.tensor];
      if (t.gridded() && tiles_[i] != t.chunks[w.chunk].digest) {
        return ChunkWhere(t, w.chunk) + (p_.whole ? "" : " in " + p_.group_where[w.group]);
      }
    }
    for (size_t g = 0; g < p_.group_tensor.size(); ++g) {
      const TensorEntry& t = c_.tensors[p_.group_tensor[g]];
      if (!t.gridded() && groups_.Tensor(g) != t.target_checksum) return p_.group_where[g];
    }
    return std::nullopt;
  }

 private:
  const Container& c_;
  const Plan& p_;
  std::vector<uint64_t> tiles_;
  Digests groups_;
};

// A keyframe's works: Verify decodes into scratch and checks every digest
// (nothing written); Write then decodes into the destination.
class KeyframeApply {
 public:
  KeyframeApply(const Container& c, const Plan& p, ThreadPool* pool) : c_(c), p_(p), pool_(pool) {}

  Status Verify() {
    Verifier verifier(c_, p_);
    FirstError error;
    ParallelFor(pool_, p_.works.size(), [&](size_t i) {
      const Work& w = p_.works[i];
      const TensorEntry& t = c_.tensors[w.tensor];
      WithWidth(DTypeWidth(t.dtype), [&](auto zero) {
        using T = decltype(zero);
        std::vector<T> scratch(t.tiles[w.chunk].n);
        Status s = internal::DecodeKeyframeChunk<T>(c_.PosStream(t.chunks[w.chunk]), scratch.size(), scratch.data());
        if (!s.ok()) return error.Record(i, s.WithContext(ChunkWhere(t, w.chunk)));
        verifier.Record(i, reinterpret_cast<const uint8_t*>(scratch.data()));
      });
    });
    WSYNC_RETURN_IF_ERROR(error.status());
    if (auto bad = verifier.Mismatch()) {
      return DataLossError(*bad + ": keyframe content does not match its checksum; destination not modified");
    }
    return Status::Ok();
  }

  // REQUIRES: Verify() succeeded (the same bytes decode the same way).
  Status Write() {
    FirstError error;
    ParallelFor(pool_, p_.works.size(), [&](size_t i) {
      const Work& w = p_.works[i];
      const TensorEntry& t = c_.tensors[w.tensor];
      const internal::Tile& tile = t.tiles[w.chunk];
      WithWidth(DTypeWidth(t.dtype), [&](auto zero) {
        using T = decltype(zero);
        const std::string_view stream = c_.PosStream(t.chunks[w.chunk]);
        if (uint8_t* at = internal::ContiguousAt(tile, w.at, sizeof(T))) {
          return error.Record(i, internal::DecodeKeyframeChunk<T>(stream, tile.n, reinterpret_cast<T*>(at)));
        }
        std::vector<T> scratch(tile.n);
        error.Record(i, internal::DecodeKeyframeChunk<T>(stream, tile.n, scratch.data()));
        internal::Scatter(tile, w.at, sizeof(T), reinterpret_cast<const uint8_t*>(scratch.data()));
      });
    });
    return error.status();
  }

 private:
  const Container& c_;
  const Plan& p_;
  ThreadPool* pool_;
};

// A patch's works: Run decodes, adds and verifies each chunk while it is in
// cache, and undoes everything itself when anything fails; Undo takes back
// a successful Run (when a later part of the same version fails).
class DeltaApply {
 public:
  DeltaApply(const Container& c, const Plan& p, ThreadPool* pool)
      : c_(c), p_(p), pool_(pool), decoded_(p.works.size()), ready_(p.works.size(), 0), applied_(p.works.size(), 0) {}

  // Decodes work i against the bytes now at its placement and writes
  // nothing (ahead of Run, while the rest of the patch arrives); Run then
  // adds it without decoding it again. A chunk that fails to decode is left
  // to Run, which decodes it again and names the error. Distinct works may
  // be decoded concurrently.
  void Predecode(size_t i) {
    const Work& w = p_.works[i];
    const TensorEntry& t = c_.tensors[w.tensor];
    const ChunkEntry& ch = t.chunks[w.chunk];
    const internal::Tile& tile = t.tiles[w.chunk];
    WithWidth(DTypeWidth(t.dtype), [&](auto zero) {
      using T = decltype(zero);
      thread_local std::vector<uint8_t> scratch;
      const T* x = reinterpret_cast<const T*>(internal::ChunkBytes(tile, w.at, sizeof(T), &scratch));
      Status s = internal::DecodeChunk<T>(ch.mode, ch.changed, c_.PosStream(ch), c_.ValStream(ch), x, tile.n,
                                          ExponentFieldOf(t.dtype), &decoded_[i].Get<T>());
      ready_[i] = s.ok() ? 1 : 0;
    });
  }

  // holds_base: whether the destination holds the patch's base (asked after
  // a failure, to tell a wrong base from a corrupt patch); null when it
  // cannot be known (pieces).
  Status Run(const std::function<bool()>& holds_base) {
    Verifier verifier(c_, p_);
    FirstError error;
    ParallelFor(pool_, p_.works.size(), [&](size_t i) {
      const uint8_t* result = nullptr;
      Status s = Chunk(i, /*undo=*/false, &result);
      if (!s.ok()) return error.Record(i, s);
      verifier.Record(i, result);
    });
    auto fail = [&](Status s) {
      Undo();
      if (holds_base && !holds_base()) return WrongBase(c_);
      return s;
    };
    if (error.failed()) {
      if (holds_base || error.status().code() != StatusCode::kDataLoss) return fail(error.status());
      return fail(DataLossError(error.status().message() +
                                " (the patch is corrupted or the pieces do not hold its base); change undone"));
    }
    if (auto bad = verifier.Mismatch()) {
      return fail(DataLossError(*bad + ": result does not match the patch's checksum (" +
                                (holds_base ? std::string("the patch is corrupted")
                                            : std::string("the patch is corrupted or the pieces do not hold its base")) +
                                "); change undone, destination unchanged"));
    }
    return Status::Ok();
  }

  void Undo() {
    ParallelFor(pool_, p_.works.size(), [&](size_t i) {
      if (applied_[i]) (void)Chunk(i, /*undo=*/true, nullptr);
      applied_[i] = 0;
    });
  }

 private:
  // Adds (or with undo subtracts) work i's change at its placement; adding
  // first decodes it against the bytes there and points *result at the
  // chunk's new bytes (valid until this thread's next chunk). A chunk that
  // fails to decode is left untouched.
  Status Chunk(size_t i, bool undo, const uint8_t** result) {
    const Work& w = p_.works[i];
    const TensorEntry& t = c_.tensors[w.tensor];
    const ChunkEntry& ch = t.chunks[w.chunk];
    const internal::Tile& tile = t.tiles[w.chunk];
    return WithWidth(DTypeWidth(t.dtype), [&](auto zero) -> Status {
      using T = decltype(zero);
      thread_local std::vector<uint8_t> scratch;
      uint8_t* at = internal::ContiguousAt(tile, w.at, sizeof(T));
      uint8_t* bytes = at;
      if (at == nullptr) {
        scratch.resize(tile.n * sizeof(T));
        internal::Gather(tile, w.at, sizeof(T), scratch.data());
        bytes = scratch.data();
      }
      T* x = reinterpret_cast<T*>(bytes);
      SparseDelta<T>& d = decoded_[i].Get<T>();
      if (!undo && !ready_[i]) {
        Status s = internal::DecodeChunk<T>(ch.mode, ch.changed, c_.PosStream(ch), c_.ValStream(ch), x, tile.n,
                                            ExponentFieldOf(t.dtype), &d);
        if (!s.ok()) return s.WithContext(ChunkWhere(t, w.chunk));
      }
      internal::ScatterAdd<T>(x, d, undo);
      if (at == nullptr) internal::Scatter(tile, w.at, sizeof(T), bytes);
      if (!undo) {
        applied_[i] = 1;
        *result = bytes;
      }
      return Status::Ok();
    });
  }

  const Container& c_;
  const Plan& p_;
  ThreadPool* pool_;
  std::vector<Decoded> decoded_;
  std::vector<uint8_t> ready_;  // decoded_[i] holds work i's change (Predecode)
  std::vector<uint8_t> applied_;
};

// The parts of one version (one container each, disjoint tensors) applied
// as one: keyframes verified first (nothing written), then each patch
// applied and verified (all undone if any fails), then the keyframes
// written.
struct PartApply {
  Container c;
  Plan plan;
  std::function<bool()> holds_base;  // patches; null: unknown
  std::unique_ptr<DeltaApply> delta;  // patches: made by ApplyAll unless decoding began ahead
};

// Reads a part whose tensors are destination tensors of their names.
// REQUIRES: *p stays where it is (holds_base refers to p->c).
// Plans a part whose container p->c is read: into destination tensors of
// its tensors' names. REQUIRES: *p stays where it is.
Status PlanWholePart(std::span<const MutableTensorView> tensors, bool allow_extra, ThreadPool* pool, PartApply* p) {
  WSYNC_ASSIGN_OR_RETURN(auto dst, MatchTensors(p->c, tensors, allow_extra));
  p->plan = WholePlan(p->c, dst);
  WSYNC_RETURN_IF_ERROR(CheckPresent(p->c, p->plan));
  const Container* held = &p->c;
  p->holds_base = [held, dst, pool] { return HoldsBase(*held, dst, pool); };
  return Status::Ok();
}

// Plans a part whose container p->c is read into pieces (other_parts: see
// PiecesPlan).
Status PlanPiecesPart(std::span<const RuntimeTensor> runtime, bool other_parts, PartApply* p) {
  WSYNC_ASSIGN_OR_RETURN(p->plan, PiecesPlan(p->c, runtime, /*need_data=*/true, other_parts));
  return CheckPresent(p->c, p->plan);
}

Status ReadWholePart(std::string_view patch, std::span<const MutableTensorView> tensors, bool allow_extra,
                     const ApplyOptions& options, PartApply* p) {
  WSYNC_ASSIGN_OR_RETURN(p->c, internal::ReadContainer(patch, options.verify_patch_checksum));
  return PlanWholePart(tensors, allow_extra, options.pool, p);
}

// Reads a part applied into pieces (other_parts: see PiecesPlan).
Status ReadPiecesPart(std::string_view patch, std::span<const RuntimeTensor> runtime, bool other_parts,
                      const ApplyOptions& options, PartApply* p) {
  WSYNC_ASSIGN_OR_RETURN(p->c, internal::ReadContainer(patch, options.verify_patch_checksum));
  return PlanPiecesPart(runtime, other_parts, p);
}

Status ApplyAll(std::span<PartApply* const> parts, ThreadPool* pool) {
  std::vector<std::unique_ptr<KeyframeApply>> keyframes;
  for (PartApply* p : parts) {
    if (p->c.kind != PatchKind::kKeyframe) continue;
    keyframes.push_back(std::make_unique<KeyframeApply>(p->c, p->plan, pool));
    WSYNC_RETURN_IF_ERROR(keyframes.back()->Verify());
  }
  std::vector<DeltaApply*> applied;
  auto undo = [&] {
    for (DeltaApply* d : applied) d->Undo();
  };
  for (PartApply* p : parts) {
    if (p->c.kind != PatchKind::kPatch) continue;
    if (!p->delta) p->delta = std::make_unique<DeltaApply>(p->c, p->plan, pool);
    if (Status s = p->delta->Run(p->holds_base); !s.ok()) {
      undo();
      return s;
    }
    applied.push_back(p->delta.get());
  }
  for (auto& k : keyframes) {
    if (Status s = k->Write(); !s.ok()) {
      undo();
      return s.WithContext("a verified keyframe failed to decode again");
    }
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

namespace {

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

}  // namespace

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

Status ApplyPatch(std::string_view patch, std::span<const MutableTensorView> tensors,
                  const ApplyOptions& options) {
  PartApply part;
  WSYNC_RETURN_IF_ERROR(ReadWholePart(patch, tensors, options.allow_extra_tensors, options, &part));
  PartApply* parts[] = {&part};
  return ApplyAll(parts, options.pool);
}

Status ValidatePieces(std::span<const RuntimeTensor> runtime, std::span<const TensorView> canonical,
                      std::span<const TileGrid> grids) {
  // A directory of the canonical set (shapes and grids, no streams) plans
  // the pieces as an apply would.
  std::unordered_map<std::string_view, const TileGrid*> by_name;
  for (const TileGrid& g : grids) by_name.emplace(g.tensor, &g);
  Container c;
  c.chunk_bytes = internal::kMaxChunkBytes;  // chunks never cross cells: any size checks the same
  for (const TensorView& t : canonical) {
    WSYNC_RETURN_IF_ERROR(internal::ValidateTensor(t, /*need_data=*/false));
    auto it = by_name.find(t.name);
    WSYNC_ASSIGN_OR_RETURN(TensorEntry e, EntryFor(t, c.chunk_bytes, it == by_name.end() ? nullptr : it->second));
    c.tensors.push_back(std::move(e));
  }
  return PiecesPlan(c, runtime, /*need_data=*/false).status();
}

std::vector<TileGrid> GridsFor(std::span<const std::vector<RuntimeTensor>> layouts,
                               std::span<const TensorView> canonical) {
  std::unordered_map<std::string_view, size_t> index;
  for (size_t t = 0; t < canonical.size(); ++t) index.emplace(canonical[t].name, t);
  std::vector<std::set<uint64_t>> rows(canonical.size()), cols(canonical.size());
  for (const auto& layout : layouts) {
    for (const RuntimeTensor& rt : layout) {
      for (const Piece& piece : rt.pieces) {
        auto it = index.find(piece.canonical);
        if (it == index.end()) continue;
        Rect cr, rr;
        if (!PieceRects(piece, canonical[it->second].shape, rt.view.shape, &cr, &rr).ok()) continue;
        rows[it->second].insert({cr.r0, cr.r1});
        cols[it->second].insert({cr.c0, cr.c1});
      }
    }
  }
  std::vector<TileGrid> out;
  for (size_t t = 0; t < canonical.size(); ++t) {
    uint64_t nrows, ncols;
    internal::ViewOf(canonical[t].shape, canonical[t].NumElements(), &nrows, &ncols);
    TileGrid g{canonical[t].name, {}, {}};
    for (uint64_t r : rows[t]) {
      if (r > 0 && r < nrows) g.row_cuts.push_back(r);
    }
    for (uint64_t col : cols[t]) {
      if (col > 0 && col < ncols) g.col_cuts.push_back(col);
    }
    if (!g.row_cuts.empty() || !g.col_cuts.empty()) out.push_back(std::move(g));
  }
  return out;
}

Status ApplyToPieces(std::string_view patch, std::span<const RuntimeTensor> runtime, const ApplyOptions& options) {
  PartApply part;
  WSYNC_RETURN_IF_ERROR(ReadPiecesPart(patch, runtime, /*other_parts=*/false, options, &part));
  PartApply* parts[] = {&part};
  return ApplyAll(parts, options.pool);
}

namespace {

// Parts of one version hold disjoint tensors, which cover the destination
// (unless allow_extra_tensors).
Status CheckWholeParts(std::span<PartApply* const> parts, std::span<const MutableTensorView> tensors,
                       const ApplyOptions& options) {
  std::unordered_map<std::string_view, size_t> part_of;
  for (size_t i = 0; i < parts.size(); ++i) {
    for (const TensorEntry& e : parts[i]->c.tensors) {
      if (auto [it, fresh] = part_of.emplace(e.name, i); !fresh) {
        return FailedPreconditionError("tensor " + Quoted(e.name) + " is in parts " + std::to_string(it->second) +
                                       " and " + std::to_string(i) + " of the version");
      }
    }
  }
  if (!options.allow_extra_tensors) {
    for (const MutableTensorView& t : tensors) {
      if (!part_of.count(t.name)) {
        return FailedPreconditionError("destination tensor " + Quoted(t.name) + " is in no part of the version");
      }
    }
  }
  return Status::Ok();
}

// The same for pieces: every piece's tensor in exactly one part.
Status CheckPiecesParts(std::span<PartApply* const> parts, std::span<const RuntimeTensor> runtime) {
  std::unordered_set<std::string_view> names;
  for (PartApply* p : parts) {
    for (const TensorEntry& e : p->c.tensors) {
      if (!names.insert(e.name).second) {
        return FailedPreconditionError("tensor " + Quoted(e.name) + " is in two parts of the version");
      }
    }
  }
  for (const RuntimeTensor& rt : runtime) {
    for (size_t j = 0; j < rt.pieces.size(); ++j) {
      if (!names.count(rt.pieces[j].canonical)) {
        return FailedPreconditionError(PieceWhere(rt, j) + ": no part of the version has this tensor");
      }
    }
  }
  return Status::Ok();
}

std::vector<PartApply*> Pointers(std::vector<PartApply>& parts) {
  std::vector<PartApply*> out;
  for (PartApply& p : parts) out.push_back(&p);
  return out;
}

}  // namespace

Status ApplyParts(std::span<const std::string_view> patches, std::span<const MutableTensorView> tensors,
                  const ApplyOptions& options) {
  if (patches.empty()) return InvalidArgumentError("no parts to apply");
  std::vector<PartApply> parts(patches.size());
  for (size_t i = 0; i < patches.size(); ++i) {
    WSYNC_RETURN_IF_ERROR(ReadWholePart(patches[i], tensors, /*allow_extra=*/true, options, &parts[i]));
  }
  const std::vector<PartApply*> all = Pointers(parts);
  WSYNC_RETURN_IF_ERROR(CheckWholeParts(all, tensors, options));
  return ApplyAll(all, options.pool);
}

Status ApplyPartsToPieces(std::span<const std::string_view> patches, std::span<const RuntimeTensor> runtime,
                          const ApplyOptions& options) {
  if (patches.empty()) return InvalidArgumentError("no parts to apply");
  std::vector<PartApply> parts(patches.size());
  for (size_t i = 0; i < patches.size(); ++i) {
    WSYNC_RETURN_IF_ERROR(ReadPiecesPart(patches[i], runtime, /*other_parts=*/true, options, &parts[i]));
  }
  const std::vector<PartApply*> all = Pointers(parts);
  WSYNC_RETURN_IF_ERROR(CheckPiecesParts(all, runtime));
  return ApplyAll(all, options.pool);
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

// ---- ApplyAhead

struct ApplyAhead::Impl {
  // One segment: a container and its plan, read from its head as soon as
  // its preamble and directory are in.
  struct Segment {
    uint64_t begin = 0;     // in the stream
    uint64_t header = 0;    // preamble and directory bytes
    uint64_t total = 0;
    std::string head;       // those bytes, to check that Apply is given the same
    PartApply part;
    std::vector<size_t> order;  // patches: works by where their streams end
    size_t next = 0;            // works of `order` decoded ahead
  };

  std::vector<MutableTensorView> tensors;
  std::vector<RuntimeTensor> runtime;
  bool pieces = false;
  ApplyOptions options;
  std::vector<std::unique_ptr<Segment>> segments;
  uint64_t end = 0;      // where the next segment begins
  bool stopped = false;  // something did not parse: Apply reads it again and says what
  size_t decoded = 0;

  // Opens the segment at `end` when its head is in; false when not (yet).
  bool Open(std::string_view prefix) {
    if (prefix.size() < end + internal::kPreambleBytes) return false;
    const std::string_view rest = prefix.substr(end);
    StatusOr<internal::Preamble> pre = internal::ReadPreamble(rest);
    if (!pre.ok()) return Stop();
    if (rest.size() < pre->HeaderBytes()) return false;
    auto seg = std::make_unique<Segment>();
    seg->begin = end;
    seg->header = pre->HeaderBytes();
    seg->total = pre->TotalBytes();
    seg->head = std::string(rest.substr(0, seg->header));
    PartApply& p = seg->part;
    StatusOr<Container> c = internal::ReadContainer(rest, /*verify_checksum=*/false, /*head_only=*/true);
    if (!c.ok()) return Stop();
    p.c = std::move(*c);
    const Status planned = pieces ? PlanPiecesPart(runtime, /*other_parts=*/true, &p)
                                  : PlanWholePart(tensors, /*allow_extra=*/true, options.pool, &p);
    if (!planned.ok()) return Stop();
    if (p.c.kind == PatchKind::kPatch) {
      p.delta = std::make_unique<DeltaApply>(p.c, p.plan, options.pool);
      seg->order.resize(p.plan.works.size());
      for (size_t i = 0; i < seg->order.size(); ++i) seg->order[i] = i;
      std::stable_sort(seg->order.begin(), seg->order.end(), [&](size_t a, size_t b) { return StreamEnd(p, a) < StreamEnd(p, b); });
    }
    end += seg->total;
    segments.push_back(std::move(seg));
    return true;
  }

  static uint64_t StreamEnd(const PartApply& p, size_t work) {
    const Work& w = p.plan.works[work];
    const ChunkEntry& ch = p.c.tensors[w.tensor].chunks[w.chunk];
    return ch.offset + ch.pos_len + ch.val_len;
  }

  bool Stop() {
    stopped = true;
    return false;
  }

  // Decodes the works of a patch segment whose streams are in `prefix`.
  void Decode(Segment& seg, std::string_view prefix) {
    PartApply& p = seg.part;
    if (!p.delta || seg.next == seg.order.size()) return;
    const uint64_t have = std::min<uint64_t>(prefix.size() - seg.begin, seg.total) - seg.header;
    p.c.payload = prefix.substr(seg.begin + seg.header, have);
    size_t upto = seg.next;
    while (upto < seg.order.size() && StreamEnd(p, seg.order[upto]) <= have) ++upto;
    if (upto == seg.next) return;
    const size_t first = seg.next;
    ParallelFor(options.pool, upto - first, [&](size_t k) { p.delta->Predecode(seg.order[first + k]); });
    decoded += upto - first;
    seg.next = upto;
  }
};

ApplyAhead::ApplyAhead(std::span<const MutableTensorView> tensors, const ApplyOptions& options)
    : impl_(std::make_unique<Impl>()) {
  impl_->tensors.assign(tensors.begin(), tensors.end());
  impl_->options = options;
}

ApplyAhead::ApplyAhead(std::span<const RuntimeTensor> runtime, const ApplyOptions& options)
    : impl_(std::make_unique<Impl>()) {
  impl_->runtime.assign(runtime.begin(), runtime.end());
  impl_->pieces = true;
  impl_->options = options;
}

ApplyAhead::ApplyAhead(ApplyAhead&&) noexcept = default;
ApplyAhead& ApplyAhead::operator=(ApplyAhead&&) noexcept = default;
ApplyAhead::~ApplyAhead() = default;

size_t ApplyAhead::decoded_ahead() const { return impl_->decoded; }

void ApplyAhead::Advance(std::string_view prefix) {
  Impl& m = *impl_;
  while (!m.stopped) {
    if (!m.segments.empty()) m.Decode(*m.segments.back(), prefix);
    if (m.segments.empty() || prefix.size() >= m.end) {
      if (!m.Open(prefix)) break;
    } else {
      break;
    }
  }
}

Status ApplyAhead::Apply(std::string_view stream) {
  Impl& m = *impl_;
  WSYNC_ASSIGN_OR_RETURN(std::vector<std::string_view> segments, SplitSegments(stream));
  // What was read ahead is used when the stream is the one it read: the same
  // segments with the same heads (and each verified whole below).
  bool same = !m.stopped && m.segments.size() == segments.size();
  for (size_t i = 0; same && i < segments.size(); ++i) {
    const Impl::Segment& seg = *m.segments[i];
    same = segments[i].data() == stream.data() + seg.begin && segments[i].size() == seg.total &&
           segments[i].substr(0, seg.header) == seg.head;
  }
  if (!same) {
    // Another stream than the one read ahead: applied as given.
    m.segments.clear();
    return m.pieces ? ApplyPartsToPieces(segments, m.runtime, m.options)
                    : ApplyParts(segments, m.tensors, m.options);
  }
  std::vector<PartApply*> parts;
  for (size_t i = 0; i < segments.size(); ++i) {
    PartApply& p = m.segments[i]->part;
    // The directory read ahead is this one; the whole segment is checked
    // (its checksum) before a byte is written.
    WSYNC_ASSIGN_OR_RETURN(Container whole, internal::ReadContainer(segments[i], m.options.verify_patch_checksum));
    p.c.payload = whole.payload;
    parts.push_back(&p);
  }
  if (m.pieces) {
    WSYNC_RETURN_IF_ERROR(CheckPiecesParts(parts, m.runtime));
  } else {
    WSYNC_RETURN_IF_ERROR(CheckWholeParts(parts, m.tensors, m.options));
  }
  return ApplyAll(parts, m.options.pool);
}

uint64_t LayoutFingerprint(std::span<const RuntimeTensor> runtime) {
  std::string s;
  ByteWriter w(&s);
  auto dims = [&](const std::vector<uint64_t>& v) {
    w.Varint(v.size());
    for (uint64_t d : v) w.Varint(d);
  };
  w.Varint(runtime.size());
  for (const RuntimeTensor& rt : runtime) {
    w.Varint(rt.view.name.size());
    w.Bytes(rt.view.name);
    dims(rt.view.shape);
    w.Varint(rt.pieces.size());
    for (const Piece& p : rt.pieces) {
      w.Varint(p.canonical.size());
      w.Bytes(p.canonical);
      dims(p.start);
      dims(p.extent);
      dims(p.runtime_start);
    }
  }
  const uint64_t h = Hash64(s.data(), s.size());
  return h == 0 ? 1 : h;
}

StatusOr<std::string> SelectForPieces(std::string_view patch, std::span<const RuntimeTensor> runtime) {
  WSYNC_ASSIGN_OR_RETURN(Container c, internal::ReadContainer(patch, true));
  WSYNC_ASSIGN_OR_RETURN(Plan plan, PiecesPlan(c, runtime, /*need_data=*/false, /*other_parts=*/true));
  WSYNC_RETURN_IF_ERROR(CheckPresent(c, plan));
  std::vector<std::vector<uint8_t>> needed(c.tensors.size());
  for (size_t t = 0; t < c.tensors.size(); ++t) needed[t].assign(c.tensors[t].chunks.size(), 0);
  for (const Work& w : plan.works) needed[w.tensor][w.chunk] = 1;
  std::string payload;
  for (size_t t = 0; t < c.tensors.size(); ++t) {
    for (size_t k = 0; k < c.tensors[t].chunks.size(); ++k) {
      ChunkEntry& ch = c.tensors[t].chunks[k];
      if (needed[t][k]) {
        payload.append(c.PosStream(ch));
        payload.append(c.ValStream(ch));
      } else {
        ch = ChunkEntry{};
        ch.absent = true;
      }
    }
  }
  return internal::WriteContainer(c, payload);
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
      internal::ScatterAdd(values.data(), db, false);
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
