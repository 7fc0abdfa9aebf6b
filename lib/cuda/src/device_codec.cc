// DeviceCodec over the kernels (kernels.h) and the staged host codec
// (codec/staged.h). Per tensor: launches, one copy back of the compact
// streams, host entropy coding. See device_codec.h for the contract and
// docs/gpu.md for the data flow.
#include "wsync/cuda/device_codec.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include "wsync/codec/checksum.h"
#include "wsync/codec/staged.h"
#include "wsync/cuda/kernels.h"
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


// A growable device allocation. Grow() synchronizes the device before it
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

// Carves aligned pieces out of one scratch block.
class Carver {
 public:
  template <typename T>
  size_t Add(size_t count) {
    offset_ = (offset_ + 255) / 256 * 256;
    const size_t at = offset_;
    offset_ += count * sizeof(T) + 8;
    return at;
  }
  size_t bytes() const { return offset_ + 256; }

 private:
  size_t offset_ = 0;
};

template <typename T>
T* At(void* base, size_t offset) {
  return reinterpret_cast<T*>(static_cast<uint8_t*>(base) + offset);
}

template <typename T>
Status CopyDown(std::vector<T>* out, const T* src, size_t count, cudaStream_t s) {
  out->resize(count);
  if (count == 0) return Status::Ok();
  return Check(cudaMemcpyAsync(out->data(), src, count * sizeof(T), cudaMemcpyDeviceToHost, s), "copy to host");
}

Status CopyUp(void* dst, const void* src, size_t bytes, cudaStream_t s) {
  if (bytes == 0) return Status::Ok();
  return Check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s), "copy to device");
}

logic::Layout LayoutOf(uint64_t n, size_t width, uint32_t chunk_bytes) {
  return logic::Layout{.n = n, .chunk_elems = chunk_bytes / width};
}

}  // namespace

Status DeviceAvailable() {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) return UnavailableError(std::string("no usable CUDA device: ") + cudaGetErrorString(e));
  if (count == 0) return UnavailableError("no CUDA device");
  return Status::Ok();
}

// A tensor's compact change on the host, ready for the entropy stage.
struct TensorChange {
  std::vector<size_t> chunk_ids;   // the writer's chunk indices
  std::vector<uint32_t> chunk_off; // changes of chunk c: [chunk_off[c], chunk_off[c + 1])
  std::vector<uint32_t> pos, rank;
  std::vector<uint8_t> delta, old;
  std::vector<ClassSpec> specs;
  size_t width = 0;
  bool conditioned = false;

  ChunkChange Change(size_t c) const {
    ChunkChange ch;
    ch.count = chunk_off[c + 1] - chunk_off[c];
    ch.pos = pos.data() + chunk_off[c];
    ch.delta = delta.data() + size_t{chunk_off[c]} * width;
    ch.old = conditioned ? old.data() + size_t{chunk_off[c]} * width : nullptr;
    return ch;
  }
  const uint32_t* Ranks(size_t c) const { return rank.empty() ? nullptr : rank.data() + chunk_off[c]; }
};

struct DeviceCodec::Impl {
  int device = 0;
  cudaStream_t compute = nullptr;
  cudaStream_t copy = nullptr;
  Scratch scratch;       // per-tensor working memory
  Scratch changes;       // compact change streams of a tensor
  Scratch digest_mem;    // digests

  ~Impl() {
    if (compute != nullptr) cudaStreamDestroy(compute);
    if (copy != nullptr) cudaStreamDestroy(copy);
  }

  Status Activate() const { return Check(cudaSetDevice(device), "select device"); }

  // Block digests of device memory, to the host.
  Status Digests(const void* data, size_t nbytes, std::vector<uint64_t>* out) {
    const size_t count = codec::ChecksumBlockCount(nbytes);
    out->resize(count);
    if (count == 0) return Status::Ok();
    WSYNC_ASSIGN_OR_RETURN(void* mem, digest_mem.Get(count * sizeof(uint64_t)));
    WSYNC_RETURN_IF_ERROR(LaunchBlockDigests(data, nbytes, static_cast<uint64_t*>(mem), compute));
    WSYNC_RETURN_IF_ERROR(CopyDown(out, static_cast<const uint64_t*>(mem), count, compute));
    return Check(cudaStreamSynchronize(compute), "digests");
  }

  StatusOr<uint64_t> Checksum(const void* data, size_t nbytes) {
    std::vector<uint64_t> d;
    WSYNC_RETURN_IF_ERROR(Digests(data, nbytes, &d));
    return codec::CombineBlockDigests(d);
  }

  // Per-class rank prefix (exclusive scan of class counts) of a tensor under
  // per-chunk specs. Enqueued on `compute`.
  Status RankPrefix(const void* base, size_t width, logic::Layout l, const std::vector<ClassSpec>& specs,
                    ClassSpec* specs_dev, uint32_t* counts, uint32_t* prefix, void* scan_temp, size_t scan_bytes) {
    WSYNC_RETURN_IF_ERROR(CopyUp(specs_dev, specs.data(), specs.size() * sizeof(ClassSpec), compute));
    WSYNC_RETURN_IF_ERROR(LaunchClassCounts(base, static_cast<int>(width), l, specs_dev, counts, compute));
    return ExclusiveScan(scan_temp, &scan_bytes, counts, prefix, kMaxClasses * l.Blocks() + 1, compute);
  }

  size_t ScanBytes(size_t n) {
    size_t bytes = 0;
    if (!ExclusiveScan(nullptr, &bytes, nullptr, nullptr, n, nullptr).ok()) return 0;
    return bytes;
  }

  // The device part of encoding one tensor: digests, compact change, class
  // choice (host, small) and ranks. The entropy stage runs later over all
  // chunks of the set at once.
  Status CompactTensor(const codec::staged::PatchWriter& writer, const TensorView& base, const TensorView& target,
                       uint32_t chunk_bytes, bool condition, ThreadPool* pool, TensorChange* out,
                       std::vector<uint64_t>* base_digests, std::vector<uint64_t>* target_digests);

  Status ApplyDelta(const codec::staged::PatchReader& r, std::span<const MutableTensorView> dst,
                    const std::vector<size_t>& match, const codec::ApplyOptions& options);
  Status ApplyKeyframe(const codec::staged::PatchReader& r, std::span<const MutableTensorView> dst,
                       const std::vector<size_t>& match, const codec::ApplyOptions& options);
  StatusOr<bool> HoldsBase(const codec::staged::PatchReader& r, std::span<const MutableTensorView> dst,
                           const std::vector<size_t>& match);
};

Status DeviceCodec::Impl::CompactTensor(const codec::staged::PatchWriter& writer, const TensorView& base,
                                        const TensorView& target, uint32_t chunk_bytes, bool condition,
                                        ThreadPool* pool, TensorChange* out, std::vector<uint64_t>* base_digests,
                                        std::vector<uint64_t>* target_digests) {
  const std::vector<size_t>& chunk_ids = out->chunk_ids;
  const size_t width = codec::DTypeWidth(target.dtype);
  const size_t nbytes = target.NumBytes();
  const logic::Layout l = LayoutOf(target.NumElements(), width, chunk_bytes);
  if (nbytes == 0) {
    base_digests->clear();
    target_digests->clear();
    return Status::Ok();
  }
  const uint64_t blocks = l.Blocks();
  const uint64_t chunks = l.Chunks();
  const size_t bins = codec::staged::HistogramBins(target.dtype);
  const bool conditioned = condition && bins > 0;
  const size_t scan_n = std::max<size_t>(blocks + 1, kMaxClasses * blocks + 1);
  const size_t scan_bytes = ScanBytes(scan_n);

  Carver carve;
  const size_t o_counts = carve.Add<uint32_t>(scan_n);
  const size_t o_offsets = carve.Add<uint32_t>(scan_n);
  const size_t o_chunks = carve.Add<uint32_t>(chunks + 1);
  const size_t o_hist = carve.Add<uint32_t>(conditioned ? chunks * bins : 1);
  const size_t o_specs = carve.Add<ClassSpec>(chunks);
  const size_t o_temp = carve.Add<uint8_t>(scan_bytes);
  const size_t ndigests = codec::ChecksumBlockCount(nbytes);
  const size_t o_bdig = carve.Add<uint64_t>(ndigests);
  const size_t o_tdig = carve.Add<uint64_t>(ndigests);
  WSYNC_ASSIGN_OR_RETURN(void* mem, scratch.Get(carve.bytes()));
  WSYNC_RETURN_IF_ERROR(LaunchBlockDigests(base.data, nbytes, At<uint64_t>(mem, o_bdig), compute));
  WSYNC_RETURN_IF_ERROR(LaunchBlockDigests(target.data, nbytes, At<uint64_t>(mem, o_tdig), compute));
  auto* counts = At<uint32_t>(mem, o_counts);
  auto* offsets = At<uint32_t>(mem, o_offsets);
  auto* chunk_offsets = At<uint32_t>(mem, o_chunks);
  auto* hist = At<uint32_t>(mem, o_hist);
  void* temp = At<uint8_t>(mem, o_temp);
  const int w = static_cast<int>(width);

  WSYNC_RETURN_IF_ERROR(LaunchDiffCounts(base.data, target.data, w, l, counts, compute));
  size_t tb = scan_bytes;
  WSYNC_RETURN_IF_ERROR(ExclusiveScan(temp, &tb, counts, offsets, blocks + 1, compute));
  WSYNC_RETURN_IF_ERROR(LaunchChunkOffsets(offsets, l, chunk_offsets, compute));
  if (conditioned) {
    const codec::ExponentField ef = codec::ExponentFieldOf(target.dtype);
    WSYNC_RETURN_IF_ERROR(LaunchSampleHistogram(base.data, w, l, ef.shift, ef.mask, static_cast<uint32_t>(bins),
                                                hist, compute));
  }
  std::vector<uint32_t>& chunk_off = out->chunk_off;
  std::vector<uint32_t> hist_host;
  WSYNC_RETURN_IF_ERROR(CopyDown(&chunk_off, chunk_offsets, chunks + 1, compute));
  if (conditioned) WSYNC_RETURN_IF_ERROR(CopyDown(&hist_host, hist, chunks * bins, compute));
  WSYNC_RETURN_IF_ERROR(CopyDown(base_digests, At<uint64_t>(mem, o_bdig), ndigests, compute));
  WSYNC_RETURN_IF_ERROR(CopyDown(target_digests, At<uint64_t>(mem, o_tdig), ndigests, compute));
  WSYNC_RETURN_IF_ERROR(Check(cudaStreamSynchronize(compute), "diff"));
  const size_t m = chunk_off[chunks];
  out->width = width;
  out->conditioned = conditioned;

  // The compact change: positions, deltas, old values.
  Carver cc;
  const size_t o_pos = cc.Add<uint32_t>(m);
  const size_t o_delta = cc.Add<uint8_t>(m * width);
  const size_t o_old = cc.Add<uint8_t>(m * width);
  const size_t o_rank = cc.Add<uint32_t>(m);
  WSYNC_ASSIGN_OR_RETURN(void* cmem, changes.Get(cc.bytes()));
  WSYNC_RETURN_IF_ERROR(LaunchDiffScatter(base.data, target.data, w, l, offsets, At<uint32_t>(cmem, o_pos),
                                          At<uint8_t>(cmem, o_delta), At<uint8_t>(cmem, o_old), compute));
  WSYNC_RETURN_IF_ERROR(CopyDown(&out->pos, At<uint32_t>(cmem, o_pos), m, compute));
  WSYNC_RETURN_IF_ERROR(CopyDown(&out->delta, At<uint8_t>(cmem, o_delta), m * width, compute));
  WSYNC_RETURN_IF_ERROR(CopyDown(&out->old, At<uint8_t>(cmem, o_old), m * width, compute));
  WSYNC_RETURN_IF_ERROR(Check(cudaStreamSynchronize(compute), "compaction"));

  // Classes on the host (small), ranks on the device when any chunk needs them.
  std::vector<ClassSpec>& specs = out->specs;
  specs.resize(chunks);
  ParallelFor(pool, chunks, [&](size_t c) {
    if (codec::ClassSourceChunk(c) != c) return;  // takes its run's classes, below
    specs[c] = writer.ChooseClasses(chunk_ids[c], conditioned ? hist_host.data() + c * bins : nullptr, out->Change(c));
  });
  for (uint64_t c = 0; c < chunks; ++c) specs[c] = specs[codec::ClassSourceChunk(c)];
  bool need_ranks = false;
  for (uint64_t c = 0; c < chunks; ++c) {
    need_ranks = need_ranks || writer.NeedsRanks(chunk_ids[c], out->Change(c).count, specs[c]);
  }
  if (need_ranks) {
    WSYNC_RETURN_IF_ERROR(RankPrefix(base.data, width, l, specs, At<ClassSpec>(mem, o_specs), counts, offsets, temp,
                                     scan_bytes));
    WSYNC_RETURN_IF_ERROR(LaunchRanks(base.data, w, l, At<ClassSpec>(mem, o_specs), offsets, chunk_offsets,
                                      At<uint32_t>(cmem, o_pos), At<uint8_t>(cmem, o_old), m,
                                      At<uint32_t>(cmem, o_rank), compute));
    WSYNC_RETURN_IF_ERROR(CopyDown(&out->rank, At<uint32_t>(cmem, o_rank), m, compute));
    WSYNC_RETURN_IF_ERROR(Check(cudaStreamSynchronize(compute), "ranks"));
  }
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

// Chunk ids of the writer per tensor.
std::vector<std::vector<size_t>> ChunksByTensor(const std::vector<Chunk>& chunks, size_t tensors) {
  std::vector<std::vector<size_t>> out(tensors);
  for (size_t i = 0; i < chunks.size(); ++i) out[chunks[i].tensor].push_back(i);
  return out;
}

}  // namespace

StatusOr<std::string> DeviceCodec::EncodePatch(std::span<const TensorView> base, std::span<const TensorView> target,
                                               const codec::EncodeOptions& options) {
  return Encode({}, {}, base, options, {}, target);
}

StatusOr<std::string> DeviceCodec::SnapshotAndEncode(std::span<const TensorView> live,
                                                     std::span<const MutableTensorView> snapshot,
                                                     std::span<const TensorView> previous,
                                                     const codec::EncodeOptions& options,
                                                     const std::function<void()>& on_snapshot) {
  std::vector<TensorView> targets;
  for (const auto& s : snapshot) targets.push_back(s.AsConst());
  WSYNC_RETURN_IF_ERROR(CheckPairs(live, targets, "live and snapshot"));
  return Encode(live, snapshot, previous, options, on_snapshot, targets);
}

StatusOr<std::string> DeviceCodec::Encode(std::span<const TensorView> live,
                                          std::span<const MutableTensorView> snapshot,
                                          std::span<const TensorView> previous, const codec::EncodeOptions& options,
                                          const std::function<void()>& on_snapshot,
                                          std::span<const TensorView> target) {
  Impl& d = *impl_;
  WSYNC_RETURN_IF_ERROR(d.Activate());
  WSYNC_RETURN_IF_ERROR(CheckPairs(previous, target, "base and target"));
  WSYNC_ASSIGN_OR_RETURN(auto writer, codec::staged::PatchWriter::Create(target, options));
  const auto by_tensor = ChunksByTensor(writer.chunks(), target.size());
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

  std::vector<uint64_t> target_sums(target.size()), base_sums(target.size());
  std::vector<TensorChange> changes(target.size());
  Status status;
  for (size_t t = 0; t < target.size() && status.ok(); ++t) {
    if (snapshotting) status = Check(cudaStreamWaitEvent(d.compute, landed[t], 0), "wait for snapshot");
    std::vector<uint64_t> bd, td;
    changes[t].chunk_ids = by_tensor[t];
    if (status.ok()) {
      status = d.CompactTensor(writer, previous[t], target[t], options.chunk_bytes, options.condition_on_base,
                               options.pool, &changes[t], &bd, &td);
    }
    if (status.ok()) {
      base_sums[t] = codec::CombineBlockDigests(bd);
      target_sums[t] = codec::CombineBlockDigests(td);
    }
    // Once the copy stream is idle the trainer may go on; check as we go.
    if (status.ok() && !snapshot_reported && cudaStreamQuery(d.copy) == cudaSuccess) status = report_snapshot();
  }
  if (status.ok()) status = report_snapshot();
  cudaStreamSynchronize(d.copy);
  destroy();
  WSYNC_RETURN_IF_ERROR(status);
  // The entropy stage over every chunk of the set at once.
  std::vector<std::pair<size_t, size_t>> all;  // (tensor, chunk in tensor)
  for (size_t t = 0; t < changes.size(); ++t) {
    for (size_t c = 0; c < changes[t].chunk_ids.size(); ++c) all.emplace_back(t, c);
  }
  FirstError error;
  ParallelFor(options.pool, all.size(), [&](size_t i) {
    const TensorChange& tc = changes[all[i].first];
    const size_t c = all[i].second;
    error.Record(i, tc.chunk_off.empty() ? Status::Ok()
                                         : writer.SetChunk(tc.chunk_ids[c], tc.Change(c), tc.specs[c], tc.Ranks(c)));
  });
  WSYNC_RETURN_IF_ERROR(error.status());
  WSYNC_RETURN_IF_ERROR(writer.SetChecksums(target_sums, base_sums));
  return writer.Finish();
}

StatusOr<bool> DeviceCodec::Impl::HoldsBase(const codec::staged::PatchReader& r,
                                            std::span<const MutableTensorView> dst,
                                            const std::vector<size_t>& match) {
  std::vector<uint64_t> sums;
  for (size_t t = 0; t < match.size(); ++t) {
    const MutableTensorView& v = dst[match[t]];
    WSYNC_ASSIGN_OR_RETURN(uint64_t sum, Checksum(v.data, v.NumBytes()));
    sums.push_back(sum);
  }
  return codec::SetChecksumOf(sums) == r.base_set_checksum();
}

namespace {

Status WrongBase(const codec::staged::PatchReader& r) {
  return FailedPreconditionError("the destination does not hold the patch's base version " +
                                 std::to_string(r.base_version()) + " (base checksum differs); destination unchanged");
}

}  // namespace

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

Status DeviceCodec::Impl::ApplyDelta(const codec::staged::PatchReader& r, std::span<const MutableTensorView> dst,
                                     const std::vector<size_t>& match, const codec::ApplyOptions& options) {
  const auto& chunks = r.chunks();
  const auto by_tensor = ChunksByTensor(chunks, match.size());
  std::vector<DecodedChunk> decoded(chunks.size());
  FirstError error;
  // Stage 1 on the host: positions (or ranks) of every chunk.
  ParallelFor(options.pool, chunks.size(), [&](size_t i) { error.Record(i, r.DecodePositions(i, &decoded[i])); });

  // Stage 2 on the device: positions from ranks and old values, where the
  // coding is conditioned on the base.
  std::vector<std::vector<uint8_t>> old(chunks.size());
  for (size_t t = 0; t < match.size() && error.status().ok(); ++t) {
    const MutableTensorView& v = dst[match[t]];
    const size_t width = codec::DTypeWidth(v.dtype);
    const int w = static_cast<int>(width);
    const logic::Layout l = LayoutOf(v.NumElements(), width, r.chunk_bytes());
    std::vector<uint32_t> e_chunk, e_rank;
    std::vector<uint8_t> e_cls;
    std::vector<uint64_t> g_index;
    std::vector<ClassSpec> specs(by_tensor[t].size());
    for (size_t c = 0; c < by_tensor[t].size(); ++c) {
      const DecodedChunk& dc = decoded[by_tensor[t][c]];
      specs[c] = dc.spec;
      if (!dc.values_pending || dc.spec.k == 1) continue;
      if (dc.ranked) {
        size_t at = 0;
        for (int k = 0; k < dc.spec.k; ++k) {
          for (uint64_t j = 0; j < dc.class_counts[k]; ++j, ++at) {
            e_chunk.push_back(static_cast<uint32_t>(c));
            e_cls.push_back(static_cast<uint8_t>(k));
            e_rank.push_back(dc.ranks[at]);
          }
        }
      } else {
        for (uint32_t p : dc.pos) g_index.push_back(chunks[by_tensor[t][c]].first_element + p);
      }
    }
    if (e_chunk.empty() && g_index.empty()) continue;
    const size_t me = e_chunk.size(), mg = g_index.size();
    const uint64_t blocks = l.Blocks();
    const size_t scan_n = kMaxClasses * blocks + 1;
    const size_t scan_bytes = ScanBytes(scan_n);
    Carver carve;
    const size_t o_specs = carve.Add<ClassSpec>(specs.size());
    const size_t o_counts = carve.Add<uint32_t>(scan_n);
    const size_t o_prefix = carve.Add<uint32_t>(scan_n);
    const size_t o_temp = carve.Add<uint8_t>(scan_bytes);
    const size_t o_chunk = carve.Add<uint32_t>(me);
    const size_t o_cls = carve.Add<uint8_t>(me);
    const size_t o_rank = carve.Add<uint32_t>(me);
    const size_t o_pos = carve.Add<uint32_t>(me);
    const size_t o_eold = carve.Add<uint8_t>(me * width);
    const size_t o_err = carve.Add<uint32_t>(1);
    const size_t o_gidx = carve.Add<uint64_t>(mg);
    const size_t o_gold = carve.Add<uint8_t>(mg * width);
    WSYNC_ASSIGN_OR_RETURN(void* mem, scratch.Get(carve.bytes()));
    std::vector<uint32_t> e_pos, err(1, 0);
    std::vector<uint8_t> e_old, g_old;
    if (me > 0) {
      WSYNC_RETURN_IF_ERROR(RankPrefix(v.data, width, l, specs, At<ClassSpec>(mem, o_specs),
                                       At<uint32_t>(mem, o_counts), At<uint32_t>(mem, o_prefix),
                                       At<uint8_t>(mem, o_temp), scan_bytes));
      WSYNC_RETURN_IF_ERROR(CopyUp(At<void>(mem, o_chunk), e_chunk.data(), me * 4, compute));
      WSYNC_RETURN_IF_ERROR(CopyUp(At<void>(mem, o_cls), e_cls.data(), me, compute));
      WSYNC_RETURN_IF_ERROR(CopyUp(At<void>(mem, o_rank), e_rank.data(), me * 4, compute));
      WSYNC_RETURN_IF_ERROR(Check(cudaMemsetAsync(At<void>(mem, o_err), 0, 4, compute), "memset"));
      WSYNC_RETURN_IF_ERROR(LaunchRankPositions(v.data, w, l, At<ClassSpec>(mem, o_specs), At<uint32_t>(mem, o_prefix),
                                                At<uint32_t>(mem, o_chunk), At<uint8_t>(mem, o_cls),
                                                At<uint32_t>(mem, o_rank), me, At<uint32_t>(mem, o_pos),
                                                At<uint8_t>(mem, o_eold), At<uint32_t>(mem, o_err), compute));
      WSYNC_RETURN_IF_ERROR(CopyDown(&e_pos, At<uint32_t>(mem, o_pos), me, compute));
      WSYNC_RETURN_IF_ERROR(CopyDown(&e_old, At<uint8_t>(mem, o_eold), me * width, compute));
      WSYNC_RETURN_IF_ERROR(CopyDown(&err, At<uint32_t>(mem, o_err), 1, compute));
    }
    if (mg > 0) {
      WSYNC_RETURN_IF_ERROR(CopyUp(At<void>(mem, o_gidx), g_index.data(), mg * 8, compute));
      WSYNC_RETURN_IF_ERROR(LaunchGather(v.data, w, At<uint64_t>(mem, o_gidx), mg, At<uint8_t>(mem, o_gold), compute));
      WSYNC_RETURN_IF_ERROR(CopyDown(&g_old, At<uint8_t>(mem, o_gold), mg * width, compute));
    }
    WSYNC_RETURN_IF_ERROR(Check(cudaStreamSynchronize(compute), "positions"));
    if (err[0] != 0) {
      const size_t e = err[0] - 1;
      const Chunk& ch = chunks[by_tensor[t][e_chunk[e]]];
      error.Record(by_tensor[t][e_chunk[e]],
                   DataLossError("tensor " + Quoted(r.tensor_name(t)) + " chunk " + std::to_string(ch.index) +
                                 ": position stream: class " + std::to_string(e_cls[e]) + " rank " +
                                 std::to_string(e_rank[e]) + " beyond its elements"));
      break;
    }
    // Where each chunk's entries start, then the merges in parallel.
    std::vector<size_t> e_start(by_tensor[t].size()), g_start(by_tensor[t].size());
    for (size_t c = 0, e_at = 0, g_at = 0; c < by_tensor[t].size(); ++c) {
      const DecodedChunk& dc = decoded[by_tensor[t][c]];
      e_start[c] = e_at;
      g_start[c] = g_at;
      if (!dc.values_pending || dc.spec.k == 1) continue;
      (dc.ranked ? e_at : g_at) += dc.ranked ? dc.ranks.size() : dc.pos.size();
    }
    ParallelFor(options.pool, by_tensor[t].size(), [&](size_t c) {
      const size_t i = by_tensor[t][c];
      DecodedChunk& dc = decoded[i];
      if (!dc.values_pending || dc.spec.k == 1) return;
      if (dc.ranked) {
        error.Record(i, codec::staged::MergeRankedPositions(e_pos.data() + e_start[c],
                                                             e_old.data() + e_start[c] * width, width, &dc, &old[i]));
      } else {
        old[i].assign(g_old.begin() + g_start[c] * width, g_old.begin() + (g_start[c] + dc.pos.size()) * width);
      }
    });
  }
  // Stage 3 on the host: the values.
  if (error.status().ok()) {
    ParallelFor(options.pool, chunks.size(), [&](size_t i) {
      error.Record(i, r.DecodeValues(i, old[i].empty() ? nullptr : old[i].data(), &decoded[i]));
    });
  }
  if (!error.status().ok()) {
    WSYNC_ASSIGN_OR_RETURN(bool holds, HoldsBase(r, dst, match));
    if (!holds) return WrongBase(r);
    return error.status();
  }

  // Scatter every tensor, then verify every tensor; undo all on a mismatch.
  std::vector<std::vector<uint64_t>> index(match.size());
  std::vector<std::vector<uint8_t>> deltas(match.size());
  ParallelFor(options.pool, match.size(), [&](size_t t) {
    for (size_t i : by_tensor[t]) {
      const DecodedChunk& dc = decoded[i];
      for (uint32_t p : dc.pos) index[t].push_back(chunks[i].first_element + p);
      deltas[t].insert(deltas[t].end(), dc.delta.begin(), dc.delta.end());
    }
  });
  auto scatter = [&](size_t t, bool undo) -> Status {
    const MutableTensorView& v = dst[match[t]];
    const size_t m = index[t].size();
    if (m == 0) return Status::Ok();
    Carver carve;
    const size_t o_idx = carve.Add<uint64_t>(m);
    const size_t o_delta = carve.Add<uint8_t>(deltas[t].size());
    WSYNC_ASSIGN_OR_RETURN(void* mem, changes.Get(carve.bytes()));
    WSYNC_RETURN_IF_ERROR(CopyUp(At<void>(mem, o_idx), index[t].data(), m * 8, compute));
    WSYNC_RETURN_IF_ERROR(CopyUp(At<void>(mem, o_delta), deltas[t].data(), deltas[t].size(), compute));
    WSYNC_RETURN_IF_ERROR(LaunchScatterAdd(v.data, static_cast<int>(codec::DTypeWidth(v.dtype)),
                                           At<uint64_t>(mem, o_idx), At<uint8_t>(mem, o_delta), m, undo, compute));
    return Check(cudaStreamSynchronize(compute), "scatter");
  };
  for (size_t t = 0; t < match.size(); ++t) WSYNC_RETURN_IF_ERROR(scatter(t, false));
  for (size_t t = 0; t < match.size(); ++t) {
    const MutableTensorView& v = dst[match[t]];
    WSYNC_ASSIGN_OR_RETURN(uint64_t sum, Checksum(v.data, v.NumBytes()));
    if (sum == r.target_checksum(t)) continue;
    for (size_t u = 0; u < match.size(); ++u) WSYNC_RETURN_IF_ERROR(scatter(u, true));
    WSYNC_ASSIGN_OR_RETURN(bool holds, HoldsBase(r, dst, match));
    if (!holds) return WrongBase(r);
    return DataLossError("tensor " + Quoted(r.tensor_name(t)) +
                         ": result does not match the patch's checksum (the patch is corrupted); "
                         "change undone, destination unchanged");
  }
  return Status::Ok();
}

Status DeviceCodec::ApplyPatch(std::string_view patch, std::span<const MutableTensorView> tensors,
                               const codec::ApplyOptions& options) {
  WSYNC_RETURN_IF_ERROR(impl_->Activate());
  WSYNC_ASSIGN_OR_RETURN(auto reader, codec::staged::PatchReader::Open(patch, options.verify_patch_checksum));
  WSYNC_ASSIGN_OR_RETURN(auto match, reader.Match(tensors, options.allow_extra_tensors));
  if (reader.kind() == codec::PatchKind::kKeyframe) return impl_->ApplyKeyframe(reader, tensors, match, options);
  return impl_->ApplyDelta(reader, tensors, match, options);
}

StatusOr<uint64_t> DeviceCodec::TensorChecksum(const void* data, size_t nbytes) {
  WSYNC_RETURN_IF_ERROR(impl_->Activate());
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

}  // namespace wsync::cuda
