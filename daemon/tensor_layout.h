// The layout of registered tensors as the coordinator records it.
#pragma once

#include <span>

#include "wsync/codec/codec.h"
#include "wsync/v1/coordinator.pb.h"

namespace wsync::daemon {

// Names, dtypes and shapes of `tensors`; `published`: with the dtypes the
// source publishes (F32 as BF16).
wsync::v1::Layout LayoutOf(std::span<const codec::TensorView> tensors, bool published);

}  // namespace wsync::daemon
