#include "tensor_layout.h"

#include "wsync/buffers/safetensors.h"

namespace wsync::daemon {

wsync::v1::Layout LayoutOf(std::span<const codec::TensorView> tensors, bool published) {
  wsync::v1::Layout l;
  for (const auto& t : tensors) {
    auto* lt = l.add_tensors();
    lt->set_name(t.name);
    lt->set_dtype(std::string(codec::DTypeName(published ? buffers::PublishedDType(t.dtype) : t.dtype)));
    for (uint64_t d : t.shape) lt->add_shape(d);
  }
  return l;
}

}  // namespace wsync::daemon
