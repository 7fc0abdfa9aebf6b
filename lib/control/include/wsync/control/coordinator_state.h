// The coordinator's logic as a pure state machine: versions, nodes, leases,
// staleness policy and topology. No sockets: the gRPC adapter (server.h)
// forwards each RPC to one method here, and tests drive it with a FakeClock.
//
// Every mutation is appended to the Store before it takes effect, so the
// state recovered after a crash holds every acknowledged mutation.
// Heartbeats are not logged: after a restart every node gets one TTL of
// grace from the restart time.
//
// Thread safety: all methods are thread-safe (one internal mutex).
// WaitForChange lets RPC handlers block without polling.
#pragma once

#include <chrono>
#include <functional>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>

#include "wsync/control/clock.h"
#include "wsync/control/layout_offers.h"
#include "wsync/control/store.h"
#include "wsync/util/status.h"
#include "wsync/v1/coordinator.pb.h"

namespace wsync::control {

struct CoordinatorOptions {
  uint64_t default_ttl_ms = 10'000;  // nodes and leases
  uint64_t max_ttl_ms = 600'000;
  uint64_t max_staleness = 0;        // 0: no bound
  wsync::v1::StalenessPolicy policy = wsync::v1::STALENESS_BLOCK;
  uint32_t fanout = 4;               // children per parent in the sync tree
  // A parent a sink reported unreachable is not its parent again for this
  // long, unless the parent restarts (or no other holder exists).
  uint64_t parent_avoid_ms = 30'000;
  size_t compact_every = 10'000;     // log records between snapshots
  // From this many registered nodes on, with no staleness bound, sinks are
  // told to let their heartbeats carry their applied versions instead of a
  // ReportApplied call per version (0: never).
  size_t heartbeat_reports_from = 2'000;
  // Heartbeats per second the fleet is paced to, with no staleness bound
  // (0: never paced). Sinks heartbeat every quarter of their TTL, until the
  // fleet is larger than this allows: then every sink is asked for one
  // every nodes/budget seconds, and its TTL stretches to four of those
  // periods (a process that dies is still marked dead at once, when its
  // Watch stream breaks).
  uint64_t heartbeat_budget = 4'000;
};

// The coordinator's domains (internals in lib/control/src/): each holds its
// own state and has no lock; CoordinatorState's one mutex guards them all.
class NodeRegistry;
class VersionLog;
class LeaseTable;
class LayoutRegistry;
class RelayTree;
class StalenessGate;

class CoordinatorState {
 public:
  // Recovers from `store` (REQUIRES: outlives this; OpenLogStore's Recovered
  // passed as `recovered`). REQUIRES: clock outlives this.
  static StatusOr<std::unique_ptr<CoordinatorState>> Create(const CoordinatorOptions& options, const Clock* clock,
                                                            std::unique_ptr<Store> store,
                                                            const Recovered& recovered);
  ~CoordinatorState();

  // A new incarnation of the node, unless `req` is a retry of the call that
  // made its current one (RegisterRequest.request_id): that answer again.
  StatusOr<wsync::v1::RegisterResponse> Register(const wsync::v1::RegisterRequest& req);
  StatusOr<wsync::v1::HeartbeatResponse> Heartbeat(const wsync::v1::HeartbeatRequest& req);
  Status Deregister(const std::string& name);

  // FailedPrecondition unless version > head; InvalidArgument for version 0.
  // The same summary again (version, base, set checksum, source) is Ok: a
  // publisher retrying after a lost answer learns that it was stored.
  StatusOr<uint64_t> Publish(const wsync::v1::VersionSummary& version);
  wsync::v1::ListVersionsResponse ListVersions(uint64_t after) const;

  // Sets the node's applied version. Answered at once and made durable
  // within a tick (Tick, Flush) or with the next durable change, whichever
  // comes first, in one batch with the other reports.
  StatusOr<wsync::v1::Node> ReportApplied(const std::string& name, uint64_t version);

  // A retry of an acquisition (the same non-empty `request_id` from the same
  // node) gets the lease it granted while that lease is held.
  StatusOr<wsync::v1::Lease> AcquireLease(const std::string& node, uint64_t version, uint64_t ttl_ms,
                                          const std::string& request_id = "");
  StatusOr<wsync::v1::Lease> RenewLease(uint64_t id, uint64_t ttl_ms);
  Status ReleaseLease(uint64_t id);
  wsync::v1::ListLeasesResponse ListLeases() const;

  // Evaluates the staleness policy for publishing `version` now. With the
  // evict policy, lagging sinks are marked to resync from a keyframe.
  StatusOr<wsync::v1::MayPublishResponse> MayPublish(uint64_t version);

  wsync::v1::StatusResponse GetStatus() const;

  // The first call sets the layout (durably); later ones check theirs
  // against it (control/layout.h): FailedPrecondition naming the tensor.
  Status SetLayout(const wsync::v1::Layout& layout);
  // The layout; `set` false before any SetLayout.
  wsync::v1::GetLayoutResponse GetLayout() const;
  // The layouts sinks offer (soft state; a deregistered node's goes).
  LayoutOffers& offers() { return offers_; }

  // Expires nodes and leases whose TTL passed; reassigns parents; makes
  // the applied versions reported since the last tick durable.
  void Tick();
  // Makes the applied versions reported so far durable (Tick does it too;
  // a coordinator stopping calls it last).
  Status Flush();

  // The node's Watch stream broke: the node (of that incarnation) is marked
  // disconnected now (NODE_DISCONNECTED: not a parent, not blocking
  // publishes; its applied version still kept for it until its TTL). Its
  // children get another parent now, and are given back if it heartbeats
  // again within its TTL, holding the head, while they are on the source.
  void WatchBroken(const std::string& name, uint64_t incarnation);

  uint64_t head() const;
  // Registrations waiting for the next group commit (for metrics and tests).
  size_t RegistrationsQueued();

  // A counter that grows on every change; WaitForChange returns once it
  // differs from `seen` or at `deadline`. Returns the current value.
  uint64_t generation() const;
  uint64_t WaitForChange(uint64_t seen, std::chrono::steady_clock::time_point deadline) const;
  // The same for what ListVersions answers only (a version or a part
  // announced, the floor raised): what watchers wait for. A fleet's
  // heartbeats, reports and registrations do not wake them.
  uint64_t versions_generation() const;
  uint64_t WaitForVersions(uint64_t seen, std::chrono::steady_clock::time_point deadline) const;

  // The Watch call's loop, for an adapter with a thread per watcher (the
  // in-process client): on_version for each version after `after`, then
  // for new ones as they are published, until it returns false (the
  // watcher went away) or stop() is true (checked at least every 200 ms).
  // True when the watcher went away, so the adapter reports WatchBroken;
  // false when stopped.
  bool WatchVersions(uint64_t after, const std::function<bool(const wsync::v1::VersionSummary&)>& on_version,
                     const std::function<bool()>& stop) const;
  // MayPublish, waiting until it is allowed, `deadline`, or stop().
  StatusOr<wsync::v1::MayPublishResponse> MayPublishWaiting(uint64_t version,
                                                             std::chrono::steady_clock::time_point deadline,
                                                             const std::function<bool()>& stop);

 private:
  CoordinatorState(const CoordinatorOptions& options, const Clock* clock, std::unique_ptr<Store> store);
  // Applies `r` to the component that owns its kind. REQUIRES: mu_ held.
  void Apply(const wsync::store::v1::Record& r);
  // Appends `r` to the store (after the reports not yet durable, in one
  // batch), applies it, compacts every compact_every records and wakes
  // waiters. REQUIRES: mu_ held.
  Status Log(const wsync::store::v1::Record& r);
  // Appends the reports not yet durable, then `r` when given, in one batch.
  // REQUIRES: mu_ held.
  Status CommitLocked(const wsync::store::v1::Record* r);
  // Replaces the store's snapshot and log every compact_every records.
  // REQUIRES: mu_ held.
  void MaybeCompactLocked();
  // Every component's state (on-disk format: store.h). REQUIRES: mu_ held.
  wsync::store::v1::Snapshot MakeSnapshot() const;
  // Ends nodes past their TTL, then the leases of dead nodes and expired
  // ones, then reassigns parents. REQUIRES: mu_ held.
  void ExpireLocked();
  // One pass of the relay tree; whether any sink's parent changed. REQUIRES: mu_ held.
  bool AssignParentsLocked();
  // Sets a live sink's applied version (a report, or a heartbeat carrying
  // one): validated, applied at once, made durable within a tick.
  Status ApplyReportLocked(wsync::v1::Node* current, uint64_t version);
  // Whether sinks are told to let heartbeats carry their applied versions
  // (CoordinatorOptions::heartbeat_reports_from).
  bool ReportsOnHeartbeatsLocked() const;
  // The reports not yet in the store, as node_reports records (empty: none).
  // REQUIRES: mu_ held.
  std::vector<wsync::store::v1::Record> ReportRecordsLocked() const;
  // Flushes the reports with mu_ released (Tick). REQUIRES: mu_ held by
  // `lock`, which this releases.
  void FlushReportsUnlocked(std::unique_lock<std::mutex> lock);
  // The heartbeat period node `n` is asked for
  // (CoordinatorOptions::heartbeat_budget; 0: a quarter of its TTL).
  uint64_t PacedIntervalLocked(const wsync::v1::Node& n) const;
  // A registration's pass: at once, except in a storm of them in a large
  // fleet (a pass is O(nodes)): then at the next Tick. REQUIRES: mu_ held.
  void AssignParentsSoonLocked();
  // Whether a sink can get version `head` from its parents (a relay holding
  // it, or a source whose history does). REQUIRES: mu_ held.
  bool HeadReachableLocked(const wsync::v1::Node& sink, uint64_t head) const;
  void NotifyLocked();
  // What ListVersions answers changed (after NotifyLocked's waiters, the
  // watchers'). REQUIRES: mu_ held.
  void VersionsChangedLocked();
  // The answer to the registration that made `node`'s incarnation. REQUIRES: mu_ held.
  wsync::v1::RegisterResponse RegisteredLocked(const wsync::v1::Node& node) const;
  // Makes the reports not yet durable and `records` durable, in one store
  // batch (as few etcd transactions as its limits allow). REQUIRES: mu_ held.
  Status CommitLocked(const std::vector<wsync::store::v1::Record>& records);

  // Registrations are committed in groups: each waits in the queue, and one
  // waiting thread at a time commits everything queued in one store batch
  // (group commit), so a storm of registrations over etcd costs a
  // transaction per group, not per registration.
  struct PendingRegistration;
  // Takes mu_; commits `group` and answers each of it. A second
  // registration of a name already in the group goes back to the queue.
  void RegisterGroup(const std::vector<PendingRegistration*>& group);

  CoordinatorOptions options_;
  const Clock* clock_;
  std::unique_ptr<Store> store_;
  // Log, for the components' mutations (RecordLog).
  const std::function<Status(const wsync::store::v1::Record&)> log_;

  mutable std::mutex mu_;
  mutable std::condition_variable changed_;
  uint64_t generation_ = 0;
  mutable std::condition_variable versions_changed_;
  uint64_t versions_generation_ = 0;
  std::unique_ptr<NodeRegistry> nodes_;      // nodes and liveness
  std::unique_ptr<VersionLog> versions_;     // versions, their parts, what sources hold
  std::unique_ptr<LeaseTable> leases_;
  std::unique_ptr<LayoutRegistry> layout_;
  std::unique_ptr<RelayTree> tree_;          // who pulls from whom (soft state)
  int64_t last_pass_ms_ = 0;                  // when a registration last ran a pass (clock_)
  std::unique_ptr<StalenessGate> staleness_;
  LayoutOffers offers_;
  // Applied versions reported and applied in memory, not yet in the store:
  // each node's latest durable fields, by node.
  std::unordered_map<std::string, wsync::store::v1::NodeRecord> unflushed_reports_;
  int64_t unflushed_since_ms_ = 0;  // when the oldest of them came (clock_)
  // Serializes the store's calls, in the order their records were made:
  // taken with mu_ held (a commit under mu_), or, for the reports a tick
  // flushes, taken under mu_ and kept after mu_ is released, so that
  // heartbeats do not wait for that commit. Taken after mu_ when both are
  // held; mu_ is never taken while it is held.
  std::mutex store_mu_;
  // The registrations' queue (Register). Taken after mu_ when both are held.
  std::mutex register_mu_;
  std::condition_variable registered_;
  std::deque<PendingRegistration*> register_queue_;
  bool registering_ = false;  // a thread is committing a group
};

}  // namespace wsync::control
