// DeviceCodec over the kernels (kernels.h) and the staged host codec
// (codec/staged.h). Per batch of tensors: launches, one copy back of the
// compact streams into page-locked memory, host entropy coding. See
// device_codec.h for the contract and docs/gpu.md for the data flow.
//
// This file: creating the codec, its phase timing, the rank scratch and the
// helpers that device_codec_impl.h declares for the encode, apply and
// checksum files.
#include "wsync/cuda/device_codec.h"

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstring>

#include "device_codec_impl.h"
#include "wsync/codec/staged.h"
#include "wsync/cuda/carver.h"
#include "wsync/cuda/kernels.h"

namespace wsync::cuda {
namespace internal {

Status Check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::Ok();
  return InternalError(std::string("CUDA ") + what + ": " + cudaGetErrorString(e));
}

Status CopyUp(void* dst, const void* src, size_t bytes, cudaStream_t s) {
  if (bytes == 0) return Status::Ok();
  return Check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s), "copy to device");
}

logic::Layout LayoutOf(uint64_t n, size_t width, uint32_t chunk_bytes) {
  return logic::Layout{.n = n, .chunk_elems = chunk_bytes / width};
}

void RankEntries(const codec::staged::DecodedChunk& dc, uint32_t chunk, uint32_t* chunk_out, uint8_t* cls_out,
                 uint32_t* rank_out) {
  size_t at = 0;
  for (int k = 0; k < dc.spec.k; ++k) {
    for (uint64_t j = 0; j < dc.class_counts[k]; ++j, ++at) {
      chunk_out[at] = chunk;
      cls_out[at] = static_cast<uint8_t>(k);
      rank_out[at] = dc.ranks[at];
    }
  }
}

size_t GatheredBytes(const codec::staged::Cell& c, size_t width) {
  return c.contiguous() ? 0 : (c.elements() * width + 255) / 256 * 256;
}

StatusOr<const uint8_t*> CellElements(const codec::staged::Cell& c, const void* data, size_t width, uint8_t* scratch,
                                      cudaStream_t s) {
  const auto* at = static_cast<const uint8_t*>(data) + (c.row0 * c.tensor_cols + c.col0) * width;
  if (c.contiguous()) return at;
  WSYNC_RETURN_IF_ERROR(Check(cudaMemcpy2DAsync(scratch, c.cols * width, at, c.tensor_cols * width, c.cols * width,
                                                c.rows, cudaMemcpyDeviceToDevice, s),
                              "gathering a cell"));
  return scratch;
}

}  // namespace internal

namespace {

using namespace internal;  // device_codec_impl.h

using codec::ClassSpec;
using codec::kMaxClasses;

}  // namespace

Status DeviceAvailable() {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) return UnavailableError(std::string("no usable CUDA device: ") + cudaGetErrorString(e));
  if (count == 0) return UnavailableError("no CUDA device");
  return Status::Ok();
}

DeviceCodec::Impl::~Impl() {
  if (compute != nullptr) cudaStreamDestroy(compute);
  if (copy != nullptr) cudaStreamDestroy(copy);
}

Status DeviceCodec::Impl::Activate() const { return Check(cudaSetDevice(device), "select device"); }

Status DeviceCodec::Impl::Begin(Workspace& workspace) {
  if (workspace.device() != device) {
    return InvalidArgumentError("a workspace of device " + std::to_string(workspace.device()) +
                                " passed to a codec of device " + std::to_string(device));
  }
  ws = &workspace.arenas();
  StartPhases();
  WSYNC_RETURN_IF_ERROR(Activate());
  // A failed runtime call elsewhere in this thread (another library's, a
  // pointer query on host memory) leaves its error for the next check of the
  // last error: CUB's and each launch's here would report it as their own.
  (void)cudaGetLastError();
  return Status::Ok();
}

void DeviceCodec::Impl::StartPhases() {
  phases.clear();
  mark = std::chrono::steady_clock::now();
}

void DeviceCodec::Impl::EndPhase(const char* name) {
  const auto now = std::chrono::steady_clock::now();
  const double s = std::chrono::duration<double>(now - mark).count();
  mark = now;
  for (Phase& p : phases) {
    if (std::strcmp(p.name, name) == 0) {
      p.seconds += s;
      return;
    }
  }
  phases.push_back({name, s});
}

StatusOr<DeviceCodec::Impl::RankScratch> DeviceCodec::Impl::RankScratchOf(logic::Layout l) {
  RankScratch r;
  const size_t scan_n = kMaxClasses * l.Blocks() + 1;
  WSYNC_ASSIGN_OR_RETURN(r.scan_bytes, ScanBytes(scan_n));
  Carver carve;
  r.o_specs = carve.Add<ClassSpec>(l.Chunks());
  r.o_counts = carve.Add<uint32_t>(scan_n);
  r.o_prefix = carve.Add<uint32_t>(scan_n);
  r.o_temp = carve.Add<uint8_t>(r.scan_bytes);
  r.bytes = carve.bytes();
  return r;
}

Status DeviceCodec::Impl::RankPrefix(const void* base, size_t width, logic::Layout l,
                                     const std::vector<ClassSpec>& specs, void* mem, const RankScratch& r) {
  auto* specs_dev = At<ClassSpec>(mem, r.o_specs);
  auto* counts = At<uint32_t>(mem, r.o_counts);
  WSYNC_RETURN_IF_ERROR(CopyUp(specs_dev, specs.data(), specs.size() * sizeof(ClassSpec), compute));
  WSYNC_RETURN_IF_ERROR(LaunchClassCounts(base, static_cast<int>(width), l, specs_dev, counts, compute));
  size_t tb = r.scan_bytes;
  return ExclusiveScan(At<void>(mem, r.o_temp), &tb, counts, At<uint32_t>(mem, r.o_prefix),
                       kMaxClasses * l.Blocks() + 1, compute);
}

StatusOr<size_t> DeviceCodec::Impl::ScanBytes(size_t n) {
  size_t bytes = 0;
  WSYNC_RETURN_IF_ERROR(ExclusiveScan(nullptr, &bytes, nullptr, nullptr, n, nullptr)
                            .WithContext("the scratch of a scan of " + std::to_string(n) + " counts"));
  return bytes;
}

DeviceCodec::DeviceCodec(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
DeviceCodec::~DeviceCodec() = default;

StatusOr<std::unique_ptr<DeviceCodec>> DeviceCodec::Create(int device, EntropyStage entropy) {
  WSYNC_RETURN_IF_ERROR(DeviceAvailable());
  auto impl = std::make_unique<Impl>();
  impl->device = device;
  impl->entropy = entropy;
  WSYNC_RETURN_IF_ERROR(impl->Activate());
  WSYNC_RETURN_IF_ERROR(Check(cudaStreamCreateWithFlags(&impl->compute, cudaStreamNonBlocking), "stream"));
  WSYNC_RETURN_IF_ERROR(Check(cudaStreamCreateWithFlags(&impl->copy, cudaStreamNonBlocking), "stream"));
  return std::unique_ptr<DeviceCodec>(new DeviceCodec(std::move(impl)));
}

const std::vector<DeviceCodec::Phase>& DeviceCodec::last_phases() const { return impl_->phases; }

}  // namespace wsync::cuda
