#include "node_registry.h"

#include <algorithm>

#include <spdlog/spdlog.h>

#include "wsync/util/text.h"

namespace wsync::control {

using wsync::store::v1::NodeRecord;
using wsync::v1::Node;

namespace {

// How long node `n` may go without a heartbeat: its TTL, or four of the
// periods it was asked to heartbeat at, if longer (a paced fleet).
uint64_t SilenceMs(const Node& n) { return std::max(n.ttl_ms(), 4 * n.heartbeat_interval_ms()); }

// Copies the durable fields (NodeRecord's) between a Node and a NodeRecord,
// either way: the one list of what the log keeps of a node.
template <typename From, typename To>
void CopyDurableFields(const From& from, To* to) {
  to->set_name(from.name());
  to->set_role(from.role());
  to->set_host(from.host());
  to->set_data_address(from.data_address());
  to->mutable_capabilities()->CopyFrom(from.capabilities());
  to->set_ttl_ms(from.ttl_ms());
  to->set_incarnation(from.incarnation());
  to->set_applied_version(from.applied_version());
  to->set_resync_keyframe(from.resync_keyframe());
  to->set_register_request_id(from.register_request_id());
}

}  // namespace

NodeRecord NodeRegistry::ToRecord(const Node& n) {
  NodeRecord nr;
  CopyDurableFields(n, &nr);
  return nr;
}

void NodeRegistry::Apply(const NodeRecord& record) {
  CopyDurableFields(record, &nodes_[record.name()]);
  next_incarnation_ = std::max(next_incarnation_, record.incarnation() + 1);
  Reindex(record.name());  // its TTL may have changed
}

void NodeRegistry::Erase(const std::string& name) {
  nodes_.erase(name);
  Reindex(name);
}

void NodeRegistry::Reindex(const std::string& name) {
  const Node* n = Find(name);
  const bool filed = n != nullptr && n->state() != wsync::v1::NODE_DEAD;
  const int64_t deadline = filed ? n->last_heartbeat_unix_ms() + static_cast<int64_t>(SilenceMs(*n)) : 0;
  auto it = deadline_.find(name);
  if (it != deadline_.end()) {
    if (filed && it->second == deadline) return;  // a report: the TTL did not move
    by_deadline_.erase({it->second, name});
    deadline_.erase(it);
  }
  if (!filed) return;
  by_deadline_.insert({deadline, name});
  deadline_[name] = deadline;
}

void NodeRegistry::Touch(const std::string& name, int64_t now, uint64_t interval_ms) {
  Node* n = Find(name);
  if (n == nullptr) return;
  n->set_last_heartbeat_unix_ms(now);
  n->set_heartbeat_interval_ms(interval_ms);
  Reindex(name);
}

NodeRecord NodeRegistry::Registration(const wsync::v1::RegisterRequest& req, uint64_t ttl_ms) const {
  NodeRecord nr;
  if (auto it = nodes_.find(req.name()); it != nodes_.end()) nr = ToRecord(it->second);
  nr.set_name(req.name());
  nr.set_role(req.role());
  nr.set_host(req.host());
  nr.set_data_address(req.data_address());
  nr.mutable_capabilities()->CopyFrom(req.capabilities());
  nr.set_ttl_ms(ttl_ms);
  nr.set_incarnation(next_incarnation_);
  nr.set_register_request_id(req.request_id());
  return nr;
}

const Node* NodeRegistry::RegisteredBy(const wsync::v1::RegisterRequest& req) const {
  if (req.request_id().empty()) return nullptr;
  auto it = nodes_.find(req.name());
  if (it == nodes_.end() || it->second.state() == wsync::v1::NODE_DEAD) return nullptr;
  return it->second.register_request_id() == req.request_id() ? &it->second : nullptr;
}

Node* NodeRegistry::Find(const std::string& name) {
  auto it = nodes_.find(name);
  return it == nodes_.end() ? nullptr : &it->second;
}

Node* NodeRegistry::FindLive(const std::string& name) {
  Node* n = Find(name);
  return n == nullptr || n->state() == wsync::v1::NODE_DEAD ? nullptr : n;
}

std::vector<std::string> NodeRegistry::Expire(int64_t now) {
  std::vector<std::string> dead;
  while (!by_deadline_.empty() && by_deadline_.begin()->first < now) {
    const std::string name = by_deadline_.begin()->second;
    by_deadline_.erase(by_deadline_.begin());
    deadline_.erase(name);
    Node& n = nodes_.at(name);  // the order holds only nodes that exist
    n.set_state(wsync::v1::NODE_DEAD);
    dead.push_back(name);
    if (SilenceMs(n) > n.ttl_ms()) {
      spdlog::warn("node {} missed four heartbeats at the fleet's pace ({} ms each): marked dead, its leases end",
                   name, n.heartbeat_interval_ms());
    } else {
      spdlog::warn("node {} missed its TTL of {} ms: marked dead, its leases end", name, n.ttl_ms());
    }
  }
  return dead;
}

bool NodeRegistry::Disconnect(const std::string& name, uint64_t incarnation) {
  Node* n = Find(name);
  if (n == nullptr || n->state() != wsync::v1::NODE_ALIVE || n->incarnation() != incarnation) return false;
  n->set_state(wsync::v1::NODE_DISCONNECTED);
  spdlog::warn("node {}: its watch stream broke: disconnected (dead at its TTL unless it heartbeats)", Quoted(name));
  return true;
}

void NodeRegistry::GraceAll(int64_t now, const std::function<uint64_t(const Node&)>& interval_of) {
  for (auto& [name, n] : nodes_) {
    n.set_state(wsync::v1::NODE_ALIVE);
    n.set_last_heartbeat_unix_ms(now);
    n.set_heartbeat_interval_ms(interval_of ? interval_of(n) : 0);
    Reindex(name);
  }
}

void NodeRegistry::SaveTo(wsync::store::v1::Snapshot* snapshot) const {
  for (const auto& [name, n] : nodes_) *snapshot->add_nodes() = ToRecord(n);
  snapshot->set_next_incarnation(next_incarnation_);
}

void NodeRegistry::LoadFrom(const wsync::store::v1::Snapshot& snapshot) {
  for (const auto& n : snapshot.nodes()) Apply(n);
  next_incarnation_ = std::max(next_incarnation_, snapshot.next_incarnation());
}

}  // namespace wsync::control
