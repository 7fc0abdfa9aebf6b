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
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

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
};

class CoordinatorState {
 public:
  // Recovers from `store` (REQUIRES: outlives this; OpenLogStore's Recovered
  // passed as `recovered`). REQUIRES: clock outlives this.
  static StatusOr<std::unique_ptr<CoordinatorState>> Create(const CoordinatorOptions& options, const Clock* clock,
                                                            std::unique_ptr<Store> store,
                                                            const Recovered& recovered);

  StatusOr<wsync::v1::RegisterResponse> Register(const wsync::v1::RegisterRequest& req);
  StatusOr<wsync::v1::HeartbeatResponse> Heartbeat(const wsync::v1::HeartbeatRequest& req);
  Status Deregister(const std::string& name);

  // FailedPrecondition unless version > head; InvalidArgument for version 0.
  // The same summary again (version, base, set checksum, source) is Ok: a
  // publisher retrying after a lost answer learns that it was stored.
  StatusOr<uint64_t> Publish(const wsync::v1::VersionSummary& version);
  wsync::v1::ListVersionsResponse ListVersions(uint64_t after) const;

  StatusOr<wsync::v1::Node> ReportApplied(const std::string& name, uint64_t version);

  StatusOr<wsync::v1::Lease> AcquireLease(const std::string& node, uint64_t version, uint64_t ttl_ms);
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

  // Expires nodes and leases whose TTL passed; reassigns parents.
  void Tick();

  // The node's Watch stream broke: the node (of that incarnation) is marked
  // disconnected now (NODE_DISCONNECTED: not a parent, not blocking
  // publishes; its applied version still kept for it until its TTL). Its
  // children get another parent now, and are given back if it heartbeats
  // again within its TTL, holding the head, while they are on the source.
  void WatchBroken(const std::string& name, uint64_t incarnation);

  uint64_t head() const;

  // A counter that grows on every change; WaitForChange returns once it
  // differs from `seen` or at `deadline`. Returns the current value.
  uint64_t generation() const;
  uint64_t WaitForChange(uint64_t seen, std::chrono::steady_clock::time_point deadline) const;

  // The Watch call's loop, for every adapter: on_version for each version
  // after `after`, then for new ones as they are published, until it returns
  // false (the watcher went away) or stop() is true (checked at least every
  // 200 ms). True when the watcher went away, so the adapter reports
  // WatchBroken; false when stopped.
  bool WatchVersions(uint64_t after, const std::function<bool(const wsync::v1::VersionSummary&)>& on_version,
                     const std::function<bool()>& stop) const;
  // MayPublish, waiting until it is allowed, `deadline`, or stop().
  StatusOr<wsync::v1::MayPublishResponse> MayPublishWaiting(uint64_t version,
                                                             std::chrono::steady_clock::time_point deadline,
                                                             const std::function<bool()>& stop);

 private:
  CoordinatorState(const CoordinatorOptions& options, const Clock* clock, std::unique_ptr<Store> store);
  void Apply(const wsync::store::v1::Record& r);       // REQUIRES: mu_ held
  Status Log(const wsync::store::v1::Record& r);       // append, apply, maybe compact
  // Grants or renews lease `id` until now + ttl (0: default). REQUIRES: mu_ held.
  StatusOr<wsync::v1::Lease> GrantLeaseLocked(uint64_t id, const std::string& node, uint64_t version, uint64_t ttl_ms);
  wsync::store::v1::NodeRecord ToRecord(const wsync::v1::Node& n) const;
  wsync::store::v1::Snapshot MakeSnapshot() const;
  void ExpireLocked();
  // Whether any sink's parent changed.
  bool AssignParentsLocked();
  bool IsDescendantLocked(const std::string& node, const std::string& ancestor) const;
  // The children `parent` lost when its watch broke, back to it (see WatchBroken). REQUIRES: mu_ held.
  void GiveBackChildrenLocked(const std::string& parent);
  // Whether `child` avoids `parent` now (it reported it unreachable). REQUIRES: mu_ held.
  bool AvoidsLocked(const std::string& child, const std::string& parent) const;
  uint64_t OldestLeasedLocked() const;
  // The highest version ever acknowledged: the head, or the store's floor
  // after a salvage that lost versions. REQUIRES: mu_ held.
  uint64_t AcknowledgedHeadLocked() const;
  // Whether a sink can get version `head` from its parents (a relay holding
  // it, or a source whose history does). REQUIRES: mu_ held.
  bool HeadReachableLocked(const wsync::v1::Node& sink, uint64_t head) const;
  // `source` announced `version`: its history holds it. REQUIRES: mu_ held.
  void NoteSourceHoldsLocked(const std::string& source, uint64_t version);
  StatusOr<uint64_t> PublishPartLocked(const wsync::v1::VersionSummary& part);
  Status SetLayoutPartLocked(const wsync::v1::Layout& layout);
  void FillDerivedLocked(wsync::v1::Node* n) const;
  void NotifyLocked();

  CoordinatorOptions options_;
  const Clock* clock_;
  std::unique_ptr<Store> store_;

  mutable std::mutex mu_;
  mutable std::condition_variable changed_;
  uint64_t generation_ = 0;
  std::map<std::string, wsync::v1::Node> nodes_;
  // Sources: the newest version each one's history holds, as its heartbeats
  // and announcements say (not durable; absent: not known).
  std::map<std::string, uint64_t> source_heads_;
  std::map<uint64_t, wsync::v1::VersionSummary> versions_;
  // Versions published by several sources, not yet whole: version -> part -> summary.
  std::map<uint64_t, std::map<uint32_t, wsync::v1::VersionSummary>> parts_;
  std::map<uint64_t, wsync::v1::Lease> leases_;
  // Sinks -> (a parent their pulls could not reach, until when it is
  // avoided for them, unix ms). Soft state: not durable.
  std::map<std::string, std::pair<std::string, int64_t>> avoid_;
  // Sinks -> the parent they lost when its watch stream broke; given back
  // if it heartbeats again within its TTL (soft state).
  std::map<std::string, std::string> former_parent_;
  std::optional<wsync::v1::Layout> layout_;
  uint64_t version_floor_ = 0;  // no version at or below it is published (Recovered::version_floor)
  uint64_t next_lease_id_ = 1;
  uint64_t next_incarnation_ = 1;
  bool tree_dirty_ = false;
  LayoutOffers offers_;  // a report may change the relay tree: AssignParentsLocked at the next Tick
};

}  // namespace wsync::control
