#include "wsync/buffers/device_region.h"

#include <spdlog/spdlog.h>

#include <mutex>

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

namespace {

std::mutex& MapperMutex() {
  static std::mutex mu;
  return mu;
}

DeviceRegionMapper& ProcessMapper() {
  static DeviceRegionMapper* mapper = new DeviceRegionMapper();  // lives as long as the process
  return *mapper;
}

class CudaIpcRegion : public Region {
 public:
  CudaIpcRegion(cuda::IpcHandle handle, uint8_t* data) : handle_(handle), data_(data) {}
  ~CudaIpcRegion() override {
    std::lock_guard<std::mutex> lock(MapperMutex());
    Status s = ProcessMapper().Unmap(handle_);
    if (!s.ok()) spdlog::warn("unmapping {}: {}", description(), s.ToString());
  }
  uint8_t* data() override { return data_; }
  size_t size() const override { return handle_.bytes; }
  bool writable() const override { return true; }
  bool on_device() const override { return true; }
  int device() const override { return handle_.device; }
  std::string description() const override {
    return "cuda-ipc:device " + std::to_string(handle_.device) + "+" + std::to_string(handle_.offset);
  }

 private:
  cuda::IpcHandle handle_;
  uint8_t* data_;
};

}  // namespace

StatusOr<std::unique_ptr<Region>> OpenCudaIpc(const std::string& handle_text) {
  WSYNC_ASSIGN_OR_RETURN(cuda::IpcHandle h, cuda::IpcHandle::Parse(handle_text));
  std::lock_guard<std::mutex> lock(MapperMutex());
  WSYNC_ASSIGN_OR_RETURN(void* p, ProcessMapper().Map(h));
  return std::unique_ptr<Region>(new CudaIpcRegion(h, static_cast<uint8_t*>(p)));
}

}  // namespace wsync::buffers
