// DeviceCodec over the kernels (kernels.h) and the staged host codec
// (codec/staged.h). Per batch of tensors: launches, one copy back of the
// compact streams into page-locked memory, host entropy coding. See
// device_codec.h for the contract and docs/gpu.md for the data flow.
#include "wsync/cuda/device_codec.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <mutex>
#include <unordered_map>

#include "wsync/codec/checksum.h"
#include "wsync/codec/staged.h"
#include "wsync/cuda/carver.h"
#include "wsync/cuda/encode_plan.h"
#include "wsync/cuda/kernels.h"
#include "wsync/cuda/placed.h"
#include "wsync/cuda/sparse_plan.h"
#include "wsync/util/first_error.h"
#include "wsync/util/thread_pool.h"
#include "wsync/util/text.h"

namespace wsync::cuda {
namespace {

using codec::ClassSpec;
using codec::kMaxClasses;
using codec::MutableTensorView;
using codec::TensorView;
using codec::staged::Chunk;
using codec::staged::ChunkChange;
using codec::staged::DecodedChunk;

Status Check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::Ok();
  return InternalError(std::string("CUDA ") + what + ": " + cudaGetErrorString(e));
}

// A growable device allocation. Get() synchronizes the device before it
// frees the old block, so no enqueued work still uses it.
class Scratch {
 public:
  ~Scratch() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  StatusOr<void*> Get(size_t bytes) {
    if (bytes <= size_) return ptr_;
    if (ptr_ != nullptr) {
      WSYNC_RETURN_IF_ERROR(Check(cudaDeviceSynchronize(), "synchronize"));
      cudaFree(ptr_);
      ptr_ = nullptr;
      size_ = 0;
    }
    const size_t want = std::max(bytes, size_ * 3 / 2);
    WSYNC_RETURN_IF_ERROR(Check(cudaMalloc(&ptr_, want), "allocating scratch memory"));
    size_ = want;
    return ptr_;
  }

 private:
  void* ptr_ = nullptr;
  size_t size_ = 0;
};

Status CopyUp(void* dst, const void* src, size_t bytes, cudaStream_t s) {
  if (bytes == 0) return Status::Ok();
  return Check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s), "copy to device");
}

logic::Layout LayoutOf(uint64_t n, size_t width, uint32_t chunk_bytes) {
  return logic::Layout{.n = n, .chunk_elems = chunk_bytes / width};
}


// Page-locked host memory the device copies into, so that copies run at DMA
// speed and truly asynchronously: blocks kept between calls, handed out
// first-fit, all free again after Reset(). In steady state nothing is
// allocated.
class PinnedArena {
 public:
  static constexpr size_t kKeepBytes = size_t{256} << 20;  // kept between calls at least (Trim)

  PinnedArena() = default;
  PinnedArena(const PinnedArena&) = delete;
  PinnedArena& operator=(const PinnedArena&) = delete;
  ~PinnedArena() {
    for (const Block& b : blocks_) cudaFreeHost(b.ptr);
  }
  void Reset() {
    for (Block& b : blocks_) b.used = 0;
    used_ = 0;
  }
  // Between calls: frees the largest blocks until at most the larger of
  // `keep` and twice what the call used at its peak stays (room for the
  // blocks' leftovers), so that calls alike reuse their memory and one large
  // call does not hold it for good.
  void Trim(size_t keep) {
    keep = std::max(keep, 2 * peak_);
    peak_ = 0;
    std::sort(blocks_.begin(), blocks_.end(), [](const Block& a, const Block& b) { return a.size < b.size; });
    size_t total = 0;
    for (const Block& b : blocks_) total += b.size;
    while (total > keep && !blocks_.empty()) {
      total -= blocks_.back().size;
      cudaFreeHost(blocks_.back().ptr);
      blocks_.pop_back();
    }
    Reset();
  }
  template <typename T>
  StatusOr<T*> Alloc(size_t count) {
    const size_t n = std::max<size_t>(256, (count * sizeof(T) + 255) / 256 * 256);
    used_ += n;
    peak_ = std::max(peak_, used_);
    for (Block& b : blocks_) {
      if (b.size - b.used >= n) {
        void* p = b.ptr + b.used;
        b.used += n;
        return static_cast<T*>(p);
      }
    }
    const size_t size = std::max(n, kMinBlock);
    void* p = nullptr;
    WSYNC_RETURN_IF_ERROR(Check(cudaMallocHost(&p, size), "allocating page-locked host memory"));
    blocks_.push_back({static_cast<uint8_t*>(p), size, n});
    return static_cast<T*>(p);
  }

 private:
  static constexpr size_t kMinBlock = size_t{16} << 20;
  struct Block {
    uint8_t* ptr;
    size_t size;
    size_t used;
  };
  std::vector<Block> blocks_;
  size_t used_ = 0;  // handed out since the last Reset
  size_t peak_ = 0;  // the most handed out at once since the last Trim
};

// Ends a call: waits for what the call left on its stream, then trims the
// page-locked memory (also on an error return).
struct EndOfCall {
  cudaStream_t stream;
  PinnedArena& pinned;
  ~EndOfCall() {
    cudaStreamSynchronize(stream);
    pinned.Trim(PinnedArena::kKeepBytes);
  }
};

template <typename T>
Status CopyToPinned(PinnedArena& pinned, const T** out, const T* src, size_t count, cudaStream_t s) {
  WSYNC_ASSIGN_OR_RETURN(T* dst, pinned.Alloc<T>(count));
  *out = dst;
  if (count == 0) return Status::Ok();
  return Check(cudaMemcpyAsync(dst, src, count * sizeof(T), cudaMemcpyDeviceToHost, s), "copy to host");
}

// Tensors are encoded in batches whose first-pass scratch (block counts and
// offsets, 8 bytes per 32 elements) stays under this, or one tensor alone:
// a batch costs three synchronizations, and its compact changes are
// entropy-coded before the next batch reuses the page-locked memory.
constexpr size_t kBatchScratchBytes = size_t{64} << 20;
// A batch's bases staged from host memory stay under this, or one tensor.
constexpr size_t kStagingBytes = size_t{256} << 20;
// The device's coder takes a batch's chunks while its jobs' scratch and
// streams stay under this (about 16 bytes per change); the host codes the
// rest.
constexpr size_t kCoderArenaBytes = size_t{256} << 20;
// An apply into pieces or tile grids gathers chunks into images of at most
// this (or one chunk) at a time.
constexpr size_t kImageBytes = size_t{64} << 20;

// A ranked chunk's entries for LaunchRankPositions, class after class: each
// rank's chunk (in the layout the kernel resolves it in), class and rank.
void RankEntries(const DecodedChunk& dc, uint32_t chunk, uint32_t* chunk_out, uint8_t* cls_out, uint32_t* rank_out) {
  size_t at = 0;
  for (int k = 0; k < dc.spec.k; ++k) {
    for (uint64_t j = 0; j < dc.class_counts[k]; ++j, ++at) {
      chunk_out[at] = chunk;
      cls_out[at] = static_cast<uint8_t>(k);
      rank_out[at] = dc.ranks[at];
    }
  }
}

// Scratch bytes a cell takes when gathered out of its tensor (256-byte
// aligned); 0 when its elements are contiguous there.
size_t GatheredBytes(const codec::staged::Cell& c, size_t width) {
  return c.contiguous() ? 0 : (c.elements() * width + 255) / 256 * 256;
}

// A cell's elements in its row-major order: where they start in the
// tensor's data when contiguous there, else copied into `scratch`
// (GatheredBytes of it) by a two-dimensional copy enqueued on `s`.
StatusOr<const uint8_t*> CellElements(const codec::staged::Cell& c, const void* data, size_t width, uint8_t* scratch,
                                      cudaStream_t s) {
  const auto* at = static_cast<const uint8_t*>(data) + (c.row0 * c.tensor_cols + c.col0) * width;
  if (c.contiguous()) return at;
  WSYNC_RETURN_IF_ERROR(Check(cudaMemcpy2DAsync(scratch, c.cols * width, at, c.tensor_cols * width, c.cols * width,
                                                c.rows, cudaMemcpyDeviceToDevice, s),
                              "gathering a cell"));
  return scratch;
}

}  // namespace

Status DeviceAvailable() {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) return UnavailableError(std::string("no usable CUDA device: ") + cudaGetErrorString(e));
  if (count == 0) return UnavailableError("no CUDA device");
  return Status::Ok();
}

// One cell of an encode (a tensor without a grid is one cell): where its
// elements lie on the device in the cell's row-major order, where its
// scratch lies, and its compact change once copied to page-locked memory.
struct CellChange {
  size_t tensor = 0;
  uint64_t n = 0;                // the cell's elements
  const void* base = nullptr;    // the cell's elements, in the tensor or gathered
  const void* target = nullptr;
  std::vector<size_t> chunk_ids;  // the writer's chunk indices
  logic::Layout layout;
  size_t width = 0;
  size_t bins = 0;
  bool conditioned = false;
  bool need_ranks = false;
  // Device scratch of the batch (offsets into it).
  size_t o_counts = 0, o_offsets = 0, o_chunks = 0, o_hist = 0, o_temp = 0, scan_bytes = 0, o_bdig = 0, o_tdig = 0;
  size_t ndigests = 0;
  size_t o_pos = 0, o_delta = 0, o_old = 0, o_rank = 0;  // in the compact scratch
  // The compact change on the device (ranks when computed).
  const uint32_t* d_pos = nullptr;
  const uint8_t* d_delta = nullptr;
  const uint8_t* d_old = nullptr;
  const uint32_t* d_rank = nullptr;
  // Host (page-locked).
  const uint32_t* chunk_off = nullptr;  // changes of chunk c: [chunk_off[c], chunk_off[c + 1])
  const uint32_t* hist = nullptr;       // bins per chunk, when conditioned
  const uint64_t* base_digests = nullptr;
  const uint64_t* target_digests = nullptr;
  // The compact changes of the chunks the host reads (FetchChanges): a
  // run's first chunk for the class choice, and those the device's coder
  // leaves to the host; null elsewhere.
  struct Fetched {
    const uint32_t* pos = nullptr;
    const uint8_t* delta = nullptr;
    const uint8_t* old = nullptr;
    const uint32_t* rank = nullptr;
  };
  std::vector<Fetched> fetched;  // per chunk
  std::vector<ClassSpec> specs;

  bool empty() const { return layout.n == 0; }
  uint64_t changes() const { return empty() ? 0 : chunk_off[layout.Chunks()]; }
  uint64_t count(size_t c) const { return chunk_off[c + 1] - chunk_off[c]; }
  ChunkChange Change(size_t c) const {
    ChunkChange ch;
    ch.count = count(c);
    ch.pos = fetched[c].pos;
    ch.delta = fetched[c].delta;
    ch.old = conditioned ? fetched[c].old : nullptr;
    return ch;
  }
  const uint32_t* Ranks(size_t c) const { return fetched[c].rank; }
};

// Enqueues the digests of many regions in one launch: the job list goes
// through page-locked memory to `jobs_dev` (room for every region).
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

struct DeviceCodec::Impl {
  int device = 0;
  cudaStream_t compute = nullptr;
  cudaStream_t copy = nullptr;
  Scratch scratch;       // encode: a batch's first pass; apply: the entries (on the device's decoding, all of it)
  Scratch changes;       // encode: a batch's compact changes; apply: the scatter lists
  Scratch rank_mem;      // class counts and their scan, one tensor at a time
  Scratch digest_mem;    // digests
  Scratch staging;       // bases in host memory, a batch at a time
  Scratch images;        // cells gathered out of their tensors, a batch at a time
  Scratch coder_mem;     // encode: the entropy stage's jobs, scratch and streams, a batch at a time
  Scratch packed_mem;    // encode: the coded streams packed for the copy to the host
  Scratch fetch_mem;     // encode: the compact changes the host reads, packed for the copy
  PinnedArena pinned;    // what the device copies back
  std::vector<Phase> phases;
  std::chrono::steady_clock::time_point mark;

  ~Impl() {
    if (compute != nullptr) cudaStreamDestroy(compute);
    if (copy != nullptr) cudaStreamDestroy(copy);
  }

  Status Activate() const { return Check(cudaSetDevice(device), "select device"); }

  void StartPhases() {
    phases.clear();
    mark = std::chrono::steady_clock::now();
  }
  // Ends the phase running since the last mark.
  void EndPhase(const char* name) {
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

  // codec::TensorChecksum of each region, with one launch and one
  // synchronization.
  StatusOr<std::vector<uint64_t>> Checksums(std::span<const std::pair<const void*, size_t>> regions) {
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
    WSYNC_ASSIGN_OR_RETURN(void* mem, digest_mem.Get(carve.bytes()));
    auto* dev = At<uint64_t>(mem, o_digests);
    std::vector<DigestJob> jobs;
    for (size_t i = 0; i < regions.size(); ++i) jobs.push_back({regions[i].first, regions[i].second, dev + first[i], 0});
    WSYNC_RETURN_IF_ERROR(EnqueueDigests(pinned, jobs, At<DigestJob>(mem, o_jobs), compute));
    WSYNC_ASSIGN_OR_RETURN(uint64_t* host, pinned.Alloc<uint64_t>(first.back()));
    WSYNC_RETURN_IF_ERROR(
        Check(cudaMemcpyAsync(host, dev, first.back() * sizeof(uint64_t), cudaMemcpyDeviceToHost, compute), "copy"));
    WSYNC_RETURN_IF_ERROR(Check(cudaStreamSynchronize(compute), "digests"));
    for (size_t i = 0; i < regions.size(); ++i) {
      out[i] = codec::CombineBlockDigests(std::span<const uint64_t>(host + first[i], first[i + 1] - first[i]));
    }
    return out;
  }

  // Checksums of the destination's tensors the patch matched, in its order.
  StatusOr<std::vector<uint64_t>> Checksums(std::span<const MutableTensorView> dst, const std::vector<size_t>& match) {
    std::vector<std::pair<const void*, size_t>> regions;
    for (size_t i : match) regions.emplace_back(dst[i].data, dst[i].NumBytes());
    return Checksums(regions);
  }

  StatusOr<uint64_t> Checksum(const void* data, size_t nbytes) {
    const std::pair<const void*, size_t> one{data, nbytes};
    WSYNC_ASSIGN_OR_RETURN(auto sums, Checksums(std::span(&one, 1)));
    return sums[0];
  }

  // Scratch of RankPrefix for a tensor of this layout.
  struct RankScratch {
    size_t o_specs = 0, o_counts = 0, o_prefix = 0, o_temp = 0, scan_bytes = 0, bytes = 0;
  };
  RankScratch RankScratchOf(logic::Layout l) {
    RankScratch r;
    const size_t scan_n = kMaxClasses * l.Blocks() + 1;
    r.scan_bytes = ScanBytes(scan_n);
    Carver carve;
    r.o_specs = carve.Add<ClassSpec>(l.Chunks());
    r.o_counts = carve.Add<uint32_t>(scan_n);
    r.o_prefix = carve.Add<uint32_t>(scan_n);
    r.o_temp = carve.Add<uint8_t>(r.scan_bytes);
    r.bytes = carve.bytes();
    return r;
  }

  // Per-class rank prefix (exclusive scan of class counts) of a tensor under
  // per-chunk specs, into rank_mem (laid out by RankScratchOf, already
  // large enough). Enqueued on `compute`; rank_mem is reused by the next
  // tensor in stream order.
  Status RankPrefix(const void* base, size_t width, logic::Layout l, const std::vector<ClassSpec>& specs,
                    void* mem, const RankScratch& r) {
    auto* specs_dev = At<ClassSpec>(mem, r.o_specs);
    auto* counts = At<uint32_t>(mem, r.o_counts);
    WSYNC_RETURN_IF_ERROR(CopyUp(specs_dev, specs.data(), specs.size() * sizeof(ClassSpec), compute));
    WSYNC_RETURN_IF_ERROR(LaunchClassCounts(base, static_cast<int>(width), l, specs_dev, counts, compute));
    size_t tb = r.scan_bytes;
    return ExclusiveScan(At<void>(mem, r.o_temp), &tb, counts, At<uint32_t>(mem, r.o_prefix),
                         kMaxClasses * l.Blocks() + 1, compute);
  }

  size_t ScanBytes(size_t n) {
    size_t bytes = 0;
    if (!ExclusiveScan(nullptr, &bytes, nullptr, nullptr, n, nullptr).ok()) return 0;
    return bytes;
  }

  // Copies the host bases of tensors [t0, t1) (`bytes` with 256-byte
  // alignment) into `staging` and points bases[t0, t1) there. Enqueued on
  // `compute`, so the next batch's copy waits for this batch's reads.
  Status StageBases(std::span<const TensorView> host, size_t t0, size_t t1, size_t bytes,
                    std::vector<TensorView>& bases) {
    WSYNC_ASSIGN_OR_RETURN(void* mem, staging.Get(bytes));
    size_t at = 0;
    for (size_t t = t0; t < t1; ++t) {
      bases[t] = host[t];
      bases[t].data = static_cast<uint8_t*>(mem) + at;
      WSYNC_RETURN_IF_ERROR(CopyUp(static_cast<uint8_t*>(mem) + at, host[t].data, host[t].NumBytes(), compute));
      at += (host[t].NumBytes() + 255) / 256 * 256;
    }
    EndPhase("stage");
    return Status::Ok();
  }

  // Points cells[k], the writer's cell cell0 + k, at its elements: in the
  // tensor when contiguous there, else gathered into `images` (a
  // two-dimensional copy, after the tensor's snapshot landed). Enqueued on
  // `compute`.
  Status PlaceCells(const codec::staged::PatchWriter& writer, std::span<const TensorView> base,
                    std::span<const TensorView> target, size_t cell0, std::span<CellChange> cells,
                    std::span<cudaEvent_t> landed);

  // The device part of encoding a batch of whole tensors' cells: digests,
  // compact changes, class choice (host, small) and ranks, with one
  // synchronization per step for the whole batch. specs: by writer chunk.
  Status CompactBatch(const codec::staged::PatchWriter& writer, std::span<CellChange> batch,
                      const codec::EncodeOptions& options, std::vector<ClassSpec>& specs);

  // Copies the segments' bytes (device memory) back to back into
  // page-locked memory: the segment list up, one packing kernel into `mem`,
  // one copy down. Synchronizes.
  StatusOr<const uint8_t*> PackToHost(std::span<const PackSegment> segments, uint64_t bytes, Scratch& mem,
                                      const char* what);

  // Copies the compact changes of these chunks (cell in batch, chunk in
  // cell) that are not on the host yet, with their ranks where computed,
  // packed into one copy; their `fetched` pointers then point at them.
  // Synchronizes.
  Status FetchChanges(std::span<CellChange> batch, std::span<const std::pair<size_t, size_t>> which);

  // The entropy stage on the device: codes the batch's chunks that
  // MaySparseEncode (encode_plan.h), one per thread, and hands their
  // streams to the writer; coded[chunk] marks those it coded. The rest
  // (other modes, or streams past their room) are left for the host.
  // Then fetches the changes of the chunks it leaves to the host.
  Status CodeOnDevice(codec::staged::PatchWriter& writer, std::span<CellChange> batch,
                      const codec::EncodeOptions& options, std::vector<uint8_t>& coded);

  Status ApplyDelta(const codec::staged::PatchReader& r, std::span<const MutableTensorView> dst,
                    const std::vector<size_t>& match, const codec::ApplyOptions& options);
  // A patch decoded on the device, its chunks in other modes than sparse
  // beside it on the host; false (nothing done) when those hold more than
  // an eighth of the changes.
  StatusOr<bool> ApplySparse(std::string_view patch, const codec::staged::PatchReader& r,
                             std::span<const MutableTensorView> dst, const std::vector<size_t>& match,
                             const codec::ApplyOptions& options);
  // Scatters (scatter(false)), verifies every tensor against the patch and
  // undoes the scatter (scatter(true)) on a mismatch or a failure.
  Status ScatterAndVerify(const codec::staged::PatchReader& r, std::span<const MutableTensorView> dst,
                          const std::vector<size_t>& match, const std::function<Status(bool undo)>& scatter);
  Status ApplyKeyframe(const codec::staged::PatchReader& r, std::span<const MutableTensorView> dst,
                       const std::vector<size_t>& match, const codec::ApplyOptions& options);
  // Patches into pieces or tile grids (placed.h). dst: the destination
  // tensors' data, as the plans' Work::dst index them.
  // unwritten: what a DataLoss before the first write becomes (a wrong
  // base told apart where it can be).
  Status ApplyPlaced(std::span<const codec::staged::PatchReader* const> readers,
                     std::span<const codec::staged::ApplyPlan> plans, std::span<void* const> dst,
                     const codec::ApplyOptions& options, const std::function<Status(Status)>& unwritten);
  // A keyframe part's decoded works (values[w]: its chunk's bytes) to their
  // placements, batch by batch through the image scratch.
  Status WriteTiles(const codec::staged::PatchReader& r, const codec::staged::ApplyPlan& plan,
                    const std::vector<std::vector<uint8_t>>& values, std::span<void* const> dst);
  StatusOr<bool> HoldsBase(const codec::staged::PatchReader& r, std::span<const MutableTensorView> dst,
                           const std::vector<size_t>& match);
  // What a failed apply reports: FailedPrecondition when the destination
  // does not hold the patch's base (then that is why it failed), else error.
  Status Failure(const codec::staged::PatchReader& r, std::span<const MutableTensorView> dst,
                 const std::vector<size_t>& match, Status error);
};

Status DeviceCodec::Impl::PlaceCells(const codec::staged::PatchWriter& writer, std::span<const TensorView> base,
                                     std::span<const TensorView> target, size_t cell0, std::span<CellChange> cells,
                                     std::span<cudaEvent_t> landed) {
  const auto& chunks = writer.chunks();
  const std::span<const codec::staged::Cell> of(writer.cells().data() + cell0, cells.size());
  size_t bytes = 0;
  for (const codec::staged::Cell& cell : of) bytes += 2 * GatheredBytes(cell, chunks[cell.first_chunk].width);
  void* mem = nullptr;
  if (bytes > 0) {
    WSYNC_ASSIGN_OR_RETURN(mem, images.Get(bytes));
  }
  uint8_t* at = static_cast<uint8_t*>(mem);
  size_t waited = SIZE_MAX;
  for (size_t k = 0; k < cells.size(); ++k) {
    CellChange& cc = cells[k];
    const codec::staged::Cell& cell = of[k];
    const size_t t = cell.tensor, w = chunks[cell.first_chunk].width, image = GatheredBytes(cell, w);
    cc.tensor = t;
    cc.width = w;
    cc.n = cell.elements();
    cc.chunk_ids.resize(cell.chunks);
    for (size_t c = 0; c < cell.chunks; ++c) cc.chunk_ids[c] = cell.first_chunk + c;
    if (!landed.empty() && waited != t) {
      WSYNC_RETURN_IF_ERROR(Check(cudaStreamWaitEvent(compute, landed[t], 0), "wait for snapshot"));
      waited = t;
    }
    WSYNC_ASSIGN_OR_RETURN(cc.base, CellElements(cell, base[t].data, w, at, compute));
    WSYNC_ASSIGN_OR_RETURN(cc.target, CellElements(cell, target[t].data, w, at + image, compute));
    at += 2 * image;
  }
  if (bytes > 0) EndPhase("gather");
  return Status::Ok();
}

Status DeviceCodec::Impl::CompactBatch(const codec::staged::PatchWriter& writer, std::span<CellChange> batch,
                                       const codec::EncodeOptions& options, std::vector<ClassSpec>& specs) {
  // First pass: digests, block counts, their scan, chunk offsets, histograms.
  Carver carve;
  for (CellChange& tc : batch) {
    const codec::staged::Chunk& first = writer.chunks()[tc.chunk_ids.at(0)];
    tc.layout = LayoutOf(tc.n, tc.width, options.chunk_bytes);
    if (tc.empty()) continue;
    tc.bins = codec::staged::HistogramBins(first.dtype);
    tc.conditioned = options.condition_on_base && tc.bins > 0;
    const uint64_t blocks = tc.layout.Blocks(), chunks = tc.layout.Chunks();
    tc.scan_bytes = ScanBytes(blocks + 1);
    tc.ndigests = codec::ChecksumBlockCount(tc.n * tc.width);
    tc.o_counts = carve.Add<uint32_t>(blocks + 1);
    tc.o_offsets = carve.Add<uint32_t>(blocks + 1);
    tc.o_chunks = carve.Add<uint32_t>(chunks + 1);
    tc.o_hist = carve.Add<uint32_t>(tc.conditioned ? chunks * tc.bins : 1);
    tc.o_temp = carve.Add<uint8_t>(tc.scan_bytes);
    tc.o_bdig = carve.Add<uint64_t>(tc.ndigests);
    tc.o_tdig = carve.Add<uint64_t>(tc.ndigests);
  }
  const size_t o_jobs = carve.Add<DigestJob>(2 * batch.size());
  WSYNC_ASSIGN_OR_RETURN(void* mem, scratch.Get(carve.bytes()));
  // Each step synchronizes once for the batch, so that the phases time apart.
  std::vector<DigestJob> jobs;
  for (CellChange& tc : batch) {
    if (tc.empty()) continue;
    const size_t nbytes = tc.layout.n * tc.width;
    jobs.push_back({tc.base, nbytes, At<uint64_t>(mem, tc.o_bdig), 0});
    jobs.push_back({tc.target, nbytes, At<uint64_t>(mem, tc.o_tdig), 0});
  }
  WSYNC_RETURN_IF_ERROR(EnqueueDigests(pinned, jobs, At<DigestJob>(mem, o_jobs), compute));
  for (CellChange& tc : batch) {
    if (tc.empty()) continue;
    WSYNC_RETURN_IF_ERROR(CopyToPinned(pinned, &tc.base_digests, At<uint64_t>(mem, tc.o_bdig), tc.ndigests, compute));
    WSYNC_RETURN_IF_ERROR(CopyToPinned(pinned, &tc.target_digests, At<uint64_t>(mem, tc.o_tdig), tc.ndigests, compute));
  }
  WSYNC_RETURN_IF_ERROR(Check(cudaStreamSynchronize(compute), "digests"));
  EndPhase("digests");
  for (CellChange& tc : batch) {
    if (tc.empty()) continue;
    const logic::Layout& l = tc.layout;
    WSYNC_RETURN_IF_ERROR(LaunchDiffCounts(tc.base, tc.target, static_cast<int>(tc.width), l,
                                           At<uint32_t>(mem, tc.o_counts), compute));
    size_t tb = tc.scan_bytes;
    WSYNC_RETURN_IF_ERROR(ExclusiveScan(At<void>(mem, tc.o_temp), &tb, At<uint32_t>(mem, tc.o_counts),
                                        At<uint32_t>(mem, tc.o_offsets), l.Blocks() + 1, compute));
    WSYNC_RETURN_IF_ERROR(LaunchChunkOffsets(At<uint32_t>(mem, tc.o_offsets), l, At<uint32_t>(mem, tc.o_chunks),
                                             compute));
    WSYNC_RETURN_IF_ERROR(CopyToPinned(pinned, &tc.chunk_off, At<uint32_t>(mem, tc.o_chunks), l.Chunks() + 1, compute));
  }
  WSYNC_RETURN_IF_ERROR(Check(cudaStreamSynchronize(compute), "diff"));
  EndPhase("diff");
  for (CellChange& tc : batch) {
    if (tc.empty() || !tc.conditioned) continue;
    const codec::ExponentField ef = codec::ExponentFieldOf(writer.chunks()[tc.chunk_ids[0]].dtype);
    WSYNC_RETURN_IF_ERROR(LaunchSampleHistogram(tc.base, static_cast<int>(tc.width), tc.layout, ef.shift,
                                                ef.mask, static_cast<uint32_t>(tc.bins), At<uint32_t>(mem, tc.o_hist),
                                                compute));
    WSYNC_RETURN_IF_ERROR(
        CopyToPinned(pinned, &tc.hist, At<uint32_t>(mem, tc.o_hist), tc.layout.Chunks() * tc.bins, compute));
  }
  WSYNC_RETURN_IF_ERROR(Check(cudaStreamSynchronize(compute), "histograms"));
  EndPhase("histograms");

  // The compact changes: positions, deltas, old values (and ranks, later).
  Carver cc;
  for (CellChange& tc : batch) {
    if (tc.empty()) continue;
    const size_t m = tc.changes();
    tc.o_pos = cc.Add<uint32_t>(m);
    tc.o_delta = cc.Add<uint8_t>(m * tc.width);
    tc.o_old = cc.Add<uint8_t>(m * tc.width);
    tc.o_rank = cc.Add<uint32_t>(m);
  }
  WSYNC_ASSIGN_OR_RETURN(void* cmem, changes.Get(cc.bytes()));
  for (CellChange& tc : batch) {
    if (tc.empty()) continue;
    WSYNC_RETURN_IF_ERROR(LaunchDiffScatter(tc.base, tc.target, static_cast<int>(tc.width),
                                            tc.layout, At<uint32_t>(mem, tc.o_offsets), At<uint32_t>(cmem, tc.o_pos),
                                            At<uint8_t>(cmem, tc.o_delta), At<uint8_t>(cmem, tc.o_old), compute));
    tc.d_pos = At<uint32_t>(cmem, tc.o_pos);
    tc.d_delta = At<uint8_t>(cmem, tc.o_delta);
    tc.d_old = At<uint8_t>(cmem, tc.o_old);
    tc.fetched.assign(tc.layout.Chunks(), {});
  }
  // Classes on the host (small): the first chunk of every run of its
  // tensor's chunks chooses (a batch holds whole tensors, every cell), from
  // its change, the only ones fetched here.
  std::vector<std::pair<size_t, size_t>> sources;  // (cell in batch, chunk)
  for (size_t i = 0; i < batch.size(); ++i) {
    const CellChange& tc = batch[i];
    if (tc.empty()) continue;
    for (uint64_t c = 0; c < tc.layout.Chunks(); ++c) {
      if (writer.ClassSource(tc.chunk_ids[c]) == tc.chunk_ids[c]) sources.emplace_back(i, c);
    }
  }
  WSYNC_RETURN_IF_ERROR(FetchChanges(batch, sources));
  EndPhase("compact");

  ParallelFor(options.pool, sources.size(), [&](size_t s) {
    const CellChange& tc = batch[sources[s].first];
    const size_t c = sources[s].second;
    specs[tc.chunk_ids[c]] =
        writer.ChooseClasses(tc.chunk_ids[c], tc.conditioned ? tc.hist + c * tc.bins : nullptr, tc.Change(c));
  });
  size_t rank_bytes = 0;
  for (CellChange& tc : batch) {
    if (tc.empty()) continue;
    tc.specs.resize(tc.layout.Chunks());
    for (uint64_t c = 0; c < tc.layout.Chunks(); ++c) {
      tc.specs[c] = specs[writer.ClassSource(tc.chunk_ids[c])];
      tc.need_ranks = tc.need_ranks || writer.NeedsRanks(tc.chunk_ids[c], tc.Change(c).count, tc.specs[c]);
    }
    if (tc.need_ranks) rank_bytes = std::max(rank_bytes, RankScratchOf(tc.layout).bytes);
  }
  EndPhase("classes");
  if (rank_bytes == 0) return Status::Ok();

  // Ranks on the device, one tensor after another in rank_mem.
  WSYNC_ASSIGN_OR_RETURN(void* rmem, rank_mem.Get(rank_bytes));
  for (CellChange& tc : batch) {
    if (!tc.need_ranks) continue;
    const void* b = tc.base;
    const RankScratch rs = RankScratchOf(tc.layout);
    WSYNC_RETURN_IF_ERROR(RankPrefix(b, tc.width, tc.layout, tc.specs, rmem, rs));
    WSYNC_RETURN_IF_ERROR(LaunchRanks(b, static_cast<int>(tc.width), tc.layout, At<ClassSpec>(rmem, rs.o_specs),
                                      At<uint32_t>(rmem, rs.o_prefix), At<uint32_t>(mem, tc.o_chunks),
                                      At<uint32_t>(cmem, tc.o_pos), At<uint8_t>(cmem, tc.o_old), tc.changes(),
                                      At<uint32_t>(cmem, tc.o_rank), compute));
    tc.d_rank = At<uint32_t>(cmem, tc.o_rank);
  }
  WSYNC_RETURN_IF_ERROR(Check(cudaStreamSynchronize(compute), "ranks"));
  EndPhase("ranks");
  return Status::Ok();
}

StatusOr<const uint8_t*> DeviceCodec::Impl::PackToHost(std::span<const PackSegment> segments, uint64_t bytes,
                                                       Scratch& mem, const char* what) {
  const size_t o_packed = (segments.size() * sizeof(PackSegment) + 255) / 256 * 256;
  WSYNC_ASSIGN_OR_RETURN(void* dev, mem.Get(o_packed + bytes));
  WSYNC_ASSIGN_OR_RETURN(PackSegment * list, pinned.Alloc<PackSegment>(segments.size()));
  std::copy(segments.begin(), segments.end(), list);
  WSYNC_RETURN_IF_ERROR(CopyUp(dev, list, segments.size() * sizeof(PackSegment), compute));
  WSYNC_RETURN_IF_ERROR(
      LaunchPackSegments(static_cast<const PackSegment*>(dev), segments.size(), At<uint8_t>(dev, o_packed), compute));
  const uint8_t* host = nullptr;
  WSYNC_RETURN_IF_ERROR(CopyToPinned(pinned, &host, At<uint8_t>(dev, o_packed), bytes, compute));
  WSYNC_RETURN_IF_ERROR(Check(cudaStreamSynchronize(compute), what));
  return host;
}

Status DeviceCodec::Impl::FetchChanges(std::span<CellChange> batch,
                                       std::span<const std::pair<size_t, size_t>> which) {
  std::vector<PackSegment> segments;
  uint64_t bytes = 0;
  auto add = [&](const void* src, uint64_t n) {
    const uint64_t at = bytes;
    segments.push_back({static_cast<const uint8_t*>(src), n, at});
    bytes = (bytes + n + 7) / 8 * 8;
    return at;
  };
  struct Where {
    size_t cell, chunk;
    uint64_t pos, delta, old, rank;
  };
  std::vector<Where> where;
  constexpr uint64_t kNone = UINT64_MAX;
  for (const auto& [k, c] : which) {
    CellChange& tc = batch[k];
    const uint64_t m = tc.count(c), off = tc.chunk_off[c];
    if (m == 0) continue;
    Where w{k, c, kNone, kNone, kNone, kNone};
    if (tc.fetched[c].pos == nullptr) {
      w.pos = add(tc.d_pos + off, 4 * m);
      w.delta = add(tc.d_delta + off * tc.width, m * tc.width);
      if (tc.conditioned) w.old = add(tc.d_old + off * tc.width, m * tc.width);
    }
    if (tc.d_rank != nullptr && tc.fetched[c].rank == nullptr) w.rank = add(tc.d_rank + off, 4 * m);
    if (w.pos != kNone || w.rank != kNone) where.push_back(w);
  }
  if (segments.empty()) return Status::Ok();
  WSYNC_ASSIGN_OR_RETURN(const uint8_t* host, PackToHost(segments, bytes, fetch_mem, "fetching changes"));
  for (const Where& w : where) {
    CellChange::Fetched& f = batch[w.cell].fetched[w.chunk];
    if (w.pos != kNone) {
      f.pos = reinterpret_cast<const uint32_t*>(host + w.pos);
      f.delta = host + w.delta;
      if (w.old != kNone) f.old = host + w.old;
    }
    if (w.rank != kNone) f.rank = reinterpret_cast<const uint32_t*>(host + w.rank);
  }
  return Status::Ok();
}

Status DeviceCodec::Impl::CodeOnDevice(codec::staged::PatchWriter& writer, std::span<CellChange> batch,
                                       const codec::EncodeOptions& options, std::vector<uint8_t>& coded) {
  std::vector<EncodeInput> inputs;
  std::vector<size_t> changed;                                    // writer chunks with changes
  std::unordered_map<size_t, std::pair<size_t, size_t>> where;  // writer chunk -> (cell in batch, chunk in cell)
  // The changes of these chunks to the host, for it to code or weigh.
  auto fetch = [&](std::span<const size_t> chunks) {
    std::vector<std::pair<size_t, size_t>> which;
    for (size_t chunk : chunks) which.push_back(where.at(chunk));
    return FetchChanges(batch, which);
  };
  for (size_t k = 0; k < batch.size(); ++k) {
    const CellChange& tc = batch[k];
    if (tc.empty()) continue;
    for (uint64_t c = 0; c < tc.layout.Chunks(); ++c) {
      where[tc.chunk_ids[c]] = {k, c};
      if (tc.count(c) > 0) changed.push_back(tc.chunk_ids[c]);
      const size_t off = tc.chunk_off[c];
      EncodeInput in;
      in.chunk = tc.chunk_ids[c];
      in.elements = writer.chunks()[in.chunk].elements;
      in.changed = tc.chunk_off[c + 1] - off;
      in.pos = tc.d_pos + off;
      in.delta = tc.d_delta + off * tc.width;
      in.old = tc.conditioned ? tc.d_old + off * tc.width : nullptr;
      in.rank = tc.d_rank == nullptr ? nullptr : tc.d_rank + off;
      in.spec = tc.specs[c];
      in.width = static_cast<int>(tc.width);
      if (MaySparseEncode(in.elements, in.changed)) inputs.push_back(in);
    }
  }
  if (inputs.empty()) return fetch(changed);
  const size_t arena_bytes = PlanSparseEncode(inputs, nullptr, kCoderArenaBytes).bytes;
  const size_t o_lg = (arena_bytes + 255) / 256 * 256;
  WSYNC_ASSIGN_OR_RETURN(void* mem, coder_mem.Get(o_lg + sizeof(codec::sparse::Log2Table)));
  auto* arena = static_cast<uint8_t*>(mem);
  const EncodePlan plan = PlanSparseEncode(inputs, arena, kCoderArenaBytes);
  const size_t njobs = plan.jobs.size();
  if (njobs == 0) return fetch(changed);
  WSYNC_ASSIGN_OR_RETURN(SparseEncodeJob * jobs, pinned.Alloc<SparseEncodeJob>(njobs));
  std::copy(plan.jobs.begin(), plan.jobs.end(), jobs);
  WSYNC_ASSIGN_OR_RETURN(uint32_t * lg, pinned.Alloc<uint32_t>(codec::sparse::kLog2Table.size()));
  std::copy(codec::sparse::kLog2Table.begin(), codec::sparse::kLog2Table.end(), lg);
  WSYNC_RETURN_IF_ERROR(CopyUp(arena + plan.o_jobs, jobs, njobs * sizeof(SparseEncodeJob), compute));
  WSYNC_RETURN_IF_ERROR(CopyUp(arena + o_lg, lg, sizeof(codec::sparse::Log2Table), compute));
  auto* results_dev = At<codec::sparse::SparseEncodeResult>(arena, plan.o_results);
  WSYNC_RETURN_IF_ERROR(LaunchSparseEncode(At<SparseEncodeJob>(arena, plan.o_jobs), njobs, At<uint32_t>(arena, o_lg),
                                           results_dev, compute));
  const codec::sparse::SparseEncodeResult* results = nullptr;
  WSYNC_RETURN_IF_ERROR(CopyToPinned(pinned, &results, results_dev, njobs, compute));
  WSYNC_RETURN_IF_ERROR(Check(cudaStreamSynchronize(compute), "sparse encode"));
  EndPhase("device entropy");

  // The streams cross to the host, packed back to back, and the changes
  // of the chunks the host still weighs or codes (none at RL rates).
  const std::span<const codec::sparse::SparseEncodeResult> rs(results, njobs);
  WSYNC_RETURN_IF_ERROR(fetch(ChunksForTheHost(plan, rs, changed)));
  const Packing packing = PackSparseEncoded(plan, rs);
  if (packing.segments.empty()) return Status::Ok();
  WSYNC_ASSIGN_OR_RETURN(const uint8_t* packed,
                         PackToHost(packing.segments, packing.bytes, packed_mem, "packing the coded streams"));
  EndPhase("streams to host");
  auto change_of = [&](size_t chunk) {
    const auto [k, c] = where.at(chunk);
    return batch[k].Change(c);
  };
  WSYNC_RETURN_IF_ERROR(SetSparseEncoded(plan, rs, packed, change_of, options.pool, writer, &coded));
  EndPhase("modes weighed");
  return Status::Ok();
}

DeviceCodec::DeviceCodec(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
DeviceCodec::~DeviceCodec() = default;

StatusOr<std::unique_ptr<DeviceCodec>> DeviceCodec::Create(int device) {
  WSYNC_RETURN_IF_ERROR(DeviceAvailable());
  auto impl = std::make_unique<Impl>();
  impl->device = device;
  WSYNC_RETURN_IF_ERROR(impl->Activate());
  WSYNC_RETURN_IF_ERROR(Check(cudaStreamCreateWithFlags(&impl->compute, cudaStreamNonBlocking), "stream"));
  WSYNC_RETURN_IF_ERROR(Check(cudaStreamCreateWithFlags(&impl->copy, cudaStreamNonBlocking), "stream"));
  return std::unique_ptr<DeviceCodec>(new DeviceCodec(std::move(impl)));
}

namespace {

Status CheckPairs(std::span<const TensorView> a, std::span<const TensorView> b, const char* what) {
  if (a.size() != b.size()) {
    return InvalidArgumentError(std::string(what) + ": " + std::to_string(a.size()) + " vs " +
                                std::to_string(b.size()) + " tensors");
  }
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].name != b[i].name) {
      return InvalidArgumentError("tensor " + std::to_string(i) + ": " + Quoted(a[i].name) + " vs " + Quoted(b[i].name));
    }
    if (a[i].dtype != b[i].dtype || a[i].shape != b[i].shape) {
      return InvalidArgumentError("tensor " + Quoted(a[i].name) + ": base and target differ in dtype or shape");
    }
  }
  return Status::Ok();
}

std::vector<TensorView> ConstViews(std::span<const MutableTensorView> v) {
  std::vector<TensorView> out;
  for (const auto& m : v) out.push_back(m.AsConst());
  return out;
}

}  // namespace

StatusOr<std::string> DeviceCodec::EncodePatch(std::span<const TensorView> base, std::span<const TensorView> target,
                                               const codec::EncodeOptions& options) {
  return Encode({}, {}, base, options, {}, target, {}, false);
}

StatusOr<std::string> DeviceCodec::SnapshotAndEncode(std::span<const TensorView> live,
                                                     std::span<const MutableTensorView> snapshot,
                                                     std::span<const TensorView> previous,
                                                     const codec::EncodeOptions& options,
                                                     const std::function<void()>& on_snapshot) {
  const std::vector<TensorView> targets = ConstViews(snapshot);
  WSYNC_RETURN_IF_ERROR(CheckPairs(live, targets, "live and snapshot"));
  return Encode(live, snapshot, previous, options, on_snapshot, targets, {}, false);
}

StatusOr<std::string> DeviceCodec::EncodeAndAdvance(std::span<const TensorView> live,
                                                    std::span<const MutableTensorView> previous,
                                                    const codec::EncodeOptions& options) {
  const std::vector<TensorView> base = ConstViews(previous);
  return Encode({}, {}, base, options, {}, live, previous, false);
}

StatusOr<std::string> DeviceCodec::EncodeAndAdvanceFromHost(std::span<const TensorView> live,
                                                            std::span<const MutableTensorView> previous,
                                                            const codec::EncodeOptions& options) {
  const std::vector<TensorView> base = ConstViews(previous);
  return Encode({}, {}, base, options, {}, live, previous, true);
}

StatusOr<std::string> DeviceCodec::Encode(std::span<const TensorView> live,
                                          std::span<const MutableTensorView> snapshot,
                                          std::span<const TensorView> previous, const codec::EncodeOptions& options,
                                          const std::function<void()>& on_snapshot,
                                          std::span<const TensorView> target,
                                          std::span<const MutableTensorView> advance, bool base_on_host) {
  Impl& d = *impl_;
  d.StartPhases();
  WSYNC_RETURN_IF_ERROR(d.Activate());
  const EndOfCall end{d.compute, d.pinned};
  WSYNC_RETURN_IF_ERROR(CheckPairs(previous, target, "base and target"));
  WSYNC_ASSIGN_OR_RETURN(auto writer, codec::staged::PatchWriter::Create(target, options));
  if (!options.grids.empty() && options.chunk_bytes != codec::kChecksumBlockBytes) {
    return InvalidArgumentError("the device codec codes tile grids in chunks of " +
                                std::to_string(codec::kChecksumBlockBytes) + " bytes only (chunk_bytes " +
                                std::to_string(options.chunk_bytes) + ")");
  }
  const bool snapshotting = !live.empty();

  // Copy stream: every tensor's snapshot, an event after each.
  std::vector<cudaEvent_t> landed(snapshotting ? target.size() : 0, nullptr);
  auto destroy = [&] {
    for (cudaEvent_t e : landed) {
      if (e != nullptr) cudaEventDestroy(e);
    }
  };
  for (size_t t = 0; t < landed.size(); ++t) {
    Status s = Check(cudaEventCreateWithFlags(&landed[t], cudaEventDisableTiming), "event");
    if (s.ok()) {
      s = Check(cudaMemcpyAsync(snapshot[t].data, live[t].data, live[t].NumBytes(), cudaMemcpyDeviceToDevice, d.copy),
                "snapshot copy");
    }
    if (s.ok()) s = Check(cudaEventRecord(landed[t], d.copy), "event");
    if (!s.ok()) {
      cudaStreamSynchronize(d.copy);
      destroy();
      return s;
    }
  }
  bool snapshot_reported = !snapshotting;
  auto report_snapshot = [&]() -> Status {
    if (snapshot_reported) return Status::Ok();
    snapshot_reported = true;
    WSYNC_RETURN_IF_ERROR(Check(cudaStreamSynchronize(d.copy), "snapshot"));
    if (on_snapshot) on_snapshot();
    return Status::Ok();
  };

  // Batch after batch of whole tensors (every cell of each): the device
  // compacts and entropy-codes the chunks its coder takes (sparse-coded at
  // RL change rates), the host codes the rest.
  const auto& cells = writer.cells();
  std::vector<size_t> first_cell(target.size() + 1, cells.size());  // cells of t: [first_cell[t], first_cell[t + 1])
  for (size_t k = cells.size(); k-- > 0;) first_cell[cells[k].tensor] = k;
  for (size_t t = target.size(); t-- > 0;) first_cell[t] = std::min(first_cell[t], first_cell[t + 1]);
  auto gathered = [&](size_t t) {  // scratch for tensor t's cells gathered out of it (base and target)
    size_t bytes = 0;
    for (size_t k = first_cell[t]; k < first_cell[t + 1]; ++k) {
      bytes += 2 * GatheredBytes(cells[k], codec::DTypeWidth(target[t].dtype));
    }
    return bytes;
  };
  std::vector<uint64_t> target_sums(target.size()), base_sums(target.size());
  std::vector<ClassSpec> specs(writer.chunks().size());
  std::vector<uint8_t> coded(writer.chunks().size(), 0);  // chunks the device coded
  std::vector<CellChange> changes;
  Status status;
  // A base in host memory is staged on the device batch by batch.
  std::vector<TensorView> bases(previous.begin(), previous.end());
  for (size_t t0 = 0; t0 < target.size() && status.ok();) {
    size_t t1 = t0, bytes = 0, staged = 0, images = 0;
    while (t1 < target.size() &&
           (t1 == t0 || (bytes + target[t1].NumElements() / 4 <= kBatchScratchBytes &&
                         images + gathered(t1) <= kStagingBytes &&
                         (!base_on_host || staged + target[t1].NumBytes() <= kStagingBytes)))) {
      bytes += target[t1].NumElements() / 4;
      staged += (target[t1].NumBytes() + 255) / 256 * 256;
      images += gathered(t1);
      ++t1;
    }
    changes.assign(first_cell[t1] - first_cell[t0], CellChange{});
    d.pinned.Reset();
    if (base_on_host) status = d.StageBases(previous, t0, t1, staged, bases);
    if (status.ok()) status = d.PlaceCells(writer, bases, target, first_cell[t0], changes, landed);
    if (status.ok()) status = d.CompactBatch(writer, changes, options, specs);
    // Once the copy stream is idle the trainer may go on; check as we go.
    if (status.ok() && !snapshot_reported && cudaStreamQuery(d.copy) == cudaSuccess) status = report_snapshot();
    if (!status.ok()) break;
    // Checksums over each tensor's cells in turn; a gridded chunk (1 MiB) is
    // one checksum block of its cell, so its tile digest is that block's.
    std::vector<std::pair<size_t, size_t>> all;  // (cell in batch, chunk in cell)
    std::vector<uint64_t> bd, td;
    for (size_t t = t0; t < t1 && status.ok(); ++t) {
      bd.clear();
      td.clear();
      for (size_t k = first_cell[t] - first_cell[t0]; k < first_cell[t + 1] - first_cell[t0]; ++k) {
        const CellChange& cc = changes[k];
        bd.insert(bd.end(), cc.base_digests, cc.base_digests + cc.ndigests);
        td.insert(td.end(), cc.target_digests, cc.target_digests + cc.ndigests);
        for (size_t c = 0; c < cc.chunk_ids.size(); ++c) {
          all.emplace_back(k, c);
          if (writer.gridded(cc.chunk_ids[c]) && status.ok()) {
            status = writer.SetTileDigest(cc.chunk_ids[c], cc.target_digests[c]);
          }
        }
      }
      base_sums[t] = codec::CombineBlockDigests(bd);
      target_sums[t] = codec::CombineBlockDigests(td);
    }
    if (status.ok()) status = d.CodeOnDevice(writer, changes, options, coded);
    if (!status.ok()) break;
    FirstError error;
    ParallelFor(options.pool, all.size(), [&](size_t i) {
      const CellChange& tc = changes[all[i].first];
      const size_t c = all[i].second;
      if (coded[tc.chunk_ids[c]]) return;
      error.Record(i, writer.SetChunk(tc.chunk_ids[c], tc.Change(c), tc.specs[c], tc.Ranks(c)));
    });
    status = error.status();  // the cells' host memory is the next batch's
    d.EndPhase("entropy");
    t0 = t1;
  }
  if (status.ok()) status = report_snapshot();
  cudaStreamSynchronize(d.copy);
  destroy();
  WSYNC_RETURN_IF_ERROR(status);
  WSYNC_RETURN_IF_ERROR(writer.SetChecksums(target_sums, base_sums));
  auto out = writer.Finish();
  d.EndPhase("finish");
  if (out.ok() && !advance.empty()) {
    // The patch is made: the base becomes the target.
    for (size_t t = 0; t < advance.size(); ++t) {
      WSYNC_RETURN_IF_ERROR(Check(cudaMemcpyAsync(advance[t].data, target[t].data, target[t].NumBytes(),
                                                  cudaMemcpyDefault, d.compute),
                                  "updating the base"));
    }
    WSYNC_RETURN_IF_ERROR(Check(cudaStreamSynchronize(d.compute), "updating the base"));
    d.EndPhase("advance");
  }
  return out;
}

StatusOr<bool> DeviceCodec::Impl::HoldsBase(const codec::staged::PatchReader& r,
                                            std::span<const MutableTensorView> dst,
                                            const std::vector<size_t>& match) {
  WSYNC_ASSIGN_OR_RETURN(auto sums, Checksums(dst, match));
  return codec::SetChecksumOf(sums) == r.base_set_checksum();
}

namespace {

Status WrongBase(const codec::staged::PatchReader& r) {
  return FailedPreconditionError("the destination does not hold the patch's base version " +
                                 std::to_string(r.base_version()) + " (base checksum differs); destination unchanged");
}

}  // namespace

Status DeviceCodec::Impl::Failure(const codec::staged::PatchReader& r, std::span<const MutableTensorView> dst,
                                  const std::vector<size_t>& match, Status error) {
  WSYNC_ASSIGN_OR_RETURN(bool holds, HoldsBase(r, dst, match));
  return holds ? error : WrongBase(r);
}

Status DeviceCodec::Impl::ApplyKeyframe(const codec::staged::PatchReader& r, std::span<const MutableTensorView> dst,
                                        const std::vector<size_t>& match, const codec::ApplyOptions& options) {
  // Decode and verify everything on the host before the first byte is
  // written: a keyframe is a cold start, its size is the model's.
  const auto& chunks = r.chunks();
  std::vector<std::vector<uint8_t>> values(match.size());
  for (size_t t = 0; t < match.size(); ++t) values[t].resize(dst[match[t]].NumBytes());
  FirstError error;
  ParallelFor(options.pool, chunks.size(), [&](size_t i) {
    const Chunk& c = chunks[i];
    error.Record(i, r.DecodeKeyframe(i, values[c.tensor].data() + c.first_element * c.width));
  });
  WSYNC_RETURN_IF_ERROR(error.status());
  for (size_t t = 0; t < match.size(); ++t) {
    if (codec::TensorChecksum(values[t].data(), values[t].size(), options.pool) != r.target_checksum(t)) {
      return DataLossError("tensor " + Quoted(r.tensor_name(t)) +
                           ": keyframe content does not match its checksum; destination not modified");
    }
  }
  for (size_t t = 0; t < match.size(); ++t) {
    WSYNC_RETURN_IF_ERROR(CopyUp(dst[match[t]].data, values[t].data(), values[t].size(), compute));
  }
  return Check(cudaStreamSynchronize(compute), "keyframe copy");
}

Status DeviceCodec::Impl::ScatterAndVerify(const codec::staged::PatchReader& r,
                                           std::span<const MutableTensorView> dst, const std::vector<size_t>& match,
                                           const std::function<Status(bool undo)>& scatter) {
  WSYNC_RETURN_IF_ERROR(scatter(false));
  Status scattered = Check(cudaStreamSynchronize(compute), "scatter");
  EndPhase("scatter");
  auto sums = scattered.ok() ? Checksums(dst, match) : StatusOr<std::vector<uint64_t>>(scattered);
  EndPhase("verify");
  if (!sums.ok()) {
    // The scatter may or may not have run: put the tensors back either way.
    const Status undone = scatter(true);
    cudaStreamSynchronize(compute);
    return undone.ok() ? sums.status() : undone;
  }
  for (size_t t = 0; t < match.size(); ++t) {
    if ((*sums)[t] == r.target_checksum(t)) continue;
    WSYNC_RETURN_IF_ERROR(scatter(true));
    WSYNC_RETURN_IF_ERROR(Check(cudaStreamSynchronize(compute), "undo"));
    return Failure(r, dst, match,
                   DataLossError("tensor " + Quoted(r.tensor_name(t)) +
                                 ": result does not match the patch's checksum (the patch is corrupted); "
                                 "change undone, destination unchanged"));
  }
  return Status::Ok();
}

StatusOr<bool> DeviceCodec::Impl::ApplySparse(std::string_view patch, const codec::staged::PatchReader& r,
                                              std::span<const MutableTensorView> dst, const std::vector<size_t>& match,
                                              const codec::ApplyOptions& options) {
  const auto& chunks = r.chunks();
  std::vector<size_t> widths;
  for (size_t i : match) widths.push_back(codec::DTypeWidth(dst[i].dtype));
  SparsePlan p;
  FirstError error;
  PlanSparse(patch, r, widths, &p, &error);
  if (p.host_changes * 8 > p.entries + p.host_changes) return false;
  const std::vector<SparseJob>& jobs = p.jobs;
  const size_t m = p.entries, nbytes = p.bytes;
  // Chunks in other modes: positions on the host now, values once the old
  // values they need are gathered on the device.
  std::vector<DecodedChunk> hdec(p.host_chunks.size());
  if (!error.failed()) {
    ParallelFor(options.pool, hdec.size(),
                [&](size_t k) { error.Record(p.host_chunks[k], r.DecodePositions(p.host_chunks[k], &hdec[k])); });
  }
  if (error.failed()) return Failure(r, dst, match, error.status());
  // Per tensor, the host chunks' scatter list (page-locked, then on the
  // device) and the indices of the old values they need.
  struct HostList {
    size_t m = 0, mg = 0;
    uint64_t* index = nullptr;
    uint8_t* delta = nullptr;
    uint64_t* gather = nullptr;
    const uint8_t* gathered = nullptr;
    size_t o_index = 0, o_delta = 0, o_gather = 0, o_gathered = 0;
  };
  std::vector<HostList> hl(match.size());
  std::vector<size_t> h_start(hdec.size()), g_start(hdec.size());
  auto needs_old = [&](size_t k) { return hdec[k].values_pending && hdec[k].spec.k > 1; };
  for (size_t k = 0; k < hdec.size(); ++k) {
    HostList& l = hl[chunks[p.host_chunks[k]].tensor];
    h_start[k] = l.m;
    l.m += hdec[k].pos.size();
    g_start[k] = l.mg;
    if (needs_old(k)) l.mg += hdec[k].pos.size();
  }

  // Device memory: the patch, the jobs, and per change its rank, class,
  // chunk, position and old value by class, merged position and old value,
  // scatter index and delta.
  Carver carve;
  const size_t o_patch = carve.Add<uint8_t>(patch.size());
  const size_t o_jobs = carve.Add<SparseJob>(jobs.size());
  const size_t o_counts = carve.Add<uint64_t>(jobs.size() * kMaxClasses);
  const size_t o_error = carve.Add<uint32_t>(jobs.size() + match.size());  // jobs', then rank errors per tensor
  const size_t o_rank = carve.Add<uint32_t>(m);
  const size_t o_cls = carve.Add<uint8_t>(m);
  const size_t o_chunk = carve.Add<uint32_t>(m);
  const size_t o_pos = carve.Add<uint32_t>(m);
  const size_t o_mpos = carve.Add<uint32_t>(m);
  const size_t o_index = carve.Add<uint64_t>(m);
  const size_t o_old = carve.Add<uint8_t>(nbytes);
  const size_t o_mold = carve.Add<uint8_t>(nbytes);
  const size_t o_delta = carve.Add<uint8_t>(nbytes);
  for (size_t t = 0; t < match.size(); ++t) {
    HostList& l = hl[t];
    if (l.m == 0) continue;
    const size_t width = widths[t];
    l.o_index = carve.Add<uint64_t>(l.m);
    l.o_delta = carve.Add<uint8_t>(l.m * width);
    l.o_gather = carve.Add<uint64_t>(l.mg);
    l.o_gathered = carve.Add<uint8_t>(l.mg * width);
    WSYNC_ASSIGN_OR_RETURN(l.index, pinned.Alloc<uint64_t>(l.m));
    WSYNC_ASSIGN_OR_RETURN(l.delta, pinned.Alloc<uint8_t>(l.m * width));
    WSYNC_ASSIGN_OR_RETURN(l.gather, pinned.Alloc<uint64_t>(l.mg));
  }
  WSYNC_ASSIGN_OR_RETURN(void* mem, scratch.Get(carve.bytes()));
  WSYNC_ASSIGN_OR_RETURN(uint8_t* patch_host, pinned.Alloc<uint8_t>(patch.size()));
  std::memcpy(patch_host, patch.data(), patch.size());
  WSYNC_ASSIGN_OR_RETURN(SparseJob* jobs_host, pinned.Alloc<SparseJob>(jobs.size()));
  std::copy(jobs.begin(), jobs.end(), jobs_host);
  WSYNC_RETURN_IF_ERROR(CopyUp(At<void>(mem, o_patch), patch_host, patch.size(), compute));
  WSYNC_RETURN_IF_ERROR(CopyUp(At<void>(mem, o_jobs), jobs_host, jobs.size() * sizeof(SparseJob), compute));
  WSYNC_RETURN_IF_ERROR(
      Check(cudaMemsetAsync(At<void>(mem, o_error), 0, (jobs.size() + match.size()) * 4, compute), "memset"));
  for (size_t k = 0; k < hdec.size(); ++k) {
    if (!needs_old(k)) continue;
    const Chunk& c = chunks[p.host_chunks[k]];
    uint64_t* g = hl[c.tensor].gather + g_start[k];
    for (size_t j = 0; j < hdec[k].pos.size(); ++j) g[j] = c.first_element + hdec[k].pos[j];
  }
  for (size_t t = 0; t < match.size(); ++t) {
    HostList& l = hl[t];
    if (l.mg == 0) continue;
    WSYNC_RETURN_IF_ERROR(CopyUp(At<void>(mem, l.o_gather), l.gather, l.mg * 8, compute));
    WSYNC_RETURN_IF_ERROR(LaunchGather(dst[match[t]].data, static_cast<int>(widths[t]), At<uint64_t>(mem, l.o_gather),
                                       l.mg, At<uint8_t>(mem, l.o_gathered), compute));
    WSYNC_RETURN_IF_ERROR(
        CopyToPinned(pinned, &l.gathered, At<uint8_t>(mem, l.o_gathered), l.mg * widths[t], compute));
  }
  EndPhase("upload");

  // Errors of the jobs (the first failed chunk in patch order names the
  // error) and of the rank kernel per tensor, after one synchronization.
  const uint32_t* errors = nullptr;
  auto check_errors = [&](const char* step) -> Status {
    WSYNC_RETURN_IF_ERROR(
        CopyToPinned(pinned, &errors, At<uint32_t>(mem, o_error), jobs.size() + match.size(), compute));
    WSYNC_RETURN_IF_ERROR(Check(cudaStreamSynchronize(compute), step));
    for (size_t j = 0; j < jobs.size(); ++j) {
      if (errors[j] == codec::sparse::kSparseOk) continue;
      const Chunk& c = chunks[p.job_chunk[j]];
      error.Record(
          p.job_chunk[j],
          DataLossError("tensor " + Quoted(r.tensor_name(c.tensor)) + " chunk " + std::to_string(c.index) + ": " +
                        codec::sparse::SparseErrorText(static_cast<codec::sparse::SparseError>(errors[j]))));
    }
    for (size_t t = 0; t < match.size(); ++t) {
      const uint32_t e = errors[jobs.size() + t];
      if (e == 0) continue;
      const size_t i = p.job_chunk[p.JobOfEntry(t, e - 1)];
      error.Record(i, DataLossError("tensor " + Quoted(r.tensor_name(t)) + " chunk " + std::to_string(chunks[i].index) +
                                    ": position stream: a rank beyond its class"));
    }
    return Status::Ok();
  };
  auto* rank = At<uint32_t>(mem, o_rank);
  auto* cls = At<uint8_t>(mem, o_cls);
  auto* chunk_of = At<uint32_t>(mem, o_chunk);
  auto* pos = At<uint32_t>(mem, o_pos);
  auto* old = At<uint8_t>(mem, o_old);
  auto* err = At<uint32_t>(mem, o_error);
  WSYNC_RETURN_IF_ERROR(LaunchSparseRanks(At<SparseJob>(mem, o_jobs), jobs.size(), At<uint8_t>(mem, o_patch), rank, cls,
                                          chunk_of, At<uint64_t>(mem, o_counts), err, compute));
  WSYNC_RETURN_IF_ERROR(check_errors("sparse ranks"));
  // Positions and old values of the conditioned tensors' ranks, by class
  // (a one-class chunk's ranks there are its positions).
  if (!error.failed()) {
    size_t rank_bytes = 0;
    for (size_t t = 0; t < match.size(); ++t) {
      if (!p.tensors[t].conditioned) continue;
      const size_t width = codec::DTypeWidth(dst[match[t]].dtype);
      rank_bytes =
          std::max(rank_bytes, RankScratchOf(LayoutOf(dst[match[t]].NumElements(), width, r.chunk_bytes())).bytes);
    }
    void* rmem = nullptr;
    if (rank_bytes > 0) {
      WSYNC_ASSIGN_OR_RETURN(rmem, rank_mem.Get(rank_bytes));
    }
    for (size_t t = 0; t < match.size(); ++t) {
      const SparsePlan::Tensor& tp = p.tensors[t];
      if (!tp.conditioned) continue;
      const MutableTensorView& v = dst[match[t]];
      const size_t width = codec::DTypeWidth(v.dtype);
      const logic::Layout l = LayoutOf(v.NumElements(), width, r.chunk_bytes());
      const RankScratch rs = RankScratchOf(l);
      WSYNC_RETURN_IF_ERROR(RankPrefix(v.data, width, l, tp.specs, rmem, rs));
      WSYNC_RETURN_IF_ERROR(LaunchRankPositions(v.data, static_cast<int>(width), l, At<ClassSpec>(rmem, rs.o_specs),
                                                At<uint32_t>(rmem, rs.o_prefix), chunk_of + tp.entry, cls + tp.entry,
                                                rank + tp.entry, tp.m, pos + tp.entry, old + tp.byte,
                                                err + jobs.size() + t, compute));
    }
    WSYNC_RETURN_IF_ERROR(LaunchSparseValues(At<SparseJob>(mem, o_jobs), jobs.size(), At<uint8_t>(mem, o_patch), rank,
                                             At<uint64_t>(mem, o_counts), pos, old, At<uint32_t>(mem, o_mpos),
                                             At<uint8_t>(mem, o_mold), At<uint64_t>(mem, o_index),
                                             At<uint8_t>(mem, o_delta), err, compute));
    // While the device decodes, the host chunks' values, then their lists up.
    ParallelFor(options.pool, hdec.size(), [&](size_t k) {
      const size_t i = p.host_chunks[k];
      const Chunk& c = chunks[i];
      const HostList& l = hl[c.tensor];
      const uint8_t* old_values = needs_old(k) ? l.gathered + g_start[k] * c.width : nullptr;
      const Status s = r.DecodeValues(i, old_values, &hdec[k]);
      error.Record(i, s);
      if (!s.ok()) return;
      for (size_t j = 0; j < hdec[k].pos.size(); ++j) l.index[h_start[k] + j] = c.first_element + hdec[k].pos[j];
      std::memcpy(l.delta + h_start[k] * c.width, hdec[k].delta.data(), hdec[k].delta.size());
    });
    for (size_t t = 0; t < match.size() && !error.failed(); ++t) {
      const HostList& l = hl[t];
      if (l.m == 0) continue;
      WSYNC_RETURN_IF_ERROR(CopyUp(At<void>(mem, l.o_index), l.index, l.m * 8, compute));
      WSYNC_RETURN_IF_ERROR(CopyUp(At<void>(mem, l.o_delta), l.delta, l.m * widths[t], compute));
    }
    WSYNC_RETURN_IF_ERROR(check_errors("sparse values"));
  }
  EndPhase("decode");
  if (error.failed()) return Failure(r, dst, match, error.status());
  auto scatter = [&](bool undo) -> Status {
    for (size_t t = 0; t < match.size(); ++t) {
      const SparsePlan::Tensor& tp = p.tensors[t];
      const HostList& l = hl[t];
      void* x = dst[match[t]].data;
      const int w = static_cast<int>(widths[t]);
      WSYNC_RETURN_IF_ERROR(LaunchScatterAdd(x, w, At<uint64_t>(mem, o_index) + tp.entry,
                                             At<uint8_t>(mem, o_delta) + tp.byte, tp.m, undo, compute));
      WSYNC_RETURN_IF_ERROR(LaunchScatterAdd(x, w, At<uint64_t>(mem, l.o_index), At<uint8_t>(mem, l.o_delta), l.m,
                                             undo, compute));
    }
    return Status::Ok();
  };
  WSYNC_RETURN_IF_ERROR(ScatterAndVerify(r, dst, match, scatter));
  return true;
}

Status DeviceCodec::Impl::ApplyDelta(const codec::staged::PatchReader& r, std::span<const MutableTensorView> dst,
                                     const std::vector<size_t>& match, const codec::ApplyOptions& options) {
  const auto& chunks = r.chunks();
  const auto by_tensor = ChunksByTensor(chunks, match.size());
  std::vector<DecodedChunk> decoded(chunks.size());
  FirstError error;
  pinned.Reset();
  // Stage 1 on the host: positions (or ranks) of every chunk.
  ParallelFor(options.pool, chunks.size(), [&](size_t i) { error.Record(i, r.DecodePositions(i, &decoded[i])); });
  EndPhase("positions");

  // Stage 2 on the device, every tensor in one go: positions from ranks and
  // old values, where the coding is conditioned on the base.
  struct Entries {
    size_t me = 0, mg = 0;        // ranked entries, gathered elements
    uint32_t* chunk = nullptr;    // page-locked: ranked entries' chunk in tensor, class and rank
    uint8_t* cls = nullptr;
    uint32_t* rank = nullptr;
    uint64_t* gather = nullptr;   // page-locked: element indices whose old values are gathered
    std::vector<ClassSpec> specs;
    size_t o_chunk = 0, o_cls = 0, o_rank = 0, o_pos = 0, o_eold = 0, o_err = 0, o_gidx = 0, o_gold = 0;
    const uint32_t* pos = nullptr;  // page-locked, once copied back
    const uint8_t* old = nullptr;
    const uint8_t* gathered = nullptr;
    const uint32_t* err = nullptr;
  };
  std::vector<Entries> entries(match.size());
  // Where each chunk's entries start in its tensor's lists.
  std::vector<size_t> e_start(chunks.size()), g_start(chunks.size()), tensor_of(chunks.size()), in_tensor(chunks.size());
  Carver carve;
  size_t rank_bytes = 0;
  bool any = false;
  for (size_t t = 0; t < match.size() && !error.failed(); ++t) {
    const MutableTensorView& v = dst[match[t]];
    const size_t width = codec::DTypeWidth(v.dtype);
    Entries& e = entries[t];
    e.specs.resize(by_tensor[t].size());
    for (size_t c = 0; c < by_tensor[t].size(); ++c) {
      const size_t i = by_tensor[t][c];
      const DecodedChunk& dc = decoded[i];
      e.specs[c] = dc.spec;
      tensor_of[i] = t;
      in_tensor[i] = c;
      e_start[i] = e.me;
      g_start[i] = e.mg;
      if (!dc.values_pending || dc.spec.k == 1) continue;
      if (dc.ranked) {
        uint64_t listed = 0;
        for (int k = 0; k < dc.spec.k; ++k) listed += dc.class_counts[k];
        if (listed != dc.ranks.size()) {
          error.Record(i, DataLossError("tensor " + Quoted(r.tensor_name(t)) + " chunk " +
                                        std::to_string(chunks[i].index) + ": class counts do not sum to its ranks"));
        }
        e.me += dc.ranks.size();
      } else {
        e.mg += dc.pos.size();
      }
    }
    if (e.me == 0 && e.mg == 0) continue;
    any = true;
    WSYNC_ASSIGN_OR_RETURN(e.chunk, pinned.Alloc<uint32_t>(e.me));
    WSYNC_ASSIGN_OR_RETURN(e.cls, pinned.Alloc<uint8_t>(e.me));
    WSYNC_ASSIGN_OR_RETURN(e.rank, pinned.Alloc<uint32_t>(e.me));
    WSYNC_ASSIGN_OR_RETURN(e.gather, pinned.Alloc<uint64_t>(e.mg));
    e.o_chunk = carve.Add<uint32_t>(e.me);
    e.o_cls = carve.Add<uint8_t>(e.me);
    e.o_rank = carve.Add<uint32_t>(e.me);
    e.o_pos = carve.Add<uint32_t>(e.me);
    e.o_eold = carve.Add<uint8_t>(e.me * width);
    e.o_err = carve.Add<uint32_t>(1);
    e.o_gidx = carve.Add<uint64_t>(e.mg);
    e.o_gold = carve.Add<uint8_t>(e.mg * width);
    if (e.me > 0) {
      rank_bytes = std::max(rank_bytes, RankScratchOf(LayoutOf(v.NumElements(), width, r.chunk_bytes())).bytes);
    }
  }
  if (any && !error.failed()) {
    ParallelFor(options.pool, chunks.size(), [&](size_t i) {
      const DecodedChunk& dc = decoded[i];
      if (!dc.values_pending || dc.spec.k == 1) return;
      Entries& e = entries[tensor_of[i]];
      if (dc.ranked) {
        RankEntries(dc, static_cast<uint32_t>(in_tensor[i]), e.chunk + e_start[i], e.cls + e_start[i],
                    e.rank + e_start[i]);
      } else {
        for (size_t j = 0; j < dc.pos.size(); ++j) e.gather[g_start[i] + j] = chunks[i].first_element + dc.pos[j];
      }
    });
  }
  if (any && !error.failed()) {
    WSYNC_ASSIGN_OR_RETURN(void* mem, scratch.Get(carve.bytes()));
    void* rmem = nullptr;
    if (rank_bytes > 0) {
      WSYNC_ASSIGN_OR_RETURN(rmem, rank_mem.Get(rank_bytes));
    }
    for (size_t t = 0; t < match.size(); ++t) {
      Entries& e = entries[t];
      const size_t me = e.me, mg = e.mg;
      if (me == 0 && mg == 0) continue;
      const MutableTensorView& v = dst[match[t]];
      const size_t width = codec::DTypeWidth(v.dtype);
      const int w = static_cast<int>(width);
      const logic::Layout l = LayoutOf(v.NumElements(), width, r.chunk_bytes());
      if (me > 0) {
        const RankScratch rs = RankScratchOf(l);
        WSYNC_RETURN_IF_ERROR(RankPrefix(v.data, width, l, e.specs, rmem, rs));
        WSYNC_RETURN_IF_ERROR(CopyUp(At<void>(mem, e.o_chunk), e.chunk, me * 4, compute));
        WSYNC_RETURN_IF_ERROR(CopyUp(At<void>(mem, e.o_cls), e.cls, me, compute));
        WSYNC_RETURN_IF_ERROR(CopyUp(At<void>(mem, e.o_rank), e.rank, me * 4, compute));
        WSYNC_RETURN_IF_ERROR(Check(cudaMemsetAsync(At<void>(mem, e.o_err), 0, 4, compute), "memset"));
        WSYNC_RETURN_IF_ERROR(LaunchRankPositions(v.data, w, l, At<ClassSpec>(rmem, rs.o_specs),
                                                  At<uint32_t>(rmem, rs.o_prefix), At<uint32_t>(mem, e.o_chunk),
                                                  At<uint8_t>(mem, e.o_cls), At<uint32_t>(mem, e.o_rank), me,
                                                  At<uint32_t>(mem, e.o_pos), At<uint8_t>(mem, e.o_eold),
                                                  At<uint32_t>(mem, e.o_err), compute));
        WSYNC_RETURN_IF_ERROR(CopyToPinned(pinned, &e.pos, At<uint32_t>(mem, e.o_pos), me, compute));
        WSYNC_RETURN_IF_ERROR(CopyToPinned(pinned, &e.old, At<uint8_t>(mem, e.o_eold), me * width, compute));
        WSYNC_RETURN_IF_ERROR(CopyToPinned(pinned, &e.err, At<uint32_t>(mem, e.o_err), 1, compute));
      }
      if (mg > 0) {
        WSYNC_RETURN_IF_ERROR(CopyUp(At<void>(mem, e.o_gidx), e.gather, mg * 8, compute));
        WSYNC_RETURN_IF_ERROR(
            LaunchGather(v.data, w, At<uint64_t>(mem, e.o_gidx), mg, At<uint8_t>(mem, e.o_gold), compute));
        WSYNC_RETURN_IF_ERROR(CopyToPinned(pinned, &e.gathered, At<uint8_t>(mem, e.o_gold), mg * width, compute));
      }
    }
    WSYNC_RETURN_IF_ERROR(Check(cudaStreamSynchronize(compute), "positions"));
    for (size_t t = 0; t < match.size(); ++t) {
      const Entries& e = entries[t];
      if (e.err == nullptr || e.err[0] == 0) continue;
      const size_t k = e.err[0] - 1;
      const size_t i = by_tensor[t][e.chunk[k]];
      error.Record(i, DataLossError("tensor " + Quoted(r.tensor_name(t)) + " chunk " +
                                    std::to_string(chunks[i].index) + ": position stream: class " +
                                    std::to_string(e.cls[k]) + " rank " + std::to_string(e.rank[k]) +
                                    " beyond its elements"));
    }
  }
  EndPhase("ranks");
  // Old values of every chunk: ranked entries merged by position, gathered
  // ones as they come.
  std::vector<std::vector<uint8_t>> old(chunks.size());
  if (any && !error.failed()) {
    ParallelFor(options.pool, chunks.size(), [&](size_t i) {
      DecodedChunk& dc = decoded[i];
      if (!dc.values_pending || dc.spec.k == 1) return;
      const Entries& e = entries[tensor_of[i]];
      const size_t width = chunks[i].width;
      if (dc.ranked) {
        error.Record(i, codec::staged::MergeRankedPositions(e.pos + e_start[i], e.old + e_start[i] * width, width,
                                                             &dc, &old[i]));
      } else {
        old[i].assign(e.gathered + g_start[i] * width, e.gathered + (g_start[i] + dc.pos.size()) * width);
      }
    });
  }
  // Stage 3 on the host: the values.
  if (!error.failed()) {
    ParallelFor(options.pool, chunks.size(), [&](size_t i) {
      error.Record(i, r.DecodeValues(i, old[i].empty() ? nullptr : old[i].data(), &decoded[i]));
    });
  }
  EndPhase("values");
  if (error.failed()) return Failure(r, dst, match, error.status());

  // Scatter every tensor, then verify every tensor; undo all on a mismatch.
  struct List {
    uint64_t* index = nullptr;  // page-locked
    uint8_t* delta = nullptr;
    size_t m = 0, o_idx = 0, o_delta = 0;
  };
  std::vector<List> lists(match.size());
  Carver sc;
  for (size_t t = 0; t < match.size(); ++t) {
    List& li = lists[t];
    for (size_t i : by_tensor[t]) li.m += decoded[i].pos.size();
    const size_t width = codec::DTypeWidth(dst[match[t]].dtype);
    WSYNC_ASSIGN_OR_RETURN(li.index, pinned.Alloc<uint64_t>(li.m));
    WSYNC_ASSIGN_OR_RETURN(li.delta, pinned.Alloc<uint8_t>(li.m * width));
    li.o_idx = sc.Add<uint64_t>(li.m);
    li.o_delta = sc.Add<uint8_t>(li.m * width);
  }
  ParallelFor(options.pool, match.size(), [&](size_t t) {
    List& li = lists[t];
    size_t at = 0, bytes = 0;
    for (size_t i : by_tensor[t]) {
      const DecodedChunk& dc = decoded[i];
      for (uint32_t p : dc.pos) li.index[at++] = chunks[i].first_element + p;
      if (dc.delta.empty()) continue;
      std::memcpy(li.delta + bytes, dc.delta.data(), dc.delta.size());
      bytes += dc.delta.size();
    }
  });
  WSYNC_ASSIGN_OR_RETURN(void* smem, changes.Get(sc.bytes()));
  auto scatter = [&](bool undo) -> Status {
    for (size_t t = 0; t < match.size(); ++t) {
      const List& li = lists[t];
      if (li.m == 0) continue;
      const MutableTensorView& v = dst[match[t]];
      const int w = static_cast<int>(codec::DTypeWidth(v.dtype));
      if (!undo) {
        WSYNC_RETURN_IF_ERROR(CopyUp(At<void>(smem, li.o_idx), li.index, li.m * 8, compute));
        WSYNC_RETURN_IF_ERROR(CopyUp(At<void>(smem, li.o_delta), li.delta, li.m * w, compute));
      }
      WSYNC_RETURN_IF_ERROR(LaunchScatterAdd(v.data, w, At<uint64_t>(smem, li.o_idx), At<uint8_t>(smem, li.o_delta),
                                             li.m, undo, compute));
    }
    return Status::Ok();
  };
  return ScatterAndVerify(r, dst, match, scatter);
}

Status DeviceCodec::Impl::ApplyPlaced(std::span<const codec::staged::PatchReader* const> readers,
                                      std::span<const codec::staged::ApplyPlan> plans, std::span<void* const> dst,
                                      const codec::ApplyOptions& options,
                                      const std::function<Status(Status)>& unwritten) {
  // Every work's decoding state and result digests; errors ordered by work
  // across the parts.
  std::vector<size_t> first(plans.size() + 1, 0);
  for (size_t p = 0; p < plans.size(); ++p) first[p + 1] = first[p] + plans[p].works.size();
  std::vector<std::vector<DecodedChunk>> decoded(plans.size());
  std::vector<std::vector<std::vector<uint64_t>>> digests(plans.size());
  for (size_t p = 0; p < plans.size(); ++p) {
    decoded[p].resize(plans[p].works.size());
    digests[p].resize(plans[p].works.size());
  }
  auto where = [&](const placed::Ref& ref) {
    const auto& r = *readers[ref.part];
    const Chunk& c = r.chunks()[plans[ref.part].works[ref.work].chunk];
    return "tensor " + Quoted(r.tensor_name(c.tensor)) + " chunk " + std::to_string(c.index);
  };
  auto gridded = [&](const placed::Ref& ref) {
    const auto& r = *readers[ref.part];
    return r.gridded(r.chunks()[plans[ref.part].works[ref.work].chunk].tensor);
  };
  auto fail = [&](const Status& s) {
    if (s.code() != StatusCode::kDataLoss) return s;
    return unwritten(DataLossError(s.message() + " (the patch is corrupted or the destination does not hold its "
                                                 "base); destination unchanged"));
  };
  FirstError error;
  // Stage 1 on the host: positions (or ranks) of every work's chunk.
  ParallelFor(options.pool, first.back(), [&](size_t g) {
    const size_t p = std::upper_bound(first.begin(), first.end(), g) - first.begin() - 1;
    const size_t w = g - first[p];
    error.Record(g, readers[p]->DecodePositions(plans[p].works[w].chunk, &decoded[p][w]));
  });
  EndPhase("positions");
  if (error.failed()) return fail(error.status());

  // Batch after batch: gather the works' chunks into image slots, resolve
  // ranks and old values there, decode the values on the host, add them in
  // the image and digest the results. The destination is not touched.
  struct Change {
    size_t width = 0;
    std::vector<uint64_t> index;
    std::vector<uint8_t> delta;
  };
  std::vector<Change> commit(dst.size());
  for (const placed::Batch& b : placed::Batches(readers, plans, kImageBytes)) {
    pinned.Reset();
    const size_t n = b.works.size(), width = b.width;
    const int w = static_cast<int>(width);
    const logic::Layout l = LayoutOf(n * b.slot, width, static_cast<uint32_t>(b.slot * width));
    // Entries of ranked chunks (slot, class, rank) and old values to gather.
    std::vector<ClassSpec> specs(n);
    std::vector<size_t> e_start(n), g_start(n);
    size_t me = 0, mg = 0;
    for (size_t j = 0; j < n; ++j) {
      const DecodedChunk& dc = decoded[b.works[j].part][b.works[j].work];
      specs[j] = dc.spec;
      e_start[j] = me;
      g_start[j] = mg;
      if (!dc.values_pending || dc.spec.k == 1) continue;
      if (dc.ranked) {
        uint64_t listed = 0;
        for (int k = 0; k < dc.spec.k; ++k) listed += dc.class_counts[k];
        if (listed != dc.ranks.size()) {
          return fail(DataLossError(where(b.works[j]) + ": class counts do not sum to its ranks"));
        }
        me += dc.ranks.size();
      } else {
        mg += dc.pos.size();
      }
    }
    Carver carve;
    const size_t o_image = carve.Add<uint8_t>(n * b.slot * width);
    const size_t o_jobs = carve.Add<TileJob>(n);
    const size_t o_chunk = carve.Add<uint32_t>(me), o_cls = carve.Add<uint8_t>(me), o_rank = carve.Add<uint32_t>(me);
    const size_t o_pos = carve.Add<uint32_t>(me), o_eold = carve.Add<uint8_t>(me * width);
    const size_t o_err = carve.Add<uint32_t>(1);
    const size_t o_gidx = carve.Add<uint64_t>(mg), o_gold = carve.Add<uint8_t>(mg * width);
    const size_t o_djobs = carve.Add<DigestJob>(n);
    size_t blocks = 0;
    for (const placed::Ref& ref : b.works) {
      blocks += codec::ChecksumBlockCount(plans[ref.part].works[ref.work].map.n * width);
    }
    const size_t o_digests = carve.Add<uint64_t>(blocks);
    WSYNC_ASSIGN_OR_RETURN(void* mem, scratch.Get(carve.bytes()));
    void* image = At<void>(mem, o_image);
    WSYNC_ASSIGN_OR_RETURN(TileJob* jobs, pinned.Alloc<TileJob>(n));
    for (size_t j = 0; j < n; ++j) {
      const codec::staged::Work& work = plans[b.works[j].part].works[b.works[j].work];
      jobs[j] = TileJob{dst[work.dst], work.map};
    }
    WSYNC_RETURN_IF_ERROR(CopyUp(At<void>(mem, o_jobs), jobs, n * sizeof(TileJob), compute));
    WSYNC_RETURN_IF_ERROR(LaunchGatherTiles(At<TileJob>(mem, o_jobs), n, w, b.slot, image, compute));
    EndPhase("gather");
    const uint32_t* pos_back = nullptr;
    const uint8_t* eold_back = nullptr;
    const uint8_t* gold_back = nullptr;
    const uint32_t* err_back = nullptr;
    uint32_t* chunk_h = nullptr;
    uint8_t* cls_h = nullptr;
    uint32_t* rank_h = nullptr;
    if (me > 0 || mg > 0) {
      WSYNC_ASSIGN_OR_RETURN(chunk_h, pinned.Alloc<uint32_t>(me));
      WSYNC_ASSIGN_OR_RETURN(cls_h, pinned.Alloc<uint8_t>(me));
      WSYNC_ASSIGN_OR_RETURN(rank_h, pinned.Alloc<uint32_t>(me));
      WSYNC_ASSIGN_OR_RETURN(uint64_t* gidx_h, pinned.Alloc<uint64_t>(mg));
      for (size_t j = 0; j < n; ++j) {
        const DecodedChunk& dc = decoded[b.works[j].part][b.works[j].work];
        if (!dc.values_pending || dc.spec.k == 1) continue;
        if (dc.ranked) {
          RankEntries(dc, static_cast<uint32_t>(j), chunk_h + e_start[j], cls_h + e_start[j], rank_h + e_start[j]);
        } else {
          for (size_t i = 0; i < dc.pos.size(); ++i) gidx_h[g_start[j] + i] = j * b.slot + dc.pos[i];
        }
      }
      if (me > 0) {
        const RankScratch rs = RankScratchOf(l);
        WSYNC_ASSIGN_OR_RETURN(void* rmem, rank_mem.Get(rs.bytes));
        WSYNC_RETURN_IF_ERROR(RankPrefix(image, width, l, specs, rmem, rs));
        WSYNC_RETURN_IF_ERROR(CopyUp(At<void>(mem, o_chunk), chunk_h, me * 4, compute));
        WSYNC_RETURN_IF_ERROR(CopyUp(At<void>(mem, o_cls), cls_h, me, compute));
        WSYNC_RETURN_IF_ERROR(CopyUp(At<void>(mem, o_rank), rank_h, me * 4, compute));
        WSYNC_RETURN_IF_ERROR(Check(cudaMemsetAsync(At<void>(mem, o_err), 0, 4, compute), "memset"));
        WSYNC_RETURN_IF_ERROR(LaunchRankPositions(image, w, l, At<ClassSpec>(rmem, rs.o_specs),
                                                  At<uint32_t>(rmem, rs.o_prefix), At<uint32_t>(mem, o_chunk),
                                                  At<uint8_t>(mem, o_cls), At<uint32_t>(mem, o_rank), me,
                                                  At<uint32_t>(mem, o_pos), At<uint8_t>(mem, o_eold),
                                                  At<uint32_t>(mem, o_err), compute));
        WSYNC_RETURN_IF_ERROR(CopyToPinned(pinned, &pos_back, At<uint32_t>(mem, o_pos), me, compute));
        WSYNC_RETURN_IF_ERROR(CopyToPinned(pinned, &eold_back, At<uint8_t>(mem, o_eold), me * width, compute));
        WSYNC_RETURN_IF_ERROR(CopyToPinned(pinned, &err_back, At<uint32_t>(mem, o_err), 1, compute));
      }
      if (mg > 0) {
        WSYNC_RETURN_IF_ERROR(CopyUp(At<void>(mem, o_gidx), gidx_h, mg * 8, compute));
        WSYNC_RETURN_IF_ERROR(LaunchGather(image, w, At<uint64_t>(mem, o_gidx), mg, At<uint8_t>(mem, o_gold), compute));
        WSYNC_RETURN_IF_ERROR(CopyToPinned(pinned, &gold_back, At<uint8_t>(mem, o_gold), mg * width, compute));
      }
      WSYNC_RETURN_IF_ERROR(Check(cudaStreamSynchronize(compute), "positions"));
      if (err_back != nullptr && err_back[0] != 0) {
        const size_t k = err_back[0] - 1;
        return fail(DataLossError(where(b.works[chunk_h[k]]) + ": position stream: class " +
                                  std::to_string(cls_h[k]) + " rank " + std::to_string(rank_h[k]) +
                                  " beyond its elements"));
      }
    }
    EndPhase("ranks");
    // Stage 3 on the host: old values by position, then the values.
    ParallelFor(options.pool, n, [&](size_t j) {
      const placed::Ref& ref = b.works[j];
      DecodedChunk& dc = decoded[ref.part][ref.work];
      const size_t g = first[ref.part] + ref.work;
      std::vector<uint8_t> old;
      if (dc.values_pending && dc.spec.k > 1) {
        if (dc.ranked) {
          Status s = codec::staged::MergeRankedPositions(pos_back + e_start[j], eold_back + e_start[j] * width,
                                                         width, &dc, &old);
          if (s.ok() && !dc.pos.empty() && dc.pos.back() >= plans[ref.part].works[ref.work].map.n) {
            s = DataLossError(where(ref) + ": position stream: a rank beyond its elements");
          }
          if (!s.ok()) return error.Record(g, s);
        } else {
          old.assign(gold_back + g_start[j] * width, gold_back + (g_start[j] + dc.pos.size()) * width);
        }
      }
      error.Record(g, readers[ref.part]->DecodeValues(plans[ref.part].works[ref.work].chunk,
                                                      old.empty() ? nullptr : old.data(), &dc));
    });
    EndPhase("values");
    if (error.failed()) return fail(error.status());
    // The results in the image, and their digests.
    size_t m = 0;
    for (const placed::Ref& ref : b.works) m += decoded[ref.part][ref.work].pos.size();
    WSYNC_ASSIGN_OR_RETURN(uint64_t* idx_h, pinned.Alloc<uint64_t>(m));
    WSYNC_ASSIGN_OR_RETURN(uint8_t* delta_h, pinned.Alloc<uint8_t>(m * width));
    WSYNC_ASSIGN_OR_RETURN(DigestJob* djobs, pinned.Alloc<DigestJob>(n));
    Carver sc;
    const size_t o_idx = sc.Add<uint64_t>(m), o_delta = sc.Add<uint8_t>(m * width);
    WSYNC_ASSIGN_OR_RETURN(void* smem, changes.Get(sc.bytes()));
    // Digests on the device: a 1 MiB block each. A gridded chunk of more
    // than one block is hashed whole on the host (its tile digest).
    std::vector<const uint8_t*> whole(n, nullptr);
    size_t at = 0, nd = 0;
    uint64_t block = 0;
    for (size_t j = 0; j < n; ++j) {
      const placed::Ref& ref = b.works[j];
      const DecodedChunk& dc = decoded[ref.part][ref.work];
      for (uint32_t p : dc.pos) idx_h[at++] = j * b.slot + p;
      if (!dc.delta.empty()) std::memcpy(delta_h + (at - dc.pos.size()) * width, dc.delta.data(), dc.delta.size());
    }
    WSYNC_RETURN_IF_ERROR(CopyUp(At<void>(smem, o_idx), idx_h, m * 8, compute));
    WSYNC_RETURN_IF_ERROR(CopyUp(At<void>(smem, o_delta), delta_h, m * width, compute));
    WSYNC_RETURN_IF_ERROR(LaunchScatterAdd(image, w, At<uint64_t>(smem, o_idx), At<uint8_t>(smem, o_delta), m,
                                           /*undo=*/false, compute));
    for (size_t j = 0; j < n; ++j) {
      const placed::Ref& ref = b.works[j];
      const uint64_t bytes = plans[ref.part].works[ref.work].map.n * width;
      const uint8_t* slot = static_cast<const uint8_t*>(image) + j * b.slot * width;
      if (gridded(ref) && bytes > codec::kChecksumBlockBytes) {
        WSYNC_RETURN_IF_ERROR(CopyToPinned(pinned, &whole[j], slot, bytes, compute));
        continue;
      }
      djobs[nd++] = DigestJob{slot, bytes, At<uint64_t>(mem, o_digests) + block, block};
      block += codec::ChecksumBlockCount(bytes);
    }
    if (nd > 0) {
      WSYNC_RETURN_IF_ERROR(CopyUp(At<void>(mem, o_djobs), djobs, nd * sizeof(DigestJob), compute));
      WSYNC_RETURN_IF_ERROR(LaunchBlockDigests(At<DigestJob>(mem, o_djobs), nd, block, compute));
    }
    const uint64_t* sums = nullptr;
    WSYNC_RETURN_IF_ERROR(CopyToPinned(pinned, &sums, At<uint64_t>(mem, o_digests), block, compute));
    WSYNC_RETURN_IF_ERROR(Check(cudaStreamSynchronize(compute), "digests"));
    block = 0;
    for (size_t j = 0; j < n; ++j) {
      const placed::Ref& ref = b.works[j];
      const codec::staged::Work& work = plans[ref.part].works[ref.work];
      const uint64_t bytes = work.map.n * width;
      if (whole[j] != nullptr) {
        digests[ref.part][ref.work] = placed::ResultDigests(true, whole[j], bytes);
      } else {
        const uint64_t count = codec::ChecksumBlockCount(bytes);
        digests[ref.part][ref.work].assign(sums + block, sums + block + count);
        block += count;
      }
      Change& c = commit[work.dst];
      c.width = width;
      placed::AppendChange(work, decoded[ref.part][ref.work], &c.index, &c.delta);
      decoded[ref.part][ref.work] = DecodedChunk{};
    }
    EndPhase("verify");
  }
  if (auto bad = placed::Mismatch(readers, plans, digests)) {
    return unwritten(DataLossError(*bad + ": result does not match the patch's checksum (the patch is corrupted or "
                                          "the destination does not hold its base); destination unchanged"));
  }
  // Every work verified: the changes at their placements.
  pinned.Reset();
  Carver cc;
  std::vector<size_t> o_idx(dst.size()), o_delta(dst.size());
  for (size_t d = 0; d < dst.size(); ++d) {
    o_idx[d] = cc.Add<uint64_t>(commit[d].index.size());
    o_delta[d] = cc.Add<uint8_t>(commit[d].delta.size());
  }
  WSYNC_ASSIGN_OR_RETURN(void* cmem, changes.Get(cc.bytes()));
  Status written;
  for (size_t d = 0; d < dst.size() && written.ok(); ++d) {
    const Change& c = commit[d];
    if (c.index.empty()) continue;
    written = CopyUp(At<void>(cmem, o_idx[d]), c.index.data(), c.index.size() * 8, compute);
    if (written.ok()) written = CopyUp(At<void>(cmem, o_delta[d]), c.delta.data(), c.delta.size(), compute);
    if (written.ok()) {
      written = LaunchScatterAdd(dst[d], static_cast<int>(c.width), At<uint64_t>(cmem, o_idx[d]),
                                 At<uint8_t>(cmem, o_delta[d]), c.index.size(), /*undo=*/false, compute);
    }
  }
  if (written.ok()) written = Check(cudaStreamSynchronize(compute), "scatter");
  EndPhase("scatter");
  if (!written.ok()) {
    return DataLossError("writing the verified change: " + written.ToString() + "; the destination may be torn");
  }
  return Status::Ok();
}

Status DeviceCodec::Impl::WriteTiles(const codec::staged::PatchReader& r, const codec::staged::ApplyPlan& plan,
                                     const std::vector<std::vector<uint8_t>>& values, std::span<void* const> dst) {
  const codec::staged::PatchReader* readers[] = {&r};
  for (const placed::Batch& b : placed::Batches(readers, std::span(&plan, 1), kImageBytes)) {
    pinned.Reset();
    const size_t n = b.works.size(), slot_bytes = b.slot * b.width;
    WSYNC_ASSIGN_OR_RETURN(uint8_t* image_h, pinned.Alloc<uint8_t>(n * slot_bytes));
    WSYNC_ASSIGN_OR_RETURN(TileJob* jobs, pinned.Alloc<TileJob>(n));
    for (size_t j = 0; j < n; ++j) {
      const codec::staged::Work& work = plan.works[b.works[j].work];
      const auto& v = values[b.works[j].work];
      std::memcpy(image_h + j * slot_bytes, v.data(), v.size());
      jobs[j] = TileJob{dst[work.dst], work.map};
    }
    Carver carve;
    const size_t o_image = carve.Add<uint8_t>(n * slot_bytes), o_jobs = carve.Add<TileJob>(n);
    WSYNC_ASSIGN_OR_RETURN(void* mem, scratch.Get(carve.bytes()));
    WSYNC_RETURN_IF_ERROR(CopyUp(At<void>(mem, o_image), image_h, n * slot_bytes, compute));
    WSYNC_RETURN_IF_ERROR(CopyUp(At<void>(mem, o_jobs), jobs, n * sizeof(TileJob), compute));
    WSYNC_RETURN_IF_ERROR(LaunchScatterTiles(At<TileJob>(mem, o_jobs), n, static_cast<int>(b.width), b.slot,
                                             At<void>(mem, o_image), compute));
    WSYNC_RETURN_IF_ERROR(Check(cudaStreamSynchronize(compute), "writing a keyframe"));
  }
  EndPhase("write");
  return Status::Ok();
}

Status DeviceCodec::ApplyFlat(const codec::staged::PatchReader& reader, std::string_view patch,
                               std::span<const MutableTensorView> tensors, const codec::ApplyOptions& options) {
  WSYNC_ASSIGN_OR_RETURN(auto match, reader.Match(tensors, options.allow_extra_tensors));
  if (reader.kind() == codec::PatchKind::kKeyframe) return impl_->ApplyKeyframe(reader, tensors, match, options);
  impl_->pinned.Reset();
  WSYNC_ASSIGN_OR_RETURN(bool on_device, impl_->ApplySparse(patch, reader, tensors, match, options));
  if (on_device) return Status::Ok();
  return impl_->ApplyDelta(reader, tensors, match, options);
}

Status DeviceCodec::Apply(std::string_view patch, const codec::Destination& destination,
                          const codec::ApplyOptions& options) {
  return ApplyParts(std::span(&patch, 1), destination, options, /*as_parts=*/false);
}

Status DeviceCodec::Apply(std::span<const std::string_view> parts, const codec::Destination& destination,
                          const codec::ApplyOptions& options) {
  return ApplyParts(parts, destination, options, /*as_parts=*/true);
}

Status DeviceCodec::ApplyParts(std::span<const std::string_view> parts, const codec::Destination& destination,
                               const codec::ApplyOptions& options, bool as_parts) {
  std::vector<codec::staged::PatchReader> readers;
  for (std::string_view p : parts) {
    WSYNC_ASSIGN_OR_RETURN(auto r, codec::staged::PatchReader::Open(p, options.verify_patch_checksum));
    readers.push_back(std::move(r));
  }
  impl_->StartPhases();
  WSYNC_RETURN_IF_ERROR(impl_->Activate());
  const EndOfCall end{impl_->compute, impl_->pinned};
  if (!as_parts && readers.size() == 1 && !destination.pieces() && readers[0].flat()) {
    return ApplyFlat(readers[0], parts[0], destination.tensors(), options);
  }
  std::vector<const codec::staged::PatchReader*> refs;
  for (const auto& r : readers) refs.push_back(&r);
  WSYNC_ASSIGN_OR_RETURN(auto plans, codec::staged::PlanApply(refs, destination, options, as_parts));
  std::vector<void*> dst;
  if (destination.pieces()) {
    for (const auto& rt : destination.runtime()) dst.push_back(rt.view.data);
  } else {
    for (const auto& t : destination.tensors()) dst.push_back(t.data);
  }
  // As codec::Apply: keyframes decoded and verified first (on the host:
  // their bytes are there), then the patches applied, then the keyframes
  // written.
  std::vector<const codec::staged::PatchReader*> patch_refs, key_refs;
  std::vector<codec::staged::ApplyPlan> patch_plans, key_plans;
  for (size_t i = 0; i < refs.size(); ++i) {
    const bool key = refs[i]->kind() == codec::PatchKind::kKeyframe;
    (key ? key_refs : patch_refs).push_back(refs[i]);
    (key ? key_plans : patch_plans).push_back(std::move(plans[i]));
  }
  std::vector<placed::DecodedWorks> keyframes;
  std::vector<std::vector<std::vector<uint64_t>>> key_digests;
  for (size_t i = 0; i < key_refs.size(); ++i) {
    WSYNC_ASSIGN_OR_RETURN(auto d, placed::DecodeKeyframeWorks(*key_refs[i], key_plans[i], options.pool));
    key_digests.push_back(std::move(d.digests));
    keyframes.push_back(std::move(d));
  }
  impl_->EndPhase("keyframes");
  if (auto bad = placed::Mismatch(key_refs, key_plans, key_digests)) {
    return DataLossError(*bad + ": the keyframe's values do not match its checksum (a corrupt keyframe); "
                                "destination unchanged");
  }
  // As codec::Apply: into whole tensors, a failure of a part whose base the
  // tensors do not hold is that (FailedPrecondition); pieces cannot tell.
  auto unwritten = [&](Status s) -> Status {
    if (destination.pieces()) return s;
    for (const codec::staged::PatchReader* r : patch_refs) {
      auto match = r->Match(destination.tensors(), /*allow_extra=*/true);
      if (!match.ok()) return s;
      std::vector<TensorView> held;
      for (size_t i : *match) held.push_back(destination.tensors()[i].AsConst());
      auto sum = SetChecksum(held, r->grids());
      if (sum.ok() && *sum != r->base_set_checksum()) return WrongBase(*r);
    }
    return s;
  };
  if (!patch_refs.empty()) {
    WSYNC_RETURN_IF_ERROR(impl_->ApplyPlaced(patch_refs, patch_plans, dst, options, unwritten));
  }
  for (size_t i = 0; i < key_refs.size(); ++i) {
    Status s = impl_->WriteTiles(*key_refs[i], key_plans[i], keyframes[i].values, dst);
    if (!s.ok()) return DataLossError("writing a verified keyframe: " + s.ToString() + "; the destination may be torn");
  }
  return Status::Ok();
}

const std::vector<DeviceCodec::Phase>& DeviceCodec::last_phases() const { return impl_->phases; }

StatusOr<uint64_t> DeviceCodec::SetChecksum(std::span<const TensorView> tensors,
                                            std::span<const codec::TileGrid> grids) {
  Impl& d = *impl_;
  WSYNC_RETURN_IF_ERROR(d.Activate());
  const EndOfCall end{d.compute, d.pinned};
  codec::EncodeOptions o;
  o.grids.assign(grids.begin(), grids.end());
  WSYNC_ASSIGN_OR_RETURN(auto writer, codec::staged::PatchWriter::Create(tensors, o));
  const auto& cells = writer.cells();
  std::vector<std::vector<uint64_t>> blocks(tensors.size());
  // Cells batch by batch: whole rows hashed in place, the others gathered
  // first (at most kStagingBytes of them at a time, or one).
  for (size_t k0 = 0; k0 < cells.size();) {
    d.pinned.Reset();
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
    WSYNC_ASSIGN_OR_RETURN(void* mem, d.images.Get(carve.bytes()));
    std::vector<DigestJob> jobs;
    uint8_t* at = At<uint8_t>(mem, o_image);
    uint64_t block = 0;
    for (size_t k = k0; k < k1; ++k) {
      const codec::staged::Cell& c = cells[k];
      const size_t w = codec::DTypeWidth(tensors[c.tensor].dtype), bytes = c.elements() * w;
      WSYNC_ASSIGN_OR_RETURN(const uint8_t* src, CellElements(c, tensors[c.tensor].data, w, at, d.compute));
      at += GatheredBytes(c, w);
      jobs.push_back({src, bytes, At<uint64_t>(mem, o_sums) + block, 0});
      block += codec::ChecksumBlockCount(bytes);
    }
    WSYNC_RETURN_IF_ERROR(EnqueueDigests(d.pinned, jobs, At<DigestJob>(mem, o_jobs), d.compute));
    const uint64_t* sums = nullptr;
    WSYNC_RETURN_IF_ERROR(CopyToPinned(d.pinned, &sums, At<uint64_t>(mem, o_sums), nblocks, d.compute));
    WSYNC_RETURN_IF_ERROR(Check(cudaStreamSynchronize(d.compute), "checksums"));
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

StatusOr<uint64_t> DeviceCodec::TensorChecksum(const void* data, size_t nbytes) {
  WSYNC_RETURN_IF_ERROR(impl_->Activate());
  impl_->pinned.Reset();
  return impl_->Checksum(data, nbytes);
}

Status DeviceCodec::CastFp32ToBf16(const uint32_t* src, uint16_t* dst, size_t n) {
  WSYNC_RETURN_IF_ERROR(impl_->Activate());
  WSYNC_RETURN_IF_ERROR(LaunchCastFp32ToBf16(src, dst, n, impl_->compute));
  return Check(cudaStreamSynchronize(impl_->compute), "cast");
}

Status CopyDeviceToHost(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return Status::Ok();
  return Check(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), "copy to host");
}

Status CopyHostToDevice(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return Status::Ok();
  return Check(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), "copy to device");
}

Status CopyDeviceToDevice(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return Status::Ok();
  WSYNC_RETURN_IF_ERROR(Check(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToDevice), "device copy"));
  return Check(cudaDeviceSynchronize(), "device copy");
}

// ------------------------------------------------------------ DeviceBuffer

StatusOr<DeviceBuffer> DeviceBuffer::Allocate(size_t bytes, int device) {
  WSYNC_RETURN_IF_ERROR(DeviceAvailable());
  WSYNC_RETURN_IF_ERROR(Check(cudaSetDevice(device), "select device"));
  DeviceBuffer b;
  if (bytes > 0) WSYNC_RETURN_IF_ERROR(Check(cudaMalloc(&b.data_, bytes), "allocate"));
  b.size_ = bytes;
  return b;
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& o) noexcept : data_(o.data_), size_(o.size_) {
  o.data_ = nullptr;
  o.size_ = 0;
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    if (data_ != nullptr) cudaFree(data_);
    data_ = o.data_;
    size_ = o.size_;
    o.data_ = nullptr;
    o.size_ = 0;
  }
  return *this;
}

DeviceBuffer::~DeviceBuffer() {
  if (data_ != nullptr) cudaFree(data_);
}

Status DeviceBuffer::CopyFromHost(const void* src, size_t bytes, size_t offset) {
  if (offset > size_ || bytes > size_ - offset) return OutOfRangeError("copy past the device buffer's end");
  return Check(cudaMemcpy(static_cast<uint8_t*>(data_) + offset, src, bytes, cudaMemcpyHostToDevice), "copy");
}

Status DeviceBuffer::CopyToHost(void* dst, size_t bytes, size_t offset) const {
  if (offset > size_ || bytes > size_ - offset) return OutOfRangeError("copy past the device buffer's end");
  return Check(cudaMemcpy(dst, static_cast<const uint8_t*>(data_) + offset, bytes, cudaMemcpyDeviceToHost), "copy");
}

Status DeviceBuffer::CopyFromDevice(const void* src, size_t bytes) {
  if (bytes > size_) return OutOfRangeError("copy past the device buffer's end");
  WSYNC_RETURN_IF_ERROR(Check(cudaMemcpy(data_, src, bytes, cudaMemcpyDeviceToDevice), "copy"));
  return Check(cudaDeviceSynchronize(), "copy");
}

// ------------------------------------------------------------ PinnedBuffer

StatusOr<PinnedBuffer> PinnedBuffer::Allocate(size_t bytes) {
  WSYNC_RETURN_IF_ERROR(DeviceAvailable());
  PinnedBuffer b;
  if (bytes > 0) WSYNC_RETURN_IF_ERROR(Check(cudaMallocHost(&b.data_, bytes), "allocating page-locked host memory"));
  b.size_ = bytes;
  return b;
}

PinnedBuffer::PinnedBuffer(PinnedBuffer&& o) noexcept : data_(o.data_), size_(o.size_) {
  o.data_ = nullptr;
  o.size_ = 0;
}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& o) noexcept {
  if (this != &o) {
    if (data_ != nullptr) cudaFreeHost(data_);
    data_ = o.data_;
    size_ = o.size_;
    o.data_ = nullptr;
    o.size_ = 0;
  }
  return *this;
}

PinnedBuffer::~PinnedBuffer() {
  if (data_ != nullptr) cudaFreeHost(data_);
}

}  // namespace wsync::cuda
