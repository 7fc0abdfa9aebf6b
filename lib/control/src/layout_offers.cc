#include "wsync/control/layout_offers.h"

#include <algorithm>
#include <set>

namespace wsync::control {

StatusOr<uint32_t> LayoutOffers::Offer(const std::string& node, const wsync::v1::ServedLayout& layout) {
  if (node.empty()) return InvalidArgumentError("a layout is offered by a node: the name is empty");
  if (layout.tensors_size() == 0) return InvalidArgumentError("the layout offered by " + node + " has no tensor");
  for (const auto& t : layout.tensors()) {
    if (t.name().empty() || t.shape_size() == 0) {
      return InvalidArgumentError("the layout offered by " + node + " has a tensor without a name or shape");
    }
  }
  std::string key;
  if (!layout.SerializeToString(&key)) return InvalidArgumentError("the layout offered by " + node + " cannot be kept");
  std::lock_guard<std::mutex> lock(mu_);
  by_node_[node] = key;
  first_offered_.emplace(key, offers_++);
  // Layouts no node offers any more go.
  std::set<std::string> live;
  for (const auto& [n, k] : by_node_) live.insert(k);
  std::erase_if(first_offered_, [&](const auto& e) { return !live.count(e.first); });
  return static_cast<uint32_t>(live.size());
}

void LayoutOffers::Forget(const std::string& node) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = by_node_.find(node);
  if (it == by_node_.end()) return;
  const std::string key = it->second;
  by_node_.erase(it);
  if (std::none_of(by_node_.begin(), by_node_.end(), [&](const auto& e) { return e.second == key; })) {
    first_offered_.erase(key);
  }
}

std::vector<wsync::v1::ServedLayout> LayoutOffers::List() const {
  std::vector<std::pair<uint64_t, const std::string*>> order;
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [key, n] : first_offered_) order.emplace_back(n, &key);
  std::sort(order.begin(), order.end());
  std::vector<wsync::v1::ServedLayout> out(order.size());
  for (size_t i = 0; i < order.size(); ++i) out[i].ParseFromString(*order[i].second);
  return out;
}

}  // namespace wsync::control
