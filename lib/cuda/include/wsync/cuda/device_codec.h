// The patch codec on a GPU: encode from and apply into device memory, with
// the bytes and the behaviour of the host codec (codec.h). The device diffs,
// compacts, histograms, ranks, checksums and scatters; the entropy coders run
// on the compact streams, on the host's threads (staged.h) or, for
// sparse-coded chunks, one chunk per device thread (EntropyStage). Either
// way a patch made here is byte-identical to codec::EncodePatch on host
// copies of the same tensors, and applying one here equals codec::Apply,
// errors included.
//
// Every call works in a Workspace the caller owns and passes in
// (workspace.h): the codec itself holds only its device, its streams and
// the last call's phase timings. No CUDA header is included: a build
// without CUDA has the same API, and Create() then returns Unavailable.
// Tensor views carry device pointers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "wsync/codec/codec.h"
#include "wsync/cuda/workspace.h"
#include "wsync/util/status.h"

namespace wsync::cuda {

// Ok when this build has CUDA and a device can be used; else Unavailable
// saying why (built without CUDA, no device, driver error).
Status DeviceAvailable();

// Where a DeviceCodec codes and decodes the rANS streams of sparse-coded
// chunks (patch mode 1, nearly every chunk at RL change rates): on the
// host's threads (a call's options.pool), or one chunk per device thread.
// A chunk's streams are serial work, and a model has about a thousand chunks
// per GB: too few threads to fill a GPU, so the host's threads are faster
// unless the host has very few to spare (docs/gpu.md has the figures).
enum class EntropyStage { kHost, kDevice };

class DeviceCodec {
 public:
  // A codec on `device` with its own streams; its calls work in a
  // Workspace of the same device. Unavailable when DeviceAvailable() is not
  // ok.
  static StatusOr<std::unique_ptr<DeviceCodec>> Create(int device = 0,
                                                       EntropyStage entropy = EntropyStage::kHost);
  ~DeviceCodec();
  DeviceCodec(const DeviceCodec&) = delete;
  DeviceCodec& operator=(const DeviceCodec&) = delete;

  // codec::EncodePatch over tensors in device memory. options.pool (if any)
  // runs the host entropy stage.
  StatusOr<std::string> EncodePatch(Workspace& ws, std::span<const codec::TensorView> base,
                                    std::span<const codec::TensorView> target, const codec::EncodeOptions& options);

  // codec::Apply of a patch or keyframe, or of the parts of a version, into
  // whole tensors or the pieces of runtime tensors in device memory (tile
  // grids and selections included), with its checks, errors and
  // all-or-nothing: Stage, then Commit.
  Status Apply(Workspace& ws, std::string_view patch, const codec::Destination& destination,
               const codec::ApplyOptions& options);
  Status Apply(Workspace& ws, std::span<const std::string_view> parts, const codec::Destination& destination,
               const codec::ApplyOptions& options);

  // A version staged on the device (Stage), for Commit to write.
  class Staged {
   public:
    Staged();
    Staged(Staged&&) noexcept;
    Staged& operator=(Staged&&) noexcept;
    ~Staged();
    // Changed elements Commit writes (keyframes' not counted).
    uint64_t changes() const;
    // Device memory the kept writes hold: per change its element index (8
    // bytes), the value it held and the value it becomes (12 bytes per BF16
    // change); 0 when they were past ApplyOptions::stage_keep_bytes.
    uint64_t kept_bytes() const;
    // Whether Commit decodes the patch again (the writes were not kept).
    bool decodes_again() const;

    struct State;  // the codec's

   private:
    friend class DeviceCodec;
    std::unique_ptr<State> state_;
  };

  // The apply's every check, before the destination may be written: each
  // part's chunks the destination holds are gathered into device scratch
  // (whole tensors as identity placements), decoded against it, their
  // changes added there and every result proven against the patch's
  // digests. The destination is only read (its readers may go on); an error
  // is the one Apply would return (a corrupt, truncated or mismatched patch,
  // a destination without the patch's base), and nothing is written. Kept
  // on the device for Commit: per change its element, the value it held and
  // the value it becomes, up to options.stage_keep_bytes (past it, Commit
  // decodes again). Keyframe parts are decoded and verified on the host and
  // kept there. One part: as Apply(patch); more: as Apply(parts). The
  // parts' bytes must outlive the Staged; the workspace need not (the kept
  // writes are the Staged's own).
  StatusOr<Staged> Stage(Workspace& ws, std::span<const std::string_view> parts,
                         const codec::Destination& destination, const codec::ApplyOptions& options);
  // Writes a staged version, and nothing else: one launch checks that every
  // changed element still holds the value it was staged against, one
  // writes the new values; then the keyframes' tiles. FailedPrecondition
  // naming the first element another writer changed since staging, with
  // nothing written. Needs no other writer while it runs; once per Staged.
  // Writes not kept are decoded again in `ws`.
  Status Commit(Workspace& ws, Staged& staged);
  // After Commit, reads the destination back (its readers may have resumed):
  // DataLoss naming the first chunk that is not the version's (another
  // writer changed an element the version did not, between staging and
  // the writes).
  Status Confirm(Workspace& ws, const Staged& staged);

  // A source's base without a second copy of the model on the trainer's
  // GPU. Both encode previous -> live (like EncodePatch), then make
  // `previous` equal to `live`, only once the patch is made (on an error
  // `previous` is unchanged; a CUDA error during the update itself leaves it
  // undefined). The trainer must not write `live` until they return: its
  // pause is the encode plus the update.
  //
  // EncodeAndAdvance: `previous` in device memory (one copy of the model);
  // the update is a device-to-device copy.
  StatusOr<std::string> EncodeAndAdvance(Workspace& ws, std::span<const codec::TensorView> live,
                                         std::span<const codec::MutableTensorView> previous,
                                         const codec::EncodeOptions& options);
  // EncodeAndAdvanceFromHost: `previous` in host memory (page-locked,
  // PinnedBuffer, for full speed), copied up through a device staging buffer
  // batch by batch (at most the larger of 256 MiB and the largest tensor):
  // next to no device memory, and the model's size crosses PCIe twice per
  // version (previous up, live down).
  StatusOr<std::string> EncodeAndAdvanceFromHost(Workspace& ws, std::span<const codec::TensorView> live,
                                                 std::span<const codec::MutableTensorView> previous,
                                                 const codec::EncodeOptions& options);

  // Where the last encode or apply spent its time, phase by phase in the
  // order they ran (each phase summed over the batches of tensors), for
  // benchmarks and logs. Host clock around synchronized work.
  struct Phase {
    const char* name;
    double seconds;
  };
  const std::vector<Phase>& last_phases() const;

  // codec::TensorChecksum of nbytes of device memory.
  StatusOr<uint64_t> TensorChecksum(Workspace& ws, const void* data, size_t nbytes);

  // codec::SetChecksum of tensors in device memory on tile grids: a gridded
  // tensor hashed by cells (those not whole rows gathered into scratch).
  StatusOr<uint64_t> SetChecksum(Workspace& ws, std::span<const codec::TensorView> tensors,
                                 std::span<const codec::TileGrid> grids);

  // codec::CastFp32ToBf16 on device memory (no scratch); returns when done.
  Status CastFp32ToBf16(const uint32_t* src, uint16_t* dst, size_t n);

  // The source pipeline. Copies `live` (e.g. a trainer's buffers, opened by
  // CUDA IPC) tensor by tensor into `snapshot` on a copy stream, while the
  // compute stream encodes previous -> snapshot for each tensor as soon as
  // its copy has landed (events), so encoding overlaps the copy of the next
  // tensor. on_snapshot (may be empty) runs once every copy is done: the
  // trainer may then write its buffers again. Returns the patch; `previous`
  // is left untouched (the caller swaps the roles of the two sets).
  // REQUIRES: the three sets have equal names, dtypes and shapes.
  StatusOr<std::string> SnapshotAndEncode(Workspace& ws, std::span<const codec::TensorView> live,
                                          std::span<const codec::MutableTensorView> snapshot,
                                          std::span<const codec::TensorView> previous,
                                          const codec::EncodeOptions& options,
                                          const std::function<void()>& on_snapshot);

 private:
  struct Impl;
  explicit DeviceCodec(std::unique_ptr<Impl> impl);
  // as_parts: Apply's list form, else one patch.
  StatusOr<Staged> Stage(Workspace& ws, std::span<const std::string_view> parts,
                         const codec::Destination& destination, const codec::ApplyOptions& options, bool as_parts);
  Status StageAndCommit(Workspace& ws, std::span<const std::string_view> parts,
                        const codec::Destination& destination, const codec::ApplyOptions& options, bool as_parts);
  std::unique_ptr<Impl> impl_;
};

// Synchronous copies between device memory (any pointer cudaMemcpy accepts,
// IPC mappings included) and host or device memory.
Status CopyDeviceToHost(void* dst, const void* src, size_t bytes);
Status CopyHostToDevice(void* dst, const void* src, size_t bytes);
Status CopyDeviceToDevice(void* dst, const void* src, size_t bytes);

// Device memory owned by its holder, for tools and tests.
class DeviceBuffer {
 public:
  static StatusOr<DeviceBuffer> Allocate(size_t bytes, int device = 0);
  DeviceBuffer() = default;
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  ~DeviceBuffer();

  void* data() const { return data_; }
  size_t size() const { return size_; }
  Status CopyFromHost(const void* src, size_t bytes, size_t offset = 0);
  Status CopyToHost(void* dst, size_t bytes, size_t offset = 0) const;
  // Device-to-device copy from `src` (bytes); returns when done.
  Status CopyFromDevice(const void* src, size_t bytes);

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
};

// Page-locked host memory (cudaMallocHost): copies between it and the device
// run at full PCIe speed and asynchronously.
class PinnedBuffer {
 public:
  static StatusOr<PinnedBuffer> Allocate(size_t bytes);
  PinnedBuffer() = default;
  PinnedBuffer(PinnedBuffer&& other) noexcept;
  PinnedBuffer& operator=(PinnedBuffer&& other) noexcept;
  ~PinnedBuffer();

  void* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace wsync::cuda
