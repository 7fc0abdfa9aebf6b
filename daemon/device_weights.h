// Weights in device memory, for the source and sink daemons (issue #5).
//
// DeviceSource keeps, on the trainer's GPU, the last published version
// ("previous") and a snapshot buffer, and turns a publish into a
// VersionHistory::NewVersion: the trainer's live tensors are snapshotted by
// device-to-device copies on a copy stream while the device codec encodes
// previous -> snapshot tensor by tensor (DeviceCodec::SnapshotAndEncode);
// only the compact streams cross to the host. The history's host copy of the
// head is loaded from the device only when a keyframe of the head is asked
// for (a late or torn sink); merges for lagging sinks use the host's oldest
// copy and the patch chain. On success the two device buffers swap roles.
// Costs twice the model's size in device memory.
//
// Thread safety: one publish at a time (the source serializes them).
#pragma once

#include <memory>
#include <span>
#include <vector>

#include "version_history.h"
#include "wsync/buffers/region.h"
#include "wsync/cuda/device_codec.h"

namespace wsync::daemon {

class DeviceSource {
 public:
  // Device buffers for the trainer's tensors `layout` on `device`, in the
  // published layout (F32 tensors are published as BF16: cast on the device
  // into a buffer of their own before each encode).
  static StatusOr<std::unique_ptr<DeviceSource>> Create(std::span<const codec::TensorView> layout, int device);

  // Whether this state serves the trainer's tensors `layout` on this device.
  bool Matches(std::span<const codec::TensorView> layout, int device) const;

  // The next version from `live` (device memory of the layout given to
  // Create). REQUIRES: `live` outlives the VersionHistory::Publish call.
  VersionHistory::NewVersion Next(std::span<const codec::TensorView> live);

 private:
  DeviceSource() = default;
  struct Set {
    cuda::DeviceBuffer memory;
    std::vector<codec::MutableTensorView> views;
    std::vector<codec::TensorView> Const() const;
  };
  static StatusOr<Set> Allocate(std::span<const codec::TensorView> layout, int device);
  Status CopyDown(const Set& set, std::vector<buffers::OwnedTensor>& head) const;

  // Casts the live F32 tensors into cast_; `effective_` is what is encoded.
  Status CastLive(std::span<const codec::TensorView> live);

  std::unique_ptr<cuda::DeviceCodec> codec_;
  Set previous_, snapshot_;
  Set cast_;                                  // BF16 copies of the F32 tensors, in table order
  std::vector<codec::DType> live_dtypes_;     // the trainer's dtypes
  std::vector<codec::TensorView> effective_;  // live, with F32 tensors replaced by cast_
  std::vector<codec::TensorView> layout_;     // the published layout (Next)
  int device_ = 0;
  bool primed_ = false;  // previous_ holds the head
};

// The set checksum (codec::SetChecksum) of registered tensors, on the
// device for device memory.
StatusOr<uint64_t> TensorsSetChecksum(const buffers::MappedTensors& tensors, ThreadPool* pool);

}  // namespace wsync::daemon
