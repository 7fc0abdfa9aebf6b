// CUDA IPC export and import (wsync/cuda/ipc.h) on the runtime API. The
// allocation range comes from the driver's cuMemGetAddressRange, reached
// through the runtime's entry-point query so that nothing links libcuda and
// binaries start on hosts without a driver.
#include "wsync/cuda/ipc.h"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstring>

#include "ipc_text.h"

namespace wsync::cuda {
namespace {

Status Check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::Ok();
  return InternalError(std::string("CUDA ") + what + ": " + cudaGetErrorString(e));
}

using GetAddressRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);

StatusOr<GetAddressRange> AddressRangeFn() {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  WSYNC_RETURN_IF_ERROR(Check(cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000,
                                                               cudaEnableDefault, &found),
                              "driver entry point"));
  if (fn == nullptr || found != cudaDriverEntryPointSuccess) {
    return UnavailableError("the CUDA driver has no cuMemGetAddressRange");
  }
  return reinterpret_cast<GetAddressRange>(fn);
}

}  // namespace

std::string IpcHandle::ToString() const { return internal::IpcHandleToString(*this); }
StatusOr<IpcHandle> IpcHandle::Parse(std::string_view text) { return internal::ParseIpcHandle(text); }

StatusOr<IpcHandle> ExportDeviceMemory(const void* ptr, size_t bytes) {
  cudaPointerAttributes attr{};
  WSYNC_RETURN_IF_ERROR(Check(cudaPointerGetAttributes(&attr, ptr), "pointer attributes"));
  if (attr.type != cudaMemoryTypeDevice) {
    return InvalidArgumentError("only device memory from cudaMalloc can be exported over CUDA IPC");
  }
  WSYNC_ASSIGN_OR_RETURN(GetAddressRange range, AddressRangeFn());
  CUdeviceptr base = 0;
  size_t size = 0;
  if (range(&base, &size, reinterpret_cast<CUdeviceptr>(ptr)) != CUDA_SUCCESS) {
    return InternalError("cuMemGetAddressRange failed for the exported pointer");
  }
  const uint64_t offset = reinterpret_cast<uintptr_t>(ptr) - base;
  if (offset > size || bytes > size - offset) {
    return InvalidArgumentError("the exported range (" + std::to_string(bytes) +
                                " bytes) runs past its allocation's end");
  }
  cudaIpcMemHandle_t h;
  WSYNC_RETURN_IF_ERROR(Check(cudaIpcGetMemHandle(&h, const_cast<void*>(ptr)), "IPC export"));
  IpcHandle out;
  static_assert(sizeof(h) == sizeof(out.handle));
  std::memcpy(out.handle.data(), &h, sizeof(h));
  out.device = attr.device;
  out.offset = offset;
  out.bytes = bytes;
  return out;
}

StatusOr<void*> OpenIpcAllocation(const IpcHandle& handle) {
  WSYNC_RETURN_IF_ERROR(Check(cudaSetDevice(handle.device), "select the exporter's device"));
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.handle.data(), sizeof(h));
  void* base = nullptr;
  WSYNC_RETURN_IF_ERROR(Check(cudaIpcOpenMemHandle(&base, h, cudaIpcMemLazyEnablePeerAccess), "IPC open"));
  return base;
}

Status CloseIpcAllocation(void* base) { return Check(cudaIpcCloseMemHandle(base), "IPC close"); }

}  // namespace wsync::cuda
