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

// A version applied in two steps: staged (checked, decoded and proven
// against the tensors, which it only reads) while the engine may still read
// them, then written between its holds. codec::ApplyAhead's contract,
// wherever the tensors live.
class StagedApply {
 public:
  virtual ~StagedApply() = default;
  // The stream's first bytes while it arrives (the same bytes at every
  // call, growing): where the store can, decoded as they come.
  virtual void Advance(std::string_view prefix) = 0;
  // The complete stream: every check, writing nothing; the error Apply
  // would return.
  virtual Status Prepare(std::string_view stream) = 0;
  // Writes what Prepare staged (prepares first if it was not given the
  // stream): FailedPrecondition, nothing written, when another writer
  // changed a value the version changes since staging.
  virtual Status Apply(std::string_view stream) = 0;
  // After Apply, reads the tensors back: DataLoss naming the first chunk
  // that is not the version's.
  virtual Status Confirm() const = 0;
  // Chunks staged while the stream arrived; chunks decoded again by Apply
  // (past the staging budget).
  virtual size_t staged_ahead() const = 0;
  virtual size_t decoded_again() const = 0;
};

class WeightStore {
 public:
  // A host store for host regions, a device store (with a device codec on
  // the regions' GPU, its entropy stage where `entropy` says) for device
  // regions; Unavailable when the CUDA library is not built in or no device
  // is usable.
  static StatusOr<std::unique_ptr<WeightStore>> Open(buffers::MappedTensors tensors,
                                                     cuda::EntropyStage entropy = cuda::EntropyStage::kHost);
  virtual ~WeightStore() = default;

  // The tensors: device pointers for a device store.
  std::vector<codec::TensorView> Views() const { return tensors_.Views(); }
  const buffers::MappedTensors& tensors() const { return tensors_; }
  bool on_device() const { return tensors_.on_device(); }
  // codec::LayoutFingerprint of the pieces the tensors hold; 0 for the
  // published tensors themselves.
  uint64_t layout() const { return layout_; }

  // An apply into the tensors of a patch or keyframe, or of the parts of
  // one version back to back (a stream of segments, codec::SplitSegments:
  // every segment one part), verified and all or nothing (codec::Apply's
  // contract, into whole tensors or, when the tensors hold pieces, into the
  // pieces), staged before it writes: on the host decoded while the stream
  // arrives (codec::ApplyAhead), on the device staged in device memory once
  // the stream is complete (cuda::DeviceCodec::Stage).
  virtual std::unique_ptr<StagedApply> BeginStaged(const codec::ApplyOptions& options) const = 0;
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
