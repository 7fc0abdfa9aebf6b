// The apply side's per-chunk loops (private): a part's works staged
// (decoded, added in scratch and verified, reading the destination only),
// then committed (the changed values written), all undone on any failure
// (defined in apply_chunks.cc; the works come from apply_plan.h).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "apply_plan.h"
#include "chunk_codec.h"
#include "format.h"
#include "patch_common.h"
#include "wsync/codec/codec.h"
#include "wsync/util/status.h"
#include "wsync/util/thread_pool.h"

namespace wsync::codec::internal {

// Type-erased decoded change of one chunk, with the values it replaces.
struct Decoded {
  SparseDelta<uint8_t> d8;
  SparseDelta<uint16_t> d16;
  SparseDelta<uint32_t> d32;
  SparseDelta<uint64_t> d64;
  std::vector<uint8_t> old8;
  std::vector<uint16_t> old16;
  std::vector<uint32_t> old32;
  std::vector<uint64_t> old64;
  template <typename T>
  SparseDelta<T>& Get() {
    if constexpr (sizeof(T) == 1) return d8;
    else if constexpr (sizeof(T) == 2) return d16;
    else if constexpr (sizeof(T) == 4) return d32;
    else return d64;
  }
  // The old value at each position of Get<T>() (as staged).
  template <typename T>
  std::vector<T>& Old() {
    if constexpr (sizeof(T) == 1) return old8;
    else if constexpr (sizeof(T) == 2) return old16;
    else if constexpr (sizeof(T) == 4) return old32;
    else return old64;
  }
};

// The digests of a part's results (each gridded chunk's, each placed
// tensor's blocks), checked against the patch's.
class ResultDigests {
 public:
  ResultDigests(const Container& c, const Plan& p);
  // Records the result bytes of work i (chunk order). Distinct works may be
  // recorded concurrently.
  void Record(size_t i, const uint8_t* bytes);
  // The first mismatch: the chunk or placed tensor, as errors name it.
  std::optional<std::string> Mismatch() const;

 private:
  const Container& c_;
  const Plan& p_;
  std::vector<uint64_t> tiles_;
  Digests groups_;
};

// Whether the bytes at every work's placement are its result: each digest
// recorded again from the destination (reads only). The first mismatch.
std::optional<std::string> ResultMismatch(const Container& c, const Plan& p, ThreadPool* pool);

// A keyframe's works: Verify decodes into scratch and checks every digest
// (nothing written); Write then writes the destination: from the values
// Verify kept when they take at most `keep_bytes`, else decoded again.
class KeyframeApply {
 public:
  KeyframeApply(const Container& c, const Plan& p, ThreadPool* pool, uint64_t keep_bytes)
      : c_(c), p_(p), pool_(pool), keep_bytes_(keep_bytes) {}

  Status Verify();

  // REQUIRES: Verify() succeeded (the same bytes decode the same way).
  Status Write();

  // What Verify kept of the decoded values (Write copies them), in bytes.
  uint64_t kept_bytes() const { return kept_bytes_; }

 private:
  void Release() {
    kept_.clear();
    kept_.shrink_to_fit();
    kept_bytes_ = 0;
  }

  const Container& c_;
  const Plan& p_;
  ThreadPool* pool_;
  const uint64_t keep_bytes_;
  std::vector<std::vector<uint8_t>> kept_;  // per work, its decoded values
  uint64_t kept_bytes_ = 0;
};

// What staging may keep of a version's changes (ApplyOptions::
// stage_keep_bytes), shared by its parts and taken by their works
// concurrently.
class StageBudget {
 public:
  explicit StageBudget(uint64_t bytes) : cap_(bytes), left_(bytes) {}
  uint64_t cap() const { return cap_; }
  // Takes `bytes` when that many are left.
  bool Take(uint64_t bytes) {
    uint64_t left = left_.load(std::memory_order_relaxed);
    while (left >= bytes) {
      if (left_.compare_exchange_weak(left, left - bytes, std::memory_order_relaxed)) return true;
    }
    return false;
  }

 private:
  const uint64_t cap_;
  std::atomic<uint64_t> left_;
};

// A patch's works, in two steps. Stage reads the destination and writes
// nothing: each chunk is decoded against the bytes at its placement, its
// result built in scratch and digested, and the change kept (positions,
// deltas and the old values there) while the budget lasts; every digest
// must match before Stage succeeds. Commit then writes the changed values
// and nothing else, each only where the destination still holds the old
// value it was staged against (another writer since staging: everything
// written is put back), then decodes again the changes past the budget, in
// groups the budget holds, and writes them (ApplyOptions::stage_keep_bytes
// says what a writer found there does). Undo takes back a successful
// Commit (when a later part of the same version fails), all of it unless
// changes past the budget were written. What staging keeps: per change a
// 4-byte position, the delta and the old value (8 bytes for BF16).
class DeltaApply {
 public:
  // `budget`: shared by the version's parts; null: no bound.
  DeltaApply(const Container& c, const Plan& p, ThreadPool* pool, StageBudget* budget)
      : c_(c), p_(p), pool_(pool), budget_(budget), digests_(c, p), decoded_(p.works.size()),
        staged_(p.works.size(), kNone), committed_(p.works.size(), kNone) {}

  // Stages work i against the bytes now at its placement (ahead of Stage,
  // while the rest of the patch arrives); Stage then skips it. A chunk that
  // fails to decode is left to Stage, which decodes it again and names the
  // error. Distinct works may be staged concurrently.
  void StageAhead(size_t i);

  // Stages every work not staged ahead and checks every result's digest.
  // holds_base: whether the destination holds the patch's base (asked after
  // a failure, to tell a wrong base from a corrupt patch); null when it
  // cannot be known (pieces). Nothing is written.
  Status Stage(const std::function<bool()>& holds_base);

  // REQUIRES: Stage succeeded. FailedPrecondition naming the chunk when a
  // value there changed since staging (the destination then unchanged);
  // DataLoss when that is found in a chunk past the budget after others
  // past it were written (the destination then holds neither version).
  Status Commit();

  // Stage then Commit.
  Status Run(const std::function<bool()>& holds_base);

  // Takes back what Commit wrote; false when changes past the budget were
  // written (those cannot be).
  bool Undo();

  // Works whose change staging did not keep, decoded again and written by Commit.
  size_t decoded_again() const;

 private:
  // staged_: what decoded_[i] holds. committed_: whether work i is written.
  static constexpr uint8_t kNone = 0;
  static constexpr uint8_t kKept = 1;     // staged_: the change, kept / committed_: written, can be undone
  static constexpr uint8_t kChecked = 2;  // staged_: checked, the change dropped / committed_: written for good

  // What staging keeps of `changes` changed values `width` bytes wide: a
  // position, the delta and the old value each.
  static uint64_t ChangeBytes(uint64_t changes, size_t width) { return changes * (sizeof(uint32_t) + 2 * width); }

  // Stages work i: OK, or the chunk's decode error. `budgeted`: the change
  // is kept while the budget lasts, else checked and dropped; false: kept
  // whatever the budget (Commit's second decode).
  Status StageWork(size_t i, bool budgeted);
  // Commits work i; on a value changed since staging puts back what it
  // wrote and returns false.
  bool CommitWork(size_t i);
  void UndoWork(size_t i);
  void Drop(size_t i);
  // What staging keeps of work i's change, from the patch's count of it
  // (staging takes what it decoded).
  uint64_t KeepBytes(size_t i) const;
  // Decodes again and writes the works past the budget, in groups it holds.
  Status CommitDropped();
  Status ChangedSinceStaged(const std::string& where, bool undone) const;

  const Container& c_;
  const Plan& p_;
  ThreadPool* pool_;
  StageBudget* budget_;
  ResultDigests digests_;
  std::vector<Decoded> decoded_;
  std::vector<uint8_t> staged_;
  std::vector<uint8_t> committed_;
};

}  // namespace wsync::codec::internal
