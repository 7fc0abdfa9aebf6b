// DeviceCodec::Apply in general: parts of a version, pieces of runtime
// tensors and tile grids (placed.h). Keyframe parts are decoded and
// verified on the host; patch parts are decoded batch by batch against
// images of their chunks gathered on the device, and every result is
// verified before the destination is written; then the changes are
// scattered at their placements and the keyframes written.
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
namespace {

using namespace internal;  // device_codec_impl.h

using codec::ClassSpec;
using codec::TensorView;
using codec::staged::Chunk;
using codec::staged::DecodedChunk;

}  // namespace

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

Status DeviceCodec::Apply(std::string_view patch, const codec::Destination& destination,
                          const codec::ApplyOptions& options) {
  return impl_->ApplyParts(std::span(&patch, 1), destination, options, /*as_parts=*/false);
}

Status DeviceCodec::Apply(std::span<const std::string_view> parts, const codec::Destination& destination,
                          const codec::ApplyOptions& options) {
  return impl_->ApplyParts(parts, destination, options, /*as_parts=*/true);
}

Status DeviceCodec::Impl::ApplyParts(std::span<const std::string_view> parts, const codec::Destination& destination,
                                     const codec::ApplyOptions& options, bool as_parts) {
  std::vector<codec::staged::PatchReader> readers;
  for (std::string_view p : parts) {
    WSYNC_ASSIGN_OR_RETURN(auto r, codec::staged::PatchReader::Open(p, options.verify_patch_checksum));
    readers.push_back(std::move(r));
  }
  StartPhases();
  WSYNC_RETURN_IF_ERROR(Activate());
  const EndOfCall end{compute, pinned};
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
  EndPhase("keyframes");
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
    WSYNC_RETURN_IF_ERROR(ApplyPlaced(patch_refs, patch_plans, dst, options, unwritten));
  }
  for (size_t i = 0; i < key_refs.size(); ++i) {
    Status s = WriteTiles(*key_refs[i], key_plans[i], keyframes[i].values, dst);
    if (!s.ok()) return DataLossError("writing a verified keyframe: " + s.ToString() + "; the destination may be torn");
  }
  return Status::Ok();
}

}  // namespace wsync::cuda
