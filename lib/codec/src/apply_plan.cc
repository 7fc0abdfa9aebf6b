// The apply side's plan (apply_plan.h): destinations matched by name,
// pieces checked against the patch's tiles, the works of each part, and the
// selections a source serves to pieces.
#include <cstddef>
#include <cstdint>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "apply_plan.h"
#include "format.h"
#include "patch_common.h"
#include "wsync/codec/checksum.h"
#include "wsync/codec/codec.h"
#include "wsync/codec/staged.h"
#include "wsync/codec/tile_map.h"
#include "wsync/util/bytes.h"
#include "wsync/util/text.h"

namespace wsync::codec {
namespace {

using internal::CheckPresent;
using internal::ChunkEntry;
using internal::Container;
using internal::EntryFor;
using internal::PiecesPlan;
using internal::Plan;
using internal::TensorEntry;
using internal::Work;

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

}  // namespace

namespace internal {

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

StatusOr<Plan> PiecesPlan(const Container& c, std::span<const RuntimeTensor> runtime, bool need_data,
                          bool other_parts) {
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
