// Device kernels and their launchers (wsync/cuda/kernels.h). Every kernel is
// a thin loop around the WSYNC_HD logic of wsync/cuda/logic.h.
#include "wsync/cuda/kernels.h"

#include <cuda_runtime.h>

#include <cub/device/device_scan.cuh>
#include <algorithm>
#include <string>

#include "wsync/codec/bf16.h"
#include "wsync/codec/checksum.h"

namespace wsync::cuda {
namespace {

constexpr int kThreads = 256;
constexpr unsigned kFullWarp = 0xFFFFFFFFu;

using codec::ClassSpec;
using codec::kBlock;
using codec::kMaxClasses;
using logic::Layout;

Status LastError(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return Status::Ok();
  return InternalError(std::string(what) + ": " + cudaGetErrorString(e));
}

unsigned GridFor(uint64_t threads) {
  const uint64_t g = (threads + kThreads - 1) / kThreads;
  return static_cast<unsigned>(g == 0 ? 1 : g);
}

cudaStream_t S(Stream s) { return static_cast<cudaStream_t>(s); }

template <typename F>
Status WithWidth(int width, F&& f) {
  switch (width) {
    case 1: return f(uint8_t{});
    case 2: return f(uint16_t{});
    case 4: return f(uint32_t{});
    case 8: return f(uint64_t{});
    default: return InvalidArgumentError("element width " + std::to_string(width));
  }
}

// One warp per block of 32 elements: lane j holds element j.
template <typename T>
__global__ void DiffCountsKernel(const T* base, const T* target, Layout l, uint32_t* counts) {
  const uint64_t t = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x;
  const uint64_t b = t / kBlock;
  if (b >= l.Blocks()) {
    if (b == l.Blocks() && t % kBlock == 0) counts[b] = 0;
    return;
  }
  const int lane = static_cast<int>(t % kBlock);
  const bool ne = t < l.n && base[t] != target[t];
  const uint32_t mask = __ballot_sync(kFullWarp, ne);
  if (lane == 0) counts[b] = static_cast<uint32_t>(__popc(mask));
}

template <typename T>
__global__ void DiffScatterKernel(const T* base, const T* target, Layout l, const uint32_t* offsets, uint32_t* pos,
                                  T* delta, T* old) {
  const uint64_t t = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x;
  const uint64_t b = t / kBlock;
  if (b >= l.Blocks()) return;
  const int lane = static_cast<int>(t % kBlock);
  const bool in = t < l.n;
  const T x = in ? base[t] : T{0};
  const T y = in ? target[t] : T{0};
  const uint32_t mask = __ballot_sync(kFullWarp, x != y);
  if (x != y) {
    const uint32_t at = offsets[b] + static_cast<uint32_t>(__popc(mask & ((1u << lane) - 1)));
    pos[at] = static_cast<uint32_t>(t % l.chunk_elems);
    delta[at] = static_cast<T>(y - x);
    old[at] = x;
  }
}

__global__ void ChunkOffsetsKernel(const uint32_t* offsets, Layout l, uint32_t* chunk_offsets) {
  const uint64_t c = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x;
  const uint64_t chunks = l.Chunks();
  if (c < chunks) chunk_offsets[c] = offsets[c * l.ChunkBlocks()];
  if (c == chunks) chunk_offsets[c] = offsets[l.Blocks()];
}

template <typename T>
__global__ void SampleHistogramKernel(const T* base, Layout l, int shift, uint32_t mask, uint32_t bins,
                                      uint32_t* hist) {
  const uint64_t t = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x;
  const uint64_t b = t / kBlock;
  if (b >= l.Blocks() || !l.Sampled(b)) return;
  // A sampled block is a whole warp (full, 32-aligned): lanes with the same
  // bin add once, through their lowest lane.
  const uint32_t e = static_cast<uint32_t>((static_cast<uint64_t>(base[t]) >> shift) & mask);
  const unsigned peers = __match_any_sync(kFullWarp, e);
  if (static_cast<int>(t % kBlock) == __ffs(peers) - 1) {
    atomicAdd(&hist[(t / l.chunk_elems) * bins + e], static_cast<uint32_t>(__popc(peers)));
  }
}

// One CTA per 1 MiB digest block. Its warps read the 1 KiB blocks whole and
// coalesced, each reducing one block's stripe contributions for all eight
// lanes (logic::Xxh3WarpTerms, then three shuffles); eight threads then run
// the short sequential chain of scrambles, the tail and the merge.
constexpr int kDigestThreads = 256;
constexpr int kDigestWarps = kDigestThreads / 32;

// The digest of 1 MiB block d of a region, by one CTA.
__device__ void DigestBlock(const uint8_t* data, size_t nbytes, size_t d, uint64_t* digest) {
  const int tid = threadIdx.x;
  const size_t begin = d * codec::kChecksumBlockBytes;
  const size_t len = min(codec::kChecksumBlockBytes, nbytes - begin);
  const uint8_t* in = data + begin;
  if (len <= 240) {
    if (tid == 0) *digest = logic::Xxh3Short(in, len);
    return;
  }
  __shared__ uint64_t sums[kDigestThreads][8];
  __shared__ uint64_t acc[8];
  const int warp = tid / 32, t = tid % 32;
  uint64_t keys[logic::kWarpWords];
  for (int j = 0; j < logic::kWarpWords; ++j) keys[j] = logic::Xxh3WarpKey(t, j);
  if (tid < 8) acc[tid] = logic::Xxh3InitAcc(tid);
  const size_t blocks = logic::Xxh3FullBlocks(len);
  for (size_t first = 0; first < blocks; first += kDigestThreads) {
    const size_t n = min(static_cast<size_t>(kDigestThreads), blocks - first);
#pragma unroll 4
    for (size_t b = warp; b < n; b += kDigestWarps) {
      uint64_t own, raw;
      logic::Xxh3WarpTerms(in + (first + b) * logic::kHashBlockBytes, t, keys, &own, &raw);
      uint64_t x = own + __shfl_xor_sync(kFullWarp, raw, 1);
      x += __shfl_xor_sync(kFullWarp, x, 8);
      x += __shfl_xor_sync(kFullWarp, x, 16);
      if (t < 8) sums[b][t] = x;
    }
    __syncthreads();
    if (tid < 8) {
      const uint64_t key = logic::Xxh3ScrambleKey(tid);
      uint64_t a = acc[tid];
      for (size_t j = 0; j < n; ++j) a = logic::Xxh3Scramble(a + sums[j][tid], key);
      acc[tid] = a;
    }
    __syncthreads();
  }
  if (tid < 8) acc[tid] = logic::Xxh3TailLane(acc[tid], in, len, tid);
  __syncthreads();
  if (tid == 0) *digest = logic::Xxh3Merge(acc, len);
}

__global__ void BlockDigestsKernel(const uint8_t* data, size_t nbytes, uint64_t* digests) {
  DigestBlock(data, nbytes, blockIdx.x, digests + blockIdx.x);
}

__global__ void BatchedDigestsKernel(const DigestJob* jobs, size_t njobs) {
  const uint64_t d = blockIdx.x;
  size_t lo = 0, hi = njobs;  // the last job with first_block <= d
  while (hi - lo > 1) {
    const size_t mid = (lo + hi) / 2;
    if (jobs[mid].first_block <= d) lo = mid; else hi = mid;
  }
  const DigestJob& job = jobs[lo];
  const uint64_t local = d - job.first_block;
  DigestBlock(static_cast<const uint8_t*>(job.data), job.nbytes, local, job.out + local);
}

template <typename T>
__global__ void ClassCountsKernel(const T* base, Layout l, const ClassSpec* specs, uint32_t* counts) {
  const uint64_t b = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x;
  const uint64_t blocks = l.Blocks();
  if (b == blocks) counts[kMaxClasses * blocks] = 0;
  if (b >= blocks) return;
  uint32_t c[kMaxClasses];
  logic::BlockClassCounts(specs[b / l.ChunkBlocks()], base + b * kBlock, l.BlockLen(b), c);
  for (int k = 0; k < kMaxClasses; ++k) counts[k * blocks + b] = c[k];
}

template <typename T>
__global__ void RanksKernel(const T* base, Layout l, const ClassSpec* specs, const uint32_t* prefix,
                            const uint32_t* chunk_offsets, const uint32_t* pos, const T* old, size_t m,
                            uint32_t* rank) {
  const uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x;
  if (i >= m) return;
  // The chunk holding change i: the last c with chunk_offsets[c] <= i.
  uint64_t lo = 0, hi = l.Chunks();
  while (hi - lo > 1) {
    const uint64_t mid = (lo + hi) / 2;
    if (chunk_offsets[mid] <= i) lo = mid; else hi = mid;
  }
  const ClassSpec& spec = specs[lo];
  const uint64_t blocks = l.Blocks();
  const uint64_t first = lo * l.ChunkBlocks();
  const uint64_t b = first + pos[i] / kBlock;
  const int c = spec.ClassOf(old[i]);
  const uint32_t before = prefix[c * blocks + b] - prefix[c * blocks + first];
  rank[i] = before + logic::ClassCountBelow(spec, base + b * kBlock, l.BlockLen(b), c, static_cast<int>(pos[i] % kBlock));
}

template <typename T>
__global__ void RankPositionsKernel(const T* base, Layout l, const ClassSpec* specs, const uint32_t* prefix,
                                    const uint32_t* chunk, const uint8_t* cls, const uint32_t* rank, size_t m,
                                    uint32_t* pos, T* old, uint32_t* error) {
  const uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x;
  if (i >= m) return;
  const uint64_t ch = chunk[i];
  const int c = cls[i];
  if (ch >= l.Chunks() || c >= specs[ch].k) {
    atomicCAS(error, 0u, static_cast<uint32_t>(i + 1));
    return;
  }
  const ClassSpec& spec = specs[ch];
  const uint64_t blocks = l.Blocks();
  const uint64_t first = ch * l.ChunkBlocks();
  const uint64_t end = min(first + l.ChunkBlocks(), blocks);
  const uint32_t* row = prefix + c * blocks;
  const uint32_t r = rank[i];
  // row[end] is the next row's start when end == blocks: the exclusive scan
  // makes it this row's total either way.
  if (row[end] - row[first] <= r) {
    atomicCAS(error, 0u, static_cast<uint32_t>(i + 1));
    return;
  }
  uint64_t lo = first, hi = end;  // the last block b with row[b] - row[first] <= r
  while (hi - lo > 1) {
    const uint64_t mid = (lo + hi) / 2;
    if (row[mid] - row[first] <= r) lo = mid; else hi = mid;
  }
  const int j = logic::ClassSelect(spec, base + lo * kBlock, l.BlockLen(lo), c, r - (row[lo] - row[first]));
  const uint64_t at = lo * kBlock + j;
  pos[i] = static_cast<uint32_t>(at - ch * l.chunk_elems);
  old[i] = base[at];
}

// A CTA row per job (blockIdx.x), its columns striding over the slot.
template <typename T, bool kGather>
__global__ void TilesKernel(const TileJob* jobs, uint64_t slot, T* image) {
  const TileJob job = jobs[blockIdx.x];
  for (uint64_t k = static_cast<uint64_t>(blockIdx.y) * blockDim.x + threadIdx.x; k < slot;
       k += static_cast<uint64_t>(gridDim.y) * blockDim.x) {
    if constexpr (kGather) {
      GatherTileElement(job, blockIdx.x, slot, k, image);
    } else {
      ScatterTileElement(job, blockIdx.x, slot, k, static_cast<const T*>(image));
    }
  }
}

template <typename T>
__global__ void GatherKernel(const T* x, const uint64_t* index, size_t m, T* out) {
  const uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x;
  if (i < m) out[i] = x[index[i]];
}

template <typename T>
__global__ void ScatterAddKernel(T* x, const uint64_t* index, const T* delta, size_t m, bool undo) {
  const uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x;
  if (i >= m) return;
  T& v = x[index[i]];
  v = undo ? static_cast<T>(v - delta[i]) : static_cast<T>(v + delta[i]);
}

__global__ void CommitCheckKernel(const CommitJob* jobs, size_t njobs, uint64_t total,
                                  unsigned long long* first_foreign) {
  const uint64_t k = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x;
  if (k >= total) return;
  const CommitJob& job = jobs[CommitJobOf(jobs, njobs, k)];
  if (!HoldsStaged(job, k - job.first)) atomicMin(first_foreign, static_cast<unsigned long long>(k));
}

__global__ void CommitWriteKernel(const CommitJob* jobs, size_t njobs, uint64_t total) {
  const uint64_t k = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x;
  if (k >= total) return;
  const CommitJob& job = jobs[CommitJobOf(jobs, njobs, k)];
  WriteStaged(job, k - job.first);
}

__global__ void CastKernel(const uint32_t* in, uint16_t* out, size_t n) {
  const uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x;
  if (i < n) out[i] = codec::Fp32BitsToBf16Bits(in[i]);
}

// A sparse chunk per thread: a warp decodes 32 chunks side by side, and
// small blocks spread the chunks over every SM.
constexpr int kSparseThreads = 32;

__global__ void SparseRanksKernel(const SparseJob* jobs, size_t njobs, const uint8_t* patch, uint32_t* rank,
                                  uint8_t* cls, uint32_t* chunk, uint64_t* counts, uint32_t* error) {
  const size_t j = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= njobs) return;
  error[j] = SparseRanksJob(jobs[j], patch, rank, cls, chunk, counts + j * kMaxClasses);
}

__global__ void SparseValuesKernel(const SparseJob* jobs, size_t njobs, const uint8_t* patch, const uint32_t* rank,
                                   const uint64_t* counts, const uint32_t* pos, const uint8_t* old, uint32_t* mpos,
                                   uint8_t* mold, uint64_t* index, uint8_t* delta, uint32_t* error) {
  const size_t j = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= njobs || error[j] != codec::sparse::kSparseOk) return;
  error[j] = SparseValuesJob(jobs[j], patch, rank, counts + j * kMaxClasses, pos, old, mpos, mold, index, delta);
}

__global__ void SparseEncodeKernel(const SparseEncodeJob* jobs, size_t njobs, const uint32_t* lg,
                                   codec::sparse::SparseEncodeResult* results) {
  const size_t j = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j < njobs) results[j] = RunSparseEncodeJob(jobs[j], lg);
}

// A block per segment.
__global__ void PackSegmentsKernel(const PackSegment* segments, uint8_t* out) {
  const PackSegment seg = segments[blockIdx.x];
  for (uint64_t i = threadIdx.x; i < seg.bytes; i += blockDim.x) out[seg.at + i] = seg.src[i];
}

}  // namespace

Status LaunchDiffCounts(const void* base, const void* target, int width, Layout l, uint32_t* counts, Stream s) {
  return WithWidth(width, [&](auto zero) {
    using T = decltype(zero);
    DiffCountsKernel<T><<<GridFor((l.Blocks() + 1) * kBlock), kThreads, 0, S(s)>>>(
        static_cast<const T*>(base), static_cast<const T*>(target), l, counts);
    return LastError("diff counts");
  });
}

Status ExclusiveScan(void* temp, size_t* temp_bytes, const uint32_t* in, uint32_t* out, size_t n, Stream s) {
  const cudaError_t e = cub::DeviceScan::ExclusiveSum(temp, *temp_bytes, in, out, n, S(s));
  if (e != cudaSuccess) return InternalError(std::string("exclusive scan: ") + cudaGetErrorString(e));
  return Status::Ok();
}

Status LaunchDiffScatter(const void* base, const void* target, int width, Layout l, const uint32_t* offsets,
                         uint32_t* pos, void* delta, void* old, Stream s) {
  return WithWidth(width, [&](auto zero) {
    using T = decltype(zero);
    DiffScatterKernel<T><<<GridFor(l.Blocks() * kBlock), kThreads, 0, S(s)>>>(
        static_cast<const T*>(base), static_cast<const T*>(target), l, offsets, pos, static_cast<T*>(delta),
        static_cast<T*>(old));
    return LastError("diff scatter");
  });
}

Status LaunchChunkOffsets(const uint32_t* offsets, Layout l, uint32_t* chunk_offsets, Stream s) {
  ChunkOffsetsKernel<<<GridFor(l.Chunks() + 1), kThreads, 0, S(s)>>>(offsets, l, chunk_offsets);
  return LastError("chunk offsets");
}

Status LaunchSampleHistogram(const void* base, int width, Layout l, int shift, uint32_t mask, uint32_t bins,
                             uint32_t* hist, Stream s) {
  const cudaError_t e = cudaMemsetAsync(hist, 0, l.Chunks() * bins * sizeof(uint32_t), S(s));
  if (e != cudaSuccess) return InternalError(std::string("histogram: ") + cudaGetErrorString(e));
  return WithWidth(width, [&](auto zero) {
    using T = decltype(zero);
    SampleHistogramKernel<T><<<GridFor(l.Blocks() * kBlock), kThreads, 0, S(s)>>>(static_cast<const T*>(base), l,
                                                                                  shift, mask, bins, hist);
    return LastError("sample histogram");
  });
}

Status LaunchBlockDigests(const void* data, size_t nbytes, uint64_t* digests, Stream s) {
  const size_t count = codec::ChecksumBlockCount(nbytes);
  if (count == 0) return Status::Ok();
  BlockDigestsKernel<<<static_cast<unsigned>(count), kDigestThreads, 0, S(s)>>>(static_cast<const uint8_t*>(data),
                                                                                nbytes, digests);
  return LastError("block digests");
}

Status LaunchBlockDigests(const DigestJob* jobs, size_t njobs, uint64_t total_blocks, Stream s) {
  if (total_blocks == 0) return Status::Ok();
  if (total_blocks > 0x7FFFFFFFull) return InvalidArgumentError("too many digest blocks for one launch");
  BatchedDigestsKernel<<<static_cast<unsigned>(total_blocks), kDigestThreads, 0, S(s)>>>(jobs, njobs);
  return LastError("block digests");
}

Status LaunchClassCounts(const void* base, int width, Layout l, const ClassSpec* specs, uint32_t* counts, Stream s) {
  return WithWidth(width, [&](auto zero) {
    using T = decltype(zero);
    ClassCountsKernel<T><<<GridFor(l.Blocks() + 1), kThreads, 0, S(s)>>>(static_cast<const T*>(base), l, specs,
                                                                         counts);
    return LastError("class counts");
  });
}

Status LaunchRanks(const void* base, int width, Layout l, const ClassSpec* specs, const uint32_t* prefix,
                   const uint32_t* chunk_offsets, const uint32_t* pos, const void* old, size_t m, uint32_t* rank,
                   Stream s) {
  if (m == 0) return Status::Ok();
  return WithWidth(width, [&](auto zero) {
    using T = decltype(zero);
    RanksKernel<T><<<GridFor(m), kThreads, 0, S(s)>>>(static_cast<const T*>(base), l, specs, prefix, chunk_offsets,
                                                      pos, static_cast<const T*>(old), m, rank);
    return LastError("ranks");
  });
}

Status LaunchRankPositions(const void* base, int width, Layout l, const ClassSpec* specs, const uint32_t* prefix,
                           const uint32_t* chunk, const uint8_t* cls, const uint32_t* rank, size_t m, uint32_t* pos,
                           void* old, uint32_t* error, Stream s) {
  if (m == 0) return Status::Ok();
  return WithWidth(width, [&](auto zero) {
    using T = decltype(zero);
    RankPositionsKernel<T><<<GridFor(m), kThreads, 0, S(s)>>>(static_cast<const T*>(base), l, specs, prefix, chunk,
                                                              cls, rank, m, pos, static_cast<T*>(old), error);
    return LastError("rank positions");
  });
}

template <bool kGather>
Status LaunchTiles(const TileJob* jobs, size_t njobs, int width, uint64_t slot, void* image, Stream s) {
  if (njobs == 0) return Status::Ok();
  // Enough CTAs along y that a slot takes a few passes.
  const dim3 grid(static_cast<unsigned>(njobs),
                  static_cast<unsigned>(std::min<uint64_t>(16, (slot + kThreads - 1) / kThreads)));
  return WithWidth(width, [&](auto zero) {
    using T = decltype(zero);
    TilesKernel<T, kGather><<<grid, kThreads, 0, S(s)>>>(jobs, slot, static_cast<T*>(image));
    return LastError(kGather ? "gather tiles" : "scatter tiles");
  });
}

Status LaunchGatherTiles(const TileJob* jobs, size_t njobs, int width, uint64_t slot, void* image, Stream s) {
  return LaunchTiles<true>(jobs, njobs, width, slot, image, s);
}

Status LaunchScatterTiles(const TileJob* jobs, size_t njobs, int width, uint64_t slot, const void* image, Stream s) {
  return LaunchTiles<false>(jobs, njobs, width, slot, const_cast<void*>(image), s);
}

Status LaunchGather(const void* x, int width, const uint64_t* index, size_t m, void* out, Stream s) {
  if (m == 0) return Status::Ok();
  return WithWidth(width, [&](auto zero) {
    using T = decltype(zero);
    GatherKernel<T><<<GridFor(m), kThreads, 0, S(s)>>>(static_cast<const T*>(x), index, m, static_cast<T*>(out));
    return LastError("gather");
  });
}

Status LaunchScatterAdd(void* x, int width, const uint64_t* index, const void* delta, size_t m, bool undo, Stream s) {
  if (m == 0) return Status::Ok();
  return WithWidth(width, [&](auto zero) {
    using T = decltype(zero);
    ScatterAddKernel<T><<<GridFor(m), kThreads, 0, S(s)>>>(static_cast<T*>(x), index, static_cast<const T*>(delta),
                                                           m, undo);
    return LastError("scatter add");
  });
}

Status LaunchCommitCheck(const CommitJob* jobs, size_t njobs, uint64_t total, unsigned long long* first_foreign,
                         Stream s) {
  if (total == 0) return Status::Ok();
  CommitCheckKernel<<<GridFor(total), kThreads, 0, S(s)>>>(jobs, njobs, total, first_foreign);
  return LastError("commit check");
}

Status LaunchCommitWrite(const CommitJob* jobs, size_t njobs, uint64_t total, Stream s) {
  if (total == 0) return Status::Ok();
  CommitWriteKernel<<<GridFor(total), kThreads, 0, S(s)>>>(jobs, njobs, total);
  return LastError("commit write");
}

Status LaunchCastFp32ToBf16(const uint32_t* in, uint16_t* out, size_t n, Stream s) {
  if (n == 0) return Status::Ok();
  CastKernel<<<GridFor(n), kThreads, 0, S(s)>>>(in, out, n);
  return LastError("cast fp32 to bf16");
}

Status LaunchSparseRanks(const SparseJob* jobs, size_t njobs, const uint8_t* patch, uint32_t* rank, uint8_t* cls,
                         uint32_t* chunk, uint64_t* counts, uint32_t* error, Stream s) {
  if (njobs == 0) return Status::Ok();
  const unsigned grid = static_cast<unsigned>((njobs + kSparseThreads - 1) / kSparseThreads);
  SparseRanksKernel<<<grid, kSparseThreads, 0, S(s)>>>(jobs, njobs, patch, rank, cls, chunk, counts, error);
  return LastError("sparse ranks");
}

Status LaunchSparseValues(const SparseJob* jobs, size_t njobs, const uint8_t* patch, const uint32_t* rank,
                          const uint64_t* counts, const uint32_t* pos, const uint8_t* old, uint32_t* mpos,
                          uint8_t* mold, uint64_t* index, uint8_t* delta, uint32_t* error, Stream s) {
  if (njobs == 0) return Status::Ok();
  const unsigned grid = static_cast<unsigned>((njobs + kSparseThreads - 1) / kSparseThreads);
  SparseValuesKernel<<<grid, kSparseThreads, 0, S(s)>>>(jobs, njobs, patch, rank, counts, pos, old, mpos, mold, index,
                                                        delta, error);
  return LastError("sparse values");
}

Status LaunchSparseEncode(const SparseEncodeJob* jobs, size_t njobs, const uint32_t* lg,
                          codec::sparse::SparseEncodeResult* results, Stream s) {
  if (njobs == 0) return Status::Ok();
  const unsigned grid = static_cast<unsigned>((njobs + kSparseThreads - 1) / kSparseThreads);
  SparseEncodeKernel<<<grid, kSparseThreads, 0, S(s)>>>(jobs, njobs, lg, results);
  return LastError("sparse encode");
}

Status LaunchPackSegments(const PackSegment* segments, size_t nsegments, uint8_t* out, Stream s) {
  if (nsegments == 0) return Status::Ok();
  if (nsegments > 0x7FFFFFFFu) return InvalidArgumentError("too many segments to pack");
  PackSegmentsKernel<<<static_cast<unsigned>(nsegments), 128, 0, S(s)>>>(segments, out);
  return LastError("pack segments");
}

}  // namespace wsync::cuda
