#include "gpu_bench.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>

#include "measure.h"
#include "tp_bench.h"
#include "wsync/codec/codec.h"
#include "wsync/cuda/device_codec.h"
#include "wsync/util/thread_pool.h"

namespace wsync::bench {
namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Seconds per phase (cuda::DeviceCodec::last_phases), over calls.
struct PhaseTimes {
  std::vector<std::pair<std::string, std::vector<double>>> phases;
  void Add(const std::vector<cuda::DeviceCodec::Phase>& last) {
    for (const auto& p : last) {
      auto it = std::find_if(phases.begin(), phases.end(), [&](const auto& q) { return q.first == p.name; });
      if (it == phases.end()) it = phases.insert(phases.end(), {p.name, {}});
      it->second.push_back(p.seconds);
    }
  }
  void Print(const char* what) const {
    std::printf("  %s phases (median ms):", what);
    for (const auto& [name, s] : phases) std::printf(" %s %.1f", name.c_str(), Median(s) * 1e3);
    std::printf("\n");
  }
};

struct DeviceSet {
  std::vector<cuda::DeviceBuffer> buffers;
  std::vector<codec::MutableTensorView> views;
  std::vector<codec::TensorView> Const() const {
    std::vector<codec::TensorView> v;
    for (const auto& m : views) v.push_back(m.AsConst());
    return v;
  }
};

StatusOr<DeviceSet> Upload(const std::vector<buffers::OwnedTensor>& host) {
  DeviceSet s;
  for (const auto& t : host) {
    WSYNC_ASSIGN_OR_RETURN(auto b, cuda::DeviceBuffer::Allocate(t.bytes.size()));
    WSYNC_RETURN_IF_ERROR(b.CopyFromHost(t.bytes.data(), t.bytes.size()));
    s.views.push_back({t.name, t.dtype, t.shape, static_cast<uint8_t*>(b.data())});
    s.buffers.push_back(std::move(b));
  }
  return s;
}

// Whether the device buffers hold these tensors' bytes.
StatusOr<bool> Holds(const DeviceSet& d, const std::vector<buffers::OwnedTensor>& want) {
  bool same = true;
  for (size_t i = 0; i < want.size(); ++i) {
    std::vector<uint8_t> got(want[i].bytes.size());
    WSYNC_RETURN_IF_ERROR(d.buffers[i].CopyToHost(got.data(), got.size()));
    same = same && got == want[i].bytes;
  }
  return same;
}

Status Reset(DeviceSet& dst, const DeviceSet& src) {
  for (size_t i = 0; i < dst.buffers.size(); ++i) {
    WSYNC_RETURN_IF_ERROR(dst.buffers[i].CopyFromDevice(src.buffers[i].data(), src.buffers[i].size()));
  }
  return Status::Ok();
}

}  // namespace

int RunGpuBench(const GpuBenchOptions& o) {
  const Status avail = cuda::DeviceAvailable();
  if (!avail.ok()) {
    spdlog::error("{}", avail.ToString());
    return 2;
  }
  // The figures are the default codec's (the entropy stage on the host's
  // threads); `dd` runs it on the device, measured beside it.
  auto dc = cuda::DeviceCodec::Create(0, cuda::EntropyStage::kHost);
  auto dd = cuda::DeviceCodec::Create(0, cuda::EntropyStage::kDevice);
  if (!dc.ok() || !dd.ok()) {
    spdlog::error("{}", (dc.ok() ? dd.status() : dc.status()).ToString());
    return 2;
  }
  cuda::Workspace ws;  // every call's scratch, kept between the runs
  ThreadPool pool(o.host_threads);
  SynthModel model(o.synth, &pool);
  const double dense = static_cast<double>(model.params()) * 2;
  spdlog::info("gpu bench: {:.2f} GB of BF16, lr {}", dense / 1e9, o.synth.lr);
  std::vector<buffers::OwnedTensor> prev = model.Tensors(), cur = model.Tensors();
  model.CastTo(&prev);
  std::vector<double> enc, app, copy, d2h, host_enc, ratio;
  // The baseline a version costs without wsync on one node: the dense
  // weights copied device to host (into memory touched beforehand).
  std::vector<std::vector<uint8_t>> host_copy;
  for (const auto& t : cur) host_copy.emplace_back(t.bytes.size(), uint8_t{1});
  PhaseTimes enc_phases, app_phases;
  std::vector<double> enc_dd, app_dd;
  PhaseTimes enc_dd_phases, app_dd_phases;
  bool identical_dd = true, exact_dd = true;
  std::vector<double> pause_device, pause_host;
  // A sink's version in three steps: staged while the engine generates, the
  // commit between its holds (the pause), the confirm after them.
  std::vector<double> staging, commit, confirm, changed;
  PhaseTimes commit_phases;
  bool staged_exact = true;
  std::vector<cuda::PinnedBuffer> pinned;
  std::vector<codec::MutableTensorView> pinned_views;
  for (const auto& t : prev) {
    auto b = cuda::PinnedBuffer::Allocate(t.bytes.size());
    if (!b.ok()) {
      spdlog::error("{}", b.status().ToString());
      return 1;
    }
    std::memset(b->data(), 0, b->size());  // touched before the timed copies
    pinned_views.push_back({t.name, t.dtype, t.shape, static_cast<uint8_t*>(b->data())});
    pinned.push_back(std::move(*b));
  }
  bool identical = true;
  // Tensor-parallel: the grid of TP o.tp's layouts coded on the device, and
  // rank 0 applying its selection into its pieces in GPU memory.
  std::vector<double> enc_tp, app_tp, rank_bytes;
  PhaseTimes tp_phases;
  bool identical_tp = true, exact_tp = true;
  std::vector<TpRank> ranks;
  std::vector<codec::TileGrid> grids;
  for (int r = 0; r < o.tp && o.tp > 1; ++r) {
    auto rank = MakeTpRank(prev, o.tp, r);
    if (!rank.ok()) {
      spdlog::error("TP {}: {}", o.tp, rank.status().ToString());
      return 1;
    }
    ranks.push_back(std::move(*rank));
  }
  if (!ranks.empty()) {
    std::vector<std::vector<codec::RuntimeTensor>> layouts;
    for (const auto& r : ranks) layouts.push_back(r.layout);
    grids = codec::GridsFor(layouts, buffers::Views(prev));
  }
  for (int s = 1; s <= o.steps; ++s) {
    model.Step();
    model.CastTo(&cur);
    auto base = Upload(prev), target = Upload(cur), work = Upload(prev);
    if (!base.ok() || !target.ok() || !work.ok()) {
      spdlog::error("upload failed");
      return 1;
    }
    std::string patch;
    codec::EncodeOptions eo;
    eo.pool = &pool;  // the host entropy stage of both codecs
    codec::ApplyOptions ao;
    ao.pool = &pool;
    for (int r = 0; r < o.repeat; ++r) {
      auto t0 = Clock::now();
      auto p = (*dc)->EncodePatch(ws, base->Const(), target->Const(), eo);
      enc.push_back(Since(t0));
      enc_phases.Add((*dc)->last_phases());
      if (!p.ok()) {
        spdlog::error("{}", p.status().ToString());
        return 1;
      }
      patch = std::move(*p);
      // The trainer's pause with the source's base on the GPU, then in
      // page-locked host memory: encode and update the base.
      if (!Reset(*work, *base).ok()) return 1;
      t0 = Clock::now();
      auto on_device = (*dc)->EncodeAndAdvance(ws, target->Const(), work->views, eo);
      pause_device.push_back(Since(t0));
      for (size_t i = 0; i < prev.size(); ++i) std::memcpy(pinned[i].data(), prev[i].bytes.data(), prev[i].bytes.size());
      t0 = Clock::now();
      auto on_host = (*dc)->EncodeAndAdvanceFromHost(ws, target->Const(), pinned_views, eo);
      pause_host.push_back(Since(t0));
      if (!on_device.ok() || !on_host.ok()) {
        spdlog::error("{}", (on_device.ok() ? on_host.status() : on_device.status()).ToString());
        return 1;
      }
      identical = identical && *on_device == patch && *on_host == patch;
      t0 = Clock::now();
      if (!Reset(*work, *base).ok()) return 1;
      copy.push_back(Since(t0));
      t0 = Clock::now();
      for (size_t i = 0; i < target->buffers.size(); ++i) {
        if (!target->buffers[i].CopyToHost(host_copy[i].data(), host_copy[i].size()).ok()) return 1;
      }
      d2h.push_back(Since(t0));
      t0 = Clock::now();
      const Status a = (*dc)->Apply(ws, patch, work->views, ao);
      app.push_back(Since(t0));
      app_phases.Add((*dc)->last_phases());
      if (!a.ok()) {
        spdlog::error("{}", a.ToString());
        return 1;
      }
      // The same with the entropy stage on the device.
      t0 = Clock::now();
      auto coded = (*dd)->EncodePatch(ws, base->Const(), target->Const(), eo);
      enc_dd.push_back(Since(t0));
      enc_dd_phases.Add((*dd)->last_phases());
      if (!coded.ok() || *coded != patch) {
        identical_dd = false;
        spdlog::error("step {}: the device entropy stage's patch: {}", s,
                      coded.ok() ? "differs from the host's" : coded.status().ToString());
      }
      if (!Reset(*work, *base).ok()) return 1;
      t0 = Clock::now();
      const Status ad = (*dd)->Apply(ws, patch, work->views, ao);
      app_dd.push_back(Since(t0));
      app_dd_phases.Add((*dd)->last_phases());
      if (!ad.ok()) spdlog::error("step {}: the device entropy stage's apply: {}", s, ad.ToString());
      exact_dd = exact_dd && ad.ok();
      if (ad.ok() && r == 0) {
        auto held = Holds(*work, cur);
        if (!held.ok()) return 1;
        exact_dd = exact_dd && *held;
      }
      if (!Reset(*work, *base).ok()) return 1;
      const std::string_view one(patch);
      t0 = Clock::now();
      auto staged = (*dc)->Stage(ws, std::span(&one, 1), work->views, ao);
      staging.push_back(Since(t0));
      if (!staged.ok()) {
        spdlog::error("stage: {}", staged.status().ToString());
        return 1;
      }
      changed.push_back(static_cast<double>(staged->changes()));
      t0 = Clock::now();
      Status c = (*dc)->Commit(ws, *staged);
      commit.push_back(Since(t0));
      commit_phases.Add((*dc)->last_phases());
      t0 = Clock::now();
      if (c.ok()) c = (*dc)->Confirm(ws, *staged);
      confirm.push_back(Since(t0));
      if (!c.ok()) {
        spdlog::error("commit: {}", c.ToString());
        return 1;
      }
      if (r == 0) {
        auto held = Holds(*work, cur);
        if (!held.ok()) return 1;
        staged_exact = staged_exact && *held;
      }
    }
    auto t0 = Clock::now();
    auto host = codec::EncodePatch(buffers::Views(prev), buffers::Views(cur), eo);
    host_enc.push_back(Since(t0));
    if (!host.ok() || *host != patch) {
      identical = false;
      spdlog::error("step {}: the device's patch differs from the host codec's", s);
    }
    if (!ranks.empty()) {
      codec::EncodeOptions go = eo;
      go.grids = grids;
      std::string gridded;
      for (int r = 0; r < o.repeat; ++r) {
        t0 = Clock::now();
        auto p = (*dc)->EncodePatch(ws, base->Const(), target->Const(), go);
        enc_tp.push_back(Since(t0));
        if (!p.ok()) {
          spdlog::error("gridded encode: {}", p.status().ToString());
          return 1;
        }
        gridded = std::move(*p);
      }
      auto host_gridded = codec::EncodePatch(buffers::Views(prev), buffers::Views(cur), go);
      if (!host_gridded.ok()) {
        spdlog::error("the host's gridded encode: {}", host_gridded.status().ToString());
        return 1;
      }
      if (*host_gridded != gridded) {
        identical_tp = false;
        const auto diff = std::mismatch(gridded.begin(), gridded.end(), host_gridded->begin(), host_gridded->end());
        spdlog::error("step {}: the device's gridded patch ({} bytes) differs from the host codec's ({} bytes) "
                      "from byte {} on", s, gridded.size(), host_gridded->size(), diff.first - gridded.begin());
      }
      TpRank& rank = ranks[0];
      FillTpRank(&rank, prev);
      // Rank 0 applies its selection of the device's patch on the device;
      // should that fail, the host codec's patch too, which tells a wrong
      // encode from a wrong apply.
      auto apply_selection = [&](const std::string& patch_of, const char* whose, bool timed) -> bool {
        auto selection = codec::SelectForPieces(patch_of, rank.layout);
        if (!selection.ok()) {
          spdlog::error("{}: {}", whose, selection.status().ToString());
          return false;
        }
        if (timed) rank_bytes.push_back(static_cast<double>(selection->size()));
        for (int r = 0; r < (timed ? o.repeat : 1); ++r) {
          auto pieces = Upload(rank.tensors);
          if (!pieces.ok()) return false;
          std::vector<codec::RuntimeTensor> layout = rank.layout;
          for (size_t i = 0; i < layout.size(); ++i) layout[i].view.data = pieces->views[i].data;
          const auto t0 = Clock::now();
          const Status a = (*dc)->Apply(ws, *selection, layout, ao);
          if (timed) {
            app_tp.push_back(Since(t0));
            tp_phases.Add((*dc)->last_phases());
          }
          if (!a.ok()) {
            spdlog::error("step {}: rank 0's apply of {}: {}", s, whose, a.ToString());
            return false;
          }
          if (r > 0) continue;
          auto want = MakeTpRank(cur, o.tp, 0);
          if (!want.ok()) return false;
          FillTpRank(&*want, cur);
          auto held = Holds(*pieces, want->tensors);
          if (!held.ok()) return false;
          if (!*held) {
            spdlog::error("step {}: rank 0's pieces after its apply of {} are not the target's", s, whose);
            return false;
          }
        }
        return true;
      };
      if (!apply_selection(gridded, "the device's patch", true)) {
        exact_tp = false;
        const bool host_ok = apply_selection(*host_gridded, "the host codec's patch", false);
        spdlog::error("step {}: the host codec's patch, selected for rank 0 and applied on the device: {}", s,
                      host_ok ? "exact" : "failed too");
      }
    }
    ratio.push_back(dense / patch.size());
    std::swap(prev, cur);
  }
  std::printf("device codec, synthetic %.2f GB BF16 set, lr %g, %d steps x %d repeats (medians), "
              "host entropy stage on %d threads\n", dense / 1e9, o.synth.lr, o.steps, o.repeat, o.host_threads);
  std::printf("  patch ratio                 %10.1fx\n", Median(ratio));
  std::printf("  device encode               %10.2f GB/s\n", dense / Median(enc) / 1e9);
  std::printf("  device apply (verified)     %10.2f GB/s\n", dense / Median(app) / 1e9);
  std::printf("  device memcpy D2D           %10.2f GB/s (cudaMemcpy per tensor)\n", dense / Median(copy) / 1e9);
  std::printf("  device memcpy D2H           %10.2f GB/s (cudaMemcpy per tensor, pageable)\n",
              dense / Median(d2h) / 1e9);
  std::printf("  encode / D2D memcpy         %10.3fx\n", Median(copy) / Median(enc));
  std::printf("  apply / D2D memcpy          %10.3fx\n", Median(copy) / Median(app));
  std::printf("  version (encode + apply)    %10.3f s vs %.3f s D2H copy of the dense weights (%.2fx)\n",
              Median(enc) + Median(app), Median(d2h), Median(d2h) / (Median(enc) + Median(app)));
  std::printf("  trainer pause, base on GPU  %10.1f ms (the model once more in GPU memory)\n",
              Median(pause_device) * 1e3);
  std::printf("  trainer pause, base on host %10.1f ms (page-locked host memory; 256 MiB of GPU staging)\n",
              Median(pause_host) * 1e3);
  std::printf("  sink, staged                %10.1f ms staging (the engine generating), %.2f ms commit (its "
              "pause), %.1f ms confirm; %.0f changes (%.2f%%); bit-exact: %s\n",
              Median(staging) * 1e3, Median(commit) * 1e3, Median(confirm) * 1e3, Median(changed),
              100 * Median(changed) / (dense / 2), staged_exact ? "yes" : "NO");
  enc_phases.Print("encode");
  app_phases.Print("apply");
  commit_phases.Print("commit");
  std::printf("  entropy stage on the device: encode %.2f GB/s (%.2fx the host's), apply %.2f GB/s (%.2fx); bytes "
              "identical: %s, bit-exact: %s\n",
              dense / Median(enc_dd) / 1e9, Median(enc) / Median(enc_dd), dense / Median(app_dd) / 1e9,
              Median(app) / Median(app_dd), identical_dd ? "yes" : "NO", exact_dd ? "yes" : "NO");
  enc_dd_phases.Print("device entropy encode");
  app_dd_phases.Print("device entropy apply");
  std::printf("  host encode                 %10.2f GB/s\n", dense / Median(host_enc) / 1e9);
  std::printf("  device / host encode        %10.2fx\n", Median(host_enc) / Median(enc));
  std::printf("  patch bytes identical to the host codec: %s\n", identical ? "yes" : "NO");
  if (!ranks.empty()) {
    std::printf("  TP %d grid: device encode %.2f GB/s (%.2fx the flat encode), bytes identical to the host "
                "codec: %s\n",
                o.tp, dense / Median(enc_tp) / 1e9, Median(enc) / Median(enc_tp), identical_tp ? "yes" : "NO");
    std::printf("  TP %d rank 0: applies its %.2f MB selection into its pieces in %.1f ms (the whole model's "
                "apply: %.1f ms), bit-exact: %s\n",
                o.tp, Median(rank_bytes) / 1e6, Median(app_tp) * 1e3, Median(app) * 1e3, exact_tp ? "yes" : "NO");
    tp_phases.Print("rank 0 apply");
  }
  return identical && identical_tp && exact_tp && staged_exact && identical_dd && exact_dd ? 0 : 1;
}

}  // namespace wsync::bench
