// A sink's weights: the inference server's tensors in a shared region, the
// version they hold, and the holds that keep them stable while it generates.
//
// Apply waits until no hold is active, then applies a complete patch or
// keyframe under an exclusive lock (new holds wait while an apply is
// pending, so applies are not starved). A holder therefore always sees one
// whole version, never a half-applied one. A failed apply leaves the weights
// and the version exactly as they were (the codec undoes).
//
// A version is staged (StagedApply: checked, decoded and proven against the
// weights, in host memory or on the device) while the holders still read
// them; the apply between the holds only writes the changed values.
// Then, with the holders reading again, the weights are read back: values
// another writer changed since staging are reported (a foreign write: the
// weights hold no version until a keyframe repairs them).
//
// Thread safety: thread-safe.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "weight_store.h"
#include "wsync/exchange/exchange.h"
#include "wsync/buffers/region.h"
#include "wsync/buffers/safetensors.h"
#include "wsync/util/thread_pool.h"

namespace wsync::daemon {

using exchange::PatchStream;

class SinkWeights {
 public:
  // `options`: how versions are applied (its pool may be null; what
  // staging keeps of keyframes and of patches' changes).
  SinkWeights(std::unique_ptr<WeightStore> store, codec::ApplyOptions options, uint64_t applied_version = 0);
  ~SinkWeights();

  uint64_t applied() const;

  // Applies `stream` (complete). A patch must start at the applied version
  // (FailedPrecondition otherwise: the caller pulls again or asks for a
  // keyframe); a keyframe applies over anything. Aborted once closed.
  Status Apply(const PatchStream& stream);
  // The parts of one version from several sources (complete streams to
  // the same version), applied as one.
  Status ApplyParts(std::span<const PatchStream* const> parts);
  // Staging while a stream arrives: the store's StagedApply over the
  // tensors, then Apply with it and the stream's
  // bytes (`stream` complete, `bytes` its Assemble()): staged before it
  // waits for the engine's holds, so that only the writes wait for them.
  // DataLoss when the read-back after the apply finds a foreign write, or
  // the apply finds one it cannot undo (past the staging budget): the
  // applied version is then 0, and the caller pulls a keyframe.
  std::unique_ptr<StagedApply> BeginStaged() const;
  Status Apply(const PatchStream& stream, StagedApply& ahead, std::string_view bytes);

  // The last apply's times, and the foreign writes found.
  struct Timings {
    uint64_t staged_version = 0;  // staged, waiting for the holds to end (0: none)
    double staging_ms = 0;        // the last version's staging (off the pause)
    double apply_ms = 0;          // its apply between the holds (the pause's share)
    uint64_t foreign_writes = 0;  // values changed by another writer, found since registration
  };
  Timings timings() const;

  // Waits for an apply in progress, then refuses every later one: the
  // owner may free the memory once the SinkWeights is gone.
  void Close();

  // Why the daemon cannot bring these weights to the head (Ok: nothing is
  // wrong). A `permanent` error (the tensors do not match the published
  // layout) ends WaitForVersion at once; others are reported if it times out.
  void SetSyncError(const Status& why, bool permanent);
  Status sync_error() const;

  // Holds the weights stable; returns the version held. Blocks while an
  // apply runs or waits.
  uint64_t Hold();
  void Release();

  // Blocks until the applied version is >= v; DeadlineExceeded otherwise
  // (with the last sync error), the permanent sync error at once, or
  // Aborted once these weights are closed (the tensors registered again or
  // unregistered: wait on the ones registered now, WaitOnRegistered).
  Status WaitForVersion(uint64_t v, std::chrono::steady_clock::time_point deadline) const;
  bool closed() const;

  // Where the tensors live; read them under a Hold (Views() are device
  // pointers for a device store: HostCopy() reads them on the host).
  const WeightStore& store() const { return *store_; }
  std::vector<codec::TensorView> Views() const { return store_->Views(); }
  // The fingerprint of the pieces the tensors hold (0: the whole set).
  uint64_t layout() const { return store_->layout(); }

 private:
  // Waits for the holds, checks that every patch starts at the applied
  // version, runs `apply` and records the version.
  Status ApplyWith(std::span<const PatchStream* const> parts, const std::function<Status()>& apply, uint64_t bytes);
  // Stages `bytes` (the parts' streams back to back) with `ahead`, applies
  // them between the holds, then reads them back.
  Status ApplyStaged(std::span<const PatchStream* const> parts, StagedApply& ahead, std::string_view bytes);
  // Counts and logs a foreign write (undone: the apply was refused).
  void ForeignWriteLocked(const Status& why, bool undone);

  const std::unique_ptr<WeightStore> store_;
  const codec::ApplyOptions options_;  // every apply's: the codec's threads, the keyframe and staging budgets
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  uint64_t applied_;
  int holds_ = 0;
  int applies_waiting_ = 0;
  bool applying_ = false;
  bool confirming_ = false;  // reading the weights back after an apply
  bool closed_ = false;
  Timings timings_;
  Status sync_error_;
  bool sync_error_permanent_ = false;
};

}  // namespace wsync::daemon
