// DeviceCodec's encode: EncodePatch, SnapshotAndEncode and
// EncodeAndAdvance*, batch by batch of whole tensors. The device digests,
// diffs, compacts, histograms and ranks each batch and entropy-codes the
// chunks its coder takes (encode_plan.h); the host chooses the classes and
// codes the rest (staged.h's PatchWriter).
#include "wsync/cuda/device_codec.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <unordered_map>

#include "device_codec_impl.h"
#include "wsync/codec/checksum.h"
#include "wsync/codec/staged.h"
#include "wsync/cuda/carver.h"
#include "wsync/cuda/encode_plan.h"
#include "wsync/cuda/kernels.h"
#include "wsync/util/first_error.h"
#include "wsync/util/thread_pool.h"
#include "wsync/util/text.h"

namespace wsync::cuda {
namespace {

using namespace internal;  // device_codec_impl.h

using codec::ClassSpec;
using codec::MutableTensorView;
using codec::TensorView;

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

Status DeviceCodec::Impl::StageBases(std::span<const TensorView> host, size_t t0, size_t t1, size_t bytes,
                                     std::vector<TensorView>& bases) {
  WSYNC_ASSIGN_OR_RETURN(void* mem, ws->staging.Get(bytes));
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

Status DeviceCodec::Impl::PlaceCells(const codec::staged::PatchWriter& writer, std::span<const TensorView> base,
                                     std::span<const TensorView> target, size_t cell0, std::span<CellChange> cells,
                                     std::span<cudaEvent_t> landed) {
  const auto& chunks = writer.chunks();
  const std::span<const codec::staged::Cell> of(writer.cells().data() + cell0, cells.size());
  size_t bytes = 0;
  for (const codec::staged::Cell& cell : of) bytes += 2 * GatheredBytes(cell, chunks[cell.first_chunk].width);
  void* mem = nullptr;
  if (bytes > 0) {
    WSYNC_ASSIGN_OR_RETURN(mem, ws->images.Get(bytes));
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
    WSYNC_ASSIGN_OR_RETURN(tc.scan_bytes, ScanBytes(blocks + 1));
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
  WSYNC_ASSIGN_OR_RETURN(void* mem, ws->scratch.Get(carve.bytes()));
  // Each step synchronizes once for the batch, so that the phases time apart.
  std::vector<DigestJob> jobs;
  for (CellChange& tc : batch) {
    if (tc.empty()) continue;
    const size_t nbytes = tc.layout.n * tc.width;
    jobs.push_back({tc.base, nbytes, At<uint64_t>(mem, tc.o_bdig), 0});
    jobs.push_back({tc.target, nbytes, At<uint64_t>(mem, tc.o_tdig), 0});
  }
  WSYNC_RETURN_IF_ERROR(EnqueueDigests(ws->pinned, jobs, At<DigestJob>(mem, o_jobs), compute));
  for (CellChange& tc : batch) {
    if (tc.empty()) continue;
    WSYNC_RETURN_IF_ERROR(CopyToPinned(ws->pinned, &tc.base_digests, At<uint64_t>(mem, tc.o_bdig), tc.ndigests, compute));
    WSYNC_RETURN_IF_ERROR(CopyToPinned(ws->pinned, &tc.target_digests, At<uint64_t>(mem, tc.o_tdig), tc.ndigests, compute));
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
    WSYNC_RETURN_IF_ERROR(CopyToPinned(ws->pinned, &tc.chunk_off, At<uint32_t>(mem, tc.o_chunks), l.Chunks() + 1, compute));
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
        CopyToPinned(ws->pinned, &tc.hist, At<uint32_t>(mem, tc.o_hist), tc.layout.Chunks() * tc.bins, compute));
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
  WSYNC_ASSIGN_OR_RETURN(void* cmem, ws->changes.Get(cc.bytes()));
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
    if (!tc.need_ranks) continue;
    WSYNC_ASSIGN_OR_RETURN(const RankScratch rs, RankScratchOf(tc.layout));
    rank_bytes = std::max(rank_bytes, rs.bytes);
  }
  EndPhase("classes");
  if (rank_bytes == 0) return Status::Ok();

  // Ranks on the device, one tensor after another in rank_mem.
  WSYNC_ASSIGN_OR_RETURN(void* rmem, ws->rank_mem.Get(rank_bytes));
  for (CellChange& tc : batch) {
    if (!tc.need_ranks) continue;
    const void* b = tc.base;
    WSYNC_ASSIGN_OR_RETURN(const RankScratch rs, RankScratchOf(tc.layout));
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
  WSYNC_ASSIGN_OR_RETURN(PackSegment * list, ws->pinned.Alloc<PackSegment>(segments.size()));
  std::copy(segments.begin(), segments.end(), list);
  WSYNC_RETURN_IF_ERROR(CopyUp(dev, list, segments.size() * sizeof(PackSegment), compute));
  WSYNC_RETURN_IF_ERROR(
      LaunchPackSegments(static_cast<const PackSegment*>(dev), segments.size(), At<uint8_t>(dev, o_packed), compute));
  const uint8_t* host = nullptr;
  WSYNC_RETURN_IF_ERROR(CopyToPinned(ws->pinned, &host, At<uint8_t>(dev, o_packed), bytes, compute));
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
  WSYNC_ASSIGN_OR_RETURN(const uint8_t* host, PackToHost(segments, bytes, ws->fetch_mem, "fetching changes"));
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
      if (entropy == EntropyStage::kDevice && MaySparseEncode(in.elements, in.changed)) inputs.push_back(in);
    }
  }
  if (inputs.empty()) return fetch(changed);
  const size_t arena_bytes = PlanSparseEncode(inputs, nullptr, kCoderArenaBytes).bytes;
  const size_t o_lg = (arena_bytes + 255) / 256 * 256;
  WSYNC_ASSIGN_OR_RETURN(void* mem, ws->coder_mem.Get(o_lg + sizeof(codec::sparse::Log2Table)));
  auto* arena = static_cast<uint8_t*>(mem);
  const EncodePlan plan = PlanSparseEncode(inputs, arena, kCoderArenaBytes);
  const size_t njobs = plan.jobs.size();
  if (njobs == 0) return fetch(changed);
  WSYNC_ASSIGN_OR_RETURN(SparseEncodeJob * jobs, ws->pinned.Alloc<SparseEncodeJob>(njobs));
  std::copy(plan.jobs.begin(), plan.jobs.end(), jobs);
  WSYNC_ASSIGN_OR_RETURN(uint32_t * lg, ws->pinned.Alloc<uint32_t>(codec::sparse::kLog2Table.size()));
  std::copy(codec::sparse::kLog2Table.begin(), codec::sparse::kLog2Table.end(), lg);
  WSYNC_RETURN_IF_ERROR(CopyUp(arena + plan.o_jobs, jobs, njobs * sizeof(SparseEncodeJob), compute));
  WSYNC_RETURN_IF_ERROR(CopyUp(arena + o_lg, lg, sizeof(codec::sparse::Log2Table), compute));
  auto* results_dev = At<codec::sparse::SparseEncodeResult>(arena, plan.o_results);
  WSYNC_RETURN_IF_ERROR(LaunchSparseEncode(At<SparseEncodeJob>(arena, plan.o_jobs), njobs, At<uint32_t>(arena, o_lg),
                                           results_dev, compute));
  const codec::sparse::SparseEncodeResult* results = nullptr;
  WSYNC_RETURN_IF_ERROR(CopyToPinned(ws->pinned, &results, results_dev, njobs, compute));
  WSYNC_RETURN_IF_ERROR(Check(cudaStreamSynchronize(compute), "sparse encode"));
  EndPhase("device entropy");

  // The streams cross to the host, packed back to back, and the changes
  // of the chunks the host still weighs or codes (none at RL rates).
  const std::span<const codec::sparse::SparseEncodeResult> rs(results, njobs);
  WSYNC_RETURN_IF_ERROR(fetch(ChunksForTheHost(plan, rs, changed)));
  const Packing packing = PackSparseEncoded(plan, rs);
  if (packing.segments.empty()) return Status::Ok();
  WSYNC_ASSIGN_OR_RETURN(const uint8_t* packed,
                         PackToHost(packing.segments, packing.bytes, ws->packed_mem, "packing the coded streams"));
  EndPhase("streams to host");
  auto change_of = [&](size_t chunk) {
    const auto [k, c] = where.at(chunk);
    return batch[k].Change(c);
  };
  WSYNC_RETURN_IF_ERROR(SetSparseEncoded(plan, rs, packed, change_of, options.pool, writer, &coded));
  EndPhase("modes weighed");
  return Status::Ok();
}

StatusOr<std::string> DeviceCodec::EncodePatch(Workspace& ws, std::span<const TensorView> base,
                                               std::span<const TensorView> target, const codec::EncodeOptions& options) {
  WSYNC_RETURN_IF_ERROR(impl_->Begin(ws));
  return impl_->Encode({}, {}, base, options, {}, target, {}, false);
}

StatusOr<std::string> DeviceCodec::SnapshotAndEncode(Workspace& ws, std::span<const TensorView> live,
                                                     std::span<const MutableTensorView> snapshot,
                                                     std::span<const TensorView> previous,
                                                     const codec::EncodeOptions& options,
                                                     const std::function<void()>& on_snapshot) {
  const std::vector<TensorView> targets = ConstViews(snapshot);
  WSYNC_RETURN_IF_ERROR(CheckPairs(live, targets, "live and snapshot"));
  WSYNC_RETURN_IF_ERROR(impl_->Begin(ws));
  return impl_->Encode(live, snapshot, previous, options, on_snapshot, targets, {}, false);
}

StatusOr<std::string> DeviceCodec::EncodeAndAdvance(Workspace& ws, std::span<const TensorView> live,
                                                    std::span<const MutableTensorView> previous,
                                                    const codec::EncodeOptions& options) {
  const std::vector<TensorView> base = ConstViews(previous);
  WSYNC_RETURN_IF_ERROR(impl_->Begin(ws));
  return impl_->Encode({}, {}, base, options, {}, live, previous, false);
}

StatusOr<std::string> DeviceCodec::EncodeAndAdvanceFromHost(Workspace& ws, std::span<const TensorView> live,
                                                            std::span<const MutableTensorView> previous,
                                                            const codec::EncodeOptions& options) {
  const std::vector<TensorView> base = ConstViews(previous);
  WSYNC_RETURN_IF_ERROR(impl_->Begin(ws));
  return impl_->Encode({}, {}, base, options, {}, live, previous, true);
}

StatusOr<std::string> DeviceCodec::Impl::Encode(std::span<const TensorView> live,
                                                std::span<const MutableTensorView> snapshot,
                                                std::span<const TensorView> previous,
                                                const codec::EncodeOptions& options,
                                                const std::function<void()>& on_snapshot,
                                                std::span<const TensorView> target,
                                                std::span<const MutableTensorView> advance, bool base_on_host) {
  const EndOfCall end{compute, ws->pinned};
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
      s = Check(cudaMemcpyAsync(snapshot[t].data, live[t].data, live[t].NumBytes(), cudaMemcpyDeviceToDevice, copy),
                "snapshot copy");
    }
    if (s.ok()) s = Check(cudaEventRecord(landed[t], copy), "event");
    if (!s.ok()) {
      cudaStreamSynchronize(copy);
      destroy();
      return s;
    }
  }
  bool snapshot_reported = !snapshotting;
  auto report_snapshot = [&]() -> Status {
    if (snapshot_reported) return Status::Ok();
    snapshot_reported = true;
    WSYNC_RETURN_IF_ERROR(Check(cudaStreamSynchronize(copy), "snapshot"));
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
  std::vector<CellChange> batch;
  Status status;
  // A base in host memory is staged on the device batch by batch.
  std::vector<TensorView> bases(previous.begin(), previous.end());
  for (size_t t0 = 0; t0 < target.size() && status.ok();) {
    size_t t1 = t0, bytes = 0, staged = 0, image_bytes = 0;
    while (t1 < target.size() &&
           (t1 == t0 || (bytes + target[t1].NumElements() / 4 <= kBatchScratchBytes &&
                         image_bytes + gathered(t1) <= kStagingBytes &&
                         (!base_on_host || staged + target[t1].NumBytes() <= kStagingBytes)))) {
      bytes += target[t1].NumElements() / 4;
      staged += (target[t1].NumBytes() + 255) / 256 * 256;
      image_bytes += gathered(t1);
      ++t1;
    }
    batch.assign(first_cell[t1] - first_cell[t0], CellChange{});
    ws->pinned.Reset();
    if (base_on_host) status = StageBases(previous, t0, t1, staged, bases);
    if (status.ok()) status = PlaceCells(writer, bases, target, first_cell[t0], batch, landed);
    if (status.ok()) status = CompactBatch(writer, batch, options, specs);
    // Once the copy stream is idle the trainer may go on; check as we go.
    if (status.ok() && !snapshot_reported && cudaStreamQuery(copy) == cudaSuccess) status = report_snapshot();
    if (!status.ok()) break;
    // Checksums over each tensor's cells in turn; a gridded chunk (1 MiB) is
    // one checksum block of its cell, so its tile digest is that block's.
    std::vector<std::pair<size_t, size_t>> all;  // (cell in batch, chunk in cell)
    std::vector<uint64_t> bd, td;
    for (size_t t = t0; t < t1 && status.ok(); ++t) {
      bd.clear();
      td.clear();
      for (size_t k = first_cell[t] - first_cell[t0]; k < first_cell[t + 1] - first_cell[t0]; ++k) {
        const CellChange& cc = batch[k];
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
    if (status.ok()) status = CodeOnDevice(writer, batch, options, coded);
    if (!status.ok()) break;
    FirstError error;
    ParallelFor(options.pool, all.size(), [&](size_t i) {
      const CellChange& tc = batch[all[i].first];
      const size_t c = all[i].second;
      if (coded[tc.chunk_ids[c]]) return;
      error.Record(i, writer.SetChunk(tc.chunk_ids[c], tc.Change(c), tc.specs[c], tc.Ranks(c)));
    });
    status = error.status();  // the cells' host memory is the next batch's
    EndPhase("entropy");
    t0 = t1;
  }
  if (status.ok()) status = report_snapshot();
  cudaStreamSynchronize(copy);
  destroy();
  WSYNC_RETURN_IF_ERROR(status);
  WSYNC_RETURN_IF_ERROR(writer.SetChecksums(target_sums, base_sums));
  auto out = writer.Finish();
  EndPhase("finish");
  if (out.ok() && !advance.empty()) {
    // The patch is made: the base becomes the target.
    for (size_t t = 0; t < advance.size(); ++t) {
      WSYNC_RETURN_IF_ERROR(Check(cudaMemcpyAsync(advance[t].data, target[t].data, target[t].NumBytes(),
                                                  cudaMemcpyDefault, compute),
                                  "updating the base"));
    }
    WSYNC_RETURN_IF_ERROR(Check(cudaStreamSynchronize(compute), "updating the base"));
    EndPhase("advance");
  }
  return out;
}

}  // namespace wsync::cuda
