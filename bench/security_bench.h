// The cost of data-plane security: pulls of a patch-sized and a
// keyframe-sized stream between two in-process daemons' exchanges over UCX
// (tcp on 127.0.0.1), with no security, with authentication and with every
// message encrypted (AES-256-GCM), interleaved, medians, in one run.
#pragma once

#include <cstdint>
#include <vector>

namespace wsync::bench {

struct SecurityBenchOptions {
  std::vector<uint64_t> sizes = {40u << 10, 4u << 20, 256u << 20};  // bytes per pull
  int repeat = 5;
  bool json = false;
};

int RunSecurityBench(const SecurityBenchOptions& options);

}  // namespace wsync::bench
