#include "wsync/control/coordinator_state.h"

#include <algorithm>
#include <limits>
#include <set>

#include <spdlog/spdlog.h>

#include "wsync/control/layout.h"
#include "wsync/util/text.h"

namespace wsync::control {

using wsync::store::v1::NodeRecord;
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

}  // namespace

CoordinatorState::CoordinatorState(const CoordinatorOptions& options, const Clock* clock,
                                   std::unique_ptr<Store> store)
    : options_(options), clock_(clock), store_(std::move(store)) {}

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
  const auto& snap = recovered.snapshot;
  for (const auto& n : snap.nodes()) {
    Record r;
    *r.mutable_node_registered() = n;
    s->Apply(r);
  }
  for (const auto& v : snap.versions()) {
    Record r;
    *r.mutable_version_published() = v;
    s->Apply(r);
  }
  for (const auto& l : snap.leases()) {
    Record r;
    *r.mutable_lease_granted() = l;
    s->Apply(r);
  }
  if (snap.has_layout()) {
    Record r;
    *r.mutable_layout_set() = snap.layout();
    s->Apply(r);
  }
  for (const auto& p : snap.version_parts()) {
    Record r;
    *r.mutable_version_part() = p;
    s->Apply(r);
  }
  s->next_lease_id_ = std::max(s->next_lease_id_, snap.next_lease_id());
  s->next_incarnation_ = std::max(s->next_incarnation_, snap.next_incarnation());
  s->version_floor_ = std::max(snap.version_floor(), recovered.version_floor);
  for (const auto& r : recovered.records) s->Apply(r);
  // Heartbeats are not durable: every node gets a TTL of grace from now.
  const int64_t now = clock->NowMs();
  for (auto& [name, n] : s->nodes_) {
    n.set_state(wsync::v1::NODE_ALIVE);
    n.set_last_heartbeat_unix_ms(now);
  }
  s->AssignParentsLocked();
  if (!s->nodes_.empty() || !s->versions_.empty()) {
    spdlog::info("coordinator recovered: head version {}, {} nodes, {} leases, {} log records replayed",
                 s->versions_.empty() ? 0 : s->versions_.rbegin()->first, s->nodes_.size(), s->leases_.size(),
                 recovered.records.size());
  }
  return s;
}

// ------------------------------------------------------------ mutations

void CoordinatorState::Apply(const Record& r) {
  switch (r.kind_case()) {
    case Record::kNodeRegistered: {
      const NodeRecord& nr = r.node_registered();
      Node& n = nodes_[nr.name()];
      n.set_name(nr.name());
      n.set_role(nr.role());
      n.set_host(nr.host());
      n.set_data_address(nr.data_address());
      n.mutable_capabilities()->CopyFrom(nr.capabilities());
      n.set_ttl_ms(nr.ttl_ms());
      n.set_incarnation(nr.incarnation());
      n.set_applied_version(nr.applied_version());
      n.set_resync_keyframe(nr.resync_keyframe());
      next_incarnation_ = std::max(next_incarnation_, nr.incarnation() + 1);
      break;
    }
    case Record::kNodeDeregistered: {
      nodes_.erase(r.node_deregistered());
      for (auto it = leases_.begin(); it != leases_.end();) {
        it = it->second.node() == r.node_deregistered() ? leases_.erase(it) : std::next(it);
      }
      break;
    }
    case Record::kVersionPublished: {
      const uint64_t v = r.version_published().version();
      // Above the head, or the head's summary completed.
      if (versions_.empty() || v > versions_.rbegin()->first ||
          (v == versions_.rbegin()->first && versions_.rbegin()->second.incomplete())) {
        versions_[v] = r.version_published();
      }
      // Parts of this version and of older ones: whole now, or never.
      parts_.erase(parts_.begin(), parts_.upper_bound(v));
      break;
    }
    case Record::kVersionPart: {
      const auto& p = r.version_part();
      if (versions_.empty() || p.version() > versions_.rbegin()->first) parts_[p.version()][p.part()] = p;
      break;
    }
    case Record::kLeaseGranted: {
      const Lease& l = r.lease_granted();
      leases_[l.id()] = l;
      next_lease_id_ = std::max(next_lease_id_, l.id() + 1);
      break;
    }
    case Record::kLeaseReleased:
      leases_.erase(r.lease_released());
      break;
    case Record::kLayoutSet:
      layout_ = r.layout_set();
      break;
    case Record::kVersionFloor:
      version_floor_ = std::max(version_floor_, r.version_floor());
      break;
    case Record::KIND_NOT_SET:
      break;
  }
}

Status CoordinatorState::Log(const Record& r) {
  WSYNC_RETURN_IF_ERROR(store_->Append(r));
  Apply(r);
  if (store_->LogRecords() >= options_.compact_every) {
    Status s = store_->Compact(MakeSnapshot());
    if (!s.ok()) spdlog::warn("store compaction failed (the log keeps growing): {}", s.ToString());
  }
  NotifyLocked();
  return Status::Ok();
}

NodeRecord CoordinatorState::ToRecord(const Node& n) const {
  NodeRecord nr;
  nr.set_name(n.name());
  nr.set_role(n.role());
  nr.set_host(n.host());
  nr.set_data_address(n.data_address());
  nr.mutable_capabilities()->CopyFrom(n.capabilities());
  nr.set_ttl_ms(n.ttl_ms());
  nr.set_incarnation(n.incarnation());
  nr.set_applied_version(n.applied_version());
  nr.set_resync_keyframe(n.resync_keyframe());
  return nr;
}

wsync::store::v1::Snapshot CoordinatorState::MakeSnapshot() const {
  wsync::store::v1::Snapshot snap;
  for (const auto& [name, n] : nodes_) *snap.add_nodes() = ToRecord(n);
  for (const auto& [v, vs] : versions_) *snap.add_versions() = vs;
  for (const auto& [id, l] : leases_) *snap.add_leases() = l;
  snap.set_next_lease_id(next_lease_id_);
  snap.set_next_incarnation(next_incarnation_);
  if (layout_) *snap.mutable_layout() = *layout_;
  snap.set_version_floor(version_floor_);
  for (const auto& [v, parts] : parts_) {
    for (const auto& [p, summary] : parts) *snap.add_version_parts() = summary;
  }
  return snap;
}

void CoordinatorState::NotifyLocked() {
  ++generation_;
  changed_.notify_all();
}

// ----------------------------------------------------------------- nodes

StatusOr<wsync::v1::RegisterResponse> CoordinatorState::Register(const wsync::v1::RegisterRequest& req) {
  WSYNC_RETURN_IF_ERROR(CheckName(req.name()));
  if (req.role() == wsync::v1::ROLE_UNSPECIFIED || !wsync::v1::Role_IsValid(req.role())) {
    return InvalidArgumentError("node " + Quoted(req.name()) + ": role is unspecified");
  }
  if (req.ttl_ms() > options_.max_ttl_ms) {
    return InvalidArgumentError("TTL " + std::to_string(req.ttl_ms()) + " ms exceeds the maximum " +
                                std::to_string(options_.max_ttl_ms));
  }
  std::lock_guard<std::mutex> lock(mu_);
  ExpireLocked();
  Node n;
  auto it = nodes_.find(req.name());
  if (it != nodes_.end()) n = it->second;  // re-registration keeps the applied version
  n.set_name(req.name());
  n.set_role(req.role());
  n.set_host(req.host());
  n.set_data_address(req.data_address());
  n.mutable_capabilities()->CopyFrom(req.capabilities());
  n.set_ttl_ms(req.ttl_ms() ? req.ttl_ms() : options_.default_ttl_ms);
  n.set_incarnation(next_incarnation_);
  Record r;
  *r.mutable_node_registered() = ToRecord(n);
  WSYNC_RETURN_IF_ERROR(Log(r));
  Node& stored = nodes_[req.name()];
  source_heads_.erase(req.name());  // what a (re)registered source holds: its next heartbeat says
  // A new process of this name serves nothing yet: its children go to
  // another holder of their version now, and sinks may take it as a parent
  // again (once it holds the head).
  for (auto& [child, n] : nodes_) {
    if (n.parent() == req.name()) n.set_parent("");
  }
  std::erase_if(avoid_, [&](const auto& e) { return e.second.first == req.name(); });
  std::erase_if(former_parent_, [&](const auto& e) { return e.second == req.name(); });
  stored.set_state(wsync::v1::NODE_ALIVE);
  stored.set_last_heartbeat_unix_ms(clock_->NowMs());
  stored.set_parent("");
  AssignParentsLocked();
  spdlog::info("node {} registered as {} from {} (incarnation {})", req.name(), wsync::v1::Role_Name(req.role()),
               req.host(), stored.incarnation());
  wsync::v1::RegisterResponse resp;
  *resp.mutable_node() = stored;
  FillDerivedLocked(resp.mutable_node());
  resp.set_head_version(versions_.empty() ? 0 : versions_.rbegin()->first);
  return resp;
}

StatusOr<wsync::v1::HeartbeatResponse> CoordinatorState::Heartbeat(const wsync::v1::HeartbeatRequest& req) {
  std::lock_guard<std::mutex> lock(mu_);
  ExpireLocked();
  auto it = nodes_.find(req.name());
  if (it == nodes_.end() || it->second.state() == wsync::v1::NODE_DEAD) {
    return NotFoundError("node " + Quoted(req.name()) + " is not registered or expired; register again");
  }
  if (req.incarnation() != 0 && req.incarnation() != it->second.incarnation()) {
    return AbortedError("node " + Quoted(req.name()) + ": heartbeat from incarnation " +
                        std::to_string(req.incarnation()) + ", current is " +
                        std::to_string(it->second.incarnation()));
  }
  if (it->second.state() == wsync::v1::NODE_DISCONNECTED) {
    // Its watch broke but the process lives: alive again, and the children
    // it lost come back while they are on the source and it has room.
    it->second.set_state(wsync::v1::NODE_ALIVE);
    AssignParentsLocked();  // its own parent first: a relay is one only when rooted
    GiveBackChildrenLocked(req.name());
    NotifyLocked();
  }
  it->second.set_last_heartbeat_unix_ms(clock_->NowMs());
  if (!req.unreachable_parent().empty() && req.unreachable_parent() == it->second.parent()) {
    // The sink cannot reach its parent: another holder of its version now,
    // not at the parent's TTL.
    spdlog::warn("sink {} cannot reach its parent {}: assigning another", Quoted(req.name()),
                 Quoted(req.unreachable_parent()));
    avoid_[req.name()] = {req.unreachable_parent(),
                          clock_->NowMs() + static_cast<int64_t>(options_.parent_avoid_ms)};
    it->second.set_parent("");
    AssignParentsLocked();
    NotifyLocked();
  }
  it->second.set_sync_error(req.sync_error().substr(0, 1024));
  it->second.set_active_holds(req.active_holds());
  if (it->second.holds_pieces() != req.holds_pieces()) {
    // A sink that now holds pieces gives its children back.
    it->second.set_holds_pieces(req.holds_pieces());
    AssignParentsLocked();
    NotifyLocked();
  }
  it->second.set_oldest_hold_ms(req.oldest_hold_ms());
  if (it->second.role() == wsync::v1::ROLE_SOURCE) source_heads_[req.name()] = req.source_head();
  wsync::v1::HeartbeatResponse resp;
  *resp.mutable_node() = it->second;
  FillDerivedLocked(resp.mutable_node());
  resp.set_head_version(versions_.empty() ? 0 : versions_.rbegin()->first);
  return resp;
}

Status CoordinatorState::Deregister(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!nodes_.count(name)) return NotFoundError("node '" + name + "' is not registered");
  Record r;
  r.set_node_deregistered(name);
  WSYNC_RETURN_IF_ERROR(Log(r));
  AssignParentsLocked();
  offers_.Forget(name);
  spdlog::info("node {} deregistered", name);
  return Status::Ok();
}

// -------------------------------------------------------------- versions

StatusOr<uint64_t> CoordinatorState::Publish(const VersionSummary& version) {
  if (version.version() == 0) return InvalidArgumentError("version 0 is reserved for 'none'");
  std::lock_guard<std::mutex> lock(mu_);
  if (version.parts() > 1 || (layout_ && layout_->parts() > 1)) return PublishPartLocked(version);
  // Above the head, and above every version ever acknowledged (the store's
  // high-water mark: higher than the head after a salvage lost records).
  const uint64_t head = AcknowledgedHeadLocked();
  if (auto it = versions_.find(version.version()); it != versions_.end() &&
      it->second.source() == version.source() && it->second.base_version() == version.base_version()) {
    const VersionSummary& had = it->second;
    if (had.incomplete() && !version.incomplete() && it == std::prev(versions_.end())) {
      // The version announced while it was encoded, now complete.
      Record r;
      *r.mutable_version_published() = version;
      r.mutable_version_published()->set_published_unix_ms(had.published_unix_ms());
      WSYNC_RETURN_IF_ERROR(Log(r));
      spdlog::info("version {} complete ({} patch bytes)", version.version(), version.patch_bytes());
      return version.version();
    }
    if ((had.set_checksum() == version.set_checksum() && had.incomplete() == version.incomplete()) ||
        (!had.incomplete() && version.incomplete())) {
      // A retry of a publish that was stored but whose answer was lost (or
      // of the early announce of a version since completed).
      return version.version();
    }
  }
  if (version.version() <= head) {
    return StaleVersionError(version.version(), head).WithContext("versions only grow");
  }
  if (!version.keyframe() && version.base_version() >= version.version()) {
    return InvalidArgumentError("base version " + std::to_string(version.base_version()) +
                                " of a patch must be below its version " + std::to_string(version.version()));
  }
  Record r;
  *r.mutable_version_published() = version;
  if (version.published_unix_ms() == 0) r.mutable_version_published()->set_published_unix_ms(clock_->NowMs());
  WSYNC_RETURN_IF_ERROR(Log(r));
  NoteSourceHoldsLocked(version.source(), version.version());
  AssignParentsLocked();
  spdlog::info("version {} published by {} (base {}, {} patch bytes, {} dense bytes{}{})", version.version(),
               version.source(), version.base_version(), version.patch_bytes(), version.dense_bytes(),
               version.keyframe() ? ", keyframe" : "", version.incomplete() ? ", still being encoded: streamed as it is" : "");
  return version.version();
}

// A part of a version published by several sources: recorded; the version
// is published (visible, the head) once every part is in. A part announced
// again for a version not yet whole replaces the earlier one (its source
// restarted: nobody has applied it). Versions below a whole one that are
// still partial are dropped: their missing sources have moved past them.
StatusOr<uint64_t> CoordinatorState::PublishPartLocked(const VersionSummary& part) {
  const uint64_t v = part.version();
  if (!layout_ || layout_->parts() != part.parts() || part.parts() <= 1) {
    return FailedPreconditionError("version " + std::to_string(v) + " part " + std::to_string(part.part()) + " of " +
                                   std::to_string(part.parts()) + ": the layout is set for " +
                                   std::to_string(layout_ ? std::max<uint32_t>(1, layout_->parts()) : 0) + " part(s)");
  }
  if (part.part() >= part.parts()) {
    return InvalidArgumentError("part " + std::to_string(part.part()) + " of " + std::to_string(part.parts()));
  }
  if (part.incomplete()) {
    return InvalidArgumentError("version " + std::to_string(v) + " part " + std::to_string(part.part()) +
                                ": a part is announced once encoded (no incomplete announce)");
  }
  if (auto it = versions_.find(v); it != versions_.end() && static_cast<int>(part.part()) < it->second.part_summaries_size()) {
    const VersionSummary& had = it->second.part_summaries(static_cast<int>(part.part()));
    if (had.set_checksum() == part.set_checksum() && had.source() == part.source() &&
        had.base_version() == part.base_version()) {
      return v;  // a retry of a part stored with its version
    }
  }
  const uint64_t head = AcknowledgedHeadLocked();
  if (v <= head) {
    return StaleVersionError(v, head).WithContext("versions only grow");
  }
  if (!part.keyframe() && part.base_version() >= v) {
    return InvalidArgumentError("base version " + std::to_string(part.base_version()) +
                                " of a patch must be below its version " + std::to_string(v));
  }
  Record r;
  *r.mutable_version_part() = part;
  if (part.published_unix_ms() == 0) r.mutable_version_part()->set_published_unix_ms(clock_->NowMs());
  WSYNC_RETURN_IF_ERROR(Log(r));
  NoteSourceHoldsLocked(part.source(), v);
  const auto& have = parts_[v];
  spdlog::info("version {} part {} of {} published by {} ({} of {} parts in)", v, part.part(), part.parts(),
               part.source(), have.size(), part.parts());
  if (have.size() < part.parts()) return v;
  // Whole: the version as sinks see it.
  Record whole;
  VersionSummary* s = whole.mutable_version_published();
  s->set_version(v);
  s->set_parts(part.parts());
  s->set_keyframe(true);
  std::string sources;
  for (const auto& [index, p] : have) {
    *s->add_part_summaries() = p;
    s->set_patch_bytes(s->patch_bytes() + p.patch_bytes());
    s->set_dense_bytes(s->dense_bytes() + p.dense_bytes());
    s->set_keyframe(s->keyframe() && p.keyframe());
    if (!p.keyframe()) s->set_base_version(std::max(s->base_version(), p.base_version()));
    sources += (sources.empty() ? "" : "+") + p.source();
  }
  s->set_source(sources);
  s->set_published_unix_ms(clock_->NowMs());
  WSYNC_RETURN_IF_ERROR(Log(whole));
  AssignParentsLocked();
  spdlog::info("version {} published: all {} parts in ({})", v, part.parts(), sources);
  return v;
}

// A part of a layout of several sources: the first sets it; later parts are
// added (no tensor in two parts); a part set already is checked.
Status CoordinatorState::SetLayoutPartLocked(const wsync::v1::Layout& layout) {
  uint32_t part = layout.tensors(0).part();
  for (const auto& t : layout.tensors()) {
    if (t.part() != part) return InvalidArgumentError("a source sets the tensors of one part");
  }
  if (part >= layout.parts()) return InvalidArgumentError("part " + std::to_string(part) + " of " + std::to_string(layout.parts()));
  wsync::v1::Layout merged;
  if (layout_) {
    if (layout_->parts() != layout.parts()) {
      return FailedPreconditionError("the layout was set for " + std::to_string(std::max<uint32_t>(1, layout_->parts())) +
                                     " part(s) (sources), this source says " + std::to_string(layout.parts()));
    }
    const wsync::v1::Layout mine = PartOf(*layout_, part);
    const bool regrid = mine.tensors_size() > 0 && !SameGrids(mine, layout);
    if (mine.tensors_size() > 0) {
      WSYNC_RETURN_IF_ERROR(CheckLayout(mine, layout, "the tensors of this source"));
      if (layout_->part_sources(static_cast<int>(part)) == layout.source() && !regrid) return Status::Ok();
    }
    merged = *layout_;
    if (regrid) {
      // The layouts the source serves changed: its tensors' grids from now on.
      std::map<std::string, const wsync::v1::LayoutTensor*> offered;
      for (const auto& t : layout.tensors()) offered[t.name()] = &t;
      for (auto& t : *merged.mutable_tensors()) {
        if (auto it = offered.find(t.name()); it != offered.end() && t.part() == part) t = *it->second;
      }
      spdlog::info("layout part {}: tile grids changed by {}", part, layout.source());
    }
    if (mine.tensors_size() == 0) {
      std::set<std::string> names;
      for (const auto& t : layout_->tensors()) names.insert(t.name());
      for (const auto& t : layout.tensors()) {
        if (names.count(t.name())) {
          return FailedPreconditionError("tensor " + Quoted(t.name()) + " of part " + std::to_string(part) +
                                         " is already another part's");
        }
        *merged.add_tensors() = t;
      }
    }
  } else {
    merged = layout;
    merged.clear_part_sources();
    for (uint32_t i = 0; i < layout.parts(); ++i) merged.add_part_sources("");
  }
  merged.set_part_sources(static_cast<int>(part), layout.source());
  Record r;
  *r.mutable_layout_set() = merged;
  WSYNC_RETURN_IF_ERROR(Log(r));
  spdlog::info("layout part {} of {} ({} tensors) set by {}{}", part, layout.parts(), layout.tensors_size(),
               layout.source(), LayoutComplete(merged) ? ": the layout is complete" : "");
  return Status::Ok();
}

Status CoordinatorState::SetLayout(const wsync::v1::Layout& layout) {
  std::lock_guard<std::mutex> lock(mu_);
  if (layout.parts() > 1 && layout.tensors_size() > 0) return SetLayoutPartLocked(layout);
  if (layout_ && layout_->parts() > 1) {
    return FailedPreconditionError("the layout was set for " + std::to_string(layout_->parts()) +
                                   " parts (sources); this source registers the whole set");
  }
  if (layout_) {
    WSYNC_RETURN_IF_ERROR(CheckLayout(*layout_, layout, "the tensors of this source"));
    if (SameGrids(*layout_, layout)) return Status::Ok();
  }
  if (layout.tensors_size() == 0) return InvalidArgumentError("a layout needs at least one tensor");
  // A first layout, or the tile grids changed (the layouts the source serves
  // did): versions from now on are coded on these. Earlier versions keep
  // their checksums, taken on their grid (a sink's claim of one is checked
  // on the new grid and fails: it takes a keyframe).
  const bool regrid = layout_.has_value();
  Record r;
  *r.mutable_layout_set() = layout;
  WSYNC_RETURN_IF_ERROR(Log(r));
  spdlog::info("layout of {} tensors {} by {}", layout.tensors_size(), regrid ? "re-gridded" : "set", layout.source());
  return Status::Ok();
}

wsync::v1::GetLayoutResponse CoordinatorState::GetLayout() const {
  std::lock_guard<std::mutex> lock(mu_);
  wsync::v1::GetLayoutResponse resp;
  if (layout_) *resp.mutable_layout() = *layout_;
  // A layout of several parts counts once every part is in.
  resp.set_set(layout_.has_value() && LayoutComplete(*layout_));
  return resp;
}

wsync::v1::ListVersionsResponse CoordinatorState::ListVersions(uint64_t after) const {
  std::lock_guard<std::mutex> lock(mu_);
  wsync::v1::ListVersionsResponse resp;
  for (auto it = versions_.upper_bound(after); it != versions_.end(); ++it) *resp.add_versions() = it->second;
  for (const auto& [v, parts] : parts_) {
    VersionSummary* partial = resp.add_partial();
    partial->set_version(v);
    for (const auto& [index, p] : parts) {
      *partial->add_part_summaries() = p;
      partial->set_parts(p.parts());
    }
  }
  // Publishers read the next valid version from it: the floor counts.
  resp.set_head_version(AcknowledgedHeadLocked());
  return resp;
}

StatusOr<Node> CoordinatorState::ReportApplied(const std::string& name, uint64_t version) {
  std::lock_guard<std::mutex> lock(mu_);
  ExpireLocked();
  auto it = nodes_.find(name);
  if (it == nodes_.end() || it->second.state() == wsync::v1::NODE_DEAD) {
    return NotFoundError("node " + Quoted(name) + " is not registered or expired; register again");
  }
  if (it->second.state() == wsync::v1::NODE_DISCONNECTED) it->second.set_state(wsync::v1::NODE_ALIVE);  // it speaks
  const uint64_t head = versions_.empty() ? 0 : versions_.rbegin()->first;
  if (version > head) {
    return InvalidArgumentError("node '" + name + "' reports version " + std::to_string(version) +
                                ", above the head version " + std::to_string(head));
  }
  if (version != 0 && !versions_.count(version)) {
    return NotFoundError("version " + std::to_string(version) + " was never published");
  }
  Node n = it->second;
  n.set_applied_version(version);
  if (n.resync_keyframe() && (options_.max_staleness == 0 || head - version <= options_.max_staleness)) {
    n.set_resync_keyframe(false);
  }
  // A repeated report changes nothing: nothing to log.
  if (n.applied_version() != it->second.applied_version() || n.resync_keyframe() != it->second.resync_keyframe()) {
    Record r;
    *r.mutable_node_registered() = ToRecord(n);
    WSYNC_RETURN_IF_ERROR(Log(r));
    // A sink reaching the head may parent orphans or relieve a parent above
    // the fan-out: the tree is redone at the next Tick (within tick_ms), not
    // at each of the thousands of reports a version brings.
    tree_dirty_ = true;
  }
  Node out = nodes_[name];
  FillDerivedLocked(&out);
  return out;
}

// ---------------------------------------------------------------- leases

StatusOr<Lease> CoordinatorState::AcquireLease(const std::string& node, uint64_t version, uint64_t ttl_ms) {
  if (ttl_ms > options_.max_ttl_ms) return InvalidArgumentError("lease TTL exceeds the maximum");
  std::lock_guard<std::mutex> lock(mu_);
  ExpireLocked();
  auto it = nodes_.find(node);
  if (it == nodes_.end() || it->second.state() == wsync::v1::NODE_DEAD) {
    return NotFoundError("node " + Quoted(node) + " is not registered or expired");
  }
  if (!versions_.count(version)) {
    return NotFoundError("version " + std::to_string(version) + " was never published");
  }
  return GrantLeaseLocked(next_lease_id_, node, version, ttl_ms);
}

StatusOr<Lease> CoordinatorState::GrantLeaseLocked(uint64_t id, const std::string& node, uint64_t version,
                                                   uint64_t ttl_ms) {
  Record r;
  Lease* l = r.mutable_lease_granted();
  l->set_id(id);
  l->set_node(node);
  l->set_version(version);
  l->set_expires_unix_ms(clock_->NowMs() + static_cast<int64_t>(ttl_ms ? ttl_ms : options_.default_ttl_ms));
  WSYNC_RETURN_IF_ERROR(Log(r));
  return leases_.at(id);
}

StatusOr<Lease> CoordinatorState::RenewLease(uint64_t id, uint64_t ttl_ms) {
  if (ttl_ms > options_.max_ttl_ms) return InvalidArgumentError("lease TTL exceeds the maximum");
  std::lock_guard<std::mutex> lock(mu_);
  ExpireLocked();
  auto it = leases_.find(id);
  if (it == leases_.end()) return NotFoundError("lease " + std::to_string(id) + " is not held (expired or released)");
  return GrantLeaseLocked(id, it->second.node(), it->second.version(), ttl_ms);
}

Status CoordinatorState::ReleaseLease(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!leases_.count(id)) return NotFoundError("lease " + std::to_string(id) + " is not held");
  Record r;
  r.set_lease_released(id);
  return Log(r);
}

uint64_t CoordinatorState::OldestLeasedLocked() const {
  uint64_t oldest = 0;
  for (const auto& [id, l] : leases_) oldest = oldest == 0 ? l.version() : std::min(oldest, l.version());
  return oldest;
}

wsync::v1::ListLeasesResponse CoordinatorState::ListLeases() const {
  std::lock_guard<std::mutex> lock(mu_);
  wsync::v1::ListLeasesResponse resp;
  for (const auto& [id, l] : leases_) *resp.add_leases() = l;
  resp.set_oldest_leased_version(OldestLeasedLocked());
  return resp;
}

// ------------------------------------------------------------- staleness

StatusOr<wsync::v1::MayPublishResponse> CoordinatorState::MayPublish(uint64_t version) {
  std::lock_guard<std::mutex> lock(mu_);
  ExpireLocked();
  const uint64_t head = versions_.empty() ? 0 : versions_.rbegin()->first;
  if (version <= head) {
    return StaleVersionError(version, head);
  }
  wsync::v1::MayPublishResponse resp;
  resp.set_allowed(true);
  if (options_.max_staleness == 0) return resp;
  for (auto& [name, n] : nodes_) {
    // Sinks that never applied a version are not serving yet: they hold
    // nothing back (they start from a keyframe).
    if (n.role() != wsync::v1::ROLE_SINK || n.state() != wsync::v1::NODE_ALIVE || n.applied_version() == 0 ||
        n.resync_keyframe()) {
      continue;
    }
    if (version - n.applied_version() <= options_.max_staleness) continue;
    if (!HeadReachableLocked(n, head)) {
      // Its source restarted after announcing the head and holds no earlier
      // version: waiting could never end; the next version will reach it.
      spdlog::warn("sink {} at version {} lags, but version {} is held by no source or relay it pulls from (its "
                   "source restarted): version {} is not held back for it",
                   name, n.applied_version(), head, version);
      continue;
    }
    if (options_.policy == wsync::v1::STALENESS_EVICT) {
      Node updated = n;
      updated.set_resync_keyframe(true);
      Record r;
      *r.mutable_node_registered() = ToRecord(updated);
      WSYNC_RETURN_IF_ERROR(Log(r));
      resp.add_evicted(name);
      spdlog::warn("sink {} at version {} lags beyond max staleness {} for version {}: told to resync from a keyframe",
                   name, n.applied_version(), options_.max_staleness, version);
    } else {
      resp.add_blocking(name);
    }
  }
  resp.set_allowed(resp.blocking_size() == 0);
  return resp;
}

// Whether `sink` can get version `head`: walking up its parents, a sink
// holding it (a relay) or a source whose history holds it (every part's
// source, for versions of several sources). A node or a source's holdings
// not known (not heard from since this coordinator started or since it
// registered) count as holding it: as before this check.
void CoordinatorState::NoteSourceHoldsLocked(const std::string& source, uint64_t version) {
  auto [it, added] = source_heads_.emplace(source, version);
  if (!added) it->second = std::max(it->second, version);
}

bool CoordinatorState::HeadReachableLocked(const Node& sink, uint64_t head) const {
  const Node* n = &sink;
  for (size_t hops = 0; hops <= nodes_.size(); ++hops) {
    if (n->parent().empty()) return true;
    auto it = nodes_.find(n->parent());
    if (it == nodes_.end()) return true;
    const Node& p = it->second;
    if (p.role() == wsync::v1::ROLE_SOURCE) {
      auto holds = [&](const std::string& source) {
        auto held = source_heads_.find(source);
        return held == source_heads_.end() || held->second >= head;
      };
      if (layout_ && layout_->parts() > 1) {
        return std::all_of(layout_->part_sources().begin(), layout_->part_sources().end(), holds);
      }
      return holds(p.name());
    }
    if (p.applied_version() >= head) return true;
    n = &p;
  }
  return true;
}

// -------------------------------------------------------------- liveness

void CoordinatorState::Tick() {
  std::lock_guard<std::mutex> lock(mu_);
  ExpireLocked();
  if (tree_dirty_) {
    // Each pass gives the sinks that reached the head up to `fanout`
    // children each: a tree grows by that factor per pass.
    for (int pass = 0; pass < 16 && AssignParentsLocked(); ++pass) {
    }
    NotifyLocked();
  }
}

uint64_t CoordinatorState::AcknowledgedHeadLocked() const {
  return std::max(versions_.empty() ? 0 : versions_.rbegin()->first, version_floor_);
}

void CoordinatorState::WatchBroken(const std::string& name, uint64_t incarnation) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = nodes_.find(name);
  if (it == nodes_.end() || it->second.state() != wsync::v1::NODE_ALIVE || it->second.incarnation() != incarnation) {
    return;
  }
  it->second.set_state(wsync::v1::NODE_DISCONNECTED);
  spdlog::warn("node {}: its watch stream broke: disconnected (dead at its TTL unless it heartbeats)", Quoted(name));
  for (const auto& [child, n] : nodes_) {
    if (n.parent() == name) former_parent_[child] = name;
  }
  AssignParentsLocked();
  NotifyLocked();
}

void CoordinatorState::ExpireLocked() {
  const int64_t now = clock_->NowMs();
  bool changed = false;
  for (auto& [name, n] : nodes_) {
    if (n.state() != wsync::v1::NODE_DEAD && now - n.last_heartbeat_unix_ms() > static_cast<int64_t>(n.ttl_ms())) {
      n.set_state(wsync::v1::NODE_DEAD);
      changed = true;
      std::erase_if(former_parent_, [&](const auto& e) { return e.second == name; });
      spdlog::warn("node {} missed its TTL of {} ms: marked dead, its leases end", name, n.ttl_ms());
    }
  }
  std::vector<uint64_t> ended;
  for (const auto& [id, l] : leases_) {
    auto it = nodes_.find(l.node());
    const bool owner_dead = it == nodes_.end() || it->second.state() == wsync::v1::NODE_DEAD;
    if (owner_dead || now > l.expires_unix_ms()) ended.push_back(id);
  }
  for (uint64_t id : ended) {
    Record r;
    r.set_lease_released(id);
    Status s = store_->Append(r);
    if (!s.ok()) spdlog::warn("cannot log the end of lease {}: {}", id, s.ToString());
    Apply(r);
    changed = true;
  }
  if (changed) {
    AssignParentsLocked();
    NotifyLocked();
  }
}

// -------------------------------------------------------------- topology

bool CoordinatorState::IsDescendantLocked(const std::string& node, const std::string& ancestor) const {
  std::string cur = node;
  for (size_t hops = 0; hops <= nodes_.size(); ++hops) {
    auto it = nodes_.find(cur);
    if (it == nodes_.end() || it->second.parent().empty()) return false;
    if (it->second.parent() == ancestor) return true;
    cur = it->second.parent();
  }
  return true;  // a cycle: treat as descendant, never attach
}

void CoordinatorState::GiveBackChildrenLocked(const std::string& parent) {
  const Node& p = nodes_.at(parent);
  const uint64_t head = versions_.empty() ? 0 : versions_.rbegin()->first;
  size_t kids = 0;
  for (const auto& [name, n] : nodes_) kids += n.parent() == parent;
  for (auto it = former_parent_.begin(); it != former_parent_.end();) {
    if (it->second != parent) {
      ++it;
      continue;
    }
    auto child = nodes_.find(it->first);
    const bool back = child != nodes_.end() && child->second.state() == wsync::v1::NODE_ALIVE && kids < options_.fanout &&
                      p.role() == wsync::v1::ROLE_SINK && p.applied_version() == head && !p.holds_pieces() &&
                      !p.parent().empty() && !AvoidsLocked(it->first, parent) &&
                      !IsDescendantLocked(parent, it->first) && [&] {
                        auto now = nodes_.find(child->second.parent());
                        return now != nodes_.end() && now->second.role() == wsync::v1::ROLE_SOURCE;
                      }();
    if (back) {
      child->second.set_parent(parent);
      ++kids;
      spdlog::info("sink {} given back to {}", Quoted(it->first), Quoted(parent));
    }
    it = former_parent_.erase(it);
  }
}

bool CoordinatorState::AvoidsLocked(const std::string& child, const std::string& parent) const {
  auto it = avoid_.find(child);
  return it != avoid_.end() && it->second.first == parent && clock_->NowMs() < it->second.second;
}

bool CoordinatorState::AssignParentsLocked() {
  tree_dirty_ = false;
  bool moved = false;
  const uint64_t head = versions_.empty() ? 0 : versions_.rbegin()->first;
  std::string source;
  for (const auto& [name, n] : nodes_) {
    if (n.role() == wsync::v1::ROLE_SOURCE && n.state() == wsync::v1::NODE_ALIVE) {
      source = name;
      break;
    }
  }
  auto is_live_sink = [](const Node& n) {
    return n.role() == wsync::v1::ROLE_SINK && n.state() == wsync::v1::NODE_ALIVE;
  };
  // 1. Drop parents that are gone; count children.
  std::map<std::string, std::vector<std::string>> children;
  for (auto& [name, n] : nodes_) {
    if (n.role() != wsync::v1::ROLE_SINK) continue;
    auto p = nodes_.find(n.parent());
    if (!is_live_sink(n) || p == nodes_.end() || p->second.state() != wsync::v1::NODE_ALIVE ||
        p->second.holds_pieces() || AvoidsLocked(name, n.parent())) {
      if (is_live_sink(n) && !n.parent().empty()) spdlog::info("sink {} lost its parent {}", name, n.parent());
      n.set_parent("");
    } else {
      children[n.parent()].push_back(name);
    }
  }
  // Parents: the source, then rooted sinks at the head version.
  auto candidates = [&] {
    std::vector<std::string> out;
    if (!source.empty()) out.push_back(source);
    for (const auto& [name, c] : nodes_) {
      if (is_live_sink(c) && head != 0 && c.applied_version() == head && !c.resync_keyframe() && !c.parent().empty() &&
          !c.holds_pieces()) {
        out.push_back(name);
      }
    }
    return out;
  };
  // 2. Rebalance: a parent above the fan-out (it took children while no
  // sink was at head) gives its excess to parents with room.
  {
    const auto cands = candidates();
    for (auto& [parent, kids] : children) {
      if (kids.size() <= options_.fanout) continue;
      size_t room = 0;
      for (const auto& c : cands) {
        if (c != parent && children[c].size() < options_.fanout) room += options_.fanout - children[c].size();
      }
      size_t excess = std::min(kids.size() - options_.fanout, room);
      // Move leaves (children that are not parents themselves) first.
      std::stable_sort(kids.begin(), kids.end(),
                       [&](const std::string& a, const std::string& b) { return children[a].size() < children[b].size(); });
      while (excess > 0 && kids.size() > options_.fanout) {
        nodes_[kids.back()].set_parent("");
        moved = true;
        kids.pop_back();
        --excess;
      }
    }
  }
  // 3. Attach orphans to the first parent with room, else the least loaded.
  const auto cands = candidates();
  for (auto& [name, n] : nodes_) {
    if (!is_live_sink(n) || !n.parent().empty()) continue;
    std::string chosen, least_loaded, avoided;
    size_t least = std::numeric_limits<size_t>::max();
    for (const auto& c : cands) {
      if (c == name || IsDescendantLocked(c, name)) continue;
      if (AvoidsLocked(name, c)) {
        avoided = c;  // only if nothing else holds the version
        continue;
      }
      const size_t load = children[c].size();
      if (load < options_.fanout) {
        chosen = c;
        break;
      }
      if (load < least) {
        least = load;
        least_loaded = c;
      }
    }
    if (chosen.empty()) chosen = least_loaded;
    if (chosen.empty()) chosen = avoided;
    if (chosen.empty()) continue;
    n.set_parent(chosen);
    moved = true;
    children[chosen].push_back(name);
    spdlog::debug("sink {} assigned parent {}", name, chosen);
  }
  return moved;
}

// ---------------------------------------------------------------- status

void CoordinatorState::FillDerivedLocked(Node* n) const {
  const uint64_t head = versions_.empty() ? 0 : versions_.rbegin()->first;
  n->set_staleness(n->role() == wsync::v1::ROLE_SINK ? head - std::min(head, n->applied_version()) : 0);
}

wsync::v1::StatusResponse CoordinatorState::GetStatus() const {
  std::lock_guard<std::mutex> lock(mu_);
  wsync::v1::StatusResponse resp;
  const uint64_t head = versions_.empty() ? 0 : versions_.rbegin()->first;
  resp.set_head_version(head);
  resp.set_max_staleness(options_.max_staleness);
  resp.set_policy(options_.policy);
  uint64_t needed = OldestLeasedLocked();
  for (const auto& [name, n] : nodes_) {
    Node* out = resp.add_nodes();
    *out = n;
    FillDerivedLocked(out);
    // A disconnected sink may be back in a moment: keep what it needs until its TTL.
    if (n.role() == wsync::v1::ROLE_SINK && n.state() != wsync::v1::NODE_DEAD && n.applied_version() != 0) {
      needed = needed == 0 ? n.applied_version() : std::min(needed, n.applied_version());
    }
  }
  for (const auto& [id, l] : leases_) *resp.add_leases() = l;
  resp.set_oldest_leased_version(OldestLeasedLocked());
  resp.set_oldest_needed_version(needed);
  resp.set_now_unix_ms(clock_->NowMs());
  return resp;
}

uint64_t CoordinatorState::head() const {
  std::lock_guard<std::mutex> lock(mu_);
  return versions_.empty() ? 0 : versions_.rbegin()->first;
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
    const uint64_t gen = generation();
    const wsync::v1::ListVersionsResponse pending = ListVersions(after);
    for (const auto& v : pending.versions()) {
      if (!on_version(v)) return true;
      after = v.version();
    }
    if (stop()) break;
    WaitForChange(gen, std::chrono::steady_clock::now() + std::chrono::milliseconds(200));
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

}  // namespace wsync::control
