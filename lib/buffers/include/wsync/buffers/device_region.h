// Device buffers of another process, mapped through CUDA IPC: the importing
// side of wsync/cuda/ipc.h. Tensors of a trainer or inference server often
// share one allocation; CUDA allows one mapping of an allocation per process,
// so the mapper opens each allocation once, hands out base + offset for every
// handle into it, and closes it when the last user unmaps.
//
// Thread-compatible (one owner, or external locking).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <vector>

#include "wsync/buffers/region.h"
#include "wsync/cuda/ipc.h"
#include "wsync/util/status.h"

namespace wsync::buffers {

class DeviceRegionMapper {
 public:
  // How allocations are opened and closed; the default is CUDA IPC. Tests
  // substitute their own to exercise the bookkeeping without a GPU.
  struct Opener {
    std::function<StatusOr<void*>(const cuda::IpcHandle&)> open;
    std::function<Status(void*)> close;
  };
  static Opener CudaIpc();

  explicit DeviceRegionMapper(Opener opener = CudaIpc());
  ~DeviceRegionMapper();  // closes what is still open
  DeviceRegionMapper(const DeviceRegionMapper&) = delete;
  DeviceRegionMapper& operator=(const DeviceRegionMapper&) = delete;

  // The device pointer of the exported range (its allocation's base +
  // offset). The first Map of an allocation opens it.
  StatusOr<void*> Map(const cuda::IpcHandle& handle);

  // Releases one Map of the handle's allocation; the last one closes it.
  // NotFound when the allocation is not mapped.
  Status Unmap(const cuda::IpcHandle& handle);

  size_t open_allocations() const { return open_.size(); }

 private:
  struct Key {
    std::array<uint8_t, 64> handle;
    int device;
    bool operator<(const Key& o) const { return device != o.device ? device < o.device : handle < o.handle; }
  };
  struct Mapping {
    void* base = nullptr;
    int users = 0;
  };
  Opener opener_;
  std::map<Key, Mapping> open_;
};

// A Region over an exported device range, given the handle's text form
// (cuda/ipc.h). Maps through one process-wide mapper (CUDA allows one
// mapping per allocation per process); the region unmaps on destruction.
// Unavailable without CUDA; InvalidArgument for a malformed handle.
StatusOr<std::unique_ptr<Region>> OpenCudaIpc(const std::string& handle_text);

}  // namespace wsync::buffers
