// wsync-bench: ratio and throughput of wsync's codec against baselines
// measured in the same run, on real snapshots (codec) or generated ones
// (synth). Figures are medians over pairs and repeats.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <filesystem>
#include <map>
#include <optional>

#include "control_bench.h"
#include "security_bench.h"
#include "stage_bench.h"
#include "tp_bench.h"
#include "measure.h"
#include "gpu_bench.h"
#include "synth.h"
#include "wsync/codec/codec.h"
#include "wsync/buffers/safetensors.h"
#include "wsync/util/memory.h"

namespace wsync::bench {
namespace {

namespace fs = std::filesystem;

struct Common {
  unsigned threads = 2;
  int repeat = 3;
  int zstd_level = 3;
  bool json = false;
  bool no_condition = false;
  bool hash_base = false;
  int max_classes = codec::EncodeOptions{}.max_classes;
};

void Report(const std::string& title, const std::vector<PairResult>& pairs, double memcpy_gbs, const Common& c) {
  // Per-method medians over pairs.
  std::map<std::string, std::vector<double>> ratio, enc, app;
  std::map<std::string, bool> exact;
  std::vector<std::string> order;
  std::vector<double> r0, rc, density;
  for (const auto& p : pairs) {
    r0.push_back(p.dense_bytes / std::max(1.0, p.order0_bytes));
    rc.push_back(p.dense_bytes / std::max(1.0, p.conditional_bytes));
    density.push_back(p.elements ? static_cast<double>(p.changed) / p.elements : 0);
    for (const auto& m : p.methods) {
      if (!exact.count(m.name)) {
        order.push_back(m.name);
        exact[m.name] = true;
      }
      ratio[m.name].push_back(static_cast<double>(p.dense_bytes) / std::max<uint64_t>(1, m.bytes));
      enc[m.name].push_back(p.dense_bytes / m.encode_s / 1e9);
      app[m.name].push_back(p.dense_bytes / m.apply_s / 1e9);
      exact[m.name] = exact[m.name] && m.exact;
    }
  }
  const double wsync_ratio = Median(ratio["wsync"]);
  const double pulse_ratio = ratio.count("PULSE-style") ? Median(ratio["PULSE-style"]) : 0;
  if (c.json) {
    nlohmann::ordered_json j;
    j["title"] = title;
    j["threads"] = c.threads;
    j["memcpy_gbs"] = memcpy_gbs;
    j["median_density"] = Median(density);
    j["order0_bound_ratio"] = Median(r0);
    j["conditional_bound_ratio"] = Median(rc);
    for (const auto& name : order) {
      j["methods"][name] = {{"ratio", Median(ratio[name])},
                            {"encode_gbs", Median(enc[name])},
                            {"apply_gbs", Median(app[name])},
                            {"encode_vs_memcpy", Median(enc[name]) / memcpy_gbs},
                            {"apply_vs_memcpy", Median(app[name]) / memcpy_gbs},
                            {"bit_exact", exact[name]}};
    }
    if (pulse_ratio > 0) j["wsync_vs_pulse"] = wsync_ratio / pulse_ratio;
    nlohmann::ordered_json per = nlohmann::ordered_json::array();
    for (const auto& p : pairs) {
      nlohmann::ordered_json o;
      o["pair"] = p.label;
      o["dense_bytes"] = p.dense_bytes;
      o["changed"] = p.changed;
      for (const auto& m : p.methods) {
        o[m.name] = {{"bytes", m.bytes}, {"encode_s", m.encode_s}, {"apply_s", m.apply_s}, {"exact", m.exact}};
      }
      per.push_back(o);
    }
    j["pairs"] = per;
    std::printf("%s\n", j.dump(2).c_str());
    return;
  }
  std::printf("== %s\n", title.c_str());
  std::printf("%-24s %12s %10s %10s %10s\n", "pair", "changed", "dense MB", "wsync B", "ratio");
  for (const auto& p : pairs) {
    std::printf("%-24s %11.3f%% %10.1f %10" PRIu64 " %9.1fx\n", p.label.c_str(),
                100.0 * p.changed / std::max<uint64_t>(1, p.elements), p.dense_bytes / 1e6, p.methods[0].bytes,
                static_cast<double>(p.dense_bytes) / p.methods[0].bytes);
  }
  std::printf("\nmedians over %zu pairs (codec threads: %u, memcpy: %.2f GB/s single-threaded)\n", pairs.size(),
              c.threads, memcpy_gbs);
  std::printf("%-16s %10s %12s %12s %10s %10s %6s\n", "method", "ratio", "encode GB/s", "apply GB/s", "enc/memcpy",
              "app/memcpy", "exact");
  for (const auto& name : order) {
    std::printf("%-16s %9.1fx %12.2f %12.2f %10.2f %10.2f %6s\n", name.c_str(), Median(ratio[name]),
                Median(enc[name]), Median(app[name]), Median(enc[name]) / memcpy_gbs,
                Median(app[name]) / memcpy_gbs, exact[name] ? "yes" : "NO");
  }
  std::printf("%-16s %9.1fx\n", "order-0 bound", Median(r0));
  std::printf("%-16s %9.1fx\n", "cond. bound", Median(rc));
  if (pulse_ratio > 0) std::printf("wsync / PULSE-style ratio: %.2fx\n", wsync_ratio / pulse_ratio);
}

int RunCodec(const std::string& dir, int gap, bool baselines, const Common& c) {
  std::vector<std::string> files;
  std::error_code ec;
  for (const auto& f : fs::directory_iterator(dir, ec)) {
    if (f.path().extension() == ".safetensors") files.push_back(f.path());
  }
  if (ec) {
    spdlog::error("cannot list {}: {}", dir, ec.message());
    return 1;
  }
  std::sort(files.begin(), files.end());
  if (static_cast<int>(files.size()) <= gap) {
    spdlog::error("{} holds {} snapshots: too few for gap {}", dir, files.size(), gap);
    return 1;
  }
  std::vector<std::unique_ptr<buffers::SafetensorsFile>> snaps;
  for (const auto& f : files) {
    auto s = buffers::SafetensorsFile::Open(f);
    if (!s.ok()) {
      spdlog::error("{}", s.status().ToString());
      return 1;
    }
    snaps.push_back(std::move(*s));
  }
  ThreadPool pool(c.threads);
  MeasureOptions mo{c.repeat, c.zstd_level, baselines, !c.no_condition, &pool};
  mo.max_classes = c.max_classes;
  mo.hash_base = c.hash_base;
  Scratch scratch;
  std::vector<PairResult> pairs;
  for (size_t i = 0; i + gap < snaps.size(); ++i) {
    std::string label = fs::path(files[i]).stem().string() + "->" + fs::path(files[i + gap]).stem().string();
    pairs.push_back(MeasurePair(label, snaps[i]->tensors(), snaps[i + gap]->tensors(), mo, &scratch));
  }
  Report(dir + " (gap " + std::to_string(gap) + ")", pairs, scratch.MemcpyBytesPerSecond() / 1e9, c);
  for (const auto& p : pairs) {
    for (const auto& m : p.methods) {
      if (!m.exact) return 2;
    }
  }
  return 0;
}

// Encoding a version whole against in segments (as a source that streams
// it does): alternated, `repeat` times each, medians; the base's tensor
// checksums are given to both, as a source has them.
struct SegmentCost {
  double whole_ms = 0, segmented_ms = 0;
  size_t segments = 0;
  uint64_t whole_bytes = 0, streamed_bytes = 0;
};

SegmentCost MeasureSegments(std::span<const codec::TensorView> base, std::span<const codec::TensorView> target,
                            uint64_t segment_bytes, int repeat, ThreadPool* pool) {
  SegmentCost out;
  codec::EncodeOptions o;
  o.pool = pool;
  auto sums = codec::TensorChecksums(base, {}, pool);
  if (!sums.ok()) return out;
  o.base_set_checksum = codec::SetChecksumOf(*sums);
  std::vector<double> whole, segmented;
  for (int r = 0; r < repeat; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    auto w = codec::EncodePatch(base, target, o);
    auto t1 = std::chrono::steady_clock::now();
    uint64_t streamed = 0;
    size_t count = 0;
    auto s = codec::EncodeSegmented(base, target, o, segment_bytes, *sums, [&](size_t, std::string_view seg) {
      streamed += seg.size();
      ++count;
      return Status::Ok();
    });
    auto t2 = std::chrono::steady_clock::now();
    if (!w.ok() || !s.ok()) return out;
    whole.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    segmented.push_back(std::chrono::duration<double, std::milli>(t2 - t1).count());
    out.whole_bytes = w->size();
    out.streamed_bytes = streamed;
    out.segments = count;
  }
  out.whole_ms = Median(whole);
  out.segmented_ms = Median(segmented);
  return out;
}

int RunSynth(const SynthOptions& so, int steps, bool baselines, const std::string& out_dir, const Common& c,
             double segment_mib) {
  ThreadPool pool(c.threads);
  SynthModel model(so, &pool);
  spdlog::info("synth: {} parameters ({:.2f} GB of BF16), lr {}", model.params(), model.params() * 2 / 1e9, so.lr);
  std::vector<buffers::OwnedTensor> prev = model.Tensors(), cur = model.Tensors();
  model.CastTo(&prev);
  // Write step 0 if asked.
  auto save = [&](const std::vector<buffers::OwnedTensor>& t, int step) {
    if (out_dir.empty()) return;
    char name[32];
    std::snprintf(name, sizeof(name), "step_%04d.safetensors", step);
    Status s = buffers::WriteSafetensors((fs::path(out_dir) / name).string(), buffers::Views(t));
    if (!s.ok()) spdlog::error("{}", s.ToString());
  };
  if (!out_dir.empty()) fs::create_directories(out_dir);
  save(prev, 0);
  MeasureOptions mo{c.repeat, c.zstd_level, baselines, !c.no_condition, &pool};
  mo.max_classes = c.max_classes;
  mo.hash_base = c.hash_base;
  Scratch scratch;
  std::vector<PairResult> pairs;
  for (int s = 1; s <= steps; ++s) {
    model.Step();
    model.CastTo(&cur);
    save(cur, s);
    pairs.push_back(MeasurePair("step " + std::to_string(s - 1) + "->" + std::to_string(s), buffers::Views(prev),
                                buffers::Views(cur), mo, &scratch));
    if (segment_mib > 0) {
      const SegmentCost sc = MeasureSegments(buffers::Views(prev), buffers::Views(cur),
                                             static_cast<uint64_t>(segment_mib * (1 << 20)), c.repeat, &pool);
      std::printf("step %d->%d encoded whole %.1f ms, in %zu segments of %g MiB %.1f ms (%+.1f%%); "
                  "stream %+.2f%% bytes (%" PRIu64 " vs %" PRIu64 ")\n",
                  s - 1, s, sc.whole_ms, sc.segments, segment_mib, sc.segmented_ms,
                  (sc.segmented_ms / sc.whole_ms - 1) * 100,
                  (static_cast<double>(sc.streamed_bytes) / sc.whole_bytes - 1) * 100, sc.streamed_bytes,
                  sc.whole_bytes);
    }
    std::swap(prev, cur);
  }
  const uint64_t dense = model.params() * 2;
  const double memcpy_gbs = scratch.MemcpyBytesPerSecond() / 1e9;
  char title[128];
  std::snprintf(title, sizeof(title), "synthetic %.2f GB BF16 set, lr %g", dense / 1e9, so.lr);
  Report(title, pairs, memcpy_gbs, c);
  return 0;
}

}  // namespace
}  // namespace wsync::bench

int main(int argc, char** argv) {
  using namespace wsync::bench;
  // As wsyncd does: the codec's scratch stays mapped from one call to the
  // next (fresh pages fault; the memcpy baseline's buffers are pre-touched).
  wsync::RetainFreedMemory();
  // Logs go to stderr: stdout carries the figures (--json: a JSON document).
  spdlog::set_default_logger(spdlog::stderr_color_mt("wsync-bench"));
  CLI::App app{"wsync-bench: codec ratio and throughput against baselines"};
  app.require_subcommand(1);
  Common c;
  app.add_option("--threads", c.threads, "codec threads")->capture_default_str();
  app.add_option("--repeat", c.repeat, "timed repetitions per pair (median)")->capture_default_str();
  app.add_option("--zstd-level", c.zstd_level, "zstd level of wsync's zstd-coded streams");
  app.add_flag("--json", c.json, "machine-readable output");
  app.add_flag("--no-condition", c.no_condition, "code wsync patches without conditioning on the base");
  app.add_flag("--hash-base", c.hash_base,
               "wsync's encode hashes the base (by default it is given the base's checksum, as a source knows it)");
  app.add_option("--max-classes", c.max_classes, "most exponent classes per chunk of wsync's patches (1..8)")
      ->check(CLI::Range(1, 8));
  int rc = 0;

  auto* codec = app.add_subcommand("codec", "consecutive (or --gap K) snapshot pairs of a directory");
  std::string dir;
  int gap = 1;
  bool no_baselines = false;
  codec->add_option("DIR", dir, "directory of safetensors snapshots (sorted by name)")->required();
  codec->add_option("--gap", gap, "compare snapshot i with i+K")->check(CLI::PositiveNumber);
  codec->add_flag("--no-baselines", no_baselines, "measure wsync only");
  codec->callback([&] { rc = RunCodec(dir, gap, !no_baselines, c); });

  auto* gpu = app.add_subcommand("gpu", "the device codec on synthetic steps (needs a GPU)");
  GpuBenchOptions go;
  gpu->add_option("--params", go.synth.params, "parameters")->capture_default_str();
  gpu->add_option("--lr", go.synth.lr, "learning rate")->capture_default_str();
  gpu->add_option("--steps", go.steps, "optimizer steps (pairs measured)")->capture_default_str();
  gpu->add_option("--repeat", go.repeat, "repeats per pair")->capture_default_str();
  gpu->add_option("--host-threads", go.host_threads, "threads of the host codec compared")->capture_default_str();
  gpu->add_option("--tp", go.tp, "also code the grid of this degree's layouts and apply rank 0's pieces (0: not)")
      ->capture_default_str();
  gpu->callback([&] { rc = RunGpuBench(go); });
  auto* synth = app.add_subcommand("synth", "generated FP32-master Adam-like steps cast to BF16");
  SynthOptions so;
  int steps = 3;
  bool with_baselines = false;
  std::string out_dir;
  synth->add_option("--params", so.params, "parameters (e.g. 1073741824 for 2 GB of BF16)");
  synth->add_option("--hidden", so.hidden, "hidden size (0: from --params)");
  synth->add_option("--lr", so.lr, "learning rate")->capture_default_str();
  synth->add_option("--steps", steps, "optimizer steps (pairs measured)")->capture_default_str();
  synth->add_option("--seed", so.seed, "random seed");
  synth->add_option("--out", out_dir, "also write the BF16 snapshots here as safetensors");
  synth->add_flag("--baselines", with_baselines, "also measure the baselines (slow at GB scale)");
  double segment_mib = 0;
  synth->add_option("--segment-mib", segment_mib,
                    "also time encoding each step in segments of this many MiB (as a streaming source) against whole");
  synth->callback([&] { rc = RunSynth(so, steps, with_baselines, out_dir, c, segment_mib); });

  auto* control = app.add_subcommand("control", "coordinator RPC throughput and latency under simulated sinks");
  ControlBenchOptions cb;
  control->add_option("--sinks", cb.sinks, "simulated sinks")->capture_default_str();
  control->add_option("--workers", cb.workers, "client threads")->capture_default_str();
  control->add_option("--seconds", cb.seconds, "steady-state duration")->capture_default_str();
  control->add_option("--coordinator", cb.address, "an external coordinator (default: in-process)");
  control->add_option("--store-dir", cb.store_dir, "durable store of the in-process coordinator (fresh directory)");
  control->add_option("--etcd", cb.etcd, "also three coordinator replicas over this etcd cluster (host:port,...)");
  control->add_flag("--fleet", cb.fleet, "each call at the time a fleet of --sinks makes it, not as fast as possible");
  control->add_option("--heartbeat-ms", cb.heartbeat_ms, "--fleet: heartbeat period per sink")->capture_default_str();
  std::optional<int> publish_every;
  control->add_option("--publish-every-ms", publish_every, "a version every this many ms (default 100; --fleet 5000)");
  control->add_flag("!--no-watch", cb.watch, "--fleet: the sinks hold no Watch streams open (sink daemons do)");
  control->add_option("--report-spread-ms", cb.report_spread_ms, "--fleet: sinks report a version within this")
      ->capture_default_str();
  control->callback([&] {
    cb.publish_every_ms = publish_every ? *publish_every : cb.fleet ? 5000 : 100;
    cb.json = c.json;
    rc = RunControlBench(cb);
  });

  auto* security = app.add_subcommand("security", "the cost of data-plane authentication and encryption per pull");
  SecurityBenchOptions sb;
  security->add_option("--sizes", sb.sizes, "bytes per pull")->capture_default_str();
  security->add_option("--repeat", sb.repeat, "pulls per size and mode (median)")->capture_default_str();
  security->callback([&] { rc = RunSecurityBench(sb); });

  auto* tp = app.add_subcommand("tp", "tensor-parallel sinks: bytes and apply time per rank against the whole model");
  TpBenchOptions tb;
  tp->add_option("--params", tb.synth.params, "parameters of the generated model")->capture_default_str();
  tp->add_option("--lr", tb.synth.lr, "learning rate")->capture_default_str();
  tp->add_option("--tp", tb.tp, "tensor-parallel degrees served (the grid holds them all)")->delimiter(',')->capture_default_str();
  tp->add_option("--data", tb.dir, "real snapshots instead: ratio with and without the grid, bytes per rank");
  tp->callback([&] {
    tb.repeat = c.repeat;
    tb.threads = c.threads;
    rc = RunTpBench(tb);
  });

  auto* stage = app.add_subcommand("stage", "a sink's staging under a bound on what it keeps: staging and pause times");
  StageBenchOptions sg;
  stage->add_option("--params", sg.synth.params, "parameters of the generated model")->capture_default_str();
  stage->add_option("--lr", sg.synth.lr, "learning rate")->capture_default_str();
  stage->add_option("--steps", sg.steps, "optimizer steps (versions measured)")->capture_default_str();
  stage->add_option("--stage-mib", sg.budgets_mib, "budgets compared with no bound, in MiB")
      ->delimiter(',')
      ->capture_default_str();
  stage->callback([&] {
    sg.repeat = c.repeat;
    sg.threads = c.threads;
    rc = RunStageBench(sg);
  });

  CLI11_PARSE(app, argc, argv);
  return rc;
}
