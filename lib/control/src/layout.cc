#include "wsync/control/layout.h"

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "wsync/util/text.h"

namespace wsync::control {
namespace {

std::string ShapeText(const wsync::v1::LayoutTensor& t) {
  std::string s = "[";
  for (int i = 0; i < t.shape_size(); ++i) s += (i ? ", " : "") + std::to_string(t.shape(i));
  return s + "]";
}

}  // namespace

Status CheckLayout(const wsync::v1::Layout& published, const wsync::v1::Layout& offered, const char* what) {
  std::map<std::string, const wsync::v1::LayoutTensor*> want;
  for (const auto& t : published.tensors()) want[t.name()] = &t;
  const std::string from = published.source().empty() ? "" : " by " + Quoted(published.source());
  for (const auto& t : offered.tensors()) {
    auto it = want.find(t.name());
    if (it == want.end()) {
      return FailedPreconditionError(std::string(what) + " hold tensor " + Quoted(t.name()) +
                                     ", which the layout published" + from + " does not have");
    }
    const auto& p = *it->second;
    if (p.dtype() != t.dtype()) {
      return FailedPreconditionError("tensor " + Quoted(t.name()) + ": dtype " + t.dtype() + " in " + what +
                                     ", " + p.dtype() + " in the layout published" + from);
    }
    if (ShapeText(p) != ShapeText(t)) {
      return FailedPreconditionError("tensor " + Quoted(t.name()) + ": shape " + ShapeText(t) + " in " + what +
                                     ", " + ShapeText(p) + " in the layout published" + from);
    }
    if (!std::equal(p.row_cuts().begin(), p.row_cuts().end(), t.row_cuts().begin(), t.row_cuts().end()) ||
        !std::equal(p.col_cuts().begin(), p.col_cuts().end(), t.col_cuts().begin(), t.col_cuts().end())) {
      return FailedPreconditionError("tensor " + Quoted(t.name()) + ": its tile grid in " + what +
                                     " differs from the layout published" + from +
                                     " (the sinks' layouts served changed: a new layout needs a new coordinator store)");
    }
    want.erase(it);
  }
  if (!want.empty()) {
    return FailedPreconditionError(std::string(what) + " lack tensor " + Quoted(want.begin()->first) + " (and " +
                                   std::to_string(want.size() - 1) + " more) of the layout published" + from);
  }
  return Status::Ok();
}

wsync::v1::Layout PartOf(const wsync::v1::Layout& layout, uint32_t part) {
  wsync::v1::Layout out;
  out.set_parts(layout.parts());
  for (const auto& t : layout.tensors()) {
    if (t.part() == part) *out.add_tensors() = t;
  }
  if (part < static_cast<uint32_t>(layout.part_sources_size())) out.set_source(layout.part_sources(part));
  return out;
}

bool LayoutComplete(const wsync::v1::Layout& layout) {
  if (layout.parts() <= 1) return layout.tensors_size() > 0;
  std::vector<bool> seen(layout.parts(), false);
  for (const auto& t : layout.tensors()) {
    if (t.part() < layout.parts()) seen[t.part()] = true;
  }
  return std::all_of(seen.begin(), seen.end(), [](bool b) { return b; });
}

}  // namespace wsync::control
