// Safetensors files: read through mmap, written atomically.
//
// Format (https://huggingface.co/docs/safetensors): u64 little-endian N, N
// bytes of JSON {"name": {"dtype", "shape", "data_offsets": [begin, end]},
// "__metadata__": {string: string}}, then the data; offsets are relative to
// the end of the header. The reader treats the file as hostile: the header
// size, every offset and every size is checked against the file.
//
// Thread safety: a SafetensorsFile is immutable after Open and may be read
// from many threads.
#pragma once

#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "wsync/codec/codec.h"
#include "wsync/util/status.h"
#include "wsync/util/thread_pool.h"

namespace wsync::buffers {

class SafetensorsFile {
 public:
  // Maps `path` read-only and parses its header.
  static StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  // Tensors in file (data offset) order; views point into the mapping and are
  // valid while this object lives.
  const std::vector<codec::TensorView>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::string& path() const { return path_; }

  // The tensor named `name`, or nullptr.
  const codec::TensorView* Find(const std::string& name) const;

 private:
  SafetensorsFile() = default;
  std::string path_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  std::vector<codec::TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

// Writes tensors (in the given order) to `path` through a temporary file and
// a rename, so a reader never sees a partial file.
Status WriteSafetensors(const std::string& path, std::span<const codec::TensorView> tensors,
                        const std::map<std::string, std::string>& metadata = {});

// Owned tensors (for tools and tests): names, dtypes, shapes and bytes.
struct OwnedTensor {
  std::string name;
  codec::DType dtype = codec::DType::kBF16;
  std::vector<uint64_t> shape;
  std::vector<uint8_t> bytes;

  codec::TensorView View() const { return {name, dtype, shape, bytes.data()}; }
  codec::MutableTensorView MutableView() { return {name, dtype, shape, bytes.data()}; }
};

// Copies of the tensors of a file, e.g. as a destination to apply into.
std::vector<OwnedTensor> CopyTensors(std::span<const codec::TensorView> tensors);

// True when `to` has the names, dtypes and shapes of `from`, in order.
bool SameLayout(const std::vector<OwnedTensor>& to, std::span<const codec::TensorView> from);

// The dtype a source publishes for a registered dtype: F32 (trainer master
// weights) is published as BF16; every other dtype as it is.
codec::DType PublishedDType(codec::DType d);

// Zeroed tensors in the published layout of `tensors` (PublishedDType).
std::vector<OwnedTensor> PublishedCopy(std::span<const codec::TensorView> tensors);

// Copies `from` into `to` (same names and shapes, and the same dtype or an
// F32 tensor into a BF16 one, which is cast with round-to-nearest-even as
// PyTorch's .to(torch.bfloat16); else InvalidArgument and nothing is
// copied), in pieces over the pool (nullptr: this thread): one thread does
// not reach the memory's bandwidth.
Status CopyInto(std::span<const codec::TensorView> from, std::vector<OwnedTensor>& to, ThreadPool* pool);

std::vector<codec::TensorView> Views(const std::vector<OwnedTensor>& tensors);
std::vector<codec::MutableTensorView> MutableViews(std::vector<OwnedTensor>& tensors);

}  // namespace wsync::buffers
