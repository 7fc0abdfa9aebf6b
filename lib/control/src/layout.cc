#include "wsync/control/layout.h"

#include <algorithm>
#include <map>
#include <string>
#include <string_view>
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
    want.erase(it);
  }
  if (!want.empty()) {
    return FailedPreconditionError(std::string(what) + " lack tensor " + Quoted(want.begin()->first) + " (and " +
                                   std::to_string(want.size() - 1) + " more) of the layout published" + from);
  }
  return Status::Ok();
}

bool SameGrids(const wsync::v1::Layout& a, const wsync::v1::Layout& b) {
  std::map<std::string_view, const wsync::v1::LayoutTensor*> by_name;
  for (const auto& t : b.tensors()) by_name.emplace(t.name(), &t);
  for (const auto& t : a.tensors()) {
    auto it = by_name.find(t.name());
    if (it == by_name.end()) return false;
    const auto& u = *it->second;
    if (!std::equal(t.row_cuts().begin(), t.row_cuts().end(), u.row_cuts().begin(), u.row_cuts().end()) ||
        !std::equal(t.col_cuts().begin(), t.col_cuts().end(), u.col_cuts().begin(), u.col_cuts().end())) {
      return false;
    }
  }
  return true;
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
