// CUDA IPC in a build without CUDA: the text form works, mapping does not.
#include "ipc_text.h"
#include "wsync/cuda/ipc.h"

namespace wsync::cuda {
namespace {

Status NotBuilt() { return UnavailableError("wsync was built without CUDA: no CUDA IPC"); }

}  // namespace

std::string IpcHandle::ToString() const { return internal::IpcHandleToString(*this); }
StatusOr<IpcHandle> IpcHandle::Parse(std::string_view text) { return internal::ParseIpcHandle(text); }
StatusOr<IpcHandle> ExportDeviceMemory(const void*, size_t) { return NotBuilt(); }
StatusOr<void*> OpenIpcAllocation(const IpcHandle&) { return NotBuilt(); }
Status CloseIpcAllocation(void*) { return NotBuilt(); }

}  // namespace wsync::cuda
