// Staging with a bound on what it keeps: for generated steps, what a sink
// keeps of each version's changes before the pause, how long staging
// takes, and how long the writes (the engine's pause) take, for each
// budget (codec::ApplyOptions::stage_keep_bytes) against no bound, in one run.
#pragma once

#include <vector>

#include "synth.h"

namespace wsync::bench {

struct StageBenchOptions {
  SynthOptions synth;
  int steps = 2;
  int repeat = 5;
  unsigned threads = 2;
  // Budgets in MiB; a negative one is no bound (always measured first).
  std::vector<double> budgets_mib = {-1, 0, 16, 64};
};

// Prints one row per budget (medians over steps and repeats); 1 when a
// result differs from the target's bits.
int RunStageBench(const StageBenchOptions& options);

}  // namespace wsync::bench
