// The runtime layouts sinks offer (OfferLayout): an inference engine's rank,
// its tensors as pieces of the published ones, derived by the engine's own
// loader. Sources registered with serve_offered_layouts code tile grids that
// hold every layout offered. Soft state, one layout per node: a node's new
// offer replaces its last, and a deregistered node's goes.
//
// Thread safety: every method may be called from many threads.
#pragma once

#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "wsync/util/status.h"
#include "wsync/v1/coordinator.pb.h"

namespace wsync::control {

class LayoutOffers {
 public:
  // Records `node`'s layout. InvalidArgument when it has no tensor or a
  // tensor without pieces and shape. Returns the number of distinct layouts
  // offered now.
  StatusOr<uint32_t> Offer(const std::string& node, const wsync::v1::ServedLayout& layout);
  void Forget(const std::string& node);
  // Every distinct layout offered, each once, in the order first offered.
  std::vector<wsync::v1::ServedLayout> List() const;

 private:
  mutable std::mutex mu_;
  std::map<std::string, std::string> by_node_;  // node -> the layout, serialized
  std::map<std::string, uint64_t> first_offered_;  // serialized layout -> order of its first offer
  uint64_t offers_ = 0;
};

}  // namespace wsync::control
