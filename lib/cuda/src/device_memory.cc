// The device memory helpers of device_codec.h: synchronous copies,
// DeviceBuffer and PinnedBuffer; and Workspace (workspace.h).
#include "wsync/cuda/device_codec.h"

#include <cuda_runtime_api.h>

#include "device_codec_impl.h"

namespace wsync::cuda {
namespace {

using namespace internal;  // device_codec_impl.h

}  // namespace

Status CopyDeviceToHost(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return Status::Ok();
  return Check(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), "copy to host");
}

Status CopyHostToDevice(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return Status::Ok();
  return Check(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), "copy to device");
}

Status CopyDeviceToDevice(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return Status::Ok();
  WSYNC_RETURN_IF_ERROR(Check(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToDevice), "device copy"));
  return Check(cudaDeviceSynchronize(), "device copy");
}

// ------------------------------------------------------------ DeviceBuffer

StatusOr<DeviceBuffer> DeviceBuffer::Allocate(size_t bytes, int device) {
  WSYNC_RETURN_IF_ERROR(DeviceAvailable());
  WSYNC_RETURN_IF_ERROR(Check(cudaSetDevice(device), "select device"));
  DeviceBuffer b;
  if (bytes > 0) WSYNC_RETURN_IF_ERROR(Check(cudaMalloc(&b.data_, bytes), "allocate"));
  b.size_ = bytes;
  return b;
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& o) noexcept : data_(o.data_), size_(o.size_) {
  o.data_ = nullptr;
  o.size_ = 0;
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    if (data_ != nullptr) cudaFree(data_);
    data_ = o.data_;
    size_ = o.size_;
    o.data_ = nullptr;
    o.size_ = 0;
  }
  return *this;
}

DeviceBuffer::~DeviceBuffer() {
  if (data_ != nullptr) cudaFree(data_);
}

Status DeviceBuffer::CopyFromHost(const void* src, size_t bytes, size_t offset) {
  if (offset > size_ || bytes > size_ - offset) return OutOfRangeError("copy past the device buffer's end");
  return Check(cudaMemcpy(static_cast<uint8_t*>(data_) + offset, src, bytes, cudaMemcpyHostToDevice), "copy");
}

Status DeviceBuffer::CopyToHost(void* dst, size_t bytes, size_t offset) const {
  if (offset > size_ || bytes > size_ - offset) return OutOfRangeError("copy past the device buffer's end");
  return Check(cudaMemcpy(dst, static_cast<const uint8_t*>(data_) + offset, bytes, cudaMemcpyDeviceToHost), "copy");
}

Status DeviceBuffer::CopyFromDevice(const void* src, size_t bytes) {
  if (bytes > size_) return OutOfRangeError("copy past the device buffer's end");
  WSYNC_RETURN_IF_ERROR(Check(cudaMemcpy(data_, src, bytes, cudaMemcpyDeviceToDevice), "copy"));
  return Check(cudaDeviceSynchronize(), "copy");
}

// ------------------------------------------------------------ PinnedBuffer

StatusOr<PinnedBuffer> PinnedBuffer::Allocate(size_t bytes) {
  WSYNC_RETURN_IF_ERROR(DeviceAvailable());
  PinnedBuffer b;
  if (bytes > 0) WSYNC_RETURN_IF_ERROR(Check(cudaMallocHost(&b.data_, bytes), "allocating page-locked host memory"));
  b.size_ = bytes;
  return b;
}

PinnedBuffer::PinnedBuffer(PinnedBuffer&& o) noexcept : data_(o.data_), size_(o.size_) {
  o.data_ = nullptr;
  o.size_ = 0;
}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& o) noexcept {
  if (this != &o) {
    if (data_ != nullptr) cudaFreeHost(data_);
    data_ = o.data_;
    size_ = o.size_;
    o.data_ = nullptr;
    o.size_ = 0;
  }
  return *this;
}

PinnedBuffer::~PinnedBuffer() {
  if (data_ != nullptr) cudaFreeHost(data_);
}

Workspace::Workspace(int device) : arenas_(std::make_unique<Arenas>()) { arenas_->device = device; }
Workspace::~Workspace() { Release(); }
Workspace::Workspace(Workspace&&) noexcept = default;
Workspace& Workspace::operator=(Workspace&&) noexcept = default;

int Workspace::device() const { return arenas_ != nullptr ? arenas_->device : -1; }

size_t Workspace::device_bytes() const {
  size_t total = 0;
  if (arenas_ != nullptr) {
    for (const Scratch* a : arenas_->device_arenas()) total += a->size();
  }
  return total;
}

size_t Workspace::pinned_bytes() const { return arenas_ != nullptr ? arenas_->pinned.bytes() : 0; }

void Workspace::Release() {
  if (arenas_ == nullptr || (device_bytes() == 0 && pinned_bytes() == 0)) return;
  // Frees on its device, then gives the thread back the device it had.
  int current = 0;
  if (cudaGetDevice(&current) != cudaSuccess || cudaSetDevice(arenas_->device) != cudaSuccess) {
    (void)cudaGetLastError();
    return;
  }
  for (Scratch* a : arenas_->device_arenas()) (void)a->Free();
  arenas_->pinned.Release();
  (void)cudaSetDevice(current);
}

}  // namespace wsync::cuda
