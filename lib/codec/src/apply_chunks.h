// The apply side's per-chunk loops (private): a part's works decoded,
// added at their placements and verified, all undone on any failure
// (defined in apply_chunks.cc; the works come from apply_plan.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "apply_plan.h"
#include "chunk_codec.h"
#include "format.h"
#include "wsync/codec/codec.h"
#include "wsync/util/status.h"

namespace wsync::codec::internal {

// Type-erased decoded change of one chunk.
struct Decoded {
  SparseDelta<uint8_t> d8;
  SparseDelta<uint16_t> d16;
  SparseDelta<uint32_t> d32;
  SparseDelta<uint64_t> d64;
  template <typename T>
  SparseDelta<T>& Get() {
    if constexpr (sizeof(T) == 1) return d8;
    else if constexpr (sizeof(T) == 2) return d16;
    else if constexpr (sizeof(T) == 4) return d32;
    else return d64;
  }
};

// A keyframe's works: Verify decodes into scratch and checks every digest
// (nothing written); Write then decodes into the destination.
class KeyframeApply {
 public:
  KeyframeApply(const Container& c, const Plan& p, ThreadPool* pool) : c_(c), p_(p), pool_(pool) {}

  Status Verify();

  // REQUIRES: Verify() succeeded (the same bytes decode the same way).
  Status Write();

 private:
  const Container& c_;
  const Plan& p_;
  ThreadPool* pool_;
};

// A patch's works: Run decodes, adds and verifies each chunk while it is in
// cache, and undoes everything itself when anything fails; Undo takes back
// a successful Run (when a later part of the same version fails).
class DeltaApply {
 public:
  DeltaApply(const Container& c, const Plan& p, ThreadPool* pool)
      : c_(c), p_(p), pool_(pool), decoded_(p.works.size()), ready_(p.works.size(), 0), applied_(p.works.size(), 0) {}

  // Decodes work i against the bytes now at its placement and writes
  // nothing (ahead of Run, while the rest of the patch arrives); Run then
  // adds it without decoding it again. A chunk that fails to decode is left
  // to Run, which decodes it again and names the error. Distinct works may
  // be decoded concurrently.
  void Predecode(size_t i);

  // holds_base: whether the destination holds the patch's base (asked after
  // a failure, to tell a wrong base from a corrupt patch); null when it
  // cannot be known (pieces).
  Status Run(const std::function<bool()>& holds_base);

  void Undo();

 private:
  // Adds (or with undo subtracts) work i's change at its placement; adding
  // first decodes it against the bytes there and points *result at the
  // chunk's new bytes (valid until this thread's next chunk). A chunk that
  // fails to decode is left untouched.
  Status Chunk(size_t i, bool undo, const uint8_t** result);

  const Container& c_;
  const Plan& p_;
  ThreadPool* pool_;
  std::vector<Decoded> decoded_;
  std::vector<uint8_t> ready_;  // decoded_[i] holds work i's change (Predecode)
  std::vector<uint8_t> applied_;
};

}  // namespace wsync::codec::internal
