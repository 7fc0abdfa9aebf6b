#include "device_weights.h"

#include <spdlog/spdlog.h>

#include <cstring>

#include "weight_store.h"

namespace wsync::daemon {

std::vector<codec::TensorView> DeviceSource::Set::Const() const {
  std::vector<codec::TensorView> v;
  for (const auto& m : views) v.push_back(m.AsConst());
  return v;
}

StatusOr<DeviceSource::Set> DeviceSource::Allocate(std::span<const codec::TensorView> layout, int device,
                                                   bool on_host) {
  size_t total = 0;
  for (const auto& t : layout) total += (t.NumBytes() + 255) / 256 * 256;
  Set s;
  uint8_t* base = nullptr;
  if (on_host) {
    WSYNC_ASSIGN_OR_RETURN(s.host, cuda::PinnedBuffer::Allocate(total));
    base = static_cast<uint8_t*>(s.host.data());
  } else {
    WSYNC_ASSIGN_OR_RETURN(s.device, cuda::DeviceBuffer::Allocate(total, device));
    base = static_cast<uint8_t*>(s.device.data());
  }
  size_t at = 0;
  for (const auto& t : layout) {
    s.views.push_back({t.name, t.dtype, t.shape, base + at});
    at += (t.NumBytes() + 255) / 256 * 256;
  }
  return s;
}

StatusOr<std::unique_ptr<DeviceSource>> DeviceSource::Create(std::span<const codec::TensorView> layout, int device,
                                                             DeviceBase base, cuda::EntropyStage entropy) {
  std::unique_ptr<DeviceSource> d(new DeviceSource());
  d->device_ = device;
  d->base_ = base;
  std::vector<codec::TensorView> published, cast;
  for (const auto& t : layout) {
    d->live_dtypes_.push_back(t.dtype);
    codec::TensorView p = t;
    p.dtype = buffers::PublishedDType(t.dtype);
    published.push_back(p);
    if (p.dtype != t.dtype) cast.push_back(p);
  }
  WSYNC_ASSIGN_OR_RETURN(d->codec_, cuda::DeviceCodec::Create(device, entropy));
  d->ws_ = cuda::Workspace(device);
  WSYNC_ASSIGN_OR_RETURN(d->previous_, Allocate(published, device, base == DeviceBase::kHost));
  if (!cast.empty()) {
    WSYNC_ASSIGN_OR_RETURN(d->cast_, Allocate(cast, device, false));
  }
  spdlog::info("source: the base of the next patch is kept in {} ({:.2f} GB)",
               base == DeviceBase::kHost ? "page-locked host memory" : "GPU memory",
               static_cast<double>(base == DeviceBase::kHost ? d->previous_.host.size() : d->previous_.device.size()) /
                   1e9);
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

Status DeviceSource::LoadPrevious(std::span<const codec::TensorView> head) {
  for (size_t i = 0; i < head.size(); ++i) {
    if (base_ == DeviceBase::kHost) {
      std::memcpy(previous_.views[i].data, head[i].data, head[i].NumBytes());
    } else {
      WSYNC_RETURN_IF_ERROR(cuda::CopyHostToDevice(previous_.views[i].data, head[i].data, head[i].NumBytes()));
    }
  }
  return Status::Ok();
}

Status DeviceSource::StorePrevious(std::vector<buffers::OwnedTensor>& head) const {
  for (size_t i = 0; i < head.size(); ++i) {
    if (base_ == DeviceBase::kHost) {
      std::memcpy(head[i].bytes.data(), previous_.views[i].data, head[i].bytes.size());
    } else {
      WSYNC_RETURN_IF_ERROR(cuda::CopyDeviceToHost(head[i].bytes.data(), previous_.views[i].data, head[i].bytes.size()));
    }
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
  layout_ = previous_.Const();
  next.layout = layout_;
  next.encode = [this, trainer](std::span<const codec::TensorView> head,
                                const codec::EncodeOptions& eo) -> StatusOr<std::string> {
    WSYNC_RETURN_IF_ERROR(CastLive(trainer));
    if (!primed_) {
      // Created after earlier versions (the trainer registered again): the
      // history's host copy of the head becomes `previous`.
      WSYNC_RETURN_IF_ERROR(LoadPrevious(head));
      primed_ = true;
    }
    // On an error `previous` still holds the head (EncodeAndAdvance).
    return base_ == DeviceBase::kHost ? codec_->EncodeAndAdvanceFromHost(ws_, effective_, previous_.views, eo)
                                      : codec_->EncodeAndAdvance(ws_, effective_, previous_.views, eo);
  };
  // The first version: the trainer's tensors into `previous`, and down to
  // the host for the keyframe.
  next.fill = [this, trainer](std::vector<buffers::OwnedTensor>& head) -> Status {
    WSYNC_RETURN_IF_ERROR(CastLive(trainer));
    for (size_t i = 0; i < effective_.size(); ++i) {
      if (base_ == DeviceBase::kHost) {
        WSYNC_RETURN_IF_ERROR(cuda::CopyDeviceToHost(head[i].bytes.data(), effective_[i].data, head[i].bytes.size()));
      } else {
        WSYNC_RETURN_IF_ERROR(
            cuda::CopyDeviceToDevice(previous_.views[i].data, effective_[i].data, effective_[i].NumBytes()));
      }
    }
    WSYNC_RETURN_IF_ERROR(base_ == DeviceBase::kHost ? LoadPrevious(buffers::Views(head)) : StorePrevious(head));
    primed_ = true;
    return Status::Ok();
  };
  // Later versions stay in `previous` until the host needs the head.
  next.load_head = [this](std::vector<buffers::OwnedTensor>& head) { return StorePrevious(head); };
  return next;
}

StatusOr<uint64_t> TensorsSetChecksum(const buffers::MappedTensors& tensors, std::span<const codec::TileGrid> grids,
                                      ThreadPool* pool) {
  const auto views = tensors.Views();
  if (!tensors.on_device()) return codec::SetChecksum(views, grids, pool);
  WSYNC_ASSIGN_OR_RETURN(auto dc, cuda::DeviceCodec::Create(tensors.device()));
  cuda::Workspace ws(tensors.device());
  return dc->SetChecksum(ws, views, grids);
}

}  // namespace wsync::daemon
