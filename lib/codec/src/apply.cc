// Applying patches and keyframes: the apply engine (chunks at placements:
// whole tensors or the pieces of runtime tensors), the parts of a version
// applied as one, decoding while a stream arrives, and the selections a
// source serves to pieces.
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

using namespace set_level;  // patch_common.h

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
  size_t dst = 0;     // the destination (whole) or runtime (pieces) tensor
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

// first: the caller's list of destinations (Work::dst indexes it).
Plan WholePlan(const Container& c, const std::vector<const MutableTensorView*>& dst, const MutableTensorView* first) {
  Plan p;
  for (size_t t = 0; t < c.tensors.size(); ++t) {
    p.group_tensor.push_back(t);
    p.group_where.push_back("tensor " + Quoted(c.tensors[t].name));
    for (size_t k = 0; k < c.tensors[t].chunks.size(); ++k) {
      p.works.push_back(Work{t, k, internal::Identity(c.tensors[t], dst[t]->data), t,
                             static_cast<size_t>(dst[t] - first)});
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
  for (size_t ri = 0; ri < runtime.size(); ++ri) {
    const RuntimeTensor& rt = runtime[ri];
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
          p.works.push_back(Work{it->second, k, at, group, ri});
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
  p->plan = WholePlan(p->c, dst, tensors.data());
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
}  // namespace

namespace {

Status ApplyWhole(std::string_view patch, std::span<const MutableTensorView> tensors, const ApplyOptions& options) {
  PartApply part;
  WSYNC_RETURN_IF_ERROR(ReadWholePart(patch, tensors, options.allow_extra_tensors, options, &part));
  PartApply* parts[] = {&part};
  return ApplyAll(parts, options.pool);
}

}  // namespace

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

namespace {

Status ApplyPieces(std::string_view patch, std::span<const RuntimeTensor> runtime, const ApplyOptions& options) {
  PartApply part;
  WSYNC_RETURN_IF_ERROR(ReadPiecesPart(patch, runtime, /*other_parts=*/false, options, &part));
  PartApply* parts[] = {&part};
  return ApplyAll(parts, options.pool);
}

// Parts of one version hold disjoint tensors, which cover the destination
// (unless allow_extra_tensors).
Status CheckWholeParts(std::span<const Container* const> parts, std::span<const MutableTensorView> tensors,
                       const ApplyOptions& options) {
  std::unordered_map<std::string_view, size_t> part_of;
  for (size_t i = 0; i < parts.size(); ++i) {
    for (const TensorEntry& e : parts[i]->tensors) {
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
Status CheckPiecesParts(std::span<const Container* const> parts, std::span<const RuntimeTensor> runtime) {
  std::unordered_set<std::string_view> names;
  for (const Container* c : parts) {
    for (const TensorEntry& e : c->tensors) {
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

std::vector<const Container*> Containers(std::span<PartApply* const> parts) {
  std::vector<const Container*> out;
  for (const PartApply* p : parts) out.push_back(&p->c);
  return out;
}

Status ApplyWholeParts(std::span<const std::string_view> patches, std::span<const MutableTensorView> tensors,
                       const ApplyOptions& options) {
  if (patches.empty()) return InvalidArgumentError("no parts to apply");
  std::vector<PartApply> parts(patches.size());
  for (size_t i = 0; i < patches.size(); ++i) {
    WSYNC_RETURN_IF_ERROR(ReadWholePart(patches[i], tensors, /*allow_extra=*/true, options, &parts[i]));
  }
  const std::vector<PartApply*> all = Pointers(parts);
  WSYNC_RETURN_IF_ERROR(CheckWholeParts(Containers(all), tensors, options));
  return ApplyAll(all, options.pool);
}

Status ApplyPiecesParts(std::span<const std::string_view> patches, std::span<const RuntimeTensor> runtime,
                        const ApplyOptions& options) {
  if (patches.empty()) return InvalidArgumentError("no parts to apply");
  std::vector<PartApply> parts(patches.size());
  for (size_t i = 0; i < patches.size(); ++i) {
    WSYNC_RETURN_IF_ERROR(ReadPiecesPart(patches[i], runtime, /*other_parts=*/true, options, &parts[i]));
  }
  const std::vector<PartApply*> all = Pointers(parts);
  WSYNC_RETURN_IF_ERROR(CheckPiecesParts(Containers(all), runtime));
  return ApplyAll(all, options.pool);
}

}  // namespace

Status Apply(std::string_view patch, const Destination& destination, const ApplyOptions& options) {
  return destination.pieces() ? ApplyPieces(patch, destination.runtime(), options)
                              : ApplyWhole(patch, destination.tensors(), options);
}

Status Apply(std::span<const std::string_view> parts, const Destination& destination, const ApplyOptions& options) {
  return destination.pieces() ? ApplyPiecesParts(parts, destination.runtime(), options)
                              : ApplyWholeParts(parts, destination.tensors(), options);
}

namespace internal {

StatusOr<std::vector<staged::ApplyPlan>> PlanApply(std::span<const Container* const> parts,
                                                   const Destination& destination, const ApplyOptions& options,
                                                   bool as_parts) {
  if (parts.empty()) return InvalidArgumentError("no parts to apply");
  if (as_parts) {
    WSYNC_RETURN_IF_ERROR(destination.pieces() ? CheckPiecesParts(parts, destination.runtime())
                                               : CheckWholeParts(parts, destination.tensors(), options));
  }
  std::vector<staged::ApplyPlan> out;
  for (const Container* c : parts) {
    Plan plan;
    if (destination.pieces()) {
      WSYNC_ASSIGN_OR_RETURN(plan, PiecesPlan(*c, destination.runtime(), /*need_data=*/true, as_parts));
    } else {
      const auto tensors = destination.tensors();
      WSYNC_ASSIGN_OR_RETURN(auto dst, MatchTensors(*c, tensors, as_parts || options.allow_extra_tensors));
      plan = WholePlan(*c, dst, tensors.data());
    }
    WSYNC_RETURN_IF_ERROR(CheckPresent(*c, plan));
    std::vector<size_t> first(c->tensors.size() + 1, 0);
    for (size_t t = 0; t < c->tensors.size(); ++t) first[t + 1] = first[t] + c->tensors[t].chunks.size();
    staged::ApplyPlan p;
    p.whole = plan.whole;
    p.group_tensor = std::move(plan.group_tensor);
    p.group_where = std::move(plan.group_where);
    for (const Work& w : plan.works) {
      const TileMap map = internal::MapOf(c->tensors[w.tensor].tiles[w.chunk], w.at);
      p.works.push_back({first[w.tensor] + w.chunk, w.dst, w.group, map});
    }
    out.push_back(std::move(p));
  }
  return out;
}

}  // namespace internal

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
    return m.pieces ? ApplyPiecesParts(segments, m.runtime, m.options)
                    : ApplyWholeParts(segments, m.tensors, m.options);
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
    WSYNC_RETURN_IF_ERROR(CheckPiecesParts(Containers(parts), m.runtime));
  } else {
    WSYNC_RETURN_IF_ERROR(CheckWholeParts(Containers(parts), m.tensors, m.options));
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

}  // namespace wsync::codec
