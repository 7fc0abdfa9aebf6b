#include "weight_store.h"

#include <algorithm>
#include <set>
#include <string_view>
#include <unordered_map>

#include "wsync/codec/checksum.h"
#include "wsync/codec/codec.h"
#include "wsync/util/text.h"

#include "wsync/cuda/device_codec.h"

namespace wsync::daemon {
namespace {

// The views named in `only` (all when empty), in table order; NotFound
// naming one the tensors lack.
StatusOr<std::vector<codec::TensorView>> Only(std::vector<codec::TensorView> views, std::span<const std::string> only) {
  if (only.empty()) return views;
  std::set<std::string_view> wanted(only.begin(), only.end());
  std::vector<codec::TensorView> out;
  for (auto& v : views) {
    if (wanted.erase(v.name)) out.push_back(std::move(v));
  }
  if (!wanted.empty()) return NotFoundError("no tensor " + Quoted(std::string(*wanted.begin())) + " registered");
  return out;
}

// The segments of every stream, in order: the parts the codec applies as one.
StatusOr<std::vector<std::string_view>> Segments(std::span<const std::string_view> streams) {
  std::vector<std::string_view> out;
  for (std::string_view s : streams) {
    WSYNC_ASSIGN_OR_RETURN(auto segments, codec::SplitSegments(s));
    out.insert(out.end(), segments.begin(), segments.end());
  }
  return out;
}

// Applies the parts of one version (one part: a patch or keyframe of the
// whole set) into host tensors, whole or holding pieces. REQUIRES: parts
// split into their segments (Segments).
Status ApplyOnHost(std::span<const std::string_view> parts, const buffers::MappedTensors& tensors,
                   std::vector<codec::RuntimeTensor> runtime, const codec::ApplyOptions& options) {
  if (tensors.has_pieces()) {
    if (parts.size() == 1) return codec::Apply(parts[0], runtime, options);
    return codec::Apply(parts, runtime, options);
  }
  std::vector<codec::MutableTensorView> views;
  for (auto& rt : runtime) views.push_back(std::move(rt.view));
  if (parts.size() == 1) return codec::Apply(parts[0], views, options);
  return codec::Apply(parts, views, options);
}

class HostStore : public WeightStore {
 public:
  explicit HostStore(buffers::MappedTensors tensors) : WeightStore(std::move(tensors)) {}
  Status Apply(std::span<const std::string_view> streams, const codec::ApplyOptions& options) override {
    WSYNC_ASSIGN_OR_RETURN(auto parts, Segments(streams));
    return ApplyOnHost(parts, tensors_, tensors_.Runtime(), options);
  }
  std::unique_ptr<codec::ApplyAhead> ApplyAhead(const codec::ApplyOptions& options) const override {
    if (tensors_.has_pieces()) return std::make_unique<codec::ApplyAhead>(tensors_.Runtime(), options);
    return std::make_unique<codec::ApplyAhead>(tensors_.MutableViews(), options);
  }
  StatusOr<std::vector<buffers::OwnedTensor>> HostCopy() const override { return buffers::CopyTensors(Views()); }
  StatusOr<uint64_t> SetChecksum(std::span<const codec::TileGrid> grids, ThreadPool* pool) const override {
    return codec::SetChecksum(Views(), grids, pool);
  }
  StatusOr<std::string> EncodeKeyframe(const codec::EncodeOptions& options,
                                       std::span<const std::string> only) const override {
    WSYNC_RETURN_IF_ERROR(CheckWhole());
    WSYNC_ASSIGN_OR_RETURN(auto views, Only(Views(), only));
    return codec::EncodeKeyframe(views, options);
  }
};

class DeviceStore : public WeightStore {
 public:
  DeviceStore(buffers::MappedTensors tensors, std::unique_ptr<cuda::DeviceCodec> codec)
      : WeightStore(std::move(tensors)), codec_(std::move(codec)) {}
  Status Apply(std::span<const std::string_view> streams, const codec::ApplyOptions& options) override {
    WSYNC_ASSIGN_OR_RETURN(auto parts, Segments(streams));
    std::string joined;
    if (streams.size() == 1 && parts.size() > 1 && !tensors_.has_pieces()) {
      // A version streamed in segments: one container for the device codec,
      // joined with the checksum of what the tensors hold as its base's. When
      // they hold the base that is the base's checksum, and the container is
      // byte for byte the source's whole patch; when not, the apply fails its
      // checks and is undone (named a corrupt patch rather than a wrong base:
      // the sink takes a keyframe either way).
      WSYNC_ASSIGN_OR_RETURN(uint64_t held, codec_->SetChecksum(Views(), {}));
      WSYNC_ASSIGN_OR_RETURN(joined, codec::JoinSegments(parts, held));
      parts = {joined};
    }
    if (tensors_.has_pieces()) {
      const auto runtime = tensors_.Runtime();
      return parts.size() == 1 ? codec_->Apply(parts[0], runtime, options) : codec_->Apply(parts, runtime, options);
    }
    const auto views = tensors_.MutableViews();
    return parts.size() == 1 ? codec_->Apply(parts[0], views, options) : codec_->Apply(parts, views, options);
  }
  StatusOr<std::vector<buffers::OwnedTensor>> HostCopy() const override {
    std::vector<buffers::OwnedTensor> out;
    for (const auto& t : Views()) {
      buffers::OwnedTensor o{t.name, t.dtype, t.shape, std::vector<uint8_t>(t.NumBytes())};
      WSYNC_RETURN_IF_ERROR(cuda::CopyDeviceToHost(o.bytes.data(), t.data, o.bytes.size()));
      out.push_back(std::move(o));
    }
    return out;
  }
  StatusOr<uint64_t> SetChecksum(std::span<const codec::TileGrid> grids, ThreadPool*) const override {
    return codec_->SetChecksum(Views(), grids);
  }
  // The keyframe is encoded on the host from a copy (a late sink's, rare).
  StatusOr<std::string> EncodeKeyframe(const codec::EncodeOptions& options,
                                       std::span<const std::string> only) const override {
    WSYNC_RETURN_IF_ERROR(CheckWhole());
    WSYNC_ASSIGN_OR_RETURN(auto host, HostCopy());
    WSYNC_ASSIGN_OR_RETURN(auto views, Only(buffers::Views(host), only));
    return codec::EncodeKeyframe(views, options);
  }

 private:
  std::unique_ptr<cuda::DeviceCodec> codec_;
};

}  // namespace

// Keyframes of runtime tensors would not be keyframes of the published set.
Status WeightStore::CheckWhole() const {
  if (tensors_.has_pieces()) return FailedPreconditionError("the tensors hold pieces: no keyframe can be made of them");
  return Status::Ok();
}

StatusOr<std::unique_ptr<WeightStore>> WeightStore::Open(buffers::MappedTensors tensors) {
  if (!tensors.on_device()) return std::unique_ptr<WeightStore>(std::make_unique<HostStore>(std::move(tensors)));
  WSYNC_ASSIGN_OR_RETURN(auto codec, cuda::DeviceCodec::Create(tensors.device()));
  return std::unique_ptr<WeightStore>(std::make_unique<DeviceStore>(std::move(tensors), std::move(codec)));
}

}  // namespace wsync::daemon
