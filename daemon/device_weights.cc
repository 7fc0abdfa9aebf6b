#include "device_weights.h"

#include <spdlog/spdlog.h>

#include "weight_store.h"

namespace wsync::daemon {

std::vector<codec::TensorView> DeviceSource::Set::Const() const {
  std::vector<codec::TensorView> v;
  for (const auto& m : views) v.push_back(m.AsConst());
  return v;
}

StatusOr<DeviceSource::Set> DeviceSource::Allocate(std::span<const codec::TensorView> layout, int device) {
  size_t total = 0;
  for (const auto& t : layout) total += (t.NumBytes() + 255) / 256 * 256;
  Set s;
  WSYNC_ASSIGN_OR_RETURN(s.memory, cuda::DeviceBuffer::Allocate(total, device));
  size_t at = 0;
  for (const auto& t : layout) {
    s.views.push_back({t.name, t.dtype, t.shape, static_cast<uint8_t*>(s.memory.data()) + at});
    at += (t.NumBytes() + 255) / 256 * 256;
  }
  return s;
}

StatusOr<std::unique_ptr<DeviceSource>> DeviceSource::Create(std::span<const codec::TensorView> layout, int device) {
  std::unique_ptr<DeviceSource> d(new DeviceSource());
  d->device_ = device;
  std::vector<codec::TensorView> published, cast;
  for (const auto& t : layout) {
    d->live_dtypes_.push_back(t.dtype);
    codec::TensorView p = t;
    p.dtype = buffers::PublishedDType(t.dtype);
    published.push_back(p);
    if (p.dtype != t.dtype) cast.push_back(p);
  }
  WSYNC_ASSIGN_OR_RETURN(d->codec_, cuda::DeviceCodec::Create(device));
  WSYNC_ASSIGN_OR_RETURN(d->previous_, Allocate(published, device));
  WSYNC_ASSIGN_OR_RETURN(d->snapshot_, Allocate(published, device));
  if (!cast.empty()) {
    WSYNC_ASSIGN_OR_RETURN(d->cast_, Allocate(cast, device));
  }
  return d;
}

Status DeviceSource::CastLive(std::span<const codec::TensorView> live) {
  effective_.assign(live.begin(), live.end());
  size_t c = 0;
  for (auto& t : effective_) {
    if (t.dtype != codec::DType::kF32) continue;
    const auto& to = cast_.views[c++];
    WSYNC_RETURN_IF_ERROR(codec_->CastFp32ToBf16(reinterpret_cast<const uint32_t*>(t.data),
                                                 reinterpret_cast<uint16_t*>(to.data), t.NumElements()));
    t = to.AsConst();
  }
  return Status::Ok();
}

Status DeviceSource::CopyDown(const Set& set, std::vector<buffers::OwnedTensor>& head) const {
  for (size_t i = 0; i < head.size(); ++i) {
    WSYNC_RETURN_IF_ERROR(cuda::CopyDeviceToHost(head[i].bytes.data(), set.views[i].data, head[i].bytes.size()));
  }
  return Status::Ok();
}

bool DeviceSource::Matches(std::span<const codec::TensorView> layout, int device) const {
  if (device != device_ || layout.size() != previous_.views.size()) return false;
  for (size_t i = 0; i < layout.size(); ++i) {
    const auto& a = layout[i];
    const auto& b = previous_.views[i];
    if (a.name != b.name || a.dtype != live_dtypes_[i] || a.shape != b.shape) return false;
  }
  return true;
}

VersionHistory::NewVersion DeviceSource::Next(std::span<const codec::TensorView> trainer) {
  VersionHistory::NewVersion next;
  // The published layout (dtypes after the cast); data unused.
  layout_ = snapshot_.Const();
  next.layout = layout_;
  next.encode = [this, trainer](std::span<const codec::TensorView> head,
                                const codec::EncodeOptions& eo) -> StatusOr<std::string> {
    WSYNC_RETURN_IF_ERROR(CastLive(trainer));
    const std::span<const codec::TensorView> live = effective_;
    if (!primed_) {
      // Created after earlier versions (the trainer registered again): the
      // history's host copy of the head becomes `previous`.
      for (size_t i = 0; i < head.size(); ++i) {
        WSYNC_RETURN_IF_ERROR(cuda::CopyHostToDevice(previous_.views[i].data, head[i].data, head[i].NumBytes()));
      }
      primed_ = true;
    }
    WSYNC_ASSIGN_OR_RETURN(std::string patch,
                           codec_->SnapshotAndEncode(live, snapshot_.views, previous_.Const(), eo, {}));
    std::swap(previous_, snapshot_);  // the new version is the head now
    return patch;
  };
  // The first version: snapshot straight into `previous`, and down to the
  // host for the keyframe.
  next.fill = [this, trainer](std::vector<buffers::OwnedTensor>& head) -> Status {
    WSYNC_RETURN_IF_ERROR(CastLive(trainer));
    const std::span<const codec::TensorView> live = effective_;
    for (size_t i = 0; i < live.size(); ++i) {
      WSYNC_RETURN_IF_ERROR(cuda::CopyDeviceToDevice(previous_.views[i].data, live[i].data, live[i].NumBytes()));
    }
    WSYNC_RETURN_IF_ERROR(CopyDown(previous_, head));
    primed_ = true;
    return Status::Ok();
  };
  // Later versions stay on the device until the host needs the head.
  next.load_head = [this](std::vector<buffers::OwnedTensor>& head) { return CopyDown(previous_, head); };
  return next;
}

StatusOr<uint64_t> TensorsSetChecksum(const buffers::MappedTensors& tensors, ThreadPool* pool) {
  const auto views = tensors.Views();
  if (!tensors.on_device()) return codec::SetChecksum(views, pool);
  WSYNC_ASSIGN_OR_RETURN(auto dc, cuda::DeviceCodec::Create(tensors.device()));
  return DeviceSetChecksum(*dc, views);
}

}  // namespace wsync::daemon
