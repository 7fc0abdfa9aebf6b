// DeviceCodec's apply of one flat patch or keyframe into whole tensors.
// A patch is decoded on the device where its chunks are sparse-coded
// (ApplySparse), else its positions and values on the host with ranks and
// old values resolved on the device (ApplyDelta); either way the change is
// scattered in place, verified and undone on a mismatch. A keyframe is
// decoded and verified on the host and copied up.
#include "wsync/cuda/device_codec.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>

#include "device_codec_impl.h"
#include "wsync/codec/checksum.h"
#include "wsync/codec/staged.h"
#include "wsync/cuda/carver.h"
#include "wsync/cuda/kernels.h"
#include "wsync/cuda/sparse_plan.h"
#include "wsync/util/first_error.h"
#include "wsync/util/thread_pool.h"
#include "wsync/util/text.h"

namespace wsync::cuda {
namespace internal {

Status WrongBase(const codec::staged::PatchReader& r) {
  return FailedPreconditionError("the destination does not hold the patch's base version " +
                                 std::to_string(r.base_version()) + " (base checksum differs); destination unchanged");
}

}  // namespace internal

namespace {

using namespace internal;  // device_codec_impl.h

using codec::ClassSpec;
using codec::kMaxClasses;
using codec::MutableTensorView;
using codec::staged::Chunk;
using codec::staged::DecodedChunk;

}  // namespace

StatusOr<bool> DeviceCodec::Impl::HoldsBase(const codec::staged::PatchReader& r,
                                            std::span<const MutableTensorView> dst,
                                            const std::vector<size_t>& match) {
  WSYNC_ASSIGN_OR_RETURN(auto sums, Checksums(dst, match));
  return codec::SetChecksumOf(sums) == r.base_set_checksum();
}

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

Status DeviceCodec::Impl::ApplyFlat(const codec::staged::PatchReader& reader, std::string_view patch,
                                     std::span<const MutableTensorView> tensors, const codec::ApplyOptions& options) {
  WSYNC_ASSIGN_OR_RETURN(auto match, reader.Match(tensors, options.allow_extra_tensors));
  if (reader.kind() == codec::PatchKind::kKeyframe) return ApplyKeyframe(reader, tensors, match, options);
  pinned.Reset();
  WSYNC_ASSIGN_OR_RETURN(bool on_device, ApplySparse(patch, reader, tensors, match, options));
  if (on_device) return Status::Ok();
  return ApplyDelta(reader, tensors, match, options);
}

}  // namespace wsync::cuda
