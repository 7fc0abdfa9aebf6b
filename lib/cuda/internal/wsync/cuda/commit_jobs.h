// The writes of a staged version (DeviceCodec::Commit): per destination
// tensor, the elements its changes touch, the value each held when the
// version was staged and the value it becomes. One launch checks every
// change, one writes them all. The kernels' per-element bodies, WSYNC_HD so
// that the host runs them too.
#pragma once

#include <cstddef>
#include <cstdint>

#include "wsync/codec/block_logic.h"

namespace wsync::cuda {

struct CommitJob {
  void* data = nullptr;             // the destination tensor's
  const uint64_t* index = nullptr;  // its changed elements
  const void* old = nullptr;        // width bytes each: what they held when staged
  const void* value = nullptr;      // width bytes each: what they become
  uint64_t first = 0;               // its changes are the launch's [first, first + count)
  uint64_t count = 0;
  int32_t width = 0;
};

// The job holding change k of a launch (jobs ascending by first, k below the
// last job's first + count).
WSYNC_HD inline size_t CommitJobOf(const CommitJob* jobs, size_t njobs, uint64_t k) {
  size_t lo = 0, hi = njobs;
  while (hi - lo > 1) {
    const size_t mid = (lo + hi) / 2;
    if (jobs[mid].first <= k) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

template <typename T>
WSYNC_HD inline bool HoldsStagedOf(const CommitJob& job, uint64_t i) {
  return static_cast<const T*>(job.data)[job.index[i]] == static_cast<const T*>(job.old)[i];
}

template <typename T>
WSYNC_HD inline void WriteStagedOf(const CommitJob& job, uint64_t i) {
  static_cast<T*>(job.data)[job.index[i]] = static_cast<const T*>(job.value)[i];
}

// Whether change i of the job still holds the value it was staged against.
WSYNC_HD inline bool HoldsStaged(const CommitJob& job, uint64_t i) {
  switch (job.width) {
    case 1:
      return HoldsStagedOf<uint8_t>(job, i);
    case 2:
      return HoldsStagedOf<uint16_t>(job, i);
    case 4:
      return HoldsStagedOf<uint32_t>(job, i);
    default:
      return HoldsStagedOf<uint64_t>(job, i);
  }
}

// Writes change i of the job.
WSYNC_HD inline void WriteStaged(const CommitJob& job, uint64_t i) {
  switch (job.width) {
    case 1:
      return WriteStagedOf<uint8_t>(job, i);
    case 2:
      return WriteStagedOf<uint16_t>(job, i);
    case 4:
      return WriteStagedOf<uint32_t>(job, i);
    default:
      return WriteStagedOf<uint64_t>(job, i);
  }
}

}  // namespace wsync::cuda
