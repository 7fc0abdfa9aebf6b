// The device's decoding of sparse-coded chunks (patch mode 1), one chunk per
// thread: the job a thread runs, as WSYNC_HD functions of plain memory that
// the kernels (LaunchSparseRanks, LaunchSparseValues in kernels.h) call and
// the host tests run on the CPU over the same job lists (placed.h's
// PlanSparseBatch makes them for a batch of an apply). The decoding itself
// is codec/sparse_decode.h.
#pragma once

#include <cstddef>
#include <cstdint>

#include "wsync/codec/block_logic.h"
#include "wsync/codec/sparse_decode.h"

namespace wsync::cuda {

// One sparse-coded chunk. Stream offsets are bytes into the patch; `entry`
// is the chunk's first change among all the jobs' changes, and `byte` its
// first change's byte in the old-value and delta arrays (its tensor's width
// per change, aligned to it).
struct SparseJob {
  uint64_t pos_words, pos_word_count, pos_bits, pos_bit_bytes;
  uint64_t val_words, val_word_count, val_bits, val_bit_bytes;
  codec::ClassSpec spec;
  uint64_t elements, changed;
  uint64_t first_element;  // where its positions start in the array they index (an apply's image slot)
  uint64_t entry, byte;
  uint32_t chunk_in_tensor;  // its chunk in the layout ranks are resolved in (the slot)
  int32_t width;
};

// Step 1 of a job: its ranks into rank[entry + j] (positions when
// spec.k == 1), their classes and chunk (= chunk_in_tensor) for the rank
// kernel, and the count of each class into counts[0, kMaxClasses).
WSYNC_HD inline uint32_t SparseRanksJob(const SparseJob& job, const uint8_t* patch, uint32_t* rank, uint8_t* cls,
                                        uint32_t* chunk, uint64_t* counts) {
  const codec::sparse::RansSpan pos{patch + job.pos_words, job.pos_word_count, patch + job.pos_bits, job.pos_bit_bytes};
  codec::sparse::SearchTables tables;
  const auto e =
      codec::sparse::DecodeSparseRanks(pos, job.elements, job.changed, job.spec.k, counts, rank + job.entry, &tables);
  if (!e.ok()) return e.code;
  uint64_t at = job.entry;
  for (int k = 0; k < job.spec.k; ++k) {
    for (uint64_t i = 0; i < counts[k]; ++i, ++at) {
      cls[at] = static_cast<uint8_t>(k);
      chunk[at] = job.chunk_in_tensor;
    }
  }
  return codec::sparse::kSparseOk;
}

template <typename T>
WSYNC_HD inline uint32_t SparseValuesJobOf(const SparseJob& job, const uint8_t* patch, const uint32_t* rank,
                                           const uint64_t* counts, const uint32_t* pos, const uint8_t* old,
                                           uint32_t* mpos, uint8_t* mold, uint64_t* index, uint8_t* delta) {
  const uint32_t* positions = rank + job.entry;
  const T* olds = nullptr;
  if (job.spec.k > 1) {
    T* merged = reinterpret_cast<T*>(mold + job.byte);
    const auto e = codec::sparse::MergeClassLists<T>(pos + job.entry, reinterpret_cast<const T*>(old + job.byte),
                                                     counts, job.spec.k, mpos + job.entry, merged);
    if (!e.ok()) return e.code;
    positions = mpos + job.entry;
    olds = merged;
  }
  const codec::sparse::RansSpan val{patch + job.val_words, job.val_word_count, patch + job.val_bits, job.val_bit_bytes};
  codec::sparse::SearchTables tables;
  const auto e = codec::sparse::DecodeSparseValues<T>(val, job.changed, job.spec, olds,
                                                      reinterpret_cast<T*>(delta + job.byte), &tables);
  if (!e.ok()) return e.code;
  for (uint64_t i = 0; i < job.changed; ++i) index[job.entry + i] = job.first_element + positions[i];
  return codec::sparse::kSparseOk;
}

// Step 2, once the ranks of conditioned chunks are positions and old values
// by class (pos[entry + j], old at byte; LaunchRankPositions): merges them
// into ascending mpos and mold, decodes the values into delta at byte, and
// writes index[entry + j] = first_element + position.
WSYNC_HD inline uint32_t SparseValuesJob(const SparseJob& job, const uint8_t* patch, const uint32_t* rank,
                                         const uint64_t* counts, const uint32_t* pos, const uint8_t* old,
                                         uint32_t* mpos, uint8_t* mold, uint64_t* index, uint8_t* delta) {
  switch (job.width) {
    case 1:
      return SparseValuesJobOf<uint8_t>(job, patch, rank, counts, pos, old, mpos, mold, index, delta);
    case 2:
      return SparseValuesJobOf<uint16_t>(job, patch, rank, counts, pos, old, mpos, mold, index, delta);
    case 4:
      return SparseValuesJobOf<uint32_t>(job, patch, rank, counts, pos, old, mpos, mold, index, delta);
    default:
      return SparseValuesJobOf<uint64_t>(job, patch, rank, counts, pos, old, mpos, mold, index, delta);
  }
}

}  // namespace wsync::cuda
