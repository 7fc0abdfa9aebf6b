// DeviceCodec's apply: one plan for every destination (codec::staged's
// works: a chunk at a placement; whole tensors are identity placements),
// staged then committed. Stage gathers every work's chunk into image
// scratch, decodes it against the image (a sparse-coded chunk on the
// device; any other on the host, its ranks and old values resolved on the
// device), adds the change in the image and digests the result there;
// once every work of every part is proven, each destination's writes
// (element, old value, new value) are kept in device memory. Commit checks
// in one launch that every element still holds its old value and writes the
// new values in a second. Keyframe parts are decoded and verified on the
// host and written by tiles after the patches. See placed.h.
#include "wsync/cuda/device_codec.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>

#include "device_codec_impl.h"
#include "wsync/codec/checksum.h"
#include "wsync/codec/staged.h"
#include "wsync/cuda/carver.h"
#include "wsync/cuda/kernels.h"
#include "wsync/cuda/placed.h"
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
using codec::TensorView;
using codec::staged::Chunk;
using codec::staged::DecodedChunk;
using Digests = std::vector<std::vector<std::vector<uint64_t>>>;  // [part][work]: placed::ResultDigests

Digests EmptyDigests(std::span<const codec::staged::ApplyPlan> plans) {
  Digests d(plans.size());
  for (size_t p = 0; p < plans.size(); ++p) d[p].resize(plans[p].works.size());
  return d;
}

}  // namespace

DeviceCodec::Staged::Staged() = default;
DeviceCodec::Staged::Staged(Staged&&) noexcept = default;
DeviceCodec::Staged& DeviceCodec::Staged::operator=(Staged&&) noexcept = default;
DeviceCodec::Staged::~Staged() = default;
uint64_t DeviceCodec::Staged::changes() const { return state_ ? state_->changes : 0; }
uint64_t DeviceCodec::Staged::kept_bytes() const { return state_ ? state_->kept_bytes : 0; }
bool DeviceCodec::Staged::decodes_again() const { return state_ && !state_->kept; }

Status DeviceCodec::Impl::UploadTileJobs(std::span<const codec::staged::ApplyPlan> plans, const placed::Batch& b,
                                         std::span<void* const> dst, TileJob* jobs_dev) {
  WSYNC_ASSIGN_OR_RETURN(TileJob* jobs, ws->pinned.Alloc<TileJob>(b.works.size()));
  for (size_t j = 0; j < b.works.size(); ++j) {
    const codec::staged::Work& work = plans[b.works[j].part].works[b.works[j].work];
    jobs[j] = TileJob{dst[work.dst], work.map};
  }
  return CopyUp(jobs_dev, jobs, b.works.size() * sizeof(TileJob), compute);
}

Status DeviceCodec::Impl::DigestImage(std::span<const codec::staged::PatchReader* const> readers,
                                      std::span<const codec::staged::ApplyPlan> plans, const placed::Batch& b,
                                      const void* image, Digests& digests) {
  const size_t n = b.works.size(), width = b.width;
  auto gridded = [&](const placed::Ref& ref) {
    const auto& r = *readers[ref.part];
    return r.gridded(r.chunks()[plans[ref.part].works[ref.work].chunk].tensor);
  };
  size_t blocks = 0;
  for (const placed::Ref& ref : b.works) {
    blocks += codec::ChecksumBlockCount(plans[ref.part].works[ref.work].map.n * width);
  }
  Carver carve;
  const size_t o_jobs = carve.Add<DigestJob>(n);
  const size_t o_digests = carve.Add<uint64_t>(blocks);
  WSYNC_ASSIGN_OR_RETURN(void* mem, ws->digest_mem.Get(carve.bytes()));
  WSYNC_ASSIGN_OR_RETURN(DigestJob* jobs, ws->pinned.Alloc<DigestJob>(n));
  // A 1 MiB block per digest on the device; a gridded chunk of more than
  // one block is hashed whole on the host (its tile digest).
  std::vector<const uint8_t*> whole(n, nullptr);
  size_t nd = 0;
  uint64_t block = 0;
  for (size_t j = 0; j < n; ++j) {
    const placed::Ref& ref = b.works[j];
    const uint64_t bytes = plans[ref.part].works[ref.work].map.n * width;
    const uint8_t* slot = static_cast<const uint8_t*>(image) + j * b.slot * width;
    if (gridded(ref) && bytes > codec::kChecksumBlockBytes) {
      WSYNC_RETURN_IF_ERROR(CopyToPinned(ws->pinned, &whole[j], slot, bytes, compute));
      continue;
    }
    jobs[nd++] = DigestJob{slot, bytes, At<uint64_t>(mem, o_digests) + block, block};
    block += codec::ChecksumBlockCount(bytes);
  }
  if (nd > 0) {
    WSYNC_RETURN_IF_ERROR(CopyUp(At<void>(mem, o_jobs), jobs, nd * sizeof(DigestJob), compute));
    WSYNC_RETURN_IF_ERROR(LaunchBlockDigests(At<DigestJob>(mem, o_jobs), nd, block, compute));
  }
  const uint64_t* sums = nullptr;
  WSYNC_RETURN_IF_ERROR(CopyToPinned(ws->pinned, &sums, At<uint64_t>(mem, o_digests), block, compute));
  WSYNC_RETURN_IF_ERROR(Check(cudaStreamSynchronize(compute), "digests"));
  block = 0;
  for (size_t j = 0; j < n; ++j) {
    const placed::Ref& ref = b.works[j];
    const uint64_t bytes = plans[ref.part].works[ref.work].map.n * width;
    if (whole[j] != nullptr) {
      digests[ref.part][ref.work] = placed::ResultDigests(true, whole[j], bytes);
      continue;
    }
    const uint64_t count = codec::ChecksumBlockCount(bytes);
    digests[ref.part][ref.work].assign(sums + block, sums + block + count);
    block += count;
  }
  return Status::Ok();
}

StatusOr<std::vector<placed::Writes>> DeviceCodec::Impl::StagePatches(
    const Staged::State& st, const std::function<Status(Status)>& unwritten) {
  const auto readers = std::span<const codec::staged::PatchReader* const>(st.patch_refs);
  const auto plans = std::span<const codec::staged::ApplyPlan>(st.patch_plans);
  const auto& options = st.options;
  std::vector<placed::Writes> writes(st.dst.size());
  if (plans.empty()) return writes;
  // Every work's decoding state and result digests; errors ordered by work
  // across the parts.
  std::vector<size_t> first(plans.size() + 1, 0);
  for (size_t p = 0; p < plans.size(); ++p) first[p + 1] = first[p] + plans[p].works.size();
  std::vector<std::vector<DecodedChunk>> decoded(plans.size());
  for (size_t p = 0; p < plans.size(); ++p) decoded[p].resize(plans[p].works.size());
  Digests digests = EmptyDigests(plans);
  auto where = [&](const placed::Ref& ref) {
    const auto& r = *readers[ref.part];
    const Chunk& c = r.chunks()[plans[ref.part].works[ref.work].chunk];
    return "tensor " + Quoted(r.tensor_name(c.tensor)) + " chunk " + std::to_string(c.index);
  };
  auto fail = [&](const Status& s) {
    if (s.code() != StatusCode::kDataLoss) return s;
    return unwritten(DataLossError(s.message() + " (the patch is corrupted or the destination does not hold its "
                                                 "base); destination unchanged"));
  };
  FirstError error;
  // With the entropy stage on the device, sparse-coded chunks are decoded
  // there (their streams located here); the host decodes the positions (or
  // ranks) of every other chunk.
  placed::SparseWorks sparse(plans.size());
  if (entropy == EntropyStage::kDevice) {
    sparse = placed::LocateSparseWorks(readers, plans, &error);
  } else {
    for (size_t p = 0; p < plans.size(); ++p) sparse[p].resize(plans[p].works.size());
  }
  ParallelFor(options.pool, first.back(), [&](size_t g) {
    const size_t p = std::upper_bound(first.begin(), first.end(), g) - first.begin() - 1;
    const size_t w = g - first[p];
    if (sparse[p][w]) return;
    error.Record(g, readers[p]->DecodePositions(plans[p].works[w].chunk, &decoded[p][w]));
  });
  EndPhase("positions");
  if (error.failed()) return fail(error.status());
  // The patch parts on the device, back to back, for the device's decoding.
  std::vector<uint64_t> offsets(plans.size());
  uint64_t patch_bytes = 0;
  for (size_t p = 0; p < plans.size(); ++p) {
    offsets[p] = patch_bytes;
    patch_bytes += (st.patch_bytes[p].size() + 255) / 256 * 256;
  }
  WSYNC_ASSIGN_OR_RETURN(void* patch_dev, ws->staging.Get(patch_bytes));
  for (size_t p = 0; p < plans.size(); ++p) {
    WSYNC_ASSIGN_OR_RETURN(uint8_t* host, ws->pinned.Alloc<uint8_t>(st.patch_bytes[p].size()));
    std::memcpy(host, st.patch_bytes[p].data(), st.patch_bytes[p].size());
    WSYNC_RETURN_IF_ERROR(CopyUp(At<void>(patch_dev, offsets[p]), host, st.patch_bytes[p].size(), compute));
  }
  WSYNC_RETURN_IF_ERROR(Check(cudaStreamSynchronize(compute), "copying the patch"));  // before the pinned reset
  EndPhase("upload");

  // Batch after batch: gather the works' chunks into image slots, resolve
  // ranks and old values there, decode the values (sparse-coded chunks on
  // the device, the others on the host), add them in the image and digest
  // the results. The destination is only read.
  for (const placed::Batch& b : placed::Batches(readers, plans, kImageBytes)) {
    ws->pinned.Reset();
    const size_t n = b.works.size(), width = b.width;
    const int w = static_cast<int>(width);
    const logic::Layout l = LayoutOf(n * b.slot, width, static_cast<uint32_t>(b.slot * width));
    const placed::SparseBatch sb = placed::PlanSparseBatch(readers, plans, b, sparse, st.patch_bytes, offsets);
    const size_t nj = sb.jobs.size(), sm = sb.entries;
    // The host's works: entries of ranked chunks (slot, class, rank) and old
    // values to gather. Every slot's classes, for the rank prefix.
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
    for (size_t k = 0; k < nj; ++k) specs[sb.slot[k]] = sb.jobs[k].spec;
    Carver carve;
    const size_t o_image = carve.Add<uint8_t>(n * b.slot * width);
    const size_t o_jobs = carve.Add<TileJob>(n);
    const size_t o_chunk = carve.Add<uint32_t>(me), o_cls = carve.Add<uint8_t>(me), o_rank = carve.Add<uint32_t>(me);
    const size_t o_pos = carve.Add<uint32_t>(me), o_eold = carve.Add<uint8_t>(me * width);
    const size_t o_err = carve.Add<uint32_t>(1);
    const size_t o_gidx = carve.Add<uint64_t>(mg), o_gold = carve.Add<uint8_t>(mg * width);
    // The device's decoding: jobs, class counts, errors (the jobs', then the
    // rank kernel's), and per change its rank, class, slot, position and
    // old value by class, merged position and old value, index and delta.
    const size_t o_sjobs = carve.Add<SparseJob>(nj), o_scounts = carve.Add<uint64_t>(nj * codec::kMaxClasses);
    const size_t o_serr = carve.Add<uint32_t>(nj + 1);
    const size_t o_srank = carve.Add<uint32_t>(sm), o_scls = carve.Add<uint8_t>(sm), o_sslot = carve.Add<uint32_t>(sm);
    const size_t o_spos = carve.Add<uint32_t>(sm), o_smpos = carve.Add<uint32_t>(sm);
    const size_t o_sold = carve.Add<uint8_t>(sb.bytes), o_smold = carve.Add<uint8_t>(sb.bytes);
    const size_t o_sindex = carve.Add<uint64_t>(sm), o_sdelta = carve.Add<uint8_t>(sb.bytes);
    WSYNC_ASSIGN_OR_RETURN(void* mem, ws->scratch.Get(carve.bytes()));
    void* image = At<void>(mem, o_image);
    WSYNC_RETURN_IF_ERROR(UploadTileJobs(plans, b, st.dst, At<TileJob>(mem, o_jobs)));
    WSYNC_RETURN_IF_ERROR(LaunchGatherTiles(At<TileJob>(mem, o_jobs), n, w, b.slot, image, compute));
    EndPhase("gather");
    void* rmem = nullptr;
    RankScratch rs;
    if (me > 0 || sb.conditioned) {
      WSYNC_ASSIGN_OR_RETURN(rs, RankScratchOf(l));
      WSYNC_ASSIGN_OR_RETURN(rmem, ws->rank_mem.Get(rs.bytes));
      WSYNC_RETURN_IF_ERROR(RankPrefix(image, width, l, specs, rmem, rs));
    }
    // The device's ranks, checked before they are resolved.
    const uint32_t* serr = nullptr;
    if (nj > 0) {
      WSYNC_ASSIGN_OR_RETURN(SparseJob* sjobs_h, ws->pinned.Alloc<SparseJob>(nj));
      std::copy(sb.jobs.begin(), sb.jobs.end(), sjobs_h);
      WSYNC_RETURN_IF_ERROR(CopyUp(At<void>(mem, o_sjobs), sjobs_h, nj * sizeof(SparseJob), compute));
      WSYNC_RETURN_IF_ERROR(Check(cudaMemsetAsync(At<void>(mem, o_serr), 0, (nj + 1) * 4, compute), "memset"));
      WSYNC_RETURN_IF_ERROR(LaunchSparseRanks(At<SparseJob>(mem, o_sjobs), nj, static_cast<const uint8_t*>(patch_dev),
                                              At<uint32_t>(mem, o_srank), At<uint8_t>(mem, o_scls),
                                              At<uint32_t>(mem, o_sslot), At<uint64_t>(mem, o_scounts),
                                              At<uint32_t>(mem, o_serr), compute));
      WSYNC_RETURN_IF_ERROR(CopyToPinned(ws->pinned, &serr, At<uint32_t>(mem, o_serr), nj + 1, compute));
      WSYNC_RETURN_IF_ERROR(Check(cudaStreamSynchronize(compute), "sparse ranks"));
    }
    auto sparse_errors = [&]() -> Status {
      for (size_t k = 0; k < nj; ++k) {
        if (serr[k] == codec::sparse::kSparseOk) continue;
        return DataLossError(where(b.works[sb.slot[k]]) + ": " +
                             codec::sparse::SparseErrorText(static_cast<codec::sparse::SparseError>(serr[k])));
      }
      if (serr[nj] != 0) {
        const uint64_t e = serr[nj] - 1;
        const auto it = std::upper_bound(sb.jobs.begin(), sb.jobs.end(), e,
                                         [](uint64_t x, const SparseJob& job) { return x < job.entry; });
        return DataLossError(where(b.works[sb.slot[it - sb.jobs.begin() - 1]]) +
                             ": position stream: a rank beyond its class");
      }
      return Status::Ok();
    };
    if (nj > 0) {
      if (Status s = sparse_errors(); !s.ok()) return fail(s);
      if (sb.conditioned) {
        WSYNC_RETURN_IF_ERROR(LaunchRankPositions(
            image, w, l, At<ClassSpec>(rmem, rs.o_specs), At<uint32_t>(rmem, rs.o_prefix),
            At<uint32_t>(mem, o_sslot), At<uint8_t>(mem, o_scls), At<uint32_t>(mem, o_srank), sm,
            At<uint32_t>(mem, o_spos), At<uint8_t>(mem, o_sold), At<uint32_t>(mem, o_serr) + nj, compute));
      }
      WSYNC_RETURN_IF_ERROR(LaunchSparseValues(
          At<SparseJob>(mem, o_sjobs), nj, static_cast<const uint8_t*>(patch_dev), At<uint32_t>(mem, o_srank),
          At<uint64_t>(mem, o_scounts), At<uint32_t>(mem, o_spos), At<uint8_t>(mem, o_sold),
          At<uint32_t>(mem, o_smpos), At<uint8_t>(mem, o_smold), At<uint64_t>(mem, o_sindex),
          At<uint8_t>(mem, o_sdelta), At<uint32_t>(mem, o_serr), compute));
      WSYNC_RETURN_IF_ERROR(CopyToPinned(ws->pinned, &serr, At<uint32_t>(mem, o_serr), nj + 1, compute));
    }
    const uint32_t* pos_back = nullptr;
    const uint8_t* eold_back = nullptr;
    const uint8_t* gold_back = nullptr;
    const uint32_t* err_back = nullptr;
    uint32_t* chunk_h = nullptr;
    uint8_t* cls_h = nullptr;
    uint32_t* rank_h = nullptr;
    if (me > 0 || mg > 0) {
      WSYNC_ASSIGN_OR_RETURN(chunk_h, ws->pinned.Alloc<uint32_t>(me));
      WSYNC_ASSIGN_OR_RETURN(cls_h, ws->pinned.Alloc<uint8_t>(me));
      WSYNC_ASSIGN_OR_RETURN(rank_h, ws->pinned.Alloc<uint32_t>(me));
      WSYNC_ASSIGN_OR_RETURN(uint64_t* gidx_h, ws->pinned.Alloc<uint64_t>(mg));
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
        WSYNC_RETURN_IF_ERROR(CopyUp(At<void>(mem, o_chunk), chunk_h, me * 4, compute));
        WSYNC_RETURN_IF_ERROR(CopyUp(At<void>(mem, o_cls), cls_h, me, compute));
        WSYNC_RETURN_IF_ERROR(CopyUp(At<void>(mem, o_rank), rank_h, me * 4, compute));
        WSYNC_RETURN_IF_ERROR(Check(cudaMemsetAsync(At<void>(mem, o_err), 0, 4, compute), "memset"));
        WSYNC_RETURN_IF_ERROR(LaunchRankPositions(image, w, l, At<ClassSpec>(rmem, rs.o_specs),
                                                  At<uint32_t>(rmem, rs.o_prefix), At<uint32_t>(mem, o_chunk),
                                                  At<uint8_t>(mem, o_cls), At<uint32_t>(mem, o_rank), me,
                                                  At<uint32_t>(mem, o_pos), At<uint8_t>(mem, o_eold),
                                                  At<uint32_t>(mem, o_err), compute));
        WSYNC_RETURN_IF_ERROR(CopyToPinned(ws->pinned, &pos_back, At<uint32_t>(mem, o_pos), me, compute));
        WSYNC_RETURN_IF_ERROR(CopyToPinned(ws->pinned, &eold_back, At<uint8_t>(mem, o_eold), me * width, compute));
        WSYNC_RETURN_IF_ERROR(CopyToPinned(ws->pinned, &err_back, At<uint32_t>(mem, o_err), 1, compute));
      }
      if (mg > 0) {
        WSYNC_RETURN_IF_ERROR(CopyUp(At<void>(mem, o_gidx), gidx_h, mg * 8, compute));
        WSYNC_RETURN_IF_ERROR(LaunchGather(image, w, At<uint64_t>(mem, o_gidx), mg, At<uint8_t>(mem, o_gold), compute));
        WSYNC_RETURN_IF_ERROR(CopyToPinned(ws->pinned, &gold_back, At<uint8_t>(mem, o_gold), mg * width, compute));
      }
    }
    WSYNC_RETURN_IF_ERROR(Check(cudaStreamSynchronize(compute), "positions"));
    if (nj > 0) {
      if (Status s = sparse_errors(); !s.ok()) return fail(s);
    }
    if (err_back != nullptr && err_back[0] != 0) {
      const size_t k = err_back[0] - 1;
      return fail(DataLossError(where(b.works[chunk_h[k]]) + ": position stream: class " + std::to_string(cls_h[k]) +
                                " rank " + std::to_string(rank_h[k]) + " beyond its elements"));
    }
    EndPhase("ranks");
    // The host's works: old values by position, then the values.
    ParallelFor(options.pool, n, [&](size_t j) {
      const placed::Ref& ref = b.works[j];
      if (sparse[ref.part][ref.work]) return;
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
    // Every change of the batch, the host's works' then the device's: added
    // in the image, the values they replace and become read there, the
    // results digested.
    size_t hm = 0;
    for (const placed::Ref& ref : b.works) hm += decoded[ref.part][ref.work].pos.size();
    const size_t m = hm + sm;
    WSYNC_ASSIGN_OR_RETURN(uint64_t* idx_h, ws->pinned.Alloc<uint64_t>(hm));
    WSYNC_ASSIGN_OR_RETURN(uint8_t* delta_h, ws->pinned.Alloc<uint8_t>(hm * width));
    Carver sc;
    const size_t o_idx = sc.Add<uint64_t>(m), o_delta = sc.Add<uint8_t>(m * width);
    const size_t o_old = sc.Add<uint8_t>(m * width), o_new = sc.Add<uint8_t>(m * width);
    WSYNC_ASSIGN_OR_RETURN(void* smem, ws->changes.Get(sc.bytes()));
    size_t at = 0;
    for (size_t j = 0; j < n; ++j) {
      const DecodedChunk& dc = decoded[b.works[j].part][b.works[j].work];
      for (uint32_t p : dc.pos) idx_h[at++] = j * b.slot + p;
      if (!dc.delta.empty()) std::memcpy(delta_h + (at - dc.pos.size()) * width, dc.delta.data(), dc.delta.size());
    }
    WSYNC_RETURN_IF_ERROR(CopyUp(At<void>(smem, o_idx), idx_h, hm * 8, compute));
    WSYNC_RETURN_IF_ERROR(CopyUp(At<void>(smem, o_delta), delta_h, hm * width, compute));
    if (sm > 0) {
      WSYNC_RETURN_IF_ERROR(Check(cudaMemcpyAsync(At<uint64_t>(smem, o_idx) + hm, At<void>(mem, o_sindex), sm * 8,
                                                  cudaMemcpyDeviceToDevice, compute),
                                  "copy"));
      WSYNC_RETURN_IF_ERROR(Check(cudaMemcpyAsync(At<uint8_t>(smem, o_delta) + hm * width, At<void>(mem, o_sdelta),
                                                  sm * width, cudaMemcpyDeviceToDevice, compute),
                                  "copy"));
    }
    WSYNC_RETURN_IF_ERROR(LaunchGather(image, w, At<uint64_t>(smem, o_idx), m, At<uint8_t>(smem, o_old), compute));
    WSYNC_RETURN_IF_ERROR(LaunchScatterAdd(image, w, At<uint64_t>(smem, o_idx), At<uint8_t>(smem, o_delta), m,
                                           /*undo=*/false, compute));
    WSYNC_RETURN_IF_ERROR(LaunchGather(image, w, At<uint64_t>(smem, o_idx), m, At<uint8_t>(smem, o_new), compute));
    const uint64_t* sidx_h = nullptr;
    const uint8_t* old_h = nullptr;
    const uint8_t* new_h = nullptr;
    WSYNC_RETURN_IF_ERROR(CopyToPinned(ws->pinned, &sidx_h, At<uint64_t>(smem, o_idx) + hm, sm, compute));
    WSYNC_RETURN_IF_ERROR(CopyToPinned(ws->pinned, &old_h, At<uint8_t>(smem, o_old), m * width, compute));
    WSYNC_RETURN_IF_ERROR(CopyToPinned(ws->pinned, &new_h, At<uint8_t>(smem, o_new), m * width, compute));
    WSYNC_RETURN_IF_ERROR(DigestImage(readers, plans, b, image, digests));  // synchronizes
    at = 0;
    for (const placed::Ref& ref : b.works) {
      const codec::staged::Work& work = plans[ref.part].works[ref.work];
      DecodedChunk& dc = decoded[ref.part][ref.work];
      placed::Writes& out = writes[work.dst];
      out.width = width;
      placed::AppendWrites(work, dc.pos, old_h + at * width, new_h + at * width, &out);
      at += dc.pos.size();
      dc = DecodedChunk{};
    }
    // The device's works: their positions from the image indices.
    std::vector<uint32_t> pos;
    for (size_t k = 0; k < nj; ++k) {
      const SparseJob& job = sb.jobs[k];
      const placed::Ref& ref = b.works[sb.slot[k]];
      const codec::staged::Work& work = plans[ref.part].works[ref.work];
      pos.resize(job.changed);
      for (size_t i = 0; i < job.changed; ++i) {
        const uint64_t e = sidx_h[job.entry + i] - job.first_element;
        if (e >= work.map.n) return fail(DataLossError(where(ref) + ": position stream: a rank beyond its elements"));
        pos[i] = static_cast<uint32_t>(e);
      }
      placed::Writes& out = writes[work.dst];
      out.width = width;
      const size_t from = (hm + job.entry) * width;
      placed::AppendWrites(work, pos, old_h + from, new_h + from, &out);
    }
    EndPhase("verify");
  }
  if (auto bad = placed::Mismatch(readers, plans, digests)) {
    return unwritten(DataLossError(*bad + ": result does not match the patch's checksum (the patch is corrupted or "
                                          "the destination does not hold its base); destination unchanged"));
  }
  return writes;
}

Status DeviceCodec::Impl::UploadWrites(Staged::State& st, const std::vector<placed::Writes>& writes,
                                       internal::Scratch& mem) {
  st.jobs.clear();
  st.job_dst.clear();
  Carver carve;
  size_t njobs = 0;
  for (const placed::Writes& wr : writes) njobs += wr.index.empty() ? 0 : 1;
  const size_t o_jobs = carve.Add<CommitJob>(njobs);
  std::vector<size_t> o_index(writes.size()), o_old(writes.size()), o_value(writes.size());
  for (size_t d = 0; d < writes.size(); ++d) {
    o_index[d] = carve.Add<uint64_t>(writes[d].index.size());
    o_old[d] = carve.Add<uint8_t>(writes[d].old.size());
    o_value[d] = carve.Add<uint8_t>(writes[d].value.size());
  }
  WSYNC_ASSIGN_OR_RETURN(void* base, mem.Get(carve.bytes()));
  uint64_t total = 0;
  for (size_t d = 0; d < writes.size(); ++d) {
    const placed::Writes& wr = writes[d];
    if (wr.index.empty()) continue;
    WSYNC_RETURN_IF_ERROR(CopyUp(At<void>(base, o_index[d]), wr.index.data(), wr.index.size() * 8, compute));
    WSYNC_RETURN_IF_ERROR(CopyUp(At<void>(base, o_old[d]), wr.old.data(), wr.old.size(), compute));
    WSYNC_RETURN_IF_ERROR(CopyUp(At<void>(base, o_value[d]), wr.value.data(), wr.value.size(), compute));
    st.jobs.push_back(CommitJob{st.dst[d], At<uint64_t>(base, o_index[d]), At<void>(base, o_old[d]),
                                At<void>(base, o_value[d]), total, wr.index.size(), static_cast<int32_t>(wr.width)});
    st.job_dst.push_back(d);
    total += wr.index.size();
  }
  st.jobs_dev = At<CommitJob>(base, o_jobs);
  WSYNC_RETURN_IF_ERROR(CopyUp(At<void>(base, o_jobs), st.jobs.data(), st.jobs.size() * sizeof(CommitJob), compute));
  // The host vectors are the caller's: the copies must land before they go.
  return Check(cudaStreamSynchronize(compute), "copying the staged writes");
}

Status DeviceCodec::Impl::StageInto(Staged::State& st) {
  const codec::Destination destination = st.destination();
  std::vector<const codec::staged::PatchReader*> refs;
  for (const auto& r : st.readers) refs.push_back(&r);
  WSYNC_ASSIGN_OR_RETURN(auto plans, codec::staged::PlanApply(refs, destination, st.options, st.as_parts));
  if (st.pieces) {
    for (const auto& rt : st.runtime) st.dst.push_back(rt.view.data);
  } else {
    for (const auto& t : st.tensors) st.dst.push_back(t.data);
  }
  // As codec::Apply: keyframes decoded and verified first (on the host:
  // their bytes are there), then the patches, then the keyframes written.
  for (size_t i = 0; i < refs.size(); ++i) {
    const bool key = refs[i]->kind() == codec::PatchKind::kKeyframe;
    (key ? st.key_refs : st.patch_refs).push_back(refs[i]);
    (key ? st.key_plans : st.patch_plans).push_back(std::move(plans[i]));
    if (!key) st.patch_bytes.push_back(st.parts[i]);
  }
  Digests key_digests;
  for (size_t i = 0; i < st.key_refs.size(); ++i) {
    WSYNC_ASSIGN_OR_RETURN(auto d, placed::DecodeKeyframeWorks(*st.key_refs[i], st.key_plans[i], st.options.pool));
    key_digests.push_back(std::move(d.digests));
    st.key_values.push_back(std::move(d.values));
  }
  EndPhase("keyframes");
  if (auto bad = placed::Mismatch(st.key_refs, st.key_plans, key_digests)) {
    return DataLossError(*bad + ": the keyframe's values do not match its checksum (a corrupt keyframe); "
                                "destination unchanged");
  }
  // As codec::Apply: into whole tensors, a failure of a part whose base the
  // tensors do not hold is that (FailedPrecondition); pieces cannot tell.
  auto unwritten = [&](Status s) -> Status {
    if (st.pieces) return s;
    for (const codec::staged::PatchReader* r : st.patch_refs) {
      auto match = r->Match(st.tensors, /*allow_extra=*/true);
      if (!match.ok()) return s;
      std::vector<TensorView> held;
      for (size_t i : *match) held.push_back(st.tensors[i].AsConst());
      auto sum = SetChecksum(held, r->grids());
      if (sum.ok() && *sum != r->base_set_checksum()) return WrongBase(*r);
    }
    return s;
  };
  WSYNC_ASSIGN_OR_RETURN(auto writes, StagePatches(st, unwritten));
  uint64_t bytes = 0;
  for (const placed::Writes& wr : writes) {
    st.changes += wr.index.size();
    bytes += wr.bytes();
  }
  st.kept = bytes <= st.options.stage_keep_bytes;
  if (st.kept) {
    WSYNC_RETURN_IF_ERROR(UploadWrites(st, writes, st.writes));
    st.kept_bytes = bytes;
  }
  EndPhase("keep");
  return Status::Ok();
}

Status DeviceCodec::Impl::Commit(Staged::State& st) {
  if (st.committed) return FailedPreconditionError("this staged version was committed already");
  st.committed = true;
  if (!st.kept) {
    // Past the staging budget: decoded and proven again (against what the
    // destination holds now), the writes in the codec's scratch.
    auto writes = StagePatches(st, [](Status s) { return s; });
    if (writes.status().code() == StatusCode::kDataLoss) {
      return FailedPreconditionError("the version no longer stages as it did (another writer changed the "
                                     "destination since): " +
                                     writes.status().ToString() + "; nothing written");
    }
    WSYNC_RETURN_IF_ERROR(writes.status());
    WSYNC_RETURN_IF_ERROR(UploadWrites(st, *writes, ws->changes));
  }
  uint64_t total = 0;
  for (const CommitJob& j : st.jobs) total += j.count;
  if (total > 0) {
    ws->pinned.Reset();
    Carver carve;
    const size_t o_first = carve.Add<unsigned long long>(1);
    WSYNC_ASSIGN_OR_RETURN(void* mem, ws->digest_mem.Get(carve.bytes()));
    auto* first_foreign = At<unsigned long long>(mem, o_first);
    const CommitJob* jobs = st.jobs_dev;
    WSYNC_RETURN_IF_ERROR(Check(cudaMemsetAsync(first_foreign, 0xFF, sizeof(unsigned long long), compute), "memset"));
    WSYNC_RETURN_IF_ERROR(LaunchCommitCheck(jobs, st.jobs.size(), total, first_foreign, compute));
    const unsigned long long* back = nullptr;
    WSYNC_RETURN_IF_ERROR(CopyToPinned(ws->pinned, &back, first_foreign, 1, compute));
    WSYNC_RETURN_IF_ERROR(Check(cudaStreamSynchronize(compute), "checking the staged writes"));
    EndPhase("check");
    if (*back != ~0ull) {
      const size_t j = CommitJobOf(st.jobs.data(), st.jobs.size(), *back);
      return FailedPreconditionError("another writer changed an element of " + Quoted(st.DstName(st.job_dst[j])) +
                                     " that the version changes, between staging it and writing it; nothing "
                                     "written");
    }
    Status written = LaunchCommitWrite(jobs, st.jobs.size(), total, compute);
    if (written.ok()) written = Check(cudaStreamSynchronize(compute), "writing the staged changes");
    EndPhase("write");
    if (!written.ok()) {
      return DataLossError("writing the verified change: " + written.ToString() + "; the destination may be torn");
    }
  }
  for (size_t i = 0; i < st.key_refs.size(); ++i) {
    Status s = WriteTiles(*st.key_refs[i], st.key_plans[i], st.key_values[i], st.dst);
    if (!s.ok()) return DataLossError("writing a verified keyframe: " + s.ToString() + "; the destination may be torn");
  }
  return Status::Ok();
}

StatusOr<Digests> DeviceCodec::Impl::DestinationDigests(std::span<const codec::staged::PatchReader* const> readers,
                                                        std::span<const codec::staged::ApplyPlan> plans,
                                                        std::span<void* const> dst) {
  Digests digests = EmptyDigests(plans);
  for (const placed::Batch& b : placed::Batches(readers, plans, kImageBytes)) {
    ws->pinned.Reset();
    const size_t n = b.works.size();
    Carver carve;
    const size_t o_image = carve.Add<uint8_t>(n * b.slot * b.width);
    const size_t o_jobs = carve.Add<TileJob>(n);
    WSYNC_ASSIGN_OR_RETURN(void* mem, ws->scratch.Get(carve.bytes()));
    WSYNC_RETURN_IF_ERROR(UploadTileJobs(plans, b, dst, At<TileJob>(mem, o_jobs)));
    WSYNC_RETURN_IF_ERROR(
        LaunchGatherTiles(At<TileJob>(mem, o_jobs), n, static_cast<int>(b.width), b.slot, At<void>(mem, o_image),
                          compute));
    WSYNC_RETURN_IF_ERROR(DigestImage(readers, plans, b, At<void>(mem, o_image), digests));
  }
  return digests;
}

Status DeviceCodec::Impl::Confirm(const Staged::State& st) {
  if (!st.committed) return FailedPreconditionError("this staged version was not committed");
  for (const bool key : {false, true}) {
    const auto& refs = key ? st.key_refs : st.patch_refs;
    const auto& plans = key ? st.key_plans : st.patch_plans;
    WSYNC_ASSIGN_OR_RETURN(auto digests, DestinationDigests(refs, plans, st.dst));
    if (auto bad = placed::Mismatch(refs, plans, digests)) {
      return DataLossError(*bad + " is not the version's (another writer changed it between staging the version "
                                  "and writing it)");
    }
  }
  EndPhase("confirm");
  return Status::Ok();
}

Status DeviceCodec::Impl::WriteTiles(const codec::staged::PatchReader& r, const codec::staged::ApplyPlan& plan,
                                     const std::vector<std::vector<uint8_t>>& values, std::span<void* const> dst) {
  const codec::staged::PatchReader* readers[] = {&r};
  for (const placed::Batch& b : placed::Batches(readers, std::span(&plan, 1), kImageBytes)) {
    ws->pinned.Reset();
    const size_t n = b.works.size(), slot_bytes = b.slot * b.width;
    WSYNC_ASSIGN_OR_RETURN(uint8_t* image_h, ws->pinned.Alloc<uint8_t>(n * slot_bytes));
    for (size_t j = 0; j < n; ++j) {
      const auto& v = values[b.works[j].work];
      std::memcpy(image_h + j * slot_bytes, v.data(), v.size());
    }
    Carver carve;
    const size_t o_image = carve.Add<uint8_t>(n * slot_bytes), o_jobs = carve.Add<TileJob>(n);
    WSYNC_ASSIGN_OR_RETURN(void* mem, ws->scratch.Get(carve.bytes()));
    WSYNC_RETURN_IF_ERROR(CopyUp(At<void>(mem, o_image), image_h, n * slot_bytes, compute));
    WSYNC_RETURN_IF_ERROR(UploadTileJobs(std::span(&plan, 1), b, dst, At<TileJob>(mem, o_jobs)));
    WSYNC_RETURN_IF_ERROR(LaunchScatterTiles(At<TileJob>(mem, o_jobs), n, static_cast<int>(b.width), b.slot,
                                             At<void>(mem, o_image), compute));
    WSYNC_RETURN_IF_ERROR(Check(cudaStreamSynchronize(compute), "writing a keyframe"));
  }
  EndPhase("write keyframes");
  return Status::Ok();
}

StatusOr<DeviceCodec::Staged> DeviceCodec::Stage(Workspace& ws, std::span<const std::string_view> parts,
                                                 const codec::Destination& destination,
                                                 const codec::ApplyOptions& options) {
  return Stage(ws, parts, destination, options, /*as_parts=*/parts.size() != 1);
}

StatusOr<DeviceCodec::Staged> DeviceCodec::Stage(Workspace& ws, std::span<const std::string_view> parts,
                                                 const codec::Destination& destination,
                                                 const codec::ApplyOptions& options, bool as_parts) {
  auto st = std::make_unique<Staged::State>();
  st->parts.assign(parts.begin(), parts.end());
  st->as_parts = as_parts;
  st->options = options;
  st->pieces = destination.pieces();
  st->tensors.assign(destination.tensors().begin(), destination.tensors().end());
  st->runtime.assign(destination.runtime().begin(), destination.runtime().end());
  for (std::string_view p : parts) {
    WSYNC_ASSIGN_OR_RETURN(auto r, codec::staged::PatchReader::Open(p, options.verify_patch_checksum));
    st->readers.push_back(std::move(r));
  }
  WSYNC_RETURN_IF_ERROR(impl_->Begin(ws));
  const EndOfCall end{impl_->compute, impl_->ws->pinned};
  WSYNC_RETURN_IF_ERROR(impl_->StageInto(*st));
  Staged staged;
  staged.state_ = std::move(st);
  return staged;
}

Status DeviceCodec::Commit(Workspace& ws, Staged& staged) {
  if (!staged.state_) return FailedPreconditionError("nothing staged");
  WSYNC_RETURN_IF_ERROR(impl_->Begin(ws));
  const EndOfCall end{impl_->compute, impl_->ws->pinned};
  return impl_->Commit(*staged.state_);
}

Status DeviceCodec::Confirm(Workspace& ws, const Staged& staged) {
  if (!staged.state_) return FailedPreconditionError("nothing staged");
  WSYNC_RETURN_IF_ERROR(impl_->Begin(ws));
  const EndOfCall end{impl_->compute, impl_->ws->pinned};
  return impl_->Confirm(*staged.state_);
}

Status DeviceCodec::Apply(Workspace& ws, std::string_view patch, const codec::Destination& destination,
                          const codec::ApplyOptions& options) {
  return StageAndCommit(ws, std::span(&patch, 1), destination, options, /*as_parts=*/false);
}

Status DeviceCodec::Apply(Workspace& ws, std::span<const std::string_view> parts,
                          const codec::Destination& destination, const codec::ApplyOptions& options) {
  return StageAndCommit(ws, parts, destination, options, /*as_parts=*/true);
}

Status DeviceCodec::StageAndCommit(Workspace& ws, std::span<const std::string_view> parts,
                                   const codec::Destination& destination, const codec::ApplyOptions& options,
                                   bool as_parts) {
  codec::ApplyOptions keep_all = options;
  keep_all.stage_keep_bytes = std::numeric_limits<uint64_t>::max();  // the writes follow at once
  WSYNC_ASSIGN_OR_RETURN(Staged staged, Stage(ws, parts, destination, keep_all, as_parts));
  const std::vector<Phase> staging = impl_->phases;
  Status s = Commit(ws, staged);
  impl_->phases.insert(impl_->phases.begin(), staging.begin(), staging.end());
  return s;
}

}  // namespace wsync::cuda
