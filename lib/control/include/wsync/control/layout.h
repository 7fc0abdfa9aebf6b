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
// registered tensors", "this checkpoint").
Status CheckLayout(const wsync::v1::Layout& published, const wsync::v1::Layout& offered, const char* what);

// Several sources (Layout.parts > 1): the tensors of part `part` of a
// layout, as its source offers them.
wsync::v1::Layout PartOf(const wsync::v1::Layout& layout, uint32_t part);

// Whether every part of a layout has its tensors (a layout of one part:
// whether it has any).
bool LayoutComplete(const wsync::v1::Layout& layout);

}  // namespace wsync::control
