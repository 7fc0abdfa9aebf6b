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

}  // namespace wsync::control
