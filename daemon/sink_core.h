// The sink's logic, without gRPC: its registered weights, the holds of its
// inference server (mirrored as coordinator leases), the watch of new
// versions, the sync loop (pull from the parent, apply, keyframe fallback,
// backoff), and what it serves its own children (relay). Constructed with
// the interfaces it uses, so that it runs in-process over the loopback
// transport and control::InProcessClient in tests; the daemon's local API
// (data_daemon.cc) is a thin adapter over it.
//
// States of the sync loop (docs/data-plane.md, "Sink"): no weights or no
// parent (and no store) -> idle; behind the head -> pull (from, head) from
// the parent, a keyframe when it holds nothing, is told to resync, or the
// patch does not fit -> apply (verify; undo on mismatch) -> report applied
// (or let the next heartbeat carry it, when the coordinator says so);
// with a store tier, when no daemon serves the version (no parent, an
// unreachable one, one lacking the version past the store's wait) -> the
// store's plan to the head, applied version by version; a failure -> retry
// after a backoff (a missing version: as soon as a newer head comes; a
// parent that failed: reconnect); a layout mismatch -> never pull again
// until new tensors are registered.
//
// Thread safety: thread-safe. Start/Stop from one thread.
#pragma once

#include <atomic>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "data_daemon.h"
#include "membership.h"
#include "sink_weights.h"
#include "store_tier.h"
#include "wsync/buffers/region.h"
#include "wsync/control/client.h"
#include "wsync/exchange/exchange.h"
#include "wsync/transport/transport.h"
#include "wsync/util/thread_pool.h"

namespace wsync::daemon {

// What a sink runs on; the caller owns them and keeps them alive.
struct SinkEnvironment {
  control::CoordinatorClient* coordinator = nullptr;
  transport::Transport* transport = nullptr;  // connects to parents
  exchange::PatchFetcher* fetcher = nullptr;
  Membership* membership = nullptr;           // heartbeats on demand (after a broken watch)
  ThreadPool* pool = nullptr;
  StoreTier* store = nullptr;                 // read when no daemon serves a version (null: daemons only)
};

struct SinkStatus {
  uint64_t applied = 0, head = 0;
  size_t tensors = 0;
  uint64_t pulls_made = 0, sync_failures = 0, bytes_received = 0;
  uint64_t chunks_staged_ahead = 0;  // staged while their stream arrived
  SinkWeights::Timings timings;       // the registered weights' last apply
  Status sync_error;
  uint32_t active_holds = 0;
  int64_t oldest_hold_ms = 0;
  bool reports_on_heartbeats = false;  // the coordinator takes the applied version from heartbeats
};

class SinkCore : public exchange::PatchProvider {
 public:
  // Uses config.name, hold_ttl_ms, retry_first_ms, retry_max_ms.
  SinkCore(DataDaemonConfig config, SinkEnvironment env);
  ~SinkCore() override;

  // The watch, sync and lease threads. REQUIRES: the membership registered
  // (the watch names this incarnation, so that a broken watch marks it).
  void Start();
  // Within a second: an apply in progress completes, none starts, holds end.
  // REQUIRES: the coordinator client cancelled first (its Watch ends), as
  // the daemon's shutdown does.
  void Stop();

  // --- The inference server's side (the local API).
  // Replaces the registered tensors (the old ones are retired: their holds
  // end, an apply into them completes, none starts). `claimed` is trusted
  // only if the tensors' checksum is that version's. Refused at once when
  // the tensors cannot take the published layout. Returns the head.
  StatusOr<uint64_t> RegisterTensors(buffers::MappedTensors tensors, uint64_t claimed);
  Status Unregister();
  // The weights registered now (null: none).
  std::shared_ptr<SinkWeights> weights();

  struct HoldGrant {
    uint64_t id = 0, version = 0;
    int64_t ttl_ms = 0;
  };
  // Holds the weights stable (waits for an apply in progress). ttl_ms 0:
  // the configured TTL.
  StatusOr<HoldGrant> BeginHold(const std::string& holder, int64_t ttl_ms);
  // Blocks while hold `id` lasts; ends it when `cancelled()` turns true
  // (the holder's call or connection went), at its TTL, or at Stop. Returns
  // why it ended ("released" when by Release or retirement).
  std::string AwaitHold(uint64_t id, const std::function<bool()>& cancelled);
  Status RenewHold(uint64_t id);
  Status ReleaseHold(uint64_t id);

  SinkStatus status();
  uint64_t head() const { return head_.load(); }

  // --- Membership hooks.
  void OnHeartbeat(const wsync::v1::HeartbeatResponse& hb);
  void FillHeartbeat(wsync::v1::HeartbeatRequest* h);
  void AfterRegister(const wsync::v1::Node& node);

  // --- What this sink serves its children.
  StatusOr<std::shared_ptr<exchange::PatchStream>> Open(uint64_t from, uint64_t to) override;
  // A part of a version of several sources (the layout is not looked at: a
  // relay serves the streams it received, or a keyframe of what it holds).
  StatusOr<std::shared_ptr<exchange::PatchStream>> OpenFor(uint64_t from, uint64_t to, uint64_t layout,
                                                           uint32_t part) override;

 private:
  struct HoldState {
    std::shared_ptr<SinkWeights> weights;
    uint64_t version = 0;
    std::string holder;
    std::chrono::steady_clock::time_point since, expires;
    int64_t ttl_ms = 0;
    uint64_t lease_id = 0;  // the coordinator lease mirroring it (0: none yet)
    std::chrono::steady_clock::time_point lease_renewed;
  };

  void Kick();
  bool EndHold(uint64_t id, const std::string& why);
  void Retire(const std::shared_ptr<SinkWeights>& old, const std::string& why);
  std::pair<uint32_t, int64_t> HoldSummary();
  void ReportApplied(uint64_t version);
  // After an apply: reported now, unless the coordinator takes applied
  // versions from heartbeats (then the next heartbeat carries it).
  void ReportAppliedAfterApply(uint64_t version);
  void LeaseLoop();
  void WatchLoop();
  void SyncLoop();  // its steps: AwaitAttempt .. OnSyncFailed below
  StatusOr<transport::PeerId> ParentPeer(const std::string& parent);
  void DropPeer(const std::string& parent);
  void ResetBackoff();
  void ResetBackoffSoon();  // REQUIRES: state_mu_ held (takes sync_mu_ only)
  std::chrono::milliseconds RetryDelay(uint64_t failures);
  using PublishedLayout = StatusOr<wsync::v1::GetLayoutResponse>;  // GetLayout's answer
  Status CheckPublishedLayout(const buffers::MappedTensors& tensors, const PublishedLayout& published);
  static bool AwaitsServing(const buffers::MappedTensors& tensors, const PublishedLayout& published);
  struct PartPull {
    std::string node;
    uint32_t part = 0;
  };
  // Pulls (from, to) from each of `pulls` (the parent, or every part of a
  // version published by several sources) and applies what they send as one.
  Status SyncOnce(const std::shared_ptr<SinkWeights>& w, const std::vector<PartPull>& pulls, uint64_t from,
                  uint64_t to);
  // What to pull a version from: the parent; with several sources, each
  // part from its source, or every part from the parent when it is a relay.
  std::vector<PartPull> PullsFrom(const std::string& parent, const PublishedLayout& published);

  // The sync loop's steps, on the sync thread only: AwaitAttempt; then for
  // the NextTarget, if its tensors TakesPublishedLayout, SyncTo it from
  // PullsFrom and handle the outcome (OnSynced, OnSyncFailed).
  //
  // What one attempt syncs: the weights registered, the parent, whether the
  // coordinator asked for a keyframe, and the head to reach.
  struct SyncTarget {
    std::shared_ptr<SinkWeights> weights;
    std::string parent;
    bool resync = false;
    uint64_t head = 0;
  };
  // Blocks under sync_mu_ for a kick (at most 500 ms), then until
  // next_attempt_, ended early by stopping, a backoff reset or a head above
  // retry_on_new_head_ (the last two make the attempt due now); clears the
  // kick, the reset and retry_on_new_head_. True when an attempt is due and
  // the sink is not stopping.
  bool AwaitAttempt();
  // The target now; none when there is nothing to do: no weights, weights
  // refused by the layout check (mismatched_), no parent, or at the head.
  std::optional<SyncTarget> NextTarget();
  // Whether the target's tensors take the published layout. If not, sets
  // their sync error and: pieces no source serves yet are checked again at
  // the next head or in 30 s (retry_on_new_head_, next_attempt_); any other
  // mismatch is permanent (mismatched_) until tensors are registered again.
  bool TakesPublishedLayout(const SyncTarget& t, const PublishedLayout& published);
  // One attempt: SyncOnce from what the target holds (a keyframe when it
  // holds nothing or the coordinator asked), and once more as a keyframe
  // when the patch does not fit (FailedPrecondition, DataLoss).
  Status SyncTo(const SyncTarget& t, const std::vector<PartPull>& pulls, const std::string& from_where);
  // After a successful attempt: the failure counts and the sync error are
  // cleared and the loop kicked (a version may have come meanwhile).
  void OnSynced(const SyncTarget& t);
  // After a failed attempt `s`: next_attempt_ after the backoff (at most
  // kNotYetMs for the first kNotYetTries NotFound in a row); an unreachable
  // parent (Unavailable, DeadlineExceeded) is disconnected and reported at
  // once; NotFound lets a newer head end the delay; sets the sync error.
  void OnSyncFailed(const SyncTarget& t, const std::vector<PartPull>& pulls, const std::string& from_where, Status s);
  // A parent that could not be reached: its connections closed and the
  // coordinator told at once (it assigns another holder of the version).
  void LeaveUnreachable(const SyncTarget& t, const std::vector<PartPull>& pulls);
  // Whether the daemons' failure `s` sends this attempt to the store: no
  // store -> never; a parent lacking the version (NotFound) -> once it has
  // lacked it for the store's wait; anything else -> at once.
  bool ReadsStoreAfter(const Status& s) const;
  // Whether the parent has lacked the version (NotFound in a row since
  // lacking_since_) for the store's wait. REQUIRES: a store.
  bool LackedPastStoreWait() const;
  // The store's plan from what the target holds to its head (the newest
  // version the store holds up to it), applied version by version; once
  // more from a keyframe when a patch does not fit.
  Status SyncFromStore(const SyncTarget& t, const PublishedLayout& published);
  // One plan from `from`; *applying: the failure came from an apply.
  Status SyncFromStoreOnce(const std::shared_ptr<SinkWeights>& w, uint64_t from, uint64_t head, bool* applying);

  const DataDaemonConfig config_;
  const SinkEnvironment env_;
  std::atomic<bool> stopping_{false};
  std::mutex state_mu_;
  std::shared_ptr<SinkWeights> weights_;
  std::string parent_;
  // A parent the last pull could not reach, said in the next heartbeat.
  std::string unreachable_parent_;
  bool resync_ = false;
  // What this sink can serve its children: streams it received or is
  // receiving, and keyframes it built; the least recently used go first
  // past kKeptStreams, those still arriving last.
  struct Kept {
    std::shared_ptr<exchange::PatchStream> stream;
    uint64_t last_use = 0;
  };
  static constexpr size_t kKeptStreams = 16;
  using StreamKey = std::tuple<uint64_t, uint64_t, uint32_t>;  // from, to, part
  void KeepStreamLocked(StreamKey key, std::shared_ptr<exchange::PatchStream> stream);
  std::map<StreamKey, Kept> streams_;  // under state_mu_
  uint64_t stream_uses_ = 0;                                // under state_mu_
  std::map<std::string, transport::PeerId> peers_;  // sync thread only
  const SinkWeights* mismatched_ = nullptr;         // sync thread only: weights refused by the layout check
  std::chrono::steady_clock::time_point next_attempt_;  // sync thread only: no attempt before it (the backoff)
  std::atomic<uint64_t> head_{0};
  std::atomic<bool> reports_on_heartbeats_{false};  // as the last heartbeat's answer said
  std::atomic<uint64_t> pulls_made_{0};
  std::atomic<uint64_t> bytes_received_{0};
  std::atomic<uint64_t> staged_ahead_{0};
  std::atomic<uint64_t> failures_{0};  // consecutive failed sync attempts
  // Consecutive attempts the parent answered NotFound (it lacks the version
  // yet); the first kNotYetTries are retried within kNotYetMs.
  uint64_t not_yet_ = 0;
  std::chrono::steady_clock::time_point lacking_since_;  // sync thread only: the first of those NotFound
  static constexpr uint64_t kNotYetTries = 10;
  static constexpr int64_t kNotYetMs = 200;
  std::mt19937_64 rng_;                 // sync thread only
  std::mutex sync_mu_;
  std::condition_variable sync_cv_;
  bool kicked_ = false;
  bool backoff_reset_ = false;
  uint64_t retry_on_new_head_ = 0;  // > 0: a head above it ends the retry delay (under sync_mu_)
  std::mutex holds_mu_;
  std::condition_variable holds_cv_;
  std::map<uint64_t, HoldState> holds_;
  std::vector<uint64_t> leases_to_release_;
  uint64_t next_hold_ = 1;
  std::mutex stop_mu_;  // sleeps of the watch loop
  std::condition_variable stop_cv_;
  std::thread watcher_, syncer_, leaser_;
};

}  // namespace wsync::daemon
