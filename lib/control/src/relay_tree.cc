#include "relay_tree.h"

#include <algorithm>
#include <limits>
#include <vector>

#include <spdlog/spdlog.h>

#include "wsync/util/text.h"

namespace wsync::control {

using wsync::v1::Node;

void RelayTree::Avoid(const std::string& child, const std::string& parent) {
  avoid_[child] = {parent, clock_->NowMs() + static_cast<int64_t>(avoid_ms_)};
}

bool RelayTree::Avoids(const std::string& child, const std::string& parent) const {
  auto it = avoid_.find(child);
  return it != avoid_.end() && it->second.first == parent && clock_->NowMs() < it->second.second;
}

void RelayTree::Restarted(NodeMap& nodes, const std::string& name) {
  for (auto& [child, n] : nodes) {
    if (n.parent() == name) n.set_parent("");
  }
  Joined(name);
}

void RelayTree::Joined(const std::string& name) {
  std::erase_if(avoid_, [&](const auto& e) { return e.second.first == name; });
  std::erase_if(former_parent_, [&](const auto& e) { return e.second == name; });
}

void RelayTree::Disconnected(const NodeMap& nodes, const std::string& name) {
  for (const auto& [child, n] : nodes) {
    if (n.parent() == name) former_parent_[child] = name;
  }
}

void RelayTree::Died(const std::string& name) {
  std::erase_if(former_parent_, [&](const auto& e) { return e.second == name; });
}

bool RelayTree::IsDescendant(const NodeMap& nodes, const std::string& node, const std::string& ancestor) {
  std::string cur = node;
  for (size_t hops = 0; hops <= nodes.size(); ++hops) {
    auto it = nodes.find(cur);
    if (it == nodes.end() || it->second.parent().empty()) return false;
    if (it->second.parent() == ancestor) return true;
    cur = it->second.parent();
  }
  return true;  // a cycle: treat as descendant, never attach
}

void RelayTree::GiveBackChildren(NodeMap& nodes, const std::string& parent, uint64_t head) {
  const Node& p = nodes.at(parent);
  size_t kids = 0;
  for (const auto& [name, n] : nodes) kids += n.parent() == parent;
  for (auto it = former_parent_.begin(); it != former_parent_.end();) {
    if (it->second != parent) {
      ++it;
      continue;
    }
    auto child = nodes.find(it->first);
    const bool back = child != nodes.end() && child->second.state() == wsync::v1::NODE_ALIVE && kids < fanout_ &&
                      p.role() == wsync::v1::ROLE_SINK && p.applied_version() == head && !p.holds_pieces() &&
                      Rooted(p) && !Avoids(it->first, parent) &&
                      !IsDescendant(nodes, parent, it->first) && [&] {
                        auto now = nodes.find(child->second.parent());
                        return now != nodes.end() && now->second.role() == wsync::v1::ROLE_SOURCE;
                      }();
    if (back) {
      child->second.set_parent(parent);
      ++kids;
      spdlog::info("sink {} given back to {}", Quoted(it->first), Quoted(parent));
    }
    it = former_parent_.erase(it);
  }
}

bool RelayTree::HeadReachable(const NodeMap& nodes, const Node& sink, uint64_t head,
                              const std::function<bool(const Node& source)>& source_holds_head) {
  const Node* n = &sink;
  for (size_t hops = 0; hops <= nodes.size(); ++hops) {
    if (n->parent().empty()) return true;
    auto it = nodes.find(n->parent());
    if (it == nodes.end()) return true;
    const Node& p = it->second;
    if (p.role() == wsync::v1::ROLE_SOURCE) return source_holds_head(p);
    if (p.applied_version() >= head) return true;
    n = &p;
  }
  return true;
}

bool RelayTree::AssignParents(NodeMap& nodes, uint64_t head) {
  dirty_ = false;
  settled_ = true;
  bool moved = false;
  std::string source;
  for (const auto& [name, n] : nodes) {
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
  for (auto& [name, n] : nodes) {
    if (n.role() != wsync::v1::ROLE_SINK) continue;
    auto p = nodes.find(n.parent());
    if (!is_live_sink(n) || p == nodes.end() || p->second.state() != wsync::v1::NODE_ALIVE ||
        p->second.holds_pieces() || Avoids(name, n.parent())) {
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
    for (const auto& [name, c] : nodes) {
      if (is_live_sink(c) && head != 0 && c.applied_version() == head && !c.resync_keyframe() && Rooted(c) &&
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
      if (kids.size() <= fanout_) continue;
      size_t room = 0;
      for (const auto& c : cands) {
        if (c != parent && children[c].size() < fanout_) room += fanout_ - children[c].size();
      }
      size_t excess = std::min(kids.size() - fanout_, room);
      // Move leaves (children that are not parents themselves) first.
      std::stable_sort(kids.begin(), kids.end(),
                       [&](const std::string& a, const std::string& b) { return children[a].size() < children[b].size(); });
      while (excess > 0 && kids.size() > fanout_) {
        nodes[kids.back()].set_parent("");
        moved = true;
        kids.pop_back();
        --excess;
      }
    }
  }
  // 3. Attach orphans to the first parent with room, else the least loaded.
  const auto cands = candidates();
  for (auto& [name, n] : nodes) {
    if (!is_live_sink(n) || !n.parent().empty()) continue;
    std::string chosen, least_loaded, avoided;
    size_t least = std::numeric_limits<size_t>::max();
    for (const auto& c : cands) {
      if (c == name || IsDescendant(nodes, c, name)) continue;
      if (Avoids(name, c)) {
        avoided = c;  // only if nothing else holds the version
        continue;
      }
      const size_t load = children[c].size();
      if (load < fanout_) {
        chosen = c;
        break;
      }
      if (load < least) {
        least = load;
        least_loaded = c;
      }
    }
    if (chosen.empty()) chosen = least_loaded;
    // Nothing else holds the version: the avoided parent again, unless the
    // sink reads a store (it reads the store until the avoidance ends).
    if (chosen.empty() && !n.reads_store()) chosen = avoided;
    if (chosen.empty()) {
      settled_ = false;
      continue;
    }
    n.set_parent(chosen);
    moved = true;
    children[chosen].push_back(name);
    spdlog::debug("sink {} assigned parent {}", name, chosen);
  }
  for (const auto& [parent, kids] : children) {
    if (kids.size() > fanout_) settled_ = false;
  }
  return moved;
}

}  // namespace wsync::control
