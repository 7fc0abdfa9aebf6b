// The device's entropy stage of encoding, one sparse-coded chunk per thread:
// the job a thread runs, a WSYNC_HD function of plain memory that the kernel
// (LaunchSparseEncode in kernels.h) calls and the host tests run on the CPU
// over the same job lists (encode_plan.h makes them). The coding itself is
// codec/sparse_encode.h, the host codec's own functions.
#pragma once

#include <cstddef>
#include <cstdint>

#include "wsync/codec/block_logic.h"
#include "wsync/codec/sparse_encode.h"

namespace wsync::cuda {

// One chunk's change (m changes: positions, deltas and, when its classes
// need them, old values and ranks) and where its scratch and streams go.
struct SparseEncodeJob {
  const uint32_t* pos = nullptr;
  const void* delta = nullptr;
  const void* old = nullptr;        // null when spec.k == 1
  const uint32_t* rank = nullptr;   // null when spec.k == 1
  uint32_t* grouped = nullptr;      // m entries when spec.k > 1
  uint16_t* words = nullptr;        // m + 1
  codec::sparse::SparseEncodeWork* work = nullptr;
  uint8_t* pos_out = nullptr;
  uint8_t* val_out = nullptr;
  uint64_t pos_room = 0, val_room = 0;
  uint64_t elements = 0, changed = 0;
  codec::ClassSpec spec;
  int32_t width = 2;
};

template <typename T>
WSYNC_HD inline codec::sparse::SparseEncodeResult SparseEncodeJobOf(const SparseEncodeJob& job, const uint32_t* lg) {
  codec::sparse::SparseChunkIn<T> in;
  in.n = job.elements;
  in.m = job.changed;
  in.pos = job.pos;
  in.delta = static_cast<const T*>(job.delta);
  in.old = static_cast<const T*>(job.old);
  in.rank = job.rank;
  in.spec = job.spec;
  return codec::sparse::EncodeSparseChunk<T>(in, {job.grouped, job.words, job.work}, job.pos_out, job.pos_room,
                                             job.val_out, job.val_room, lg);
}

// Codes the job's chunk (lg: codec::sparse::kLog2Table's entries).
WSYNC_HD inline codec::sparse::SparseEncodeResult RunSparseEncodeJob(const SparseEncodeJob& job, const uint32_t* lg) {
  switch (job.width) {
    case 1: return SparseEncodeJobOf<uint8_t>(job, lg);
    case 2: return SparseEncodeJobOf<uint16_t>(job, lg);
    case 4: return SparseEncodeJobOf<uint32_t>(job, lg);
    default: return SparseEncodeJobOf<uint64_t>(job, lg);
  }
}

// A run of bytes to copy: src's `bytes` to `at` in the packed output.
struct PackSegment {
  const uint8_t* src = nullptr;
  uint64_t bytes = 0;
  uint64_t at = 0;
};

}  // namespace wsync::cuda
