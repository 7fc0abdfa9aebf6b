// The layout of registered tensors as the coordinator records it.
#pragma once

#include <span>

#include "wsync/codec/codec.h"
#include "wsync/v1/coordinator.pb.h"
#include "wsync/v1/local.pb.h"

namespace wsync::daemon {

// Names, dtypes and shapes of `tensors`; `published`: with the dtypes the
// source publishes (F32 as BF16). With the tile grids of those tensors
// that have one.
wsync::v1::Layout LayoutOf(std::span<const codec::TensorView> tensors, bool published,
                           std::span<const codec::TileGrid> grids = {});

// The published tensors of a layout (names, dtypes, shapes; no data) and
// their tile grids. InvalidArgument naming a tensor of unknown dtype.
struct CanonicalLayout {
  std::vector<codec::TensorView> tensors;
  std::vector<codec::TileGrid> grids;
};
StatusOr<CanonicalLayout> CanonicalOf(const wsync::v1::Layout& layout);

// The runtime tensors of a served (or offered) layout: names, dtypes,
// shapes and pieces; no data. InvalidArgument naming a tensor of unknown
// dtype.
StatusOr<std::vector<codec::RuntimeTensor>> RuntimeLayoutOf(const wsync::v1::ServedLayout& layout);

}  // namespace wsync::daemon
