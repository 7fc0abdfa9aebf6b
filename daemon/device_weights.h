// Weights in device memory, for the source and sink daemons.
//
// DeviceSource keeps the last published version ("previous", the base of
// the next patch) and turns a publish into a VersionHistory::NewVersion:
// the device codec encodes previous -> the trainer's live tensors and then
// updates previous to them (DeviceCodec::EncodeAndAdvance); only the compact
// streams cross to the host. Where previous lives is the trainer's choice
// (DeviceBase): one copy of the model on its GPU, or page-locked host memory
// streamed through a small device staging buffer. The history's host copy of
// the head is loaded from previous only when a keyframe of the head is asked
// for (a late or torn sink); merges for lagging sinks use the host's oldest
// copy and the patch chain.
//
// Thread safety: one publish at a time (the source serializes them).
#pragma once

#include <memory>
#include <span>
#include <vector>

#include "data_daemon.h"
#include "version_history.h"
#include "wsync/buffers/region.h"
#include "wsync/cuda/device_codec.h"

namespace wsync::daemon {

class DeviceSource {
 public:
  // Device buffers for the trainer's tensors `layout` on `device`, in the
  // published layout (F32 tensors are published as BF16: cast on the device
  // into a buffer of their own before each encode).
  static StatusOr<std::unique_ptr<DeviceSource>> Create(std::span<const codec::TensorView> layout, int device,
                                                        DeviceBase base,
                                                        cuda::EntropyStage entropy = cuda::EntropyStage::kHost);

  // Whether this state serves the trainer's tensors `layout` on this device.
  bool Matches(std::span<const codec::TensorView> layout, int device) const;

  // The next version from `live` (device memory of the layout given to
  // Create). REQUIRES: `live` outlives the VersionHistory::Publish call.
  VersionHistory::NewVersion Next(std::span<const codec::TensorView> live);

 private:
  DeviceSource() = default;
  // Tensors of the published layout in one allocation: device memory, or
  // page-locked host memory.
  struct Set {
    cuda::DeviceBuffer device;
    cuda::PinnedBuffer host;
    std::vector<codec::MutableTensorView> views;
    std::vector<codec::TensorView> Const() const;
  };
  static StatusOr<Set> Allocate(std::span<const codec::TensorView> layout, int device, bool on_host);
  // Copies between `previous_` and host tensors of the layout.
  Status LoadPrevious(std::span<const codec::TensorView> head);
  Status StorePrevious(std::vector<buffers::OwnedTensor>& head) const;

  // Casts the live F32 tensors into cast_; `effective_` is what is encoded.
  Status CastLive(std::span<const codec::TensorView> live);

  std::unique_ptr<cuda::DeviceCodec> codec_;
  cuda::Workspace ws_;  // the codec's scratch, kept between versions
  DeviceBase base_ = DeviceBase::kDevice;
  Set previous_;
  Set cast_;                                  // BF16 copies of the F32 tensors, in table order
  std::vector<codec::DType> live_dtypes_;     // the trainer's dtypes
  std::vector<codec::TensorView> effective_;  // live, with F32 tensors replaced by cast_
  std::vector<codec::TensorView> layout_;     // the published layout (Next)
  int device_ = 0;
  bool primed_ = false;  // previous_ holds the head
};

// The set checksum (codec::SetChecksum) of registered tensors on tile
// grids, on the device for device memory.
StatusOr<uint64_t> TensorsSetChecksum(const buffers::MappedTensors& tensors, std::span<const codec::TileGrid> grids,
                                      ThreadPool* pool);

}  // namespace wsync::daemon
