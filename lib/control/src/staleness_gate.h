// The coordinator's staleness policy (internal to wsync::control): how far
// a live sink may lag behind a version about to be published, and what
// happens to one beyond that (it blocks the publish, or it is told to
// resync from a keyframe).
//
// Thread safety: not thread-safe. REQUIRES for every method: the
// coordinator's mutex held (a test using it alone: one thread).
#pragma once

#include <cstdint>
#include <functional>

#include "node_registry.h"
#include "record_log.h"
#include "wsync/util/status.h"
#include "wsync/v1/coordinator.pb.h"

namespace wsync::control {

class StalenessGate {
 public:
  // `max_staleness` 0: no bound.
  StalenessGate(uint64_t max_staleness, wsync::v1::StalenessPolicy policy)
      : max_staleness_(max_staleness), policy_(policy) {}

  // Whether a sink `lag` versions behind is within the bound.
  bool Tolerates(uint64_t lag) const { return max_staleness_ == 0 || lag <= max_staleness_; }

  // CoordinatorState::MayPublish for `version` at head version `head`,
  // over `nodes`. Alive sinks that applied a version and lag beyond the
  // bound block it, or with the evict policy are marked to resync from a
  // keyframe through `log` (node_registered records); a sink for which
  // `head_reachable` is false (no parent of it holds `head`) is let be.
  StatusOr<wsync::v1::MayPublishResponse> MayPublish(uint64_t version, uint64_t head, const NodeMap& nodes,
                                                     const std::function<bool(const wsync::v1::Node& sink)>& head_reachable,
                                                     const RecordLog& log) const;

 private:
  const uint64_t max_staleness_;
  const wsync::v1::StalenessPolicy policy_;
};

}  // namespace wsync::control
