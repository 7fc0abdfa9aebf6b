// The coordinator's components, each alone (no gRPC, no Store): nodes and
// liveness, versions, leases, the layout, the relay tree and the staleness
// gate. Their mutations go to a RecordLog that applies them back, as
// CoordinatorState's Log does.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "layout_registry.h"
#include "lease_table.h"
#include "node_registry.h"
#include "relay_tree.h"
#include "staleness_gate.h"
#include "version_log.h"
#include "wsync/control/testing/fake_clock.h"

namespace wsync::control {
namespace {

using wsync::store::v1::NodeRecord;
using wsync::store::v1::Record;
using wsync::store::v1::Snapshot;
using wsync::v1::Node;

// A RecordLog that applies each record with `apply` and keeps it, or refuses
// every record (a store that fails) while `fail` is set.
struct TestLog {
  std::vector<Record> logged;
  bool fail = false;

  RecordLog To(std::function<void(const Record&)> apply) {
    return [this, apply](const Record& r) -> Status {
      if (fail) return UnavailableError("the store refuses");
      logged.push_back(r);
      apply(r);
      return Status::Ok();
    };
  }
};

NodeRecord Registered(const std::string& name, wsync::v1::Role role, uint64_t incarnation, uint64_t applied = 0,
                      uint64_t ttl_ms = 1000) {
  NodeRecord r;
  r.set_name(name);
  r.set_role(role);
  r.set_incarnation(incarnation);
  r.set_applied_version(applied);
  r.set_ttl_ms(ttl_ms);
  return r;
}

// ---- NodeRegistry

TEST(CoordinatorComponents, NodeRegistryReRegistrationKeepsTheAppliedVersionUnderANewIncarnation) {
  NodeRegistry nodes;
  wsync::v1::RegisterRequest req;
  req.set_name("sink");
  req.set_role(wsync::v1::ROLE_SINK);
  req.set_host("host-a");
  const NodeRecord first = nodes.Registration(req, 1000);
  EXPECT_EQ(first.incarnation(), 1u);
  nodes.Apply(first);
  NodeRecord applied = NodeRegistry::ToRecord(*nodes.Find("sink"));
  applied.set_applied_version(7);
  applied.set_resync_keyframe(true);
  nodes.Apply(applied);
  nodes.Find("sink")->set_parent("src");  // not durable: kept by Apply

  req.set_host("host-b");
  const NodeRecord second = nodes.Registration(req, 2000);
  EXPECT_EQ(second.incarnation(), 2u);
  EXPECT_EQ(second.applied_version(), 7u);
  EXPECT_TRUE(second.resync_keyframe());
  EXPECT_EQ(second.host(), "host-b");
  EXPECT_EQ(second.ttl_ms(), 2000u);
  nodes.Apply(second);
  EXPECT_EQ(nodes.Find("sink")->parent(), "src");
  EXPECT_EQ(nodes.Find("sink")->incarnation(), 2u);
}

TEST(CoordinatorComponents, NodeRegistrySnapshotHoldsTheDurableFieldsAndTheNextIncarnation) {
  NodeRegistry nodes;
  nodes.Apply(Registered("a", wsync::v1::ROLE_SINK, 5, 3));
  nodes.GraceAll(1234);
  Snapshot snap;
  nodes.SaveTo(&snap);
  ASSERT_EQ(snap.nodes_size(), 1);
  EXPECT_EQ(snap.next_incarnation(), 6u);
  EXPECT_EQ(snap.nodes(0).SerializeAsString(), Registered("a", wsync::v1::ROLE_SINK, 5, 3).SerializeAsString());

  NodeRegistry loaded;
  loaded.LoadFrom(snap);
  EXPECT_EQ(loaded.Find("a")->applied_version(), 3u);
  EXPECT_EQ(loaded.Find("a")->last_heartbeat_unix_ms(), 0) << "heartbeats are not durable";
  wsync::v1::RegisterRequest req;
  req.set_name("b");
  EXPECT_EQ(loaded.Registration(req, 1000).incarnation(), 6u);
}

TEST(CoordinatorComponents, NodeRegistryExpiresPastTheTtlAndDisconnectsOnlyTheCurrentIncarnation) {
  NodeRegistry nodes;
  nodes.Apply(Registered("a", wsync::v1::ROLE_SINK, 1, 0, 1000));
  nodes.Apply(Registered("b", wsync::v1::ROLE_SINK, 2, 0, 5000));
  nodes.GraceAll(0);
  EXPECT_TRUE(nodes.Expire(1000).empty()) << "a TTL of 1000 ms passes after 1000 ms";
  EXPECT_EQ(nodes.Expire(1001), std::vector<std::string>{"a"});
  EXPECT_TRUE(nodes.Expire(1002).empty()) << "dead once";
  EXPECT_EQ(nodes.FindLive("a"), nullptr);
  ASSERT_NE(nodes.Find("a"), nullptr);

  EXPECT_FALSE(nodes.Disconnect("b", 1)) << "an earlier incarnation's watch";
  EXPECT_TRUE(nodes.Disconnect("b", 2));
  EXPECT_EQ(nodes.Find("b")->state(), wsync::v1::NODE_DISCONNECTED);
  EXPECT_NE(nodes.FindLive("b"), nullptr) << "disconnected is not dead";
  EXPECT_FALSE(nodes.Disconnect("b", 2)) << "already disconnected";
  EXPECT_FALSE(nodes.Disconnect("a", 1)) << "dead";
}

TEST(CoordinatorComponents, NodeRegistryExpiresInTheOrderOfTheirDeadlinesAsTouchedAndReRegistered) {
  NodeRegistry nodes;
  for (int i = 0; i < 1000; ++i) nodes.Apply(Registered("n" + std::to_string(i), wsync::v1::ROLE_SINK, i + 1));
  nodes.GraceAll(0);
  for (int i = 0; i < 1000; i += 2) nodes.Touch("n" + std::to_string(i), 500, 0);
  std::vector<std::string> odd = nodes.Expire(1001), even;
  for (int i = 1; i < 1000; i += 2) even.push_back("n" + std::to_string(i));
  std::sort(odd.begin(), odd.end());
  std::sort(even.begin(), even.end());
  EXPECT_EQ(odd, even) << "those not heard from since 0, and only they";
  EXPECT_TRUE(nodes.Expire(1500).empty());
  EXPECT_EQ(nodes.Expire(1501).size(), 500u) << "the others, their TTL counted from the touch";
  EXPECT_TRUE(nodes.Expire(1'000'000).empty()) << "each dies once";

  // A re-registration with a shorter TTL expires by it.
  nodes.Apply(Registered("x", wsync::v1::ROLE_SINK, 2000, 0, 10'000));
  nodes.Find("x")->set_state(wsync::v1::NODE_ALIVE);
  nodes.Touch("x", 2000, 0);
  nodes.Apply(Registered("x", wsync::v1::ROLE_SINK, 2001, 0, 100));
  EXPECT_EQ(nodes.Expire(2101), std::vector<std::string>{"x"});
  // Dead, registered again: alive from its touch.
  nodes.Apply(Registered("x", wsync::v1::ROLE_SINK, 2002, 0, 100));
  EXPECT_TRUE(nodes.Expire(5000).empty()) << "still dead until registered alive";
  nodes.Find("x")->set_state(wsync::v1::NODE_ALIVE);
  nodes.Touch("x", 5000, 0);
  EXPECT_TRUE(nodes.Expire(5100).empty());
  EXPECT_EQ(nodes.Expire(5101), std::vector<std::string>{"x"});
  // Asked for heartbeats every 20 ms with a TTL of 100: its TTL; every 200: four of those.
  nodes.Find("x")->set_state(wsync::v1::NODE_ALIVE);
  nodes.Touch("x", 5200, 20);
  EXPECT_EQ(nodes.Expire(5301), std::vector<std::string>{"x"});
  nodes.Find("x")->set_state(wsync::v1::NODE_ALIVE);
  nodes.Touch("x", 5400, 200);
  EXPECT_TRUE(nodes.Expire(6200).empty());
  EXPECT_EQ(nodes.Expire(6201), std::vector<std::string>{"x"});
  // Erased: never expired.
  nodes.Apply(Registered("y", wsync::v1::ROLE_SINK, 3000, 0, 100));
  nodes.Find("y")->set_state(wsync::v1::NODE_ALIVE);
  nodes.Touch("y", 6000, 0);
  nodes.Erase("y");
  EXPECT_TRUE(nodes.Expire(1'000'000).empty());
}

// ---- VersionLog

void ApplyToVersions(VersionLog& versions, const Record& r) {
  if (r.has_version_published()) versions.ApplyPublished(r.version_published());
  if (r.has_version_part()) versions.ApplyPart(r.version_part());
}

wsync::v1::VersionSummary Keyframe(uint64_t version, uint64_t checksum, uint32_t part = 0, uint32_t parts = 0) {
  wsync::v1::VersionSummary s;
  s.set_version(version);
  s.set_keyframe(true);
  s.set_set_checksum(checksum);
  s.set_part(part);
  s.set_parts(parts);
  s.set_source(parts > 1 ? "src-" + std::to_string(part) : "src");
  return s;
}

TEST(CoordinatorComponents, VersionLogOnlyGrowsAndTakesARetryWithoutLogging) {
  FakeClock clock;
  VersionLog versions(&clock);
  TestLog log;
  const RecordLog to = log.To([&](const Record& r) { ApplyToVersions(versions, r); });
  ASSERT_EQ(*versions.Publish(Keyframe(1, 11), 0, to), 1u);
  EXPECT_EQ(versions.head(), 1u);
  ASSERT_EQ(log.logged.size(), 1u);
  EXPECT_EQ(log.logged[0].version_published().published_unix_ms(), clock.NowMs());

  EXPECT_EQ(*versions.Publish(Keyframe(1, 11), 0, to), 1u) << "a retry";
  EXPECT_EQ(log.logged.size(), 1u);
  EXPECT_EQ(versions.Publish(Keyframe(1, 12), 0, to).status().code(), StatusCode::kFailedPrecondition);
  auto patch = Keyframe(3, 13);
  patch.set_keyframe(false);
  patch.set_base_version(3);
  EXPECT_EQ(versions.Publish(patch, 0, to).status().code(), StatusCode::kInvalidArgument);

  versions.ApplyFloor(5);  // a salvage lost versions 2..5
  EXPECT_EQ(versions.Publish(Keyframe(4, 14), 0, to).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(versions.head(), 1u);
  EXPECT_EQ(versions.List(0).head_version(), 5u);

  log.fail = true;
  EXPECT_FALSE(versions.Publish(Keyframe(6, 16), 0, to).ok());
  EXPECT_EQ(versions.head(), 1u);
  EXPECT_FALSE(versions.contains(6));
}

TEST(CoordinatorComponents, VersionLogPublishesAVersionOfSeveralPartsOnceWhole) {
  FakeClock clock;
  VersionLog versions(&clock);
  TestLog log;
  const RecordLog to = log.To([&](const Record& r) { ApplyToVersions(versions, r); });
  EXPECT_EQ(versions.Publish(Keyframe(1, 1, 0, 2), 0, to).status().code(), StatusCode::kFailedPrecondition)
      << "no layout of two parts";
  ASSERT_TRUE(versions.Publish(Keyframe(1, 1, 0, 2), 2, to).ok());
  EXPECT_EQ(versions.head(), 0u);
  ASSERT_EQ(versions.List(0).partial_size(), 1);
  EXPECT_EQ(versions.List(0).partial(0).part_summaries_size(), 1);

  ASSERT_TRUE(versions.Publish(Keyframe(1, 2, 1, 2), 2, to).ok());
  EXPECT_EQ(versions.head(), 1u);
  EXPECT_EQ(log.logged.size(), 3u) << "two parts, then the whole version";
  const auto listed = versions.List(0);
  EXPECT_EQ(listed.partial_size(), 0);
  ASSERT_EQ(listed.versions_size(), 1);
  EXPECT_EQ(listed.versions(0).source(), "src-0+src-1");
  EXPECT_EQ(listed.versions(0).part_summaries_size(), 2);
  EXPECT_TRUE(versions.Publish(Keyframe(1, 2, 1, 2), 2, to).ok()) << "a retry of a part stored with its version";
  EXPECT_EQ(log.logged.size(), 3u);

  Snapshot snap;
  versions.SaveTo(&snap);
  VersionLog loaded(&clock);
  loaded.LoadFrom(snap);
  EXPECT_EQ(loaded.List(0).SerializeAsString(), listed.SerializeAsString());
}

TEST(CoordinatorComponents, VersionLogCountsASourceNotHeardFromAsHoldingEveryVersion) {
  FakeClock clock;
  VersionLog versions(&clock);
  EXPECT_TRUE(versions.SourceHolds("src", 9));
  versions.NoteSourceHolds("src", 3);
  versions.NoteSourceHolds("src", 2);  // an older announcement does not lower it
  EXPECT_TRUE(versions.SourceHolds("src", 3));
  EXPECT_FALSE(versions.SourceHolds("src", 4));
  versions.SetSourceHead("src", 1);  // its heartbeat: it restarted with less
  EXPECT_FALSE(versions.SourceHolds("src", 3));
  versions.ForgetSource("src");
  EXPECT_TRUE(versions.SourceHolds("src", 9));
}

// ---- LeaseTable

void ApplyToLeases(LeaseTable& leases, const Record& r) {
  if (r.has_lease_granted()) leases.ApplyGranted(r.lease_granted());
  if (r.has_lease_released()) leases.ApplyReleased(r.lease_released());
}

TEST(CoordinatorComponents, LeaseTableGrantsRenewsAndReleasesThroughItsLog) {
  FakeClock clock;
  LeaseTable leases(&clock, 1000);
  TestLog log;
  const RecordLog to = log.To([&](const Record& r) { ApplyToLeases(leases, r); });
  auto a = leases.Acquire("sink", 3, 0, "", to);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->id(), 1u);
  EXPECT_EQ(a->expires_unix_ms(), clock.NowMs() + 1000) << "the default TTL";
  auto b = leases.Acquire("sink", 2, 500, "", to);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->id(), 2u);
  EXPECT_EQ(leases.OldestLeased(), 2u);

  clock.Advance(100);
  auto renewed = leases.Renew(1, 2000, to);
  ASSERT_TRUE(renewed.ok());
  EXPECT_EQ(renewed->expires_unix_ms(), clock.NowMs() + 2000);
  EXPECT_EQ(leases.Renew(9, 0, to).status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(leases.Release(2, to).ok());
  EXPECT_EQ(leases.Release(2, to).code(), StatusCode::kNotFound);
  EXPECT_EQ(leases.List().leases_size(), 1);
  EXPECT_EQ(leases.List().oldest_leased_version(), 3u);

  log.fail = true;
  EXPECT_FALSE(leases.Acquire("sink", 4, 0, "", to).ok());
  EXPECT_EQ(leases.size(), 1u);
}

TEST(CoordinatorComponents, LeaseTableEndsExpiredLeasesAndThoseOfDeadOwners) {
  FakeClock clock;
  LeaseTable leases(&clock, 1000);
  TestLog log;
  const RecordLog to = log.To([&](const Record& r) { ApplyToLeases(leases, r); });
  ASSERT_TRUE(leases.Acquire("x", 1, 1000, "", to).ok());
  ASSERT_TRUE(leases.Acquire("y", 1, 5000, "", to).ok());
  const int64_t now = clock.NowMs();
  auto none_dead = [](const std::string&) { return false; };
  EXPECT_TRUE(leases.Ended(now + 500, none_dead).empty());
  EXPECT_EQ(leases.Ended(now + 500, [](const std::string& node) { return node == "y"; }),
            std::vector<uint64_t>{2});
  EXPECT_EQ(leases.Ended(now + 1001, none_dead), std::vector<uint64_t>{1});

  leases.DropNode("x");
  EXPECT_EQ(leases.size(), 1u);
  Snapshot snap;
  leases.SaveTo(&snap);
  EXPECT_EQ(snap.next_lease_id(), 3u);
  LeaseTable loaded(&clock, 1000);
  loaded.LoadFrom(snap);
  EXPECT_EQ(loaded.size(), 1u);
  auto next = loaded.Acquire("y", 1, 0, "", log.To([&](const Record& r) { ApplyToLeases(loaded, r); }));
  ASSERT_TRUE(next.ok());
  EXPECT_EQ(next->id(), 3u) << "ids are never reused";
}

// ---- LayoutRegistry

wsync::v1::Layout Tensors(const std::vector<std::string>& names, uint64_t rows, uint32_t part = 0,
                          uint32_t parts = 0) {
  wsync::v1::Layout l;
  l.set_parts(parts);
  l.set_source(parts > 1 ? "src-" + std::to_string(part) : "src");
  for (const auto& name : names) {
    auto* t = l.add_tensors();
    t->set_name(name);
    t->set_dtype("BF16");
    t->add_shape(rows);
    t->set_part(part);
  }
  return l;
}

TEST(CoordinatorComponents, LayoutRegistryIsSetOnceThenChecked) {
  LayoutRegistry layout;
  TestLog log;
  const RecordLog to = log.To([&](const Record& r) { layout.Apply(r.layout_set()); });
  EXPECT_EQ(layout.parts(), 0u);
  EXPECT_FALSE(layout.Get().set());
  EXPECT_EQ(layout.Set(Tensors({}, 4), to).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(layout.Set(Tensors({"a"}, 4), to).ok());
  EXPECT_EQ(layout.parts(), 1u);
  EXPECT_TRUE(layout.Get().set());
  EXPECT_TRUE(layout.Set(Tensors({"a"}, 4), to).ok());
  EXPECT_EQ(log.logged.size(), 1u) << "the same layout again changes nothing";
  EXPECT_EQ(layout.Set(Tensors({"a"}, 8), to).code(), StatusCode::kFailedPrecondition);
}

TEST(CoordinatorComponents, LayoutRegistryMergesThePartsOfSeveralSources) {
  LayoutRegistry layout;
  TestLog log;
  const RecordLog to = log.To([&](const Record& r) { layout.Apply(r.layout_set()); });
  ASSERT_TRUE(layout.Set(Tensors({"a"}, 4, 0, 2), to).ok());
  EXPECT_EQ(layout.parts(), 2u);
  EXPECT_FALSE(layout.Get().set()) << "half a layout";
  EXPECT_EQ(layout.Set(Tensors({"a"}, 4, 1, 2), to).code(), StatusCode::kFailedPrecondition)
      << "a tensor in two parts";
  ASSERT_TRUE(layout.Set(Tensors({"b"}, 4, 1, 2), to).ok());
  EXPECT_TRUE(layout.Get().set());
  EXPECT_EQ(layout.Get().layout().part_sources(1), "src-1");
  EXPECT_EQ(layout.Set(Tensors({"a", "b"}, 4), to).code(), StatusCode::kFailedPrecondition) << "a whole-set source";

  Snapshot snap;
  layout.SaveTo(&snap);
  LayoutRegistry loaded;
  loaded.LoadFrom(snap);
  EXPECT_EQ(loaded.Get().SerializeAsString(), layout.Get().SerializeAsString());
}

// ---- RelayTree

Node& Add(NodeMap& nodes, const std::string& name, wsync::v1::Role role, uint64_t applied,
          const std::string& parent = "") {
  Node& n = nodes[name];
  n.set_name(name);
  n.set_role(role);
  n.set_state(wsync::v1::NODE_ALIVE);
  n.set_applied_version(applied);
  n.set_parent(parent);
  return n;
}

// A relay tree over a source "src", parents avoided for 30 s.
struct TreeWithSource {
  explicit TreeWithSource(uint32_t fanout = 4) : tree(&clock, fanout, 30'000) {
    Add(nodes, "src", wsync::v1::ROLE_SOURCE, 0);
  }
  FakeClock clock;
  RelayTree tree;
  NodeMap nodes;
};

TEST(CoordinatorComponents, RelayTreeKeepsTheFanOutOverPasses) {
  TreeWithSource t(2);
  auto& [clock, tree, nodes] = t;
  for (int i = 1; i <= 5; ++i) Add(nodes, "sink-" + std::to_string(i), wsync::v1::ROLE_SINK, 1);
  tree.MarkDirty();
  for (int pass = 0; pass < 16 && tree.AssignParents(nodes, 1); ++pass) {
  }
  EXPECT_FALSE(tree.dirty());
  std::map<std::string, int> children;
  for (const auto& [name, n] : nodes) {
    if (n.role() != wsync::v1::ROLE_SINK) continue;
    EXPECT_FALSE(n.parent().empty()) << name;
    EXPECT_TRUE(RelayTree::IsDescendant(nodes, name, "src")) << name;
    ++children[n.parent()];
  }
  for (const auto& [parent, count] : children) EXPECT_LE(count, 2) << parent;
  EXPECT_FALSE(tree.AssignParents(nodes, 1)) << "a settled tree stays";
}

TEST(CoordinatorComponents, RelayTreeAvoidsAReportedParentWhileAnotherHoldsTheVersion) {
  TreeWithSource t;
  auto& [clock, tree, nodes] = t;
  Add(nodes, "alone", wsync::v1::ROLE_SINK, 1, "src");
  tree.Avoid("alone", "src");
  EXPECT_TRUE(tree.Avoids("alone", "src"));
  tree.AssignParents(nodes, 1);
  EXPECT_EQ(nodes["alone"].parent(), "src") << "nothing else holds version 1";

  Add(nodes, "relay", wsync::v1::ROLE_SINK, 1, "src");
  nodes["alone"].set_parent("");
  tree.AssignParents(nodes, 1);
  EXPECT_EQ(nodes["alone"].parent(), "relay");
  clock.Advance(30'000);
  EXPECT_FALSE(tree.Avoids("alone", "src"));
}

// Sinks that read an object store and reach no source (another network):
// the one that reads it is rooted without a parent and relays to the others;
// none is given back the source it avoids.
TEST(CoordinatorComponents, RelayTreeRootsSinksThatReadAStore) {
  TreeWithSource t(2);
  auto& [clock, tree, nodes] = t;
  for (const char* name : {"far-0", "far-1", "far-2"}) {
    Add(nodes, name, wsync::v1::ROLE_SINK, 1);
    nodes[name].set_reads_store(true);
    tree.Avoid(name, "src");
  }
  for (int pass = 0; pass < 8 && tree.AssignParents(nodes, 1); ++pass) {
  }
  int roots = 0;
  for (const char* name : {"far-0", "far-1", "far-2"}) {
    const auto& parent = nodes[name].parent();
    EXPECT_NE(parent, "src") << name;
    roots += parent.empty();
    if (!parent.empty()) {
      EXPECT_FALSE(RelayTree::IsDescendant(nodes, parent, name)) << name;
    }
  }
  EXPECT_EQ(roots, 1) << "one reads the store, the others are below it";

  // Without the store, a sink with nowhere else to go gets the avoided source back.
  for (const char* name : {"far-0", "far-1", "far-2"}) {
    nodes[name].set_reads_store(false);
    nodes[name].set_parent("");
  }
  tree.AssignParents(nodes, 1);
  for (const char* name : {"far-0", "far-1", "far-2"}) EXPECT_EQ(nodes[name].parent(), "src") << name;
}

TEST(CoordinatorComponents, RelayTreeGivesChildrenBackToAParentWhoseWatchBroke) {
  TreeWithSource t;
  auto& [clock, tree, nodes] = t;
  Add(nodes, "relay", wsync::v1::ROLE_SINK, 1, "src");
  Add(nodes, "child", wsync::v1::ROLE_SINK, 1, "relay");
  tree.Disconnected(nodes, "relay");
  nodes["relay"].set_state(wsync::v1::NODE_DISCONNECTED);
  tree.AssignParents(nodes, 1);
  EXPECT_EQ(nodes["child"].parent(), "src");

  nodes["relay"].set_state(wsync::v1::NODE_ALIVE);
  tree.AssignParents(nodes, 1);
  EXPECT_EQ(nodes["relay"].parent(), "src");
  tree.GiveBackChildren(nodes, "relay", 1);
  EXPECT_EQ(nodes["child"].parent(), "relay");

  // A parent that died gets nothing back.
  tree.Disconnected(nodes, "relay");
  tree.Died("relay");
  nodes["child"].set_parent("src");
  tree.GiveBackChildren(nodes, "relay", 1);
  EXPECT_EQ(nodes["child"].parent(), "src");
}

// A restarted node serves nothing yet: its children lose it. A name that
// joins has no children; for both, nobody avoids it any longer.
TEST(CoordinatorComponents, RelayTreeForgetsAnAvoidedParentThatRestartsOrJoinsAgain) {
  TreeWithSource t;
  auto& [clock, tree, nodes] = t;
  Add(nodes, "relay", wsync::v1::ROLE_SINK, 1, "src");
  Add(nodes, "child", wsync::v1::ROLE_SINK, 1, "relay");
  Add(nodes, "other", wsync::v1::ROLE_SINK, 1, "src");
  tree.Avoid("other", "relay");
  ASSERT_TRUE(tree.Avoids("other", "relay"));
  tree.Restarted(nodes, "relay");
  EXPECT_EQ(nodes["child"].parent(), "");
  EXPECT_FALSE(tree.Avoids("other", "relay"));

  tree.Avoid("other", "gone");
  tree.Joined("gone");
  EXPECT_FALSE(tree.Avoids("other", "gone"));
}

TEST(CoordinatorComponents, RelayTreeReachesTheHeadThroughARelayOrAsksTheSource) {
  TreeWithSource t;
  NodeMap& nodes = t.nodes;
  Add(nodes, "relay", wsync::v1::ROLE_SINK, 1, "src");
  const Node& child = Add(nodes, "child", wsync::v1::ROLE_SINK, 0, "relay");
  auto holds = [](bool held) { return [held](const Node&) { return held; }; };
  EXPECT_TRUE(RelayTree::HeadReachable(nodes, child, 1, holds(false))) << "the relay holds version 1";
  EXPECT_FALSE(RelayTree::HeadReachable(nodes, child, 2, holds(false)));
  EXPECT_TRUE(RelayTree::HeadReachable(nodes, child, 2, holds(true)));

  Add(nodes, "a", wsync::v1::ROLE_SINK, 0, "b");
  Add(nodes, "b", wsync::v1::ROLE_SINK, 0, "a");
  EXPECT_TRUE(RelayTree::IsDescendant(nodes, "a", "nobody")) << "a cycle never takes a child";
  EXPECT_FALSE(RelayTree::IsDescendant(nodes, "src", "relay"));
}

// ---- StalenessGate

TEST(CoordinatorComponents, StalenessGateBlocksOrEvictsOnlyLaggardsTheHeadCanReach) {
  NodeRegistry nodes;
  nodes.Apply(Registered("fresh", wsync::v1::ROLE_SINK, 1, 4));
  nodes.Apply(Registered("lag", wsync::v1::ROLE_SINK, 2, 1));
  nodes.Apply(Registered("new", wsync::v1::ROLE_SINK, 3, 0));
  nodes.GraceAll(0);
  TestLog log;
  const RecordLog to = log.To([&](const Record& r) { nodes.Apply(r.node_registered()); });
  auto reachable = [](const Node&) { return true; };

  const StalenessGate block(2, wsync::v1::STALENESS_BLOCK);
  EXPECT_TRUE(block.Tolerates(2));
  EXPECT_FALSE(block.Tolerates(3));
  EXPECT_TRUE(StalenessGate(0, wsync::v1::STALENESS_BLOCK).Tolerates(1000)) << "no bound";
  EXPECT_EQ(block.MayPublish(4, 4, nodes.nodes(), reachable, to).status().code(), StatusCode::kFailedPrecondition);
  auto blocked = block.MayPublish(5, 4, nodes.nodes(), reachable, to);
  ASSERT_TRUE(blocked.ok());
  EXPECT_FALSE(blocked->allowed());
  ASSERT_EQ(blocked->blocking_size(), 1);
  EXPECT_EQ(blocked->blocking(0), "lag");
  auto unreachable = block.MayPublish(5, 4, nodes.nodes(), [](const Node& n) { return n.name() != "lag"; }, to);
  EXPECT_TRUE(unreachable->allowed()) << "waiting for a head nobody can serve never ends";

  const StalenessGate evict(2, wsync::v1::STALENESS_EVICT);
  auto evicted = evict.MayPublish(5, 4, nodes.nodes(), reachable, to);
  ASSERT_TRUE(evicted.ok());
  EXPECT_TRUE(evicted->allowed());
  ASSERT_EQ(evicted->evicted_size(), 1);
  EXPECT_TRUE(nodes.Find("lag")->resync_keyframe());
  EXPECT_EQ(log.logged.size(), 1u);
  EXPECT_EQ(evict.MayPublish(5, 4, nodes.nodes(), reachable, to)->evicted_size(), 0) << "evicted once";
}

}  // namespace
}  // namespace wsync::control
