#include "wsync/buffers/device_region.h"

#include <spdlog/spdlog.h>

namespace wsync::buffers {

DeviceRegionMapper::Opener DeviceRegionMapper::CudaIpc() {
  return Opener{[](const cuda::IpcHandle& h) { return cuda::OpenIpcAllocation(h); },
                [](void* base) { return cuda::CloseIpcAllocation(base); }};
}

DeviceRegionMapper::DeviceRegionMapper(Opener opener) : opener_(std::move(opener)) {}

DeviceRegionMapper::~DeviceRegionMapper() {
  for (auto& [key, m] : open_) {
    Status s = opener_.close(m.base);
    if (!s.ok()) spdlog::warn("closing a CUDA IPC mapping: {}", s.ToString());
  }
}

StatusOr<void*> DeviceRegionMapper::Map(const cuda::IpcHandle& h) {
  const Key key{h.handle, h.device};
  auto it = open_.find(key);
  if (it == open_.end()) {
    WSYNC_ASSIGN_OR_RETURN(void* base, opener_.open(h));
    it = open_.emplace(key, Mapping{base, 0}).first;
  }
  ++it->second.users;
  return static_cast<uint8_t*>(it->second.base) + h.offset;
}

Status DeviceRegionMapper::Unmap(const cuda::IpcHandle& h) {
  auto it = open_.find(Key{h.handle, h.device});
  if (it == open_.end()) return NotFoundError("CUDA IPC allocation is not mapped");
  if (--it->second.users > 0) return Status::Ok();
  Status s = opener_.close(it->second.base);
  open_.erase(it);
  return s;
}

}  // namespace wsync::buffers
