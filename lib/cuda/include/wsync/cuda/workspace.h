// The memory a DeviceCodec call works in, owned by the caller and passed to
// every call (as DietGPU's StackDeviceMemory and CUB's temporary storage
// are): device scratch (a batch's first pass, compact changes, digests,
// staged bases and patches, gathered cells, the entropy stage's jobs) and
// page-locked host memory the device copies back into.
//
// A call grows what it needs and keeps it for the next call, so that calls
// alike allocate nothing in steady state; page-locked memory past the
// larger of 256 MiB and twice a call's peak is freed at the end of each
// call. The caller decides how long the memory lives (Release() between
// versions, say), which codecs share it (codecs on the same device that
// never run at once: a call uses all of it) and sees what it holds.
//
// Not thread-safe: one call at a time. A workspace belongs to one device; a
// call of a codec on another device is refused. No CUDA header is included;
// in a build without CUDA it holds nothing.
#pragma once

#include <cstddef>
#include <memory>

namespace wsync::cuda {

class Workspace {
 public:
  // Allocates nothing: the first call does.
  explicit Workspace(int device = 0);
  // Release()s.
  ~Workspace();
  Workspace(Workspace&&) noexcept;
  Workspace& operator=(Workspace&&) noexcept;
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;

  int device() const;
  // Bytes held now.
  size_t device_bytes() const;
  size_t pinned_bytes() const;
  // Frees all of it, after the device has finished what was enqueued; the
  // next call allocates again. The thread's current device is left as it
  // was.
  void Release();

  struct Arenas;  // lib/cuda's
  Arenas& arenas() { return *arenas_; }

 private:
  std::unique_ptr<Arenas> arenas_;
};

}  // namespace wsync::cuda
