// The published layout (names, dtypes, shapes of a version's tensors) and the
// one check every party makes against it: the coordinator when a source sets
// it, a source before it publishes, a sink when its tensors are registered.
#pragma once

#include "wsync/util/status.h"
#include "wsync/v1/coordinator.pb.h"

namespace wsync::control {

// Ok when `offered` has exactly the tensors of `published` (the same names,
// dtypes and shapes; order does not matter). FailedPrecondition otherwise,
// naming the first tensor that differs and how, in terms of `what` ("the
// registered tensors", "this checkpoint"). Tile grids are not compared:
// they follow the layouts a source serves and may change (SameGrids).
Status CheckLayout(const wsync::v1::Layout& published, const wsync::v1::Layout& offered, const char* what);

// Whether every tensor of `a` has the tile grid (row and column cuts) of the
// tensor of the same name in `b`. REQUIRES: CheckLayout(a, b) ok.
bool SameGrids(const wsync::v1::Layout& a, const wsync::v1::Layout& b);

// Several sources (Layout.parts > 1): the tensors of part `part` of a
// layout, as its source offers them.
wsync::v1::Layout PartOf(const wsync::v1::Layout& layout, uint32_t part);

// Whether every part of a layout has its tensors (a layout of one part:
// whether it has any).
bool LayoutComplete(const wsync::v1::Layout& layout);

}  // namespace wsync::control
