#include "tp_bench.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>

#include "measure.h"
#include "wsync/buffers/safetensors.h"
#include "wsync/codec/codec.h"
#include "wsync/util/thread_pool.h"

namespace wsync::bench {
namespace {

namespace fs = std::filesystem;
using buffers::OwnedTensor;
using Clock = std::chrono::steady_clock;

bool EndsWith(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

}  // namespace

StatusOr<TpRank> MakeTpRank(const std::vector<OwnedTensor>& canonical, int tp, int r) {
  TpRank rank;
  // Runtime tensor name -> (shape, pieces), in first-seen order.
  std::vector<std::string> order;
  std::map<std::string, std::pair<std::vector<uint64_t>, std::vector<codec::Piece>>> rt;
  auto add = [&](const std::string& name, std::vector<uint64_t> shape, codec::Piece p) {
    if (!rt.count(name)) {
      order.push_back(name);
      rt[name].first = shape;
    } else {
      rt[name].first[0] += shape[0];  // fused along rows
    }
    rt[name].second.push_back(std::move(p));
  };
  for (const OwnedTensor& t : canonical) {
    const std::vector<uint64_t>& s = t.shape;
    const std::vector<uint64_t> zero(s.size(), 0);
    auto rows = [&](const std::string& runtime, uint64_t at_row) -> Status {
      if (s[0] % tp != 0) return InvalidArgumentError(t.name + ": " + std::to_string(s[0]) + " rows over TP " + std::to_string(tp));
      std::vector<uint64_t> start = zero, extent = s, at = zero, shape = s;
      start[0] = r * s[0] / tp;
      extent[0] = shape[0] = s[0] / tp;
      at[0] = at_row;
      add(runtime, shape, {t.name, start, extent, at});
      return Status::Ok();
    };
    auto fused_rows = [&](const std::string& from, const std::string& to) -> Status {
      const std::string runtime = t.name.substr(0, t.name.size() - from.size()) + to;
      return rows(runtime, rt.count(runtime) ? rt[runtime].first[0] : 0);
    };
    const std::string name = t.name;
    Status st;
    if (s.size() == 2 && (EndsWith(name, "o_proj.weight") || EndsWith(name, "down_proj.weight"))) {
      if (s[1] % tp != 0) return InvalidArgumentError(name + ": columns over TP " + std::to_string(tp));
      add(name, {s[0], s[1] / tp}, {name, {0, r * s[1] / tp}, {s[0], s[1] / tp}, {0, 0}});
    } else if (s.size() == 2 && (EndsWith(name, "embed_tokens.weight") || EndsWith(name, "lm_head.weight"))) {
      const uint64_t padded = (s[0] + 63) / 64 * 64;
      if (padded % tp != 0) return InvalidArgumentError(name + ": padded vocabulary over TP " + std::to_string(tp));
      const uint64_t per = padded / tp, v0 = r * per;
      const uint64_t held = v0 >= s[0] ? 0 : std::min(per, s[0] - v0);
      rt[name].first = {per, s[1]};
      order.push_back(name);
      if (held > 0) rt[name].second.push_back({name, {v0, 0}, {held, s[1]}, {0, 0}});
    } else {
      bool fused = false;
      for (const char* qkv : {"q_proj", "k_proj", "v_proj"}) {
        for (const char* kind : {".weight", ".bias"}) {
          const std::string suffix = std::string(qkv) + kind;
          if (EndsWith(name, suffix)) {
            st = fused_rows(suffix, std::string("qkv_proj") + kind);
            fused = true;
          }
        }
      }
      for (const char* mlp : {"gate_proj.weight", "up_proj.weight"}) {
        if (EndsWith(name, mlp)) {
          st = fused_rows(mlp, "gate_up_proj.weight");
          fused = true;
        }
      }
      if (!fused) add(name, s, {name, zero, s, zero});
    }
    WSYNC_RETURN_IF_ERROR(st);
  }
  for (const std::string& name : order) {
    auto& [shape, pieces] = rt[name];
    uint64_t n = 1;
    for (uint64_t d : shape) n *= d;
    rank.tensors.push_back({name, canonical[0].dtype, shape, std::vector<uint8_t>(n * 2)});
    rank.layout.push_back({{}, pieces});
  }
  for (size_t i = 0; i < rank.tensors.size(); ++i) {
    auto& t = rank.tensors[i];
    rank.layout[i].view = {t.name, t.dtype, t.shape, t.bytes.data()};
  }
  return rank;
}

void FillTpRank(TpRank* rank, const std::vector<OwnedTensor>& canonical) {
  std::map<std::string, const OwnedTensor*> by_name;
  for (const auto& t : canonical) by_name[t.name] = &t;
  for (const codec::RuntimeTensor& rt : rank->layout) {
    const uint64_t rcols = rt.view.NumElements() / std::max<uint64_t>(1, rt.view.shape.empty() ? 1 : rt.view.shape[0]);
    for (const codec::Piece& p : rt.pieces) {
      const OwnedTensor& c = *by_name.at(p.canonical);
      const uint64_t crows = c.shape.empty() ? 1 : c.shape[0];
      const uint64_t ccols = (c.bytes.size() / 2) / std::max<uint64_t>(1, crows);
      const uint64_t inner = p.extent.size() > 1 ? ccols / c.shape[1] : 1;
      const uint64_t rows = p.extent.empty() ? 1 : p.extent[0];
      const uint64_t cols = p.extent.size() > 1 ? p.extent[1] * inner : ccols;
      const uint64_t c0 = p.start.size() > 1 ? p.start[1] * inner : 0;
      const uint64_t rc0 = p.runtime_start.size() > 1 ? p.runtime_start[1] * inner : 0;
      const uint64_t r0 = p.start.empty() ? 0 : p.start[0], rr0 = p.runtime_start.empty() ? 0 : p.runtime_start[0];
      for (uint64_t i = 0; i < rows; ++i) {
        std::memcpy(rt.view.data + ((rr0 + i) * rcols + rc0) * 2, c.bytes.data() + ((r0 + i) * ccols + c0) * 2,
                    cols * 2);
      }
    }
  }
}

namespace {

double Seconds(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

struct Encoded {
  std::string flat, gridded;
  double flat_s = 0, gridded_s = 0;  // medians
};

Encoded EncodeBoth(const std::vector<OwnedTensor>& base, const std::vector<OwnedTensor>& target,
                   const std::vector<codec::TileGrid>& grids, int repeat, ThreadPool* pool) {
  Encoded e;
  std::vector<double> flat, gridded;
  codec::EncodeOptions o;
  o.pool = pool;
  o.base_set_checksum = codec::SetChecksum(buffers::Views(base), pool);
  for (int i = 0; i < repeat; ++i) {  // interleaved
    auto t0 = Clock::now();
    o.grids.clear();
    e.flat = *codec::EncodePatch(buffers::Views(base), buffers::Views(target), o);
    flat.push_back(Seconds(t0));
    t0 = Clock::now();
    o.grids = grids;
    e.gridded = *codec::EncodePatch(buffers::Views(base), buffers::Views(target), o);
    gridded.push_back(Seconds(t0));
  }
  e.flat_s = Median(flat);
  e.gridded_s = Median(gridded);
  return e;
}

std::vector<std::vector<codec::RuntimeTensor>> LayoutsOf(const std::vector<TpRank>& ranks) {
  std::vector<std::vector<codec::RuntimeTensor>> out;
  for (const auto& r : ranks) out.push_back(r.layout);
  return out;
}

StatusOr<std::vector<TpRank>> Ranks(const std::vector<OwnedTensor>& canonical, const std::vector<int>& degrees) {
  std::vector<TpRank> ranks;
  for (int tp : degrees) {
    for (int r = 0; r < tp; ++r) {
      WSYNC_ASSIGN_OR_RETURN(TpRank rank, MakeTpRank(canonical, tp, r));
      ranks.push_back(std::move(rank));
    }
  }
  return ranks;
}

std::string Degrees(const std::vector<int>& tp) {
  std::string s;
  for (int d : tp) s += (s.empty() ? "" : ",") + std::to_string(d);
  return s;
}

// Real snapshots: the ratio with and without the grid of the degrees.
int RunOnSnapshots(const TpBenchOptions& o, ThreadPool* pool) {
  std::vector<std::string> files;
  for (const auto& f : fs::directory_iterator(o.dir)) {
    if (f.path().extension() == ".safetensors") files.push_back(f.path());
  }
  std::sort(files.begin(), files.end());
  std::vector<std::vector<OwnedTensor>> snaps;
  for (const auto& f : files) {
    auto s = buffers::SafetensorsFile::Open(f);
    if (!s.ok()) {
      spdlog::error("{}", s.status().ToString());
      return 1;
    }
    snaps.push_back(buffers::CopyTensors((*s)->tensors()));
  }
  if (snaps.size() < 2) {
    spdlog::error("{}: fewer than two snapshots", o.dir);
    return 1;
  }
  auto ranks = Ranks(snaps[0], o.tp);
  if (!ranks.ok()) {
    spdlog::error("{}", ranks.status().ToString());
    return 1;
  }
  const auto grids = codec::GridsFor(LayoutsOf(*ranks), buffers::Views(snaps[0]));
  uint64_t dense = 0, flat = 0, gridded = 0;
  // Where the grid's bytes go: more chunks, each with its streams' fixed
  // costs (rANS states, tables, directory entry) and, gridded, a digest.
  struct Parts {
    uint64_t chunks = 0, gridded_chunks = 0, header = 0, streams = 0;
    void Add(const codec::PatchInfo& info) {
      header += info.header_bytes;
      for (const auto& t : info.tensors) {
        chunks += t.chunks;
        if (!t.row_cuts.empty() || !t.col_cuts.empty()) gridded_chunks += t.chunks;
        streams += t.position_bytes + t.value_bytes;
      }
    }
  } flat_parts, gridded_parts;
  std::vector<uint64_t> rank_bytes(ranks->size(), 0);
  for (size_t i = 0; i + 1 < snaps.size(); ++i) {
    Encoded e = EncodeBoth(snaps[i], snaps[i + 1], grids, 1, pool);
    for (const auto& t : snaps[i]) dense += t.bytes.size();
    flat += e.flat.size();
    gridded += e.gridded.size();
    flat_parts.Add(*codec::InspectPatch(e.flat));
    gridded_parts.Add(*codec::InspectPatch(e.gridded));
    for (size_t r = 0; r < ranks->size(); ++r) rank_bytes[r] += codec::SelectForPieces(e.gridded, (*ranks)[r].layout)->size();
  }
  std::printf("%s: %zu pairs, grid of TP %s (%zu tensors gridded)\n", o.dir.c_str(), snaps.size() - 1,
              Degrees(o.tp).c_str(), grids.size());
  std::printf("  flat patches:    %10llu bytes, ratio %.1fx\n", static_cast<unsigned long long>(flat),
              double(dense) / flat);
  std::printf("  gridded patches: %10llu bytes, ratio %.1fx (%.2f%% larger)\n", static_cast<unsigned long long>(gridded),
              double(dense) / gridded, 100.0 * (double(gridded) / flat - 1));
  const double extra = double(gridded_parts.chunks - flat_parts.chunks);
  std::printf("  the grid's cost: %llu chunks for %llu; per added chunk %.1f bytes of streams and %.1f of "
              "directory, of which the tile digests (8 bytes per gridded chunk) make %.1f\n",
              static_cast<unsigned long long>(gridded_parts.chunks), static_cast<unsigned long long>(flat_parts.chunks),
              (double(gridded_parts.streams) - double(flat_parts.streams)) / extra,
              (double(gridded_parts.header) - double(flat_parts.header)) / extra,
              8.0 * double(gridded_parts.gridded_chunks) / extra);
  std::printf("  the tile digests alone are %.2f%% of the flat patches\n",
              100.0 * 8.0 * double(gridded_parts.gridded_chunks) / double(flat));
  size_t r = 0;
  for (int tp : o.tp) {
    for (int k = 0; k < tp; ++k, ++r) {
      std::printf("  TP %d rank %d receives %10llu bytes: %.3f of the gridded patches\n", tp, k,
                  static_cast<unsigned long long>(rank_bytes[r]), double(rank_bytes[r]) / gridded);
    }
  }
  return 0;
}

}  // namespace

int RunTpBench(const TpBenchOptions& o) {
  ThreadPool pool(o.threads);
  if (!o.dir.empty()) return RunOnSnapshots(o, &pool);
  SynthModel model(o.synth, &pool);
  std::vector<OwnedTensor> v1 = model.Tensors(), v2 = model.Tensors();
  model.Step();
  model.CastTo(&v1);
  model.Step();
  model.CastTo(&v2);
  uint64_t dense = 0;
  for (const auto& t : v1) dense += t.bytes.size();
  auto ranks = Ranks(v1, o.tp);
  if (!ranks.ok()) {
    spdlog::error("{}", ranks.status().ToString());
    return 1;
  }
  const auto grids = codec::GridsFor(LayoutsOf(*ranks), buffers::Views(v1));
  Encoded e = EncodeBoth(v1, v2, grids, o.repeat, &pool);
  std::printf("tp bench: %.2f GB of BF16 (%llu parameters), lr %g, one step; grid of TP %s; %u threads; medians of %d\n",
              dense / 1e9, static_cast<unsigned long long>(model.params()), o.synth.lr, Degrees(o.tp).c_str(),
              o.threads, o.repeat);
  std::printf("  patch, flat:    %10zu bytes (ratio %.1fx), encode %.1f ms\n", e.flat.size(), double(dense) / e.flat.size(),
              e.flat_s * 1e3);
  std::printf("  patch, gridded: %10zu bytes (ratio %.1fx, %+.2f%%), encode %.1f ms\n", e.gridded.size(),
              double(dense) / e.gridded.size(), 100.0 * (double(e.gridded.size()) / e.flat.size() - 1),
              e.gridded_s * 1e3);

  // The whole model applies the gridded patch; each rank its selection.
  std::vector<OwnedTensor> whole = buffers::CopyTensors(buffers::Views(v1));
  std::vector<double> whole_s;
  std::vector<std::vector<double>> rank_s(ranks->size());
  std::vector<std::string> selections;
  for (auto& r : *ranks) {
    FillTpRank(&r, v1);
    r.pristine = buffers::CopyTensors(buffers::Views(r.tensors));
    selections.push_back(*codec::SelectForPieces(e.gridded, r.layout));
  }
  codec::ApplyOptions ao;
  ao.pool = &pool;
  bool exact = true;
  for (int i = 0; i < o.repeat; ++i) {  // interleaved; resets untimed
    (void)buffers::CopyInto(buffers::Views(v1), whole, &pool);
    auto t0 = Clock::now();
    exact &= codec::Apply(e.gridded, buffers::MutableViews(whole), ao).ok();
    whole_s.push_back(Seconds(t0));
    for (size_t r = 0; r < ranks->size(); ++r) {
      TpRank& rank = (*ranks)[r];
      (void)buffers::CopyInto(buffers::Views(rank.pristine), rank.tensors, &pool);
      t0 = Clock::now();
      exact &= codec::Apply(selections[r], rank.layout, ao).ok();
      rank_s[r].push_back(Seconds(t0));
    }
  }
  for (size_t t = 0; t < whole.size(); ++t) exact &= whole[t].bytes == v2[t].bytes;
  const double whole_med = Median(whole_s);
  std::printf("  whole-model sink: receives %10zu bytes, applies in %.1f ms\n", e.gridded.size(), whole_med * 1e3);
  size_t r = 0;
  for (int tp : o.tp) {
    for (int k = 0; k < tp; ++k, ++r) {
      const double s = Median(rank_s[r]);
      std::printf("  TP %d rank %d sink: receives %10zu bytes (%.3f), applies in %.1f ms (%.3f of the whole)\n", tp, k,
                  selections[r].size(), double(selections[r].size()) / e.gridded.size(), s * 1e3, s / whole_med);
    }
  }
  std::printf("  every apply bit-exact: %s\n", exact ? "yes" : "NO");
  return exact ? 0 : 2;
}

}  // namespace wsync::bench
