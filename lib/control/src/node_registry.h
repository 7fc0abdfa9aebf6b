// The coordinator's registered nodes (internal to wsync::control): each
// node's durable fields, as its node_registered records carry them, and
// what is kept beside them in memory only: its state (alive, disconnected,
// dead), its last heartbeat and what that heartbeat reported, and its parent
// in the relay tree (RelayTree sets it; every reply carries it).
//
// Thread safety: not thread-safe. REQUIRES for every method: the
// coordinator's mutex held (a test using it alone: one thread).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "wsync/v1/coordinator.pb.h"
#include "wsync/v1/store.pb.h"

namespace wsync::control {

// Nodes by name.
using NodeMap = std::map<std::string, wsync::v1::Node>;

class NodeRegistry {
 public:
  // The durable fields of `n`, as the log and the snapshot hold them.
  static wsync::store::v1::NodeRecord ToRecord(const wsync::v1::Node& n);

  // Applies a node_registered record: adds the node, or replaces the durable
  // fields of the one of that name (the rest is kept). Incarnations handed
  // out later are above the record's.
  void Apply(const wsync::store::v1::NodeRecord& record);
  // Applies a node_deregistered record.
  void Erase(const std::string& name);

  // The record that registers `req` as a new incarnation of `req.name()`
  // with a TTL of `ttl_ms`. A node registered before under that name keeps
  // its applied version and its resync flag. REQUIRES: `req` validated.
  wsync::store::v1::NodeRecord Registration(const wsync::v1::RegisterRequest& req, uint64_t ttl_ms) const;

  // The live node whose current incarnation `req` (by its name and its
  // non-empty request_id) registered: `req` is a retry of that call. Else
  // nullptr.
  const wsync::v1::Node* RegisteredBy(const wsync::v1::RegisterRequest& req) const;

  // The node, or nullptr when none has that name. Pointers stay valid until
  // that node is erased.
  wsync::v1::Node* Find(const std::string& name);
  // The node, or nullptr when none has that name or it is dead (expired).
  wsync::v1::Node* FindLive(const std::string& name);

  // Marks dead every node not dead whose TTL passed at `now` (unix ms)
  // since its last heartbeat; returns their names. O(expired nodes): the
  // nodes are kept ordered by when their TTL ends.
  std::vector<std::string> Expire(int64_t now);
  // The node `name` was heard from at `now` (unix ms) and is asked for its
  // next heartbeat within `interval_ms` (0: a quarter of its TTL): it is
  // dead once its TTL, or four of those intervals if longer, pass from
  // then. REQUIRES: the node exists and is not dead.
  void Touch(const std::string& name, int64_t now, uint64_t interval_ms);
  // The node `name` of incarnation `incarnation`, if alive, is now
  // disconnected (its watch stream broke); true then. False, changing
  // nothing, when no such node is alive.
  bool Disconnect(const std::string& name, uint64_t incarnation);
  // After recovery from the store: every node alive and last heard from at
  // `now` (heartbeats are not durable), as if asked for heartbeats every
  // `interval_of(node)` ms (none: a quarter of its TTL).
  void GraceAll(int64_t now, const std::function<uint64_t(const wsync::v1::Node&)>& interval_of = {});

  // Every node: the relay tree sets parents, the staleness policy reads them.
  NodeMap& nodes() { return nodes_; }
  const NodeMap& nodes() const { return nodes_; }

  // Writes the nodes and the next incarnation into `snapshot`; LoadFrom
  // applies what SaveTo wrote (the durable fields only).
  void SaveTo(wsync::store::v1::Snapshot* snapshot) const;
  void LoadFrom(const wsync::store::v1::Snapshot& snapshot);

 private:
  // Files the node `name` (if it exists and is not dead) under the time its
  // TTL ends, or takes it out of the order.
  void Reindex(const std::string& name);

  NodeMap nodes_;
  uint64_t next_incarnation_ = 1;
  // The nodes not dead, by the unix ms after which they expire.
  std::set<std::pair<int64_t, std::string>> by_deadline_;
  std::unordered_map<std::string, int64_t> deadline_;
};

}  // namespace wsync::control
