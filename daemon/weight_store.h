// Registered tensors wherever they live, behind one interface: host memory
// (shared memory, the codec on the CPU) or device memory (CUDA IPC, the
// device codec). The daemons' logic asks the store and has no host/device
// branches; which one a registration gets follows from its regions.
//
// Thread safety: the store is immutable; callers coordinate writers (a
// sink's holds) as they do for the memory itself.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "wsync/buffers/region.h"
#include "wsync/buffers/safetensors.h"
#include "wsync/codec/codec.h"
#include "wsync/cuda/device_codec.h"
#include "wsync/util/thread_pool.h"

namespace wsync::daemon {

class WeightStore {
 public:
  // A host store for host regions, a device store (with a device codec on
  // the regions' GPU) for device regions; Unavailable when the CUDA library
  // is not built in or no device is usable.
  static StatusOr<std::unique_ptr<WeightStore>> Open(buffers::MappedTensors tensors);
  virtual ~WeightStore() = default;

  // The tensors: device pointers for a device store.
  std::vector<codec::TensorView> Views() const { return tensors_.Views(); }
  const buffers::MappedTensors& tensors() const { return tensors_; }
  bool on_device() const { return tensors_.on_device(); }
  // codec::LayoutFingerprint of the pieces the tensors hold; 0 for the
  // published tensors themselves.
  uint64_t layout() const { return layout_; }

  // Applies a patch or keyframe into the tensors, or the parts of one
  // version from several sources together: verified, undone on a mismatch
  // (codec::Apply's contract, into whole tensors or, when the tensors
  // hold pieces, into the pieces).
  // Each part may be a stream of segments (codec::SplitSegments): all the
  // segments of all the parts apply as one.
  virtual Status Apply(std::span<const std::string_view> parts, const codec::ApplyOptions& options) = 0;
  // An apply that decodes a stream while it arrives (codec::ApplyAhead) into
  // the tensors; null where the store decodes elsewhere (a device store's
  // codec decodes on the GPU, from the whole patch).
  virtual std::unique_ptr<codec::ApplyAhead> ApplyAhead(const codec::ApplyOptions& options) const {
    (void)options;
    return nullptr;
  }
  // A copy of the tensors in host memory.
  virtual StatusOr<std::vector<buffers::OwnedTensor>> HostCopy() const = 0;
  // codec::SetChecksum of the tensors coded with `grids`, computed where
  // they live.
  virtual StatusOr<uint64_t> SetChecksum(std::span<const codec::TileGrid> grids, ThreadPool* pool) const = 0;
  // A keyframe of what the tensors hold (FailedPrecondition for pieces); of
  // the tensors named in `only` when it is not empty (one part of a version
  // of several sources).
  virtual StatusOr<std::string> EncodeKeyframe(const codec::EncodeOptions& options,
                                               std::span<const std::string> only = {}) const = 0;

 protected:
  explicit WeightStore(buffers::MappedTensors tensors)
      : tensors_(std::move(tensors)), layout_(tensors_.has_pieces() ? codec::LayoutFingerprint(tensors_.Runtime()) : 0) {}
  Status CheckWhole() const;
  const buffers::MappedTensors tensors_;
  const uint64_t layout_;
};


}  // namespace wsync::daemon
