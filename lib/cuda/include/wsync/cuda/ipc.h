// CUDA IPC: sharing a device allocation between processes. The exporting
// side (a trainer or inference server, through the client library or the
// Python binding) turns a device pointer into an IpcHandle and hands its text
// form to wsyncd; the importing side (buffers/device_region.h) maps it.
//
// A handle names the whole allocation that contains the pointer (CUDA IPC
// shares allocations, not sub-ranges) plus the pointer's offset in it, so
// tensors inside one allocation share one mapping.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "wsync/util/status.h"

namespace wsync::cuda {

struct IpcHandle {
  std::array<uint8_t, 64> handle{};  // cudaIpcMemHandle_t
  int device = 0;                    // the exporter's device ordinal
  uint64_t offset = 0;               // of the exported pointer in its allocation
  uint64_t bytes = 0;                // exported bytes from that pointer

  // "wsync-ipc-v1:<device>:<offset>:<bytes>:<128 hex digits>"
  std::string ToString() const;
  // InvalidArgument naming the malformed field.
  static StatusOr<IpcHandle> Parse(std::string_view text);
  bool SameAllocation(const IpcHandle& o) const { return handle == o.handle && device == o.device; }
};

// The exporting side: the handle of `bytes` of device memory at `ptr`.
// REQUIRES: ptr was allocated with cudaMalloc (not managed, not
// cudaMallocAsync pools without IPC support), the range lies in one
// allocation. Unavailable without CUDA.
StatusOr<IpcHandle> ExportDeviceMemory(const void* ptr, size_t bytes);

// The importing side's primitives: map an exported allocation into this
// process (returns its base) and unmap it. Each allocation may be opened
// once per process: buffers/device_region.h keeps that rule.
StatusOr<void*> OpenIpcAllocation(const IpcHandle& handle);
Status CloseIpcAllocation(void* base);

}  // namespace wsync::cuda
