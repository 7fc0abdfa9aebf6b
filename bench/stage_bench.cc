#include "stage_bench.h"

#include <spdlog/spdlog.h>

#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>

#include "measure.h"
#include "wsync/buffers/safetensors.h"
#include "wsync/codec/codec.h"
#include "wsync/util/thread_pool.h"

namespace wsync::bench {
namespace {

using Ms = std::chrono::duration<double, std::milli>;

struct Row {
  std::vector<double> staging_ms, pause_ms, again, kept_mb;
};

uint64_t ChangedElements(const std::vector<buffers::OwnedTensor>& a, const std::vector<buffers::OwnedTensor>& b) {
  uint64_t n = 0;
  for (size_t t = 0; t < a.size(); ++t) {
    const auto* x = reinterpret_cast<const uint16_t*>(a[t].bytes.data());
    const auto* y = reinterpret_cast<const uint16_t*>(b[t].bytes.data());
    for (size_t i = 0; i < a[t].bytes.size() / 2; ++i) n += x[i] != y[i];
  }
  return n;
}

void Restore(std::vector<buffers::OwnedTensor>* work, const std::vector<buffers::OwnedTensor>& from) {
  for (size_t t = 0; t < from.size(); ++t) std::memcpy((*work)[t].bytes.data(), from[t].bytes.data(), from[t].bytes.size());
}

bool Same(const std::vector<buffers::OwnedTensor>& a, const std::vector<buffers::OwnedTensor>& b) {
  for (size_t t = 0; t < a.size(); ++t) {
    if (a[t].bytes != b[t].bytes) return false;
  }
  return true;
}

}  // namespace

int RunStageBench(const StageBenchOptions& o) {
  ThreadPool pool(o.threads);
  SynthModel model(o.synth, &pool);
  std::vector<buffers::OwnedTensor> prev = model.Tensors(), cur = model.Tensors(), work = model.Tensors();
  model.CastTo(&prev);
  std::vector<double> budgets = {-1};
  for (double b : o.budgets_mib) {
    if (b >= 0) budgets.push_back(b);
  }
  std::vector<Row> rows(budgets.size());
  std::vector<double> changed;
  for (int s = 1; s <= o.steps; ++s) {
    model.Step();
    model.CastTo(&cur);
    const uint64_t changes = ChangedElements(prev, cur);
    changed.push_back(static_cast<double>(changes) / (model.params()));
    codec::EncodeOptions eo;
    eo.pool = &pool;
    auto patch = codec::EncodePatch(buffers::Views(prev), buffers::Views(cur), eo);
    if (!patch.ok()) {
      spdlog::error("encode: {}", patch.status().ToString());
      return 1;
    }
    for (int r = 0; r < o.repeat; ++r) {
      for (size_t b = 0; b < budgets.size(); ++b) {
        codec::ApplyOptions ao;
        ao.pool = &pool;
        if (budgets[b] >= 0) ao.stage_keep_bytes = static_cast<uint64_t>(budgets[b] * (1 << 20));
        Restore(&work, prev);
        auto views = buffers::MutableViews(work);
        codec::ApplyAhead ahead(views, ao);
        const auto t0 = std::chrono::steady_clock::now();
        Status st = ahead.Prepare(*patch);
        const auto t1 = std::chrono::steady_clock::now();
        if (st.ok()) st = ahead.Apply(*patch);
        const auto t2 = std::chrono::steady_clock::now();
        if (!st.ok() || !Same(work, cur)) {
          spdlog::error("step {} budget {} MiB: {}", s, budgets[b], st.ok() ? "the result differs" : st.ToString());
          return 1;
        }
        rows[b].staging_ms.push_back(Ms(t1 - t0).count());
        rows[b].pause_ms.push_back(Ms(t2 - t1).count());
        rows[b].again.push_back(static_cast<double>(ahead.decoded_again()));
        // What staging kept: 8 bytes per changed BF16 value, up to the budget.
        const double all = changes * 8.0 / (1 << 20);
        rows[b].kept_mb.push_back(budgets[b] < 0 ? all : std::min(all, budgets[b]));
      }
    }
    std::swap(prev, cur);
  }
  std::printf("== staging budget: %.2f GB of BF16, lr %g, %.2f%% changed (median of %d steps), %u threads, "
              "%d repeats\n",
              model.params() * 2 / 1e9, o.synth.lr, 100 * Median(changed), o.steps, o.threads, o.repeat);
  std::printf("%-12s %12s %12s %12s %16s %14s\n", "budget", "kept MiB", "staging ms", "pause ms", "chunks in pause",
              "pause / none");
  const double none = Median(rows[0].pause_ms);
  for (size_t b = 0; b < budgets.size(); ++b) {
    char name[32];
    if (budgets[b] < 0) {
      std::snprintf(name, sizeof(name), "none");
    } else {
      std::snprintf(name, sizeof(name), "%g MiB", budgets[b]);
    }
    std::printf("%-12s %12.1f %12.1f %12.1f %16.0f %13.2fx\n", name, Median(rows[b].kept_mb),
                Median(rows[b].staging_ms), Median(rows[b].pause_ms), Median(rows[b].again),
                Median(rows[b].pause_ms) / none);
  }
  return 0;
}

}  // namespace wsync::bench
