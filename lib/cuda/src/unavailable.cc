// DeviceCodec in a build without CUDA: the same API, every entry point
// reporting Unavailable, so the daemon and tools build and say why.
#include "wsync/cuda/device_codec.h"

namespace wsync::cuda {
namespace {

Status NotBuilt() {
  return UnavailableError("wsync was built without CUDA (WSYNC_CUDA=OFF or no nvcc at build time)");
}

}  // namespace

struct DeviceCodec::Impl {
  std::vector<Phase> phases;
};

Status DeviceAvailable() { return NotBuilt(); }

DeviceCodec::DeviceCodec(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
DeviceCodec::~DeviceCodec() = default;
StatusOr<std::unique_ptr<DeviceCodec>> DeviceCodec::Create(int, EntropyStage) { return NotBuilt(); }
StatusOr<std::string> DeviceCodec::EncodePatch(Workspace&, std::span<const codec::TensorView>, std::span<const codec::TensorView>,
                                               const codec::EncodeOptions&) {
  return NotBuilt();
}
Status DeviceCodec::Apply(Workspace&, std::string_view, const codec::Destination&, const codec::ApplyOptions&) {
  return NotBuilt();
}
Status DeviceCodec::Apply(Workspace&, std::span<const std::string_view>, const codec::Destination&, const codec::ApplyOptions&) {
  return NotBuilt();
}
struct DeviceCodec::Staged::State {};
DeviceCodec::Staged::Staged() = default;
DeviceCodec::Staged::Staged(Staged&&) noexcept = default;
DeviceCodec::Staged& DeviceCodec::Staged::operator=(Staged&&) noexcept = default;
DeviceCodec::Staged::~Staged() = default;
uint64_t DeviceCodec::Staged::changes() const { return 0; }
uint64_t DeviceCodec::Staged::kept_bytes() const { return 0; }
bool DeviceCodec::Staged::decodes_again() const { return false; }
StatusOr<DeviceCodec::Staged> DeviceCodec::Stage(Workspace&, std::span<const std::string_view>, const codec::Destination&,
                                                 const codec::ApplyOptions&) {
  return NotBuilt();
}
Status DeviceCodec::Commit(Workspace&, Staged&) { return NotBuilt(); }
Status DeviceCodec::Confirm(Workspace&, const Staged&) { return NotBuilt(); }
const std::vector<DeviceCodec::Phase>& DeviceCodec::last_phases() const { return impl_->phases; }
StatusOr<uint64_t> DeviceCodec::TensorChecksum(Workspace&, const void*, size_t) { return NotBuilt(); }
StatusOr<uint64_t> DeviceCodec::SetChecksum(Workspace&, std::span<const codec::TensorView>, std::span<const codec::TileGrid>) {
  return NotBuilt();
}
Status DeviceCodec::CastFp32ToBf16(const uint32_t*, uint16_t*, size_t) { return NotBuilt(); }
StatusOr<std::string> DeviceCodec::SnapshotAndEncode(Workspace&, std::span<const codec::TensorView>,
                                                     std::span<const codec::MutableTensorView>,
                                                     std::span<const codec::TensorView>, const codec::EncodeOptions&,
                                                     const std::function<void()>&) {
  return NotBuilt();
}

StatusOr<std::string> DeviceCodec::EncodeAndAdvance(Workspace&, std::span<const codec::TensorView>,
                                                    std::span<const codec::MutableTensorView>,
                                                    const codec::EncodeOptions&) {
  return NotBuilt();
}
StatusOr<std::string> DeviceCodec::EncodeAndAdvanceFromHost(Workspace&, std::span<const codec::TensorView>,
                                                            std::span<const codec::MutableTensorView>,
                                                            const codec::EncodeOptions&) {
  return NotBuilt();
}

struct Workspace::Arenas {
  int device = 0;
};
Workspace::Workspace(int device) : arenas_(std::make_unique<Arenas>()) { arenas_->device = device; }
Workspace::~Workspace() = default;
Workspace::Workspace(Workspace&&) noexcept = default;
Workspace& Workspace::operator=(Workspace&&) noexcept = default;
int Workspace::device() const { return arenas_ != nullptr ? arenas_->device : -1; }
size_t Workspace::device_bytes() const { return 0; }
size_t Workspace::pinned_bytes() const { return 0; }
void Workspace::Release() {}

Status CopyDeviceToHost(void*, const void*, size_t) { return NotBuilt(); }
Status CopyHostToDevice(void*, const void*, size_t) { return NotBuilt(); }
Status CopyDeviceToDevice(void*, const void*, size_t) { return NotBuilt(); }

StatusOr<DeviceBuffer> DeviceBuffer::Allocate(size_t, int) { return NotBuilt(); }
DeviceBuffer::DeviceBuffer(DeviceBuffer&& o) noexcept : data_(o.data_), size_(o.size_) {}
DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&&) noexcept { return *this; }
DeviceBuffer::~DeviceBuffer() = default;
Status DeviceBuffer::CopyFromHost(const void*, size_t, size_t) { return NotBuilt(); }
Status DeviceBuffer::CopyToHost(void*, size_t, size_t) const { return NotBuilt(); }
Status DeviceBuffer::CopyFromDevice(const void*, size_t) { return NotBuilt(); }

StatusOr<PinnedBuffer> PinnedBuffer::Allocate(size_t) { return NotBuilt(); }
PinnedBuffer::PinnedBuffer(PinnedBuffer&& o) noexcept : data_(o.data_), size_(o.size_) {}
PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&&) noexcept { return *this; }
PinnedBuffer::~PinnedBuffer() = default;

}  // namespace wsync::cuda
