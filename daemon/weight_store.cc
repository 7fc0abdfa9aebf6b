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

class HostStaged : public StagedApply {
 public:
  explicit HostStaged(codec::ApplyAhead ahead) : ahead_(std::move(ahead)) {}
  void Advance(std::string_view prefix) override { ahead_.Advance(prefix); }
  Status Prepare(std::string_view stream) override { return ahead_.Prepare(stream); }
  Status Apply(std::string_view stream) override { return ahead_.Apply(stream); }
  Status Confirm() const override { return ahead_.Confirm(); }
  size_t staged_ahead() const override { return ahead_.staged_ahead(); }
  size_t decoded_again() const override { return ahead_.decoded_again(); }

 private:
  codec::ApplyAhead ahead_;
};

class HostStore : public WeightStore {
 public:
  explicit HostStore(buffers::MappedTensors tensors) : WeightStore(std::move(tensors)) {}
  std::unique_ptr<StagedApply> BeginStaged(const codec::ApplyOptions& options) const override {
    if (tensors_.has_pieces()) return std::make_unique<HostStaged>(codec::ApplyAhead(tensors_.Runtime(), options));
    return std::make_unique<HostStaged>(codec::ApplyAhead(tensors_.MutableViews(), options));
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

// A staged apply on the device: nothing is decoded while the stream arrives;
// Prepare stages the complete stream in device memory, Apply commits it.
// The stream's bytes must stay until Confirm returns (the staged version
// reads them).
class DeviceStaged : public StagedApply {
 public:
  DeviceStaged(const buffers::MappedTensors& tensors, cuda::DeviceCodec& codec, cuda::Workspace& ws,
               const codec::ApplyOptions& options)
      : tensors_(tensors), codec_(codec), ws_(ws), options_(options) {}
  void Advance(std::string_view) override {}
  Status Prepare(std::string_view stream) override {
    staged_.reset();
    stream_ = stream;
    WSYNC_ASSIGN_OR_RETURN(auto parts, codec::SplitSegments(stream));
    StatusOr<cuda::DeviceCodec::Staged> staged = [&] {
      if (tensors_.has_pieces()) {
        const auto runtime = tensors_.Runtime();
        return codec_.Stage(ws_, parts, runtime, options_);
      }
      const auto views = tensors_.MutableViews();
      return codec_.Stage(ws_, parts, views, options_);
    }();
    WSYNC_RETURN_IF_ERROR(staged.status());
    staged_ = std::make_unique<cuda::DeviceCodec::Staged>(std::move(*staged));
    return Status::Ok();
  }
  Status Apply(std::string_view stream) override {
    if (!staged_ || stream.data() != stream_.data() || stream.size() != stream_.size()) {
      WSYNC_RETURN_IF_ERROR(Prepare(stream));
    }
    return codec_.Commit(ws_, *staged_);
  }
  Status Confirm() const override { return staged_ ? codec_.Confirm(ws_, *staged_) : Status::Ok(); }
  size_t staged_ahead() const override { return 0; }
  size_t decoded_again() const override { return staged_ && staged_->decodes_again() ? 1 : 0; }

 private:
  const buffers::MappedTensors& tensors_;
  cuda::DeviceCodec& codec_;
  cuda::Workspace& ws_;
  const codec::ApplyOptions options_;
  std::string_view stream_;
  std::unique_ptr<cuda::DeviceCodec::Staged> staged_;
};

class DeviceStore : public WeightStore {
 public:
  DeviceStore(buffers::MappedTensors tensors, std::unique_ptr<cuda::DeviceCodec> codec)
      : WeightStore(std::move(tensors)), codec_(std::move(codec)), ws_(tensors_.device()) {}
  std::unique_ptr<StagedApply> BeginStaged(const codec::ApplyOptions& options) const override {
    return std::make_unique<DeviceStaged>(tensors_, *codec_, ws_, options);
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
    return codec_->SetChecksum(ws_, Views(), grids);
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
  mutable cuda::Workspace ws_;  // the codec's scratch, kept between versions
};

}  // namespace

// Keyframes of runtime tensors would not be keyframes of the published set.
Status WeightStore::CheckWhole() const {
  if (tensors_.has_pieces()) return FailedPreconditionError("the tensors hold pieces: no keyframe can be made of them");
  return Status::Ok();
}

StatusOr<std::unique_ptr<WeightStore>> WeightStore::Open(buffers::MappedTensors tensors,
                                                         cuda::EntropyStage entropy) {
  if (!tensors.on_device()) return std::unique_ptr<WeightStore>(std::make_unique<HostStore>(std::move(tensors)));
  WSYNC_ASSIGN_OR_RETURN(auto codec, cuda::DeviceCodec::Create(tensors.device(), entropy));
  return std::unique_ptr<WeightStore>(std::make_unique<DeviceStore>(std::move(tensors), std::move(codec)));
}

}  // namespace wsync::daemon
