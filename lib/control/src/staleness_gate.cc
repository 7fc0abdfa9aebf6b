#include "staleness_gate.h"

#include <spdlog/spdlog.h>

namespace wsync::control {

using wsync::store::v1::Record;
using wsync::v1::Node;

StatusOr<wsync::v1::MayPublishResponse> StalenessGate::MayPublish(
    uint64_t version, uint64_t head, const NodeMap& nodes,
    const std::function<bool(const Node& sink)>& head_reachable, const RecordLog& log) const {
  if (version <= head) {
    return StaleVersionError(version, head);
  }
  wsync::v1::MayPublishResponse resp;
  resp.set_allowed(true);
  if (max_staleness_ == 0) return resp;
  for (const auto& [name, n] : nodes) {
    // Sinks that never applied a version are not serving yet: they hold
    // nothing back (they start from a keyframe).
    if (n.role() != wsync::v1::ROLE_SINK || n.state() != wsync::v1::NODE_ALIVE || n.applied_version() == 0 ||
        n.resync_keyframe()) {
      continue;
    }
    if (Tolerates(version - n.applied_version())) continue;
    if (!head_reachable(n)) {
      // Its source restarted after announcing the head and holds no earlier
      // version: waiting could never end; the next version will reach it.
      spdlog::warn("sink {} at version {} lags, but version {} is held by no source or relay it pulls from (its "
                   "source restarted): version {} is not held back for it",
                   name, n.applied_version(), head, version);
      continue;
    }
    if (policy_ == wsync::v1::STALENESS_EVICT) {
      Node updated = n;
      updated.set_resync_keyframe(true);
      Record r;
      *r.mutable_node_registered() = NodeRegistry::ToRecord(updated);
      WSYNC_RETURN_IF_ERROR(log(r));
      resp.add_evicted(name);
      spdlog::warn("sink {} at version {} lags beyond max staleness {} for version {}: told to resync from a keyframe",
                   name, n.applied_version(), max_staleness_, version);
    } else {
      resp.add_blocking(name);
    }
  }
  resp.set_allowed(resp.blocking_size() == 0);
  return resp;
}

}  // namespace wsync::control
