// What the files of DeviceCodec share: CUDA error conversion, the device
// scratch and page-locked arenas (a Workspace's), the batch limits, the
// encode's per-cell state and DeviceCodec::Impl (streams, the workspace of
// the call running, phase timing, and the steps the encode, apply and
// checksum files define). Private to lib/cuda/src: it includes the CUDA
// runtime, which device_codec.h does not.
//
// The files: device_codec.cc (Create, phases, shared helpers),
// device_encode.cc (EncodePatch, SnapshotAndEncode, EncodeAndAdvance*),
// device_apply.cc (Stage, Commit, Confirm, Apply),
// device_checksum.cc (checksums, the cast), device_memory.cc (copies,
// DeviceBuffer, PinnedBuffer, Workspace).
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "wsync/codec/staged.h"
#include "wsync/cuda/device_codec.h"
#include "wsync/cuda/kernels.h"
#include "wsync/cuda/placed.h"
#include "wsync/cuda/workspace.h"
#include "wsync/util/status.h"

namespace wsync::cuda {
namespace internal {

Status Check(cudaError_t e, const char* what);

// A growable device allocation. Get() synchronizes the device before it
// frees the old block, so no enqueued work still uses it.
class Scratch {
 public:
  Scratch() = default;
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  StatusOr<void*> Get(size_t bytes) {
    if (bytes <= size_) return ptr_;
    const size_t want = std::max(bytes, size_ * 3 / 2);
    WSYNC_RETURN_IF_ERROR(Free());
    WSYNC_RETURN_IF_ERROR(Check(cudaMalloc(&ptr_, want), "allocating scratch memory"));
    size_ = want;
    return ptr_;
  }
  size_t size() const { return size_; }
  Status Free() {
    if (ptr_ == nullptr) return Status::Ok();
    WSYNC_RETURN_IF_ERROR(Check(cudaDeviceSynchronize(), "synchronize"));
    cudaFree(ptr_);
    ptr_ = nullptr;
    size_ = 0;
    return Status::Ok();
  }

 private:
  void* ptr_ = nullptr;
  size_t size_ = 0;
};

Status CopyUp(void* dst, const void* src, size_t bytes, cudaStream_t s);

logic::Layout LayoutOf(uint64_t n, size_t width, uint32_t chunk_bytes);

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
  ~PinnedArena() { Release(); }
  void Reset() {
    for (Block& b : blocks_) b.used = 0;
    used_ = 0;
  }
  // Between calls: frees the largest blocks until at most the larger of
  // `keep` and twice what the call used at its peak stays (room for the
  // blocks' leftovers), so that calls alike reuse their memory and one large
  // call does not hold it for good.
  void Trim(size_t keep) { FreeAbove(std::max(keep, 2 * peak_)); }
  // Frees every block.
  void Release() { FreeAbove(0); }
  size_t bytes() const {
    size_t total = 0;
    for (const Block& b : blocks_) total += b.size;
    return total;
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
  void FreeAbove(size_t keep) {
    peak_ = 0;
    std::sort(blocks_.begin(), blocks_.end(), [](const Block& a, const Block& b) { return a.size < b.size; });
    size_t total = bytes();
    while (total > keep && !blocks_.empty()) {
      total -= blocks_.back().size;
      cudaFreeHost(blocks_.back().ptr);
      blocks_.pop_back();
    }
    Reset();
  }

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
inline constexpr size_t kBatchScratchBytes = size_t{64} << 20;
// A batch's bases staged from host memory stay under this, or one tensor.
inline constexpr size_t kStagingBytes = size_t{256} << 20;
// The device's coder takes a batch's chunks while its jobs' scratch and
// streams stay under this (about 16 bytes per change); the host codes the
// rest.
inline constexpr size_t kCoderArenaBytes = size_t{256} << 20;
// An apply into pieces or tile grids gathers chunks into images of at most
// this (or one chunk) at a time.
inline constexpr size_t kImageBytes = size_t{64} << 20;

// A ranked chunk's entries for LaunchRankPositions, class after class: each
// rank's chunk (in the layout the kernel resolves it in), class and rank.
void RankEntries(const codec::staged::DecodedChunk& dc, uint32_t chunk, uint32_t* chunk_out, uint8_t* cls_out,
                 uint32_t* rank_out);

// Scratch bytes a cell takes when gathered out of its tensor (256-byte
// aligned); 0 when its elements are contiguous there.
size_t GatheredBytes(const codec::staged::Cell& c, size_t width);

// A cell's elements in its row-major order: where they start in the
// tensor's data when contiguous there, else copied into `scratch`
// (GatheredBytes of it) by a two-dimensional copy enqueued on `s`.
StatusOr<const uint8_t*> CellElements(const codec::staged::Cell& c, const void* data, size_t width, uint8_t* scratch,
                                      cudaStream_t s);

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
  std::vector<codec::ClassSpec> specs;

  bool empty() const { return layout.n == 0; }
  uint64_t changes() const { return empty() ? 0 : chunk_off[layout.Chunks()]; }
  uint64_t count(size_t c) const { return chunk_off[c + 1] - chunk_off[c]; }
  codec::staged::ChunkChange Change(size_t c) const {
    codec::staged::ChunkChange ch;
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
Status EnqueueDigests(PinnedArena& pinned, std::span<const DigestJob> regions, DigestJob* jobs_dev, cudaStream_t s);

// FailedPrecondition: the destination does not hold the patch's base.
Status WrongBase(const codec::staged::PatchReader& r);

}  // namespace internal

// A Workspace's memory. Each arena serves one use at a time, in stream
// order.
struct Workspace::Arenas {
  int device = 0;
  // encode: a batch's first pass; apply: the entries (on the device's
  // decoding, all of it)
  internal::Scratch scratch;
  internal::Scratch changes;     // encode: a batch's compact changes; apply: the writes when not kept
  internal::Scratch rank_mem;    // class counts and their scan, one tensor at a time
  internal::Scratch digest_mem;  // digests
  internal::Scratch staging;     // encode: bases in host memory, a batch at a time; apply: the patch parts
  internal::Scratch images;      // cells gathered out of their tensors, a batch at a time
  internal::Scratch coder_mem;   // encode: the entropy stage's jobs, scratch and streams, a batch at a time
  internal::Scratch packed_mem;  // encode: the coded streams packed for the copy to the host
  internal::Scratch fetch_mem;   // encode: the compact changes the host reads, packed for the copy
  internal::PinnedArena pinned;  // what the device copies back

  std::array<internal::Scratch*, 9> device_arenas() {
    return {&scratch, &changes, &rank_mem, &digest_mem, &staging, &images, &coder_mem, &packed_mem, &fetch_mem};
  }
  std::array<const internal::Scratch*, 9> device_arenas() const {
    return {&scratch, &changes, &rank_mem, &digest_mem, &staging, &images, &coder_mem, &packed_mem, &fetch_mem};
  }
};

// Not thread-safe: a call uses the streams and its workspace from start to
// end.
struct DeviceCodec::Impl {
  int device = 0;
  EntropyStage entropy = EntropyStage::kHost;
  cudaStream_t compute = nullptr;
  cudaStream_t copy = nullptr;
  Workspace::Arenas* ws = nullptr;  // the running call's (Begin)
  std::vector<Phase> phases;
  std::chrono::steady_clock::time_point mark;

  ~Impl();

  Status Activate() const;
  // Starts a call in `workspace`: the device selected, the workspace bound
  // (InvalidArgument when it belongs to another device), the phases
  // cleared. The call ends with an EndOfCall over the workspace's pinned
  // arena.
  Status Begin(Workspace& workspace);

  void StartPhases();
  // Ends the phase running since the last mark.
  void EndPhase(const char* name);

  // ---------------------------------------------------------------- checksums
  // (device_checksum.cc)

  // codec::TensorChecksum of each region, with one launch and one
  // synchronization.
  StatusOr<std::vector<uint64_t>> Checksums(std::span<const std::pair<const void*, size_t>> regions);
  StatusOr<uint64_t> Checksum(const void* data, size_t nbytes);
  // DeviceCodec::SetChecksum.
  StatusOr<uint64_t> SetChecksum(std::span<const codec::TensorView> tensors, std::span<const codec::TileGrid> grids);

  // -------------------------------------------------------------------- ranks
  // (device_codec.cc)

  // Scratch of RankPrefix for a tensor of this layout.
  struct RankScratch {
    size_t o_specs = 0, o_counts = 0, o_prefix = 0, o_temp = 0, scan_bytes = 0, bytes = 0;
  };
  StatusOr<RankScratch> RankScratchOf(logic::Layout l);

  // Per-class rank prefix (exclusive scan of class counts) of a tensor under
  // per-chunk specs, into rank_mem (laid out by RankScratchOf, already
  // large enough). Enqueued on `compute`; rank_mem is reused by the next
  // tensor in stream order.
  Status RankPrefix(const void* base, size_t width, logic::Layout l, const std::vector<codec::ClassSpec>& specs,
                    void* mem, const RankScratch& r);

  // The scratch bytes of an exclusive scan of n counts.
  StatusOr<size_t> ScanBytes(size_t n);

  // ------------------------------------------------------------------- encode
  // (device_encode.cc)

  // The encode behind EncodePatch, SnapshotAndEncode and EncodeAndAdvance*:
  // previous -> target, with `live` copied into `snapshot` first when given
  // (then target views the snapshot), and `advance` made equal to target
  // once the patch is made. base_on_host: previous is in host memory.
  StatusOr<std::string> Encode(std::span<const codec::TensorView> live,
                               std::span<const codec::MutableTensorView> snapshot,
                               std::span<const codec::TensorView> previous, const codec::EncodeOptions& options,
                               const std::function<void()>& on_snapshot, std::span<const codec::TensorView> target,
                               std::span<const codec::MutableTensorView> advance, bool base_on_host);

  // Copies the host bases of tensors [t0, t1) (`bytes` with 256-byte
  // alignment) into `staging` and points bases[t0, t1) there. Enqueued on
  // `compute`, so the next batch's copy waits for this batch's reads.
  Status StageBases(std::span<const codec::TensorView> host, size_t t0, size_t t1, size_t bytes,
                    std::vector<codec::TensorView>& bases);

  // Points cells[k], the writer's cell cell0 + k, at its elements: in the
  // tensor when contiguous there, else gathered into `images` (a
  // two-dimensional copy, after the tensor's snapshot landed). Enqueued on
  // `compute`.
  Status PlaceCells(const codec::staged::PatchWriter& writer, std::span<const codec::TensorView> base,
                    std::span<const codec::TensorView> target, size_t cell0, std::span<internal::CellChange> cells,
                    std::span<cudaEvent_t> landed);

  // The device part of encoding a batch of whole tensors' cells: digests,
  // compact changes, class choice (host, small) and ranks, with one
  // synchronization per step for the whole batch. specs: by writer chunk.
  Status CompactBatch(const codec::staged::PatchWriter& writer, std::span<internal::CellChange> batch,
                      const codec::EncodeOptions& options, std::vector<codec::ClassSpec>& specs);

  // Copies the segments' bytes (device memory) back to back into
  // page-locked memory: the segment list up, one packing kernel into `mem`,
  // one copy down. Synchronizes.
  StatusOr<const uint8_t*> PackToHost(std::span<const PackSegment> segments, uint64_t bytes, internal::Scratch& mem,
                                      const char* what);

  // Copies the compact changes of these chunks (cell in batch, chunk in
  // cell) that are not on the host yet, with their ranks where computed,
  // packed into one copy; their `fetched` pointers then point at them.
  // Synchronizes.
  Status FetchChanges(std::span<internal::CellChange> batch, std::span<const std::pair<size_t, size_t>> which);

  // The entropy stage on the device (EntropyStage::kDevice): codes the
  // batch's chunks that MaySparseEncode (encode_plan.h), one per thread, and
  // hands their streams to the writer; coded[chunk] marks those it coded.
  // The rest (other modes, or streams past their room; every chunk with
  // EntropyStage::kHost) are left for the host, whose changes it fetches.
  Status CodeOnDevice(codec::staged::PatchWriter& writer, std::span<internal::CellChange> batch,
                      const codec::EncodeOptions& options, std::vector<uint8_t>& coded);

  // -------------------------------------------------------------------- apply
  // (device_apply.cc)

  // Stage's work: the plans, the keyframes decoded and verified, the
  // patches staged and their writes kept (or not: past the budget).
  Status StageInto(Staged::State& st);
  // Every patch part's works, batch after batch: gathered into the image
  // scratch, decoded there, their changes added there and their results
  // digested; every result proven against the patch, then each
  // destination's writes returned (placed.h). Reads the destination only.
  // unwritten: what a DataLoss becomes (a wrong base told apart where it
  // can be).
  StatusOr<std::vector<placed::Writes>> StagePatches(const Staged::State& st,
                                                      const std::function<Status(Status)>& unwritten);
  // The writes' commit jobs in `mem` (device: the job list, then every
  // destination's index, old and new values); fills st.jobs, st.jobs_dev
  // and st.job_dst. Synchronizes.
  Status UploadWrites(Staged::State& st, const std::vector<placed::Writes>& writes, internal::Scratch& mem);
  Status Commit(Staged::State& st);
  Status Confirm(const Staged::State& st);
  // The digests (placed::ResultDigests) of every work's chunk as it sits in
  // the destination now, batch after batch through the image scratch.
  StatusOr<std::vector<std::vector<std::vector<uint64_t>>>> DestinationDigests(
      std::span<const codec::staged::PatchReader* const> readers, std::span<const codec::staged::ApplyPlan> plans,
      std::span<void* const> dst);
  // The tile jobs of batch b (each work's chunk at its placement in dst)
  // copied to jobs_dev (room for the batch's works), on `compute`.
  Status UploadTileJobs(std::span<const codec::staged::ApplyPlan> plans, const placed::Batch& b,
                        std::span<void* const> dst, TileJob* jobs_dev);
  // Digests of slots [0, n) of an image of batch b into digests[part][work]
  // (a gridded chunk of more than one block hashed whole on the host).
  // Synchronizes.
  Status DigestImage(std::span<const codec::staged::PatchReader* const> readers,
                     std::span<const codec::staged::ApplyPlan> plans, const placed::Batch& b, const void* image,
                     std::vector<std::vector<std::vector<uint64_t>>>& digests);
  // A keyframe part's decoded works (values[w]: its chunk's bytes) to their
  // placements, batch by batch through the image scratch.
  Status WriteTiles(const codec::staged::PatchReader& r, const codec::staged::ApplyPlan& plan,
                    const std::vector<std::vector<uint8_t>>& values, std::span<void* const> dst);
};

// What Stage keeps for Commit and Confirm. The parts' bytes are the
// caller's.
struct DeviceCodec::Staged::State {
  std::vector<std::string_view> parts;
  bool as_parts = false;
  codec::ApplyOptions options;
  bool pieces = false;
  std::vector<codec::MutableTensorView> tensors;  // the destination: whole tensors
  std::vector<codec::RuntimeTensor> runtime;      // or pieces
  std::vector<void*> dst;                         // the data of either, as the plans' Work::dst index them
  std::vector<codec::staged::PatchReader> readers;
  std::vector<const codec::staged::PatchReader*> patch_refs, key_refs;
  std::vector<codec::staged::ApplyPlan> patch_plans, key_plans;
  std::vector<std::string_view> patch_bytes;                  // each patch part's bytes
  std::vector<std::vector<std::vector<uint8_t>>> key_values;  // per keyframe part, per work
  uint64_t changes = 0;
  uint64_t kept_bytes = 0;
  bool kept = false;
  bool committed = false;
  internal::Scratch writes;               // the kept writes (UploadWrites)
  const CommitJob* jobs_dev = nullptr;    // the commit's job list, in device memory
  std::vector<CommitJob> jobs;            // the same on the host
  std::vector<size_t> job_dst;  // each job's destination

  codec::Destination destination() const {
    if (pieces) return codec::Destination(runtime);
    return codec::Destination(tensors);
  }
  // How errors name destination d.
  std::string DstName(size_t d) const { return pieces ? runtime[d].view.name : tensors[d].name; }
};

}  // namespace wsync::cuda
