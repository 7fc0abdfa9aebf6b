// Memory regions that hold tensors, and the tensor table over them.
//
// A region is memory the owner process (trainer or inference server)
// allocated and shares with its local daemon, which maps it and never asks
// the owner to copy. Kinds: POSIX shared memory (hosts without a GPU and
// every test), a safetensors file (read-only, offline use) and, with the
// CUDA library, a CUDA IPC allocation.
//
// Thread safety: a Region is immutable after creation; the bytes it maps
// are shared with the owner, who coordinates writers (the local API's holds).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "wsync/codec/codec.h"
#include "wsync/util/status.h"

namespace wsync::buffers {

// One tensor of a table: where it lives in the region.
struct TensorEntry {
  std::string name;
  codec::DType dtype = codec::DType::kBF16;
  std::vector<uint64_t> shape;
  uint64_t offset = 0;  // bytes from the start of the region
  uint32_t region = 0;  // which region, in a MappedTensors
  // A sink's runtime tensor: the pieces of canonical tensors it holds
  // (codec.h). Empty: the tensor is a canonical tensor itself.
  std::vector<codec::Piece> pieces;

  uint64_t NumBytes() const;
};

// A mapped region. Unmapped (and, for a creator of shared memory that asked
// for it, unlinked) on destruction.
class Region {
 public:
  virtual ~Region() = default;
  virtual uint8_t* data() = 0;
  virtual size_t size() const = 0;
  virtual bool writable() const = 0;
  // "shm:/name", "file:/path", ...: for logs.
  virtual std::string description() const = 0;
  // True when data() is device memory (a CUDA IPC region): only device code
  // and cudaMemcpy may touch it.
  virtual bool on_device() const { return false; }
  // The CUDA device ordinal of device memory; -1 for host memory.
  virtual int device() const { return -1; }
};

// Creates POSIX shared memory `name` ("/wsync-trainer-0") of `size` bytes,
// mode 0600, failing if it exists. With unlink_on_close the name is removed
// when the Region is destroyed.
StatusOr<std::unique_ptr<Region>> CreateShm(const std::string& name, size_t size, bool unlink_on_close);

// Maps existing POSIX shared memory read-write (the daemon side).
StatusOr<std::unique_ptr<Region>> OpenShm(const std::string& name);

// Maps the whole of the memory file `fd` refers to (a memfd another process
// passed) read-write; `what` names it in errors and logs. The mapping keeps
// the memory alive: the caller may close `fd`. The memory ends with the last
// process that maps it or holds a descriptor of it.
StatusOr<std::unique_ptr<Region>> MapDescriptor(int fd, const std::string& what);

// Checks a table against a region: names unique and non-empty, dtypes
// valid, every tensor inside the region, no two overlapping, aligned to its
// element width. InvalidArgument naming the tensor otherwise.
Status ValidateTable(const std::vector<TensorEntry>& table, size_t region_size);

// Views of the table's tensors in the region. REQUIRES: ValidateTable ok.
std::vector<codec::TensorView> TableViews(const std::vector<TensorEntry>& table, Region& region);
std::vector<codec::MutableTensorView> TableMutableViews(const std::vector<TensorEntry>& table, Region& region);

// Tensors over any number of regions: what a process registers with its
// daemon (every PyTorch allocation its own region, or all in one). Owns the
// regions (unmapped on destruction). Immutable once created.
class MappedTensors {
 public:
  // Checks every entry against its region (ValidateTable, per region; an
  // entry naming no region is InvalidArgument naming it) and that the
  // regions are all host memory or all memory of one device.
  static StatusOr<MappedTensors> Create(std::vector<std::unique_ptr<Region>> regions,
                                        std::vector<TensorEntry> table);

  const std::vector<TensorEntry>& table() const { return table_; }
  bool on_device() const { return device_ >= 0; }
  int device() const { return device_; }  // -1: host memory
  std::vector<codec::TensorView> Views() const;
  std::vector<codec::MutableTensorView> MutableViews() const;
  // Whether any tensor holds pieces (then every tensor is a runtime tensor,
  // described by Runtime()).
  bool has_pieces() const;
  std::vector<codec::RuntimeTensor> Runtime() const;
  // "3 tensors in shm:/a, shm:/b": for logs.
  std::string description() const;

 private:
  std::vector<std::unique_ptr<Region>> regions_;
  std::vector<TensorEntry> table_;
  int device_ = -1;
};

}  // namespace wsync::buffers
