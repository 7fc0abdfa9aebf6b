#include "wsync/control/coordinator_state.h"

#include <algorithm>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <spdlog/spdlog.h>

#include "layout_registry.h"
#include "lease_table.h"
#include "node_registry.h"
#include "relay_tree.h"
#include "staleness_gate.h"
#include "version_log.h"
#include "wsync/util/text.h"

namespace wsync::control {

using wsync::store::v1::Record;
using wsync::v1::Lease;
using wsync::v1::Node;
using wsync::v1::VersionSummary;

namespace {

constexpr size_t kMaxNameBytes = 256;

Status CheckName(const std::string& name) {
  if (name.empty()) return InvalidArgumentError("node name is empty");
  if (name.size() > kMaxNameBytes) return InvalidArgumentError("node name longer than 256 bytes");
  return Status::Ok();
}

Status NotLiveError(const std::string& name) {
  return NotFoundError("node " + Quoted(name) + " is not registered or expired; register again");
}

// The fields of a node derived from the state, at head version `head`.
void FillDerived(Node* n, uint64_t head) {
  n->set_staleness(n->role() == wsync::v1::ROLE_SINK ? head - std::min(head, n->applied_version()) : 0);
}

}  // namespace

CoordinatorState::CoordinatorState(const CoordinatorOptions& options, const Clock* clock,
                                   std::unique_ptr<Store> store)
    : options_(options),
      clock_(clock),
      store_(std::move(store)),
      log_([this](const Record& r) { return Log(r); }),
      nodes_(std::make_unique<NodeRegistry>()),
      versions_(std::make_unique<VersionLog>(clock)),
      leases_(std::make_unique<LeaseTable>(clock, options.default_ttl_ms)),
      layout_(std::make_unique<LayoutRegistry>()),
      tree_(std::make_unique<RelayTree>(clock, options.fanout, options.parent_avoid_ms)),
      staleness_(std::make_unique<StalenessGate>(options.max_staleness, options.policy)) {}

CoordinatorState::~CoordinatorState() = default;

StatusOr<std::unique_ptr<CoordinatorState>> CoordinatorState::Create(const CoordinatorOptions& options,
                                                                     const Clock* clock,
                                                                     std::unique_ptr<Store> store,
                                                                     const Recovered& recovered) {
  if (options.fanout == 0) return InvalidArgumentError("fanout must be at least 1");
  if (options.default_ttl_ms == 0 || options.default_ttl_ms > options.max_ttl_ms) {
    return InvalidArgumentError("default TTL must be in (0, max TTL]");
  }
  std::unique_ptr<CoordinatorState> s(new CoordinatorState(options, clock, std::move(store)));
  std::lock_guard<std::mutex> lock(s->mu_);
  // Each component loads its part of the snapshot in the order written;
  // they share no state, so the order among them is free.
  s->nodes_->LoadFrom(recovered.snapshot);
  s->versions_->LoadFrom(recovered.snapshot);
  s->leases_->LoadFrom(recovered.snapshot);
  s->layout_->LoadFrom(recovered.snapshot);
  s->versions_->ApplyFloor(recovered.version_floor);
  for (const auto& r : recovered.records) s->Apply(r);
  // Heartbeats are not durable: every node gets a TTL of grace from now
  // (of the period its fleet's sinks are paced to, if longer).
  s->nodes_->GraceAll(clock->NowMs(), [&](const Node& n) { return s->PacedIntervalLocked(n); });
  s->AssignParentsLocked();
  if (!s->nodes_->nodes().empty() || !s->versions_->empty()) {
    spdlog::info("coordinator recovered: head version {}, {} nodes, {} leases, {} log records replayed",
                 s->versions_->head(), s->nodes_->nodes().size(), s->leases_->size(), recovered.records.size());
  }
  return s;
}

// ------------------------------------------------------------ mutations

void CoordinatorState::Apply(const Record& r) {
  switch (r.kind_case()) {
    case Record::kNodeRegistered:
      nodes_->Apply(r.node_registered());
      break;
    case Record::kNodeDeregistered:
      nodes_->Erase(r.node_deregistered());
      leases_->DropNode(r.node_deregistered());
      break;
    case Record::kVersionPublished:
      versions_->ApplyPublished(r.version_published());
      VersionsChangedLocked();
      break;
    case Record::kVersionPart:
      versions_->ApplyPart(r.version_part());
      VersionsChangedLocked();
      break;
    case Record::kLeaseGranted:
      leases_->ApplyGranted(r.lease_granted());
      break;
    case Record::kLeaseReleased:
      leases_->ApplyReleased(r.lease_released());
      break;
    case Record::kLayoutSet:
      layout_->Apply(r.layout_set());
      break;
    case Record::kVersionFloor:
      versions_->ApplyFloor(r.version_floor());
      VersionsChangedLocked();
      break;
    case Record::kNodeReports:
      for (const auto& n : r.node_reports().nodes()) nodes_->Apply(n);
      break;
    case Record::KIND_NOT_SET:
      break;
  }
}

Status CoordinatorState::CommitLocked(const Record* r) {
  if (!unflushed_reports_.empty()) return CommitLocked(r ? std::vector<Record>{*r} : std::vector<Record>{});
  if (r == nullptr) return Status::Ok();
  // Alone: appended as it is, not copied into a batch (a layout's record may be large).
  std::lock_guard<std::mutex> store(store_mu_);
  return store_->Append(*r);
}

std::vector<Record> CoordinatorState::ReportRecordsLocked() const {
  // The reports in node_reports records of up to about 512 KiB each.
  constexpr size_t kReportBytes = 512 << 10;
  std::vector<Record> batch;
  size_t bytes = 0;
  for (const auto& [name, n] : unflushed_reports_) {
    const size_t size = n.ByteSizeLong();
    if (batch.empty() || (bytes > 0 && bytes + size > kReportBytes)) {
      batch.emplace_back();
      bytes = 0;
    }
    *batch.back().mutable_node_reports()->add_nodes() = n;
    bytes += size;
  }
  return batch;
}

Status CoordinatorState::CommitLocked(const std::vector<Record>& records) {
  // The reports first: they were made before these records.
  std::vector<Record> batch = ReportRecordsLocked();
  batch.insert(batch.end(), records.begin(), records.end());
  if (batch.empty()) return Status::Ok();
  std::lock_guard<std::mutex> store(store_mu_);
  // On an error the reports stay for the next try: applying a report again
  // at recovery has the same effect.
  WSYNC_RETURN_IF_ERROR(batch.size() == 1 ? store_->Append(batch[0]) : store_->AppendBatch(batch));
  unflushed_reports_.clear();
  return Status::Ok();
}

void CoordinatorState::FlushReportsUnlocked(std::unique_lock<std::mutex> lock) {
  const std::vector<Record> batch = ReportRecordsLocked();
  if (batch.empty()) return;
  auto flushing = std::exchange(unflushed_reports_, {});
  // The store is taken before mu_ is released: a record made after these
  // reports is committed after them.
  std::unique_lock<std::mutex> store(store_mu_);
  lock.unlock();
  const Status s = store_->AppendBatch(batch);
  store.unlock();
  if (s.ok()) return;
  lock.lock();
  spdlog::warn("cannot store {} applied versions reported (kept in memory, tried again next tick): {}",
               flushing.size(), s.ToString());
  // Back for the next try, unless superseded: a newer report of the node, or
  // the node registered again or gone since (a record committed meanwhile
  // that the old report must not follow).
  for (auto& [name, record] : flushing) {
    const Node* n = nodes_->Find(name);
    if (n == nullptr || n->incarnation() != record.incarnation()) continue;
    if (unflushed_reports_.empty()) unflushed_since_ms_ = clock_->NowMs();
    unflushed_reports_.emplace(name, std::move(record));
  }
}

Status CoordinatorState::Log(const Record& r) {
  WSYNC_RETURN_IF_ERROR(CommitLocked(&r));
  Apply(r);
  MaybeCompactLocked();
  NotifyLocked();
  return Status::Ok();
}

void CoordinatorState::MaybeCompactLocked() {
  std::lock_guard<std::mutex> store(store_mu_);
  if (store_->LogRecords() < options_.compact_every) return;
  Status s = store_->Compact(MakeSnapshot());
  if (!s.ok()) spdlog::warn("store compaction failed (the log keeps growing): {}", s.ToString());
}

Status CoordinatorState::Flush() {
  std::lock_guard<std::mutex> lock(mu_);
  return CommitLocked(nullptr);
}

wsync::store::v1::Snapshot CoordinatorState::MakeSnapshot() const {
  wsync::store::v1::Snapshot snap;
  nodes_->SaveTo(&snap);
  versions_->SaveTo(&snap);
  leases_->SaveTo(&snap);
  layout_->SaveTo(&snap);
  return snap;
}

void CoordinatorState::NotifyLocked() {
  ++generation_;
  changed_.notify_all();
}

void CoordinatorState::VersionsChangedLocked() {
  ++versions_generation_;
  versions_changed_.notify_all();
}

// ----------------------------------------------------------------- nodes

size_t CoordinatorState::RegistrationsQueued() {
  std::lock_guard<std::mutex> queue(register_mu_);
  return register_queue_.size();
}

struct CoordinatorState::PendingRegistration {
  const wsync::v1::RegisterRequest* req;
  StatusOr<wsync::v1::RegisterResponse> result = InternalError("not answered");
  bool done = false;  // guarded by register_mu_
};

StatusOr<wsync::v1::RegisterResponse> CoordinatorState::Register(const wsync::v1::RegisterRequest& req) {
  WSYNC_RETURN_IF_ERROR(CheckName(req.name()));
  if (req.role() == wsync::v1::ROLE_UNSPECIFIED || !wsync::v1::Role_IsValid(req.role())) {
    return InvalidArgumentError("node " + Quoted(req.name()) + ": role is unspecified");
  }
  if (req.ttl_ms() > options_.max_ttl_ms) {
    return InvalidArgumentError("TTL " + std::to_string(req.ttl_ms()) + " ms exceeds the maximum " +
                                std::to_string(options_.max_ttl_ms));
  }
  PendingRegistration me{&req};
  std::unique_lock<std::mutex> queue(register_mu_);
  register_queue_.push_back(&me);
  while (!me.done) {
    if (registering_) {
      registered_.wait(queue);
      continue;
    }
    // This thread commits everything queued, its own registration with it.
    registering_ = true;
    std::vector<PendingRegistration*> group(register_queue_.begin(), register_queue_.end());
    register_queue_.clear();
    queue.unlock();
    RegisterGroup(group);
    queue.lock();
    registering_ = false;
    registered_.notify_all();
  }
  return std::move(me.result);
}

void CoordinatorState::RegisterGroup(const std::vector<PendingRegistration*>& group) {
  std::vector<std::pair<PendingRegistration*, StatusOr<wsync::v1::RegisterResponse>>> answers;
  std::vector<PendingRegistration*> later;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ExpireLocked();
    std::vector<Record> records;
    std::vector<PendingRegistration*> registering;
    std::set<std::string> names;
    uint64_t incarnation = 0;
    for (PendingRegistration* p : group) {
      const wsync::v1::RegisterRequest& req = *p->req;
      if (const Node* registered = nodes_->RegisteredBy(req)) {
        // A retry of the call that made this incarnation (its answer was lost): that answer again.
        answers.emplace_back(p, RegisteredLocked(*registered));
        continue;
      }
      if (!names.insert(req.name()).second) {  // after the one of this group, in the next
        later.push_back(p);
        continue;
      }
      Record r;
      *r.mutable_node_registered() = nodes_->Registration(req, req.ttl_ms() ? req.ttl_ms() : options_.default_ttl_ms);
      if (incarnation == 0) incarnation = r.node_registered().incarnation();
      r.mutable_node_registered()->set_incarnation(incarnation++);  // in the order committed
      records.push_back(std::move(r));
      registering.push_back(p);
    }
    if (Status s = CommitLocked(records); !s.ok()) {
      for (PendingRegistration* p : registering) answers.emplace_back(p, s);
    } else {
      for (size_t i = 0; i < records.size(); ++i) {
        const wsync::v1::RegisterRequest& req = *registering[i]->req;
        const bool known = nodes_->Find(req.name()) != nullptr;
        Apply(records[i]);
        Node& stored = *nodes_->Find(req.name());
        versions_->ForgetSource(req.name());  // what a (re)registered source holds: its next heartbeat says
        // A new process of this name serves nothing yet: its children go to
        // another holder of their version now, and sinks may take it as a
        // parent again (once it holds the head). A name new to the nodes has
        // no children to look for (a fleet joins without a pass over it each).
        if (known) {
          tree_->Restarted(nodes_->nodes(), req.name());
        } else {
          tree_->Joined(req.name());
        }
        stored.set_state(wsync::v1::NODE_ALIVE);
        // A node registering starts over at a quarter of its TTL.
        nodes_->Touch(req.name(), clock_->NowMs(), 0);
        stored.set_parent("");
        AssignParentsSoonLocked();
        spdlog::info("node {} registered as {} from {} (incarnation {})", req.name(),
                     wsync::v1::Role_Name(req.role()), req.host(), stored.incarnation());
        answers.emplace_back(registering[i], RegisteredLocked(stored));
      }
      if (!records.empty()) {
        MaybeCompactLocked();
        NotifyLocked();
      }
    }
  }
  std::lock_guard<std::mutex> queue(register_mu_);
  for (auto& [p, answer] : answers) {
    p->result = std::move(answer);
    p->done = true;
  }
  register_queue_.insert(register_queue_.begin(), later.begin(), later.end());
}

wsync::v1::RegisterResponse CoordinatorState::RegisteredLocked(const Node& node) const {
  wsync::v1::RegisterResponse resp;
  *resp.mutable_node() = node;
  FillDerived(resp.mutable_node(), versions_->head());
  resp.set_head_version(versions_->head());
  return resp;
}

StatusOr<wsync::v1::HeartbeatResponse> CoordinatorState::Heartbeat(const wsync::v1::HeartbeatRequest& req) {
  std::lock_guard<std::mutex> lock(mu_);
  ExpireLocked();
  Node* n = nodes_->FindLive(req.name());
  if (n == nullptr) return NotLiveError(req.name());
  if (req.incarnation() != 0 && req.incarnation() != n->incarnation()) {
    return AbortedError("node " + Quoted(req.name()) + ": heartbeat from incarnation " +
                        std::to_string(req.incarnation()) + ", current is " + std::to_string(n->incarnation()));
  }
  if (n->state() == wsync::v1::NODE_DISCONNECTED) {
    // Its watch broke but the process lives: alive again, and the children
    // it lost come back while they are on the source and it has room.
    n->set_state(wsync::v1::NODE_ALIVE);
    AssignParentsLocked();  // its own parent first: a relay is one only when rooted
    tree_->GiveBackChildren(nodes_->nodes(), req.name(), versions_->head());
    NotifyLocked();
  }
  const uint64_t interval = PacedIntervalLocked(*n);
  nodes_->Touch(req.name(), clock_->NowMs(), interval);
  if (!req.unreachable_parent().empty() && req.unreachable_parent() == n->parent()) {
    // The sink cannot reach its parent: another holder of its version now,
    // not at the parent's TTL.
    spdlog::warn("sink {} cannot reach its parent {}: assigning another", Quoted(req.name()),
                 Quoted(req.unreachable_parent()));
    tree_->Avoid(req.name(), req.unreachable_parent());
    n->set_parent("");
    AssignParentsLocked();
    NotifyLocked();
  }
  n->set_sync_error(req.sync_error().substr(0, 1024));
  n->set_active_holds(req.active_holds());
  if (n->holds_pieces() != req.holds_pieces() || n->reads_store() != req.reads_store()) {
    // A sink that now holds pieces gives its children back; one that reads
    // a store may be a parent without one.
    n->set_holds_pieces(req.holds_pieces());
    n->set_reads_store(req.reads_store());
    AssignParentsLocked();
    NotifyLocked();
  }
  n->set_oldest_hold_ms(req.oldest_hold_ms());
  if (n->role() == wsync::v1::ROLE_SOURCE) versions_->SetSourceHead(req.name(), req.source_head());
  if (n->role() == wsync::v1::ROLE_SINK && req.has_applied_version() &&
      req.applied_version() != n->applied_version()) {
    // A report riding on the heartbeat: one the coordinator cannot take
    // (a version it does not know) leaves the heartbeat answered.
    if (Status s = ApplyReportLocked(n, req.applied_version()); !s.ok()) {
      spdlog::debug("heartbeat of {}: its applied version not taken: {}", Quoted(req.name()), s.ToString());
    }
  }
  wsync::v1::HeartbeatResponse resp;
  resp.set_reports_on_heartbeats(ReportsOnHeartbeatsLocked());
  resp.set_heartbeat_interval_ms(interval);
  *resp.mutable_node() = *n;
  FillDerived(resp.mutable_node(), versions_->head());
  resp.set_head_version(versions_->head());
  return resp;
}

Status CoordinatorState::Deregister(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  if (nodes_->Find(name) == nullptr) return NotFoundError("node '" + name + "' is not registered");
  Record r;
  r.set_node_deregistered(name);
  WSYNC_RETURN_IF_ERROR(Log(r));
  AssignParentsLocked();
  offers_.Forget(name);
  spdlog::info("node {} deregistered", name);
  return Status::Ok();
}

StatusOr<Node> CoordinatorState::ReportApplied(const std::string& name, uint64_t version) {
  std::lock_guard<std::mutex> lock(mu_);
  ExpireLocked();
  Node* current = nodes_->FindLive(name);
  if (current == nullptr) return NotLiveError(name);
  if (current->state() == wsync::v1::NODE_DISCONNECTED) current->set_state(wsync::v1::NODE_ALIVE);  // it speaks
  WSYNC_RETURN_IF_ERROR(ApplyReportLocked(current, version));
  Node out = *current;
  FillDerived(&out, versions_->head());
  return out;
}

Status CoordinatorState::ApplyReportLocked(Node* current, uint64_t version) {
  const std::string& name = current->name();
  const uint64_t head = versions_->head();
  if (version > head) {
    return InvalidArgumentError("node '" + name + "' reports version " + std::to_string(version) +
                                ", above the head version " + std::to_string(head));
  }
  if (version != 0 && !versions_->contains(version)) {
    return NotFoundError("version " + std::to_string(version) + " was never published");
  }
  Node n = *current;
  n.set_applied_version(version);
  if (n.resync_keyframe() && staleness_->Tolerates(head - version)) n.set_resync_keyframe(false);
  // A repeated report changes nothing: nothing to log.
  if (n.applied_version() != current->applied_version() || n.resync_keyframe() != current->resync_keyframe()) {
    // Acknowledged before it is durable: the store gets it within a tick,
    // in one batch with the other reports (or with the next durable change).
    // A failover or crash before that forgets it; the sink reports again
    // when its heartbeat's answer shows an applied version not its own.
    wsync::store::v1::NodeRecord record = NodeRegistry::ToRecord(n);
    nodes_->Apply(record);
    if (unflushed_reports_.empty()) unflushed_since_ms_ = clock_->NowMs();
    unflushed_reports_[name] = std::move(record);
    NotifyLocked();
    // A sink reaching the head may parent orphans or relieve a parent above
    // the fan-out: the tree is redone at the next Tick (within tick_ms), not
    // at each of the thousands of reports a version brings, and not at all
    // when it has neither.
    tree_->MarkCandidatesChanged();
  }
  return Status::Ok();
}

// -------------------------------------------------------------- versions

StatusOr<uint64_t> CoordinatorState::Publish(const VersionSummary& version) {
  if (version.version() == 0) return InvalidArgumentError("version 0 is reserved for 'none'");
  std::lock_guard<std::mutex> lock(mu_);
  // A new head changes which sinks may be parents: the tree follows every
  // record that moves it, before the publish goes on.
  const RecordLog log_moving_head = [this](const Record& r) {
    const uint64_t head = versions_->head();
    WSYNC_RETURN_IF_ERROR(Log(r));
    if (versions_->head() != head) AssignParentsLocked();
    return Status::Ok();
  };
  return versions_->Publish(version, layout_->parts(), log_moving_head);
}

wsync::v1::ListVersionsResponse CoordinatorState::ListVersions(uint64_t after) const {
  std::lock_guard<std::mutex> lock(mu_);
  return versions_->List(after);
}

uint64_t CoordinatorState::head() const {
  std::lock_guard<std::mutex> lock(mu_);
  return versions_->head();
}

Status CoordinatorState::SetLayout(const wsync::v1::Layout& layout) {
  std::lock_guard<std::mutex> lock(mu_);
  return layout_->Set(layout, log_);
}

wsync::v1::GetLayoutResponse CoordinatorState::GetLayout() const {
  std::lock_guard<std::mutex> lock(mu_);
  return layout_->Get();
}

// ---------------------------------------------------------------- leases

StatusOr<Lease> CoordinatorState::AcquireLease(const std::string& node, uint64_t version, uint64_t ttl_ms,
                                               const std::string& request_id) {
  if (ttl_ms > options_.max_ttl_ms) return InvalidArgumentError("lease TTL exceeds the maximum");
  std::lock_guard<std::mutex> lock(mu_);
  ExpireLocked();
  if (nodes_->FindLive(node) == nullptr) return NotFoundError("node " + Quoted(node) + " is not registered or expired");
  if (!versions_->contains(version)) {
    return NotFoundError("version " + std::to_string(version) + " was never published");
  }
  return leases_->Acquire(node, version, ttl_ms, request_id, log_);
}

StatusOr<Lease> CoordinatorState::RenewLease(uint64_t id, uint64_t ttl_ms) {
  if (ttl_ms > options_.max_ttl_ms) return InvalidArgumentError("lease TTL exceeds the maximum");
  std::lock_guard<std::mutex> lock(mu_);
  ExpireLocked();
  return leases_->Renew(id, ttl_ms, log_);
}

Status CoordinatorState::ReleaseLease(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  return leases_->Release(id, log_);
}

wsync::v1::ListLeasesResponse CoordinatorState::ListLeases() const {
  std::lock_guard<std::mutex> lock(mu_);
  return leases_->List();
}

// ------------------------------------------------------------- staleness

StatusOr<wsync::v1::MayPublishResponse> CoordinatorState::MayPublish(uint64_t version) {
  std::lock_guard<std::mutex> lock(mu_);
  ExpireLocked();
  const uint64_t head = versions_->head();
  return staleness_->MayPublish(version, head, nodes_->nodes(),
                                [&](const Node& sink) { return HeadReachableLocked(sink, head); }, log_);
}

// A source's holdings not known (not heard from since this coordinator
// started or since it registered) count as holding the head; a version of
// several sources needs every part's source.
bool CoordinatorState::HeadReachableLocked(const Node& sink, uint64_t head) const {
  auto holds = [&](const std::string& source) { return versions_->SourceHolds(source, head); };
  return RelayTree::HeadReachable(nodes_->nodes(), sink, head, [&](const Node& source) {
    const auto& layout = layout_->layout();
    if (layout && layout->parts() > 1) {
      return std::all_of(layout->part_sources().begin(), layout->part_sources().end(), holds);
    }
    return holds(source.name());
  });
}

// ---------------------------------------------------- liveness and topology

bool CoordinatorState::ReportsOnHeartbeatsLocked() const {
  return options_.max_staleness == 0 && options_.heartbeat_reports_from > 0 &&
         nodes_->nodes().size() >= options_.heartbeat_reports_from;
}

uint64_t CoordinatorState::PacedIntervalLocked(const Node& n) const {
  if (n.role() != wsync::v1::ROLE_SINK || options_.max_staleness != 0 || options_.heartbeat_budget == 0) return 0;
  // Every node heartbeats at this period: the budget holds.
  const uint64_t nodes = nodes_->nodes().size();
  const uint64_t paced = (nodes * 1000 + options_.heartbeat_budget - 1) / options_.heartbeat_budget;
  return paced > n.ttl_ms() / 4 ? paced : 0;
}

void CoordinatorState::Tick() {
  std::unique_lock<std::mutex> lock(mu_);
  MaybeCompactLocked();
  ExpireLocked();
  if (tree_->dirty()) {
    // Each pass gives the sinks that reached the head up to `fanout`
    // children each: a tree grows by that factor per pass.
    for (int pass = 0; pass < 16 && AssignParentsLocked(); ++pass) {
    }
    NotifyLocked();
  }
  // Applied versions that heartbeats carry are carried again by the next
  // ones (a new leader learns them within a heartbeat period): made durable
  // once a second, not at every tick, and with the lock released, so that
  // heartbeats do not wait for the store.
  constexpr int64_t kHeartbeatReportsFlushMs = 1000;
  const bool flush = !ReportsOnHeartbeatsLocked() || clock_->NowMs() - unflushed_since_ms_ >= kHeartbeatReportsFlushMs;
  if (flush) FlushReportsUnlocked(std::move(lock));
}

void CoordinatorState::WatchBroken(const std::string& name, uint64_t incarnation) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!nodes_->Disconnect(name, incarnation)) return;
  tree_->Disconnected(nodes_->nodes(), name);
  AssignParentsLocked();
  NotifyLocked();
}

void CoordinatorState::ExpireLocked() {
  const int64_t now = clock_->NowMs();
  const std::vector<std::string> dead = nodes_->Expire(now);
  for (const auto& name : dead) tree_->Died(name);
  bool changed = !dead.empty();
  const auto owner_dead = [&](const std::string& node) { return nodes_->FindLive(node) == nullptr; };
  for (uint64_t id : leases_->Ended(now, owner_dead)) {
    // Expiry cannot fail: an end the store refuses takes effect anyway (after
    // a restart the lease ends again, at its expiry or its owner's TTL).
    Record r;
    r.set_lease_released(id);
    Status s = CommitLocked(&r);
    if (!s.ok()) spdlog::warn("cannot log the end of lease {}: {}", id, s.ToString());
    Apply(r);
    changed = true;
  }
  if (changed) {
    AssignParentsLocked();
    NotifyLocked();
  }
}

bool CoordinatorState::AssignParentsLocked() { return tree_->AssignParents(nodes_->nodes(), versions_->head()); }

void CoordinatorState::AssignParentsSoonLocked() {
  // Thousands of sinks registering at once would each redo the whole tree;
  // within a tick of the last registration's pass they wait for the tick's
  // (a sink learns its parent from a heartbeat's answer, not from Register's).
  constexpr size_t kLargeFleet = 1000;
  constexpr int64_t kCoalesceMs = 200;
  const int64_t now = clock_->NowMs();
  if (nodes_->nodes().size() >= kLargeFleet && now - last_pass_ms_ < kCoalesceMs) {
    tree_->MarkDirty();
    return;
  }
  last_pass_ms_ = now;
  AssignParentsLocked();
}

// ---------------------------------------------------------------- status

wsync::v1::StatusResponse CoordinatorState::GetStatus() const {
  std::lock_guard<std::mutex> lock(mu_);
  wsync::v1::StatusResponse resp;
  const uint64_t head = versions_->head();
  resp.set_head_version(head);
  resp.set_max_staleness(options_.max_staleness);
  resp.set_policy(options_.policy);
  const wsync::v1::ListLeasesResponse leases = leases_->List();
  uint64_t needed = leases.oldest_leased_version();
  for (const auto& [name, n] : nodes_->nodes()) {
    Node* out = resp.add_nodes();
    *out = n;
    FillDerived(out, head);
    // A disconnected sink may be back in a moment: keep what it needs until its TTL.
    if (n.role() == wsync::v1::ROLE_SINK && n.state() != wsync::v1::NODE_DEAD && n.applied_version() != 0) {
      needed = needed == 0 ? n.applied_version() : std::min(needed, n.applied_version());
    }
  }
  *resp.mutable_leases() = leases.leases();
  resp.set_oldest_leased_version(leases.oldest_leased_version());
  resp.set_oldest_needed_version(needed);
  resp.set_now_unix_ms(clock_->NowMs());
  return resp;
}

uint64_t CoordinatorState::generation() const {
  std::lock_guard<std::mutex> lock(mu_);
  return generation_;
}

bool CoordinatorState::WatchVersions(uint64_t after,
                                     const std::function<bool(const wsync::v1::VersionSummary&)>& on_version,
                                     const std::function<bool()>& stop) const {
  while (!stop()) {
    // Read the generation first: a publish after the listing wakes us.
    const uint64_t gen = versions_generation();
    const wsync::v1::ListVersionsResponse pending = ListVersions(after);
    for (const auto& v : pending.versions()) {
      if (!on_version(v)) return true;
      after = v.version();
    }
    if (stop()) break;
    WaitForVersions(gen, std::chrono::steady_clock::now() + std::chrono::milliseconds(200));
  }
  return false;
}

StatusOr<wsync::v1::MayPublishResponse> CoordinatorState::MayPublishWaiting(
    uint64_t version, std::chrono::steady_clock::time_point deadline, const std::function<bool()>& stop) {
  for (;;) {
    const uint64_t gen = generation();
    WSYNC_ASSIGN_OR_RETURN(auto r, MayPublish(version));
    if (r.allowed() || std::chrono::steady_clock::now() >= deadline || stop()) return r;
    WaitForChange(gen, std::min(deadline, std::chrono::steady_clock::now() + std::chrono::milliseconds(200)));
  }
}

uint64_t CoordinatorState::WaitForChange(uint64_t seen, std::chrono::steady_clock::time_point deadline) const {
  std::unique_lock<std::mutex> lock(mu_);
  changed_.wait_until(lock, deadline, [&] { return generation_ != seen; });
  return generation_;
}

uint64_t CoordinatorState::versions_generation() const {
  std::lock_guard<std::mutex> lock(mu_);
  return versions_generation_;
}

uint64_t CoordinatorState::WaitForVersions(uint64_t seen, std::chrono::steady_clock::time_point deadline) const {
  std::unique_lock<std::mutex> lock(mu_);
  versions_changed_.wait_until(lock, deadline, [&] { return versions_generation_ != seen; });
  return versions_generation_;
}

}  // namespace wsync::control
