// wsync-bench gpu: the device codec against a device-to-device memcpy and the
// host codec, on synthetic steps (synth.h).
#pragma once

#include "synth.h"

namespace wsync::bench {

struct GpuBenchOptions {
  SynthOptions synth;
  int steps = 2;
  int repeat = 3;
  int host_threads = 2;
  int tp = 4;  // also the tile grid of TP `tp`'s layouts and rank 0's apply of its pieces (0: not)
};

// Prints figures; returns the process exit code (2 without a GPU).
int RunGpuBench(const GpuBenchOptions& o);

}  // namespace wsync::bench
