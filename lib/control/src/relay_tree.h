// The coordinator's relay tree (internal to wsync::control): which node each
// live sink pulls from. The parents are kept on the nodes (Node.parent, in a
// NodeRegistry's NodeMap); this holds the soft state that steers them: the
// parents sinks reported unreachable (avoided for a while) and the children
// a parent lost when its watch broke (given back if it returns). Nothing here
// is durable.
//
// The tree: the source, then sinks that hold the head and are rooted (have a
// parent themselves, or read an object store) and hold whole tensors, take
// up to `fanout` children each; a sink is never below itself.
//
// Thread safety: not thread-safe. REQUIRES for every method: the
// coordinator's mutex held (a test using it alone: one thread).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>

#include "node_registry.h"
#include "wsync/control/clock.h"

namespace wsync::control {

class RelayTree {
 public:
  // REQUIRES: `clock` outlives this; fanout >= 1. A parent a sink reported
  // unreachable is avoided for it for `avoid_ms`.
  RelayTree(const Clock* clock, uint32_t fanout, uint64_t avoid_ms)
      : clock_(clock), fanout_(fanout), avoid_ms_(avoid_ms) {}

  // One pass over `nodes` (at head version `head`): sinks drop parents that
  // are gone, not alive, hold pieces or are avoided; a parent above the
  // fan-out gives its excess to parents with room; orphans get the first
  // parent with room, else the least loaded, else one they avoid (none when
  // they read a store). Returns
  // whether a sink was moved or attached (the next pass may attach more).
  // Clears dirty().
  bool AssignParents(NodeMap& nodes, uint64_t head);
  // The tree wants a pass.
  void MarkDirty() { dirty_ = true; }
  // A sink's applied version changed: a pass only when the last one left
  // work a new holder of the head could take (an orphan, a parent above
  // the fan-out); a settled tree of a large fleet is not redone at every
  // report.
  void MarkCandidatesChanged() {
    if (!settled_) dirty_ = true;
  }
  bool dirty() const { return dirty_; }

  // `child` cannot reach `parent`: avoided for it from now for avoid_ms.
  void Avoid(const std::string& child, const std::string& parent);
  // Whether `child` avoids `parent` now.
  bool Avoids(const std::string& child, const std::string& parent) const;

  // A new process registered as `name`: it serves nothing yet, so its
  // children lose it; nobody avoids it, nothing is given back to it.
  // O(nodes).
  void Restarted(NodeMap& nodes, const std::string& name);
  // A name not in the nodes registered (a fleet joining): it has no
  // children; nobody avoids it, nothing is given back to it. O(avoided).
  void Joined(const std::string& name);
  // `name`'s watch broke: the children it has now are given back if it
  // returns (GiveBackChildren).
  void Disconnected(const NodeMap& nodes, const std::string& name);
  // `name` died: nothing is given back to it.
  void Died(const std::string& name);
  // `parent` heartbeats again: the children it lost when its watch broke
  // come back to it while they are alive and on a source, it holds the head
  // (`head`) whole, is rooted and has room. REQUIRES: `parent` in `nodes`.
  void GiveBackChildren(NodeMap& nodes, const std::string& parent, uint64_t head);

  // Whether a sink gets versions other than through its children: it has a
  // parent, or reads an object store.
  static bool Rooted(const wsync::v1::Node& n) { return !n.parent().empty() || n.reads_store(); }
  // Whether `ancestor` is above `node` (true on a cycle: never attach there).
  static bool IsDescendant(const NodeMap& nodes, const std::string& node, const std::string& ancestor);
  // Whether `sink` can get version `head` walking up its parents: a sink
  // that applied it (a relay), or a source for which `source_holds_head`
  // says so. A parent not known counts as holding it.
  static bool HeadReachable(const NodeMap& nodes, const wsync::v1::Node& sink, uint64_t head,
                            const std::function<bool(const wsync::v1::Node& source)>& source_holds_head);

 private:
  const Clock* clock_;
  const uint32_t fanout_;
  const uint64_t avoid_ms_;
  bool dirty_ = false;
  bool settled_ = false;  // the last pass left every live sink a parent and none above the fan-out
  // Sinks -> (a parent their pulls could not reach, until when it is
  // avoided for them, unix ms).
  std::map<std::string, std::pair<std::string, int64_t>> avoid_;
  // Sinks -> the parent they lost when its watch stream broke.
  std::map<std::string, std::string> former_parent_;
};

}  // namespace wsync::control
