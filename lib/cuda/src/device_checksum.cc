// DeviceCodec's checksums (codec::TensorChecksum and codec::SetChecksum of
// device memory, one digest launch per batch of regions) and its cast.
#include "wsync/cuda/device_codec.h"

#include <cuda_runtime_api.h>

#include "device_codec_impl.h"
#include "wsync/codec/checksum.h"
#include "wsync/codec/staged.h"
#include "wsync/cuda/carver.h"
#include "wsync/cuda/kernels.h"

namespace wsync::cuda {
namespace internal {

Status EnqueueDigests(PinnedArena& pinned, std::span<const DigestJob> regions, DigestJob* jobs_dev, cudaStream_t s) {
  WSYNC_ASSIGN_OR_RETURN(DigestJob* jobs, pinned.Alloc<DigestJob>(regions.size()));
  size_t n = 0;
  uint64_t blocks = 0;
  for (const DigestJob& r : regions) {
    if (r.nbytes == 0) continue;
    jobs[n] = r;
    jobs[n++].first_block = blocks;
    blocks += codec::ChecksumBlockCount(r.nbytes);
  }
  if (n == 0) return Status::Ok();
  WSYNC_RETURN_IF_ERROR(Check(cudaMemcpyAsync(jobs_dev, jobs, n * sizeof(DigestJob), cudaMemcpyHostToDevice, s),
                              "copy to device"));
  return LaunchBlockDigests(jobs_dev, n, blocks, s);
}

}  // namespace internal

namespace {

using namespace internal;  // device_codec_impl.h

using codec::MutableTensorView;
using codec::TensorView;

}  // namespace

StatusOr<std::vector<uint64_t>> DeviceCodec::Impl::Checksums(
    std::span<const std::pair<const void*, size_t>> regions) {
  std::vector<size_t> first(regions.size() + 1, 0);
  for (size_t i = 0; i < regions.size(); ++i) first[i + 1] = first[i] + codec::ChecksumBlockCount(regions[i].second);
  std::vector<uint64_t> out(regions.size(), 0);
  if (first.back() == 0) {
    for (size_t i = 0; i < regions.size(); ++i) out[i] = codec::CombineBlockDigests({});
    return out;
  }
  Carver carve;
  const size_t o_digests = carve.Add<uint64_t>(first.back());
  const size_t o_jobs = carve.Add<DigestJob>(regions.size());
  WSYNC_ASSIGN_OR_RETURN(void* mem, ws->digest_mem.Get(carve.bytes()));
  auto* dev = At<uint64_t>(mem, o_digests);
  std::vector<DigestJob> jobs;
  for (size_t i = 0; i < regions.size(); ++i) jobs.push_back({regions[i].first, regions[i].second, dev + first[i], 0});
  WSYNC_RETURN_IF_ERROR(EnqueueDigests(ws->pinned, jobs, At<DigestJob>(mem, o_jobs), compute));
  WSYNC_ASSIGN_OR_RETURN(uint64_t* host, ws->pinned.Alloc<uint64_t>(first.back()));
  WSYNC_RETURN_IF_ERROR(
      Check(cudaMemcpyAsync(host, dev, first.back() * sizeof(uint64_t), cudaMemcpyDeviceToHost, compute), "copy"));
  WSYNC_RETURN_IF_ERROR(Check(cudaStreamSynchronize(compute), "digests"));
  for (size_t i = 0; i < regions.size(); ++i) {
    out[i] = codec::CombineBlockDigests(std::span<const uint64_t>(host + first[i], first[i + 1] - first[i]));
  }
  return out;
}

StatusOr<uint64_t> DeviceCodec::Impl::Checksum(const void* data, size_t nbytes) {
  const std::pair<const void*, size_t> one{data, nbytes};
  WSYNC_ASSIGN_OR_RETURN(auto sums, Checksums(std::span(&one, 1)));
  return sums[0];
}

StatusOr<uint64_t> DeviceCodec::Impl::SetChecksum(std::span<const TensorView> tensors,
                                                  std::span<const codec::TileGrid> grids) {
  const EndOfCall end{compute, ws->pinned};
  codec::EncodeOptions o;
  o.grids.assign(grids.begin(), grids.end());
  WSYNC_ASSIGN_OR_RETURN(auto writer, codec::staged::PatchWriter::Create(tensors, o));
  const auto& cells = writer.cells();
  std::vector<std::vector<uint64_t>> blocks(tensors.size());
  // Cells batch by batch: whole rows hashed in place, the others gathered
  // first (at most kStagingBytes of them at a time, or one).
  for (size_t k0 = 0; k0 < cells.size();) {
    ws->pinned.Reset();
    size_t k1 = k0, gathered = 0, nblocks = 0;
    while (k1 < cells.size()) {
      const codec::staged::Cell& c = cells[k1];
      const size_t w = codec::DTypeWidth(tensors[c.tensor].dtype);
      if (k1 > k0 && gathered + GatheredBytes(c, w) > kStagingBytes) break;
      gathered += GatheredBytes(c, w);
      nblocks += codec::ChecksumBlockCount(c.elements() * w);
      ++k1;
    }
    Carver carve;
    const size_t o_image = carve.Add<uint8_t>(gathered), o_jobs = carve.Add<DigestJob>(k1 - k0);
    const size_t o_sums = carve.Add<uint64_t>(nblocks);
    WSYNC_ASSIGN_OR_RETURN(void* mem, ws->images.Get(carve.bytes()));
    std::vector<DigestJob> jobs;
    uint8_t* at = At<uint8_t>(mem, o_image);
    uint64_t block = 0;
    for (size_t k = k0; k < k1; ++k) {
      const codec::staged::Cell& c = cells[k];
      const size_t w = codec::DTypeWidth(tensors[c.tensor].dtype), bytes = c.elements() * w;
      WSYNC_ASSIGN_OR_RETURN(const uint8_t* src, CellElements(c, tensors[c.tensor].data, w, at, compute));
      at += GatheredBytes(c, w);
      jobs.push_back({src, bytes, At<uint64_t>(mem, o_sums) + block, 0});
      block += codec::ChecksumBlockCount(bytes);
    }
    WSYNC_RETURN_IF_ERROR(EnqueueDigests(ws->pinned, jobs, At<DigestJob>(mem, o_jobs), compute));
    const uint64_t* sums = nullptr;
    WSYNC_RETURN_IF_ERROR(CopyToPinned(ws->pinned, &sums, At<uint64_t>(mem, o_sums), nblocks, compute));
    WSYNC_RETURN_IF_ERROR(Check(cudaStreamSynchronize(compute), "checksums"));
    block = 0;
    for (size_t k = k0; k < k1; ++k) {
      const codec::staged::Cell& c = cells[k];
      const size_t n = codec::ChecksumBlockCount(c.elements() * codec::DTypeWidth(tensors[c.tensor].dtype));
      blocks[c.tensor].insert(blocks[c.tensor].end(), sums + block, sums + block + n);
      block += n;
    }
    k0 = k1;
  }
  std::vector<uint64_t> sums;
  for (const auto& b : blocks) sums.push_back(codec::CombineBlockDigests(b));
  return codec::SetChecksumOf(sums);
}

StatusOr<uint64_t> DeviceCodec::SetChecksum(Workspace& ws, std::span<const TensorView> tensors,
                                            std::span<const codec::TileGrid> grids) {
  WSYNC_RETURN_IF_ERROR(impl_->Begin(ws));
  return impl_->SetChecksum(tensors, grids);
}

StatusOr<uint64_t> DeviceCodec::TensorChecksum(Workspace& ws, const void* data, size_t nbytes) {
  WSYNC_RETURN_IF_ERROR(impl_->Begin(ws));
  const EndOfCall end{impl_->compute, impl_->ws->pinned};
  return impl_->Checksum(data, nbytes);
}

Status DeviceCodec::CastFp32ToBf16(const uint32_t* src, uint16_t* dst, size_t n) {
  WSYNC_RETURN_IF_ERROR(impl_->Activate());
  WSYNC_RETURN_IF_ERROR(LaunchCastFp32ToBf16(src, dst, n, impl_->compute));
  return Check(cudaStreamSynchronize(impl_->compute), "cast");
}

}  // namespace wsync::cuda
