#include "tensor_layout.h"

#include <unordered_map>

#include "wsync/buffers/safetensors.h"
#include "wsync/util/text.h"

namespace wsync::daemon {

wsync::v1::Layout LayoutOf(std::span<const codec::TensorView> tensors, bool published,
                           std::span<const codec::TileGrid> grids) {
  std::unordered_map<std::string_view, const codec::TileGrid*> by_name;
  for (const auto& g : grids) by_name.emplace(g.tensor, &g);
  wsync::v1::Layout l;
  for (const auto& t : tensors) {
    auto* lt = l.add_tensors();
    lt->set_name(t.name);
    lt->set_dtype(std::string(codec::DTypeName(published ? buffers::PublishedDType(t.dtype) : t.dtype)));
    for (uint64_t d : t.shape) lt->add_shape(d);
    if (auto it = by_name.find(t.name); it != by_name.end()) {
      for (uint64_t c : it->second->row_cuts) lt->add_row_cuts(c);
      for (uint64_t c : it->second->col_cuts) lt->add_col_cuts(c);
    }
  }
  return l;
}

StatusOr<CanonicalLayout> CanonicalOf(const wsync::v1::Layout& layout) {
  CanonicalLayout out;
  for (const auto& t : layout.tensors()) {
    auto dtype = codec::ParseDType(t.dtype());
    if (!dtype.ok()) return dtype.status().WithContext("published tensor " + Quoted(t.name()));
    out.tensors.push_back({t.name(), *dtype, {t.shape().begin(), t.shape().end()}, nullptr});
    if (t.row_cuts_size() > 0 || t.col_cuts_size() > 0) {
      out.grids.push_back({t.name(), {t.row_cuts().begin(), t.row_cuts().end()},
                           {t.col_cuts().begin(), t.col_cuts().end()}});
    }
  }
  return out;
}

StatusOr<std::vector<codec::RuntimeTensor>> RuntimeLayoutOf(const wsync::v1::ServedLayout& layout) {
  std::vector<codec::RuntimeTensor> out;
  out.reserve(layout.tensors_size());
  for (const auto& t : layout.tensors()) {
    auto dtype = codec::ParseDType(t.dtype());
    if (!dtype.ok()) return dtype.status().WithContext("runtime tensor " + Quoted(t.name()));
    codec::RuntimeTensor rt{{t.name(), *dtype, {t.shape().begin(), t.shape().end()}, nullptr}, {}};
    for (const auto& p : t.pieces()) {
      rt.pieces.push_back({p.canonical(), {p.start().begin(), p.start().end()}, {p.extent().begin(), p.extent().end()},
                           {p.at().begin(), p.at().end()}});
    }
    out.push_back(std::move(rt));
  }
  return out;
}

}  // namespace wsync::daemon
