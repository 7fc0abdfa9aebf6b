// Timing of codecs over one (base, target) pair, baselines included.
#pragma once

#include <set>
#include <string>
#include <vector>

#include "baselines.h"
#include "wsync/buffers/safetensors.h"
#include "wsync/codec/codec.h"
#include "wsync/util/thread_pool.h"

namespace wsync::bench {

struct MethodResult {
  std::string name;
  uint64_t bytes = 0;
  double encode_s = 0;  // median
  double apply_s = 0;   // median
  bool exact = false;
};

struct PairResult {
  std::string label;
  uint64_t dense_bytes = 0;
  uint64_t elements = 0;
  uint64_t changed = 0;
  double order0_bytes = 0;
  double conditional_bytes = 0;
  std::vector<MethodResult> methods;  // wsync first
};

struct MeasureOptions {
  int repeat = 3;
  int zstd_level = 3;
  bool baselines = true;
  bool condition = true;
  ThreadPool* pool = nullptr;  // wsync's codec threads
  int max_classes = codec::EncodeOptions{}.max_classes;
  // wsync encodes as a source does: the base's set checksum is known (it was
  // the previous version's target checksum), computed here outside the timed
  // encode. True: the encode hashes the base itself, as a caller without it.
  bool hash_base = false;
};

// Pre-touched scratch reused across pairs (fresh memory is slow to fault in),
// and the memcpy baseline: sampled between the codecs' timed runs (before
// every timed encode), so that a machine whose speed drifts is compared with
// itself at the same moments.
class Scratch {
 public:
  // Copies `base` into the scratch destination (untimed); returns its views.
  std::vector<codec::MutableTensorView> Reset(const std::vector<codec::TensorView>& base);
  // Times one single-threaded memcpy of `bytes` (its buffers pre-touched and
  // kept for the next sample).
  void SampleMemcpy(uint64_t bytes);
  // Median memcpy bandwidth over the samples, in bytes per second (0 before
  // any).
  double MemcpyBytesPerSecond() const;
  // True the first time `method` is asked about: the caller runs it once
  // untimed, as a warm-up (the steady state of a daemon that encodes or
  // applies every step, whose allocator has its pages mapped by then).
  bool FirstRun(const std::string& method);

 private:
  std::vector<buffers::OwnedTensor> dst_;
  std::vector<uint8_t> copy_from_, copy_to_;
  std::vector<double> memcpy_bps_;
  std::set<std::string> warmed_;
};

PairResult MeasurePair(const std::string& label, const std::vector<codec::TensorView>& base,
                       const std::vector<codec::TensorView>& target, const MeasureOptions& options,
                       Scratch* scratch);

double Median(std::vector<double> v);

}  // namespace wsync::bench
