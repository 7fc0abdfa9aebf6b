#include "layout_registry.h"

#include <algorithm>
#include <map>
#include <set>
#include <string>

#include <spdlog/spdlog.h>

#include "wsync/control/layout.h"
#include "wsync/util/text.h"

namespace wsync::control {

using wsync::store::v1::Record;

Status LayoutRegistry::Set(const wsync::v1::Layout& layout, const RecordLog& log) {
  if (layout.parts() > 1 && layout.tensors_size() > 0) return SetPart(layout, log);
  if (layout_ && layout_->parts() > 1) {
    return FailedPreconditionError("the layout was set for " + std::to_string(layout_->parts()) +
                                   " parts (sources); this source registers the whole set");
  }
  if (layout_) {
    WSYNC_RETURN_IF_ERROR(CheckLayout(*layout_, layout, "the tensors of this source"));
    if (SameGrids(*layout_, layout)) return Status::Ok();
  }
  if (layout.tensors_size() == 0) return InvalidArgumentError("a layout needs at least one tensor");
  // A first layout, or the tile grids changed (the layouts the source serves
  // did): versions from now on are coded on these. Earlier versions keep
  // their checksums, taken on their grid (a sink's claim of one is checked
  // on the new grid and fails: it takes a keyframe).
  const bool regrid = layout_.has_value();
  Record r;
  *r.mutable_layout_set() = layout;
  WSYNC_RETURN_IF_ERROR(log(r));
  spdlog::info("layout of {} tensors {} by {}", layout.tensors_size(), regrid ? "re-gridded" : "set", layout.source());
  return Status::Ok();
}

// A part of a layout of several sources: the first sets it; later parts are
// added (no tensor in two parts); a part set already is checked.
Status LayoutRegistry::SetPart(const wsync::v1::Layout& layout, const RecordLog& log) {
  uint32_t part = layout.tensors(0).part();
  for (const auto& t : layout.tensors()) {
    if (t.part() != part) return InvalidArgumentError("a source sets the tensors of one part");
  }
  if (part >= layout.parts()) return InvalidArgumentError("part " + std::to_string(part) + " of " + std::to_string(layout.parts()));
  wsync::v1::Layout merged;
  if (layout_) {
    if (layout_->parts() != layout.parts()) {
      return FailedPreconditionError("the layout was set for " + std::to_string(std::max<uint32_t>(1, layout_->parts())) +
                                     " part(s) (sources), this source says " + std::to_string(layout.parts()));
    }
    const wsync::v1::Layout mine = PartOf(*layout_, part);
    const bool regrid = mine.tensors_size() > 0 && !SameGrids(mine, layout);
    if (mine.tensors_size() > 0) {
      WSYNC_RETURN_IF_ERROR(CheckLayout(mine, layout, "the tensors of this source"));
      if (layout_->part_sources(static_cast<int>(part)) == layout.source() && !regrid) return Status::Ok();
    }
    merged = *layout_;
    if (regrid) {
      // The layouts the source serves changed: its tensors' grids from now on.
      std::map<std::string, const wsync::v1::LayoutTensor*> offered;
      for (const auto& t : layout.tensors()) offered[t.name()] = &t;
      for (auto& t : *merged.mutable_tensors()) {
        if (auto it = offered.find(t.name()); it != offered.end() && t.part() == part) t = *it->second;
      }
      spdlog::info("layout part {}: tile grids changed by {}", part, layout.source());
    }
    if (mine.tensors_size() == 0) {
      std::set<std::string> names;
      for (const auto& t : layout_->tensors()) names.insert(t.name());
      for (const auto& t : layout.tensors()) {
        if (names.count(t.name())) {
          return FailedPreconditionError("tensor " + Quoted(t.name()) + " of part " + std::to_string(part) +
                                         " is already another part's");
        }
        *merged.add_tensors() = t;
      }
    }
  } else {
    merged = layout;
    merged.clear_part_sources();
    for (uint32_t i = 0; i < layout.parts(); ++i) merged.add_part_sources("");
  }
  merged.set_part_sources(static_cast<int>(part), layout.source());
  Record r;
  *r.mutable_layout_set() = merged;
  WSYNC_RETURN_IF_ERROR(log(r));
  spdlog::info("layout part {} of {} ({} tensors) set by {}{}", part, layout.parts(), layout.tensors_size(),
               layout.source(), LayoutComplete(merged) ? ": the layout is complete" : "");
  return Status::Ok();
}

wsync::v1::GetLayoutResponse LayoutRegistry::Get() const {
  wsync::v1::GetLayoutResponse resp;
  if (layout_) *resp.mutable_layout() = *layout_;
  // A layout of several parts counts once every part is in.
  resp.set_set(layout_.has_value() && LayoutComplete(*layout_));
  return resp;
}

uint32_t LayoutRegistry::parts() const { return layout_ ? std::max<uint32_t>(1, layout_->parts()) : 0; }

void LayoutRegistry::SaveTo(wsync::store::v1::Snapshot* snapshot) const {
  if (layout_) *snapshot->mutable_layout() = *layout_;
}

void LayoutRegistry::LoadFrom(const wsync::store::v1::Snapshot& snapshot) {
  if (snapshot.has_layout()) Apply(snapshot.layout());
}

}  // namespace wsync::control
