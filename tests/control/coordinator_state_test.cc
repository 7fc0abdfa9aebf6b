// The coordinator's state machine with a fake clock: versions, liveness,
// leases, staleness policy, topology and recovery from its store.
#include "wsync/control/coordinator_state.h"

#include <gtest/gtest.h>

#include <condition_variable>
#include <atomic>
#include <filesystem>
#include <functional>
#include <mutex>
#include <set>
#include <thread>

#include "wsync/control/testing/fake_clock.h"

namespace wsync::control {
namespace {

using wsync::v1::Role;

std::unique_ptr<CoordinatorState> Make(const Clock* clock, CoordinatorOptions options = {}) {
  auto s = CoordinatorState::Create(options, clock, NewNullStore(), Recovered());
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return std::move(*s);
}

wsync::v1::RegisterRequest Reg(const std::string& name, Role role, uint64_t ttl = 0) {
  wsync::v1::RegisterRequest r;
  r.set_name(name);
  r.set_role(role);
  r.set_host("127.0.0.1");
  r.set_ttl_ms(ttl);
  return r;
}

wsync::v1::VersionSummary V(uint64_t v) {
  wsync::v1::VersionSummary s;
  s.set_version(v);
  s.set_base_version(v - 1);
  s.set_keyframe(v == 1);
  s.set_base_version(v == 1 ? 0 : v - 1);
  return s;
}

// A coordinator of fan-out `fanout` whose source "src" (TTL 1 s) published version 1.
std::unique_ptr<CoordinatorState> WithSourceAtVersion1(const Clock* clock, uint32_t fanout) {
  CoordinatorOptions o;
  o.fanout = fanout;
  auto s = Make(clock, o);
  EXPECT_TRUE(s->Register(Reg("src", wsync::v1::ROLE_SOURCE, 1000)).ok());
  EXPECT_TRUE(s->Publish(V(1)).ok());
  return s;
}

const wsync::v1::Node* FindNode(const wsync::v1::StatusResponse& s, const std::string& name) {
  for (const auto& n : s.nodes()) {
    if (n.name() == name) return &n;
  }
  return nullptr;
}

// The state over the log store in `dir`, recovered from what it holds;
// `wrap` (optional) puts the test's store around it. Null on a failure.
std::unique_ptr<CoordinatorState> Durable(const std::string& dir, const Clock* clock, const CoordinatorOptions& o = {},
                                          const std::function<std::unique_ptr<Store>(std::unique_ptr<Store>)>& wrap = {}) {
  Recovered rec;
  auto store = OpenLogStore(dir, &rec);
  EXPECT_TRUE(store.ok()) << store.status().ToString();
  if (!store.ok()) return nullptr;
  std::unique_ptr<Store> st = std::move(*store);
  if (wrap) st = wrap(std::move(st));
  auto s = CoordinatorState::Create(o, clock, std::move(st), rec);
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return s.ok() ? std::move(*s) : nullptr;
}

TEST(CoordinatorState, VersionsOnlyGrow) {
  FakeClock clock;
  auto s = Make(&clock);
  ASSERT_TRUE(s->Publish(V(1)).ok());
  ASSERT_TRUE(s->Publish(V(5)).ok());
  auto other5 = V(5);
  other5.set_set_checksum(99);
  EXPECT_EQ(s->Publish(other5).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(s->Publish(V(3)).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(s->Publish(V(0)).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s->head(), 5u);
  auto list = s->ListVersions(1);
  ASSERT_EQ(list.versions_size(), 1);
  EXPECT_EQ(list.versions(0).version(), 5u);
  EXPECT_EQ(s->ListVersions(0).versions_size(), 2);
}

// Issue 18, item 7: a publish whose answer was lost (the client saw
// Unavailable) had been stored; the publisher's retry of the same summary is
// told it was, and nothing changes.
TEST(CoordinatorState, RetryOfAStoredPublishSucceedsAndChangesNothing) {
  FakeClock clock;
  auto s = Make(&clock);
  auto v = V(1);
  v.set_set_checksum(0x1234);
  v.set_source("trainer-0");
  ASSERT_TRUE(s->Publish(v).ok());
  const uint64_t gen = s->generation();
  auto again = s->Publish(v);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, 1u);
  EXPECT_EQ(s->generation(), gen);
  EXPECT_EQ(s->ListVersions(0).versions_size(), 1);
  v.set_source("trainer-1");  // another publisher's version 1: refused
  EXPECT_EQ(s->Publish(v).status().code(), StatusCode::kFailedPrecondition);
}

// A version announced while it is encoded (its patch streamed as it is):
// visible at once without its checksum, completed by the same source's
// second announce, durably; retries of either are successes; another
// source's, or a completion below the head, are not completions.
TEST(CoordinatorState, AVersionAnnouncedWhileEncodedIsCompletedDurably) {
  const std::string dir = ::testing::TempDir() + "/wsync_incomplete_" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  FakeClock clock;
  CoordinatorOptions o;
  o.compact_every = 2;
  auto early = V(1);
  early.set_source("trainer");
  early.set_incomplete(true);
  auto done = early;
  done.set_incomplete(false);
  done.set_set_checksum(0xabc);
  done.set_patch_bytes(77);
  {
    Recovered rec;
    auto store = OpenLogStore(dir, &rec);
    ASSERT_TRUE(store.ok());
    auto st = CoordinatorState::Create(o, &clock, std::move(*store), rec);
    ASSERT_TRUE(st.ok());
    auto& s = *st;
    ASSERT_TRUE(s->Publish(early).ok());
    EXPECT_EQ(s->head(), 1u) << "visible at once: sinks pull it while it is encoded";
    EXPECT_TRUE(s->ListVersions(0).versions(0).incomplete());
    ASSERT_TRUE(s->Publish(early).ok()) << "a retry of the early announce";
    auto other = done;
    other.set_source("someone-else");
    EXPECT_EQ(s->Publish(other).status().code(), StatusCode::kFailedPrecondition);
    ASSERT_TRUE(s->Publish(done).ok());
    const auto listed = s->ListVersions(0).versions(0);
    EXPECT_FALSE(listed.incomplete());
    EXPECT_EQ(listed.set_checksum(), 0xabcu);
    EXPECT_EQ(listed.patch_bytes(), 77u);
    ASSERT_TRUE(s->Publish(done).ok()) << "a retry of the completion";
    ASSERT_TRUE(s->Publish(early).ok()) << "a late retry of the early announce changes nothing";
    EXPECT_FALSE(s->ListVersions(0).versions(0).incomplete());
    // Version 2, early, then 3 above it: 2 can no longer be completed.
    auto early2 = early;
    early2.set_version(2);
    early2.set_base_version(1);
    ASSERT_TRUE(s->Publish(early2).ok());
    auto v3 = done;
    v3.set_version(3);
    v3.set_base_version(2);
    ASSERT_TRUE(s->Publish(v3).ok());
    auto done2 = done;
    done2.set_version(2);
    done2.set_base_version(1);
    EXPECT_EQ(s->Publish(done2).status().code(), StatusCode::kFailedPrecondition);
  }
  Recovered rec;
  auto store = OpenLogStore(dir, &rec);
  ASSERT_TRUE(store.ok());
  auto s = CoordinatorState::Create(o, &clock, std::move(*store), rec);
  ASSERT_TRUE(s.ok());
  const auto versions = (*s)->ListVersions(0);
  ASSERT_EQ(versions.versions_size(), 3);
  EXPECT_FALSE(versions.versions(0).incomplete()) << "the completion survived the restart";
  EXPECT_EQ(versions.versions(0).set_checksum(), 0xabcu);
  EXPECT_TRUE(versions.versions(1).incomplete());
  std::filesystem::remove_all(dir);
}

TEST(CoordinatorState, NodesExpireAfterTheirTtlAndMustReregister) {
  FakeClock clock;
  auto s = Make(&clock);
  ASSERT_TRUE(s->Register(Reg("sink-a", wsync::v1::ROLE_SINK, 1000)).ok());
  clock.Advance(900);
  ASSERT_TRUE(s->Heartbeat([] { wsync::v1::HeartbeatRequest h; h.set_name("sink-a"); return h; }()).ok());
  clock.Advance(900);
  s->Tick();
  EXPECT_EQ(FindNode(s->GetStatus(), "sink-a")->state(), wsync::v1::NODE_ALIVE);
  clock.Advance(200);
  s->Tick();
  EXPECT_EQ(FindNode(s->GetStatus(), "sink-a")->state(), wsync::v1::NODE_DEAD);
  wsync::v1::HeartbeatRequest h;
  h.set_name("sink-a");
  EXPECT_EQ(s->Heartbeat(h).status().code(), StatusCode::kNotFound);
  auto again = s->Register(Reg("sink-a", wsync::v1::ROLE_SINK, 1000));
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->node().state(), wsync::v1::NODE_ALIVE);
  // A heartbeat from the old incarnation is refused.
  h.set_incarnation(again->node().incarnation() - 1);
  EXPECT_EQ(s->Heartbeat(h).status().code(), StatusCode::kAborted);
  EXPECT_TRUE(s->Deregister("sink-a").ok());
  EXPECT_EQ(s->Deregister("sink-a").code(), StatusCode::kNotFound);
}

TEST(CoordinatorState, RegistrationIsValidated) {
  FakeClock clock;
  auto s = Make(&clock);
  EXPECT_EQ(s->Register(Reg("", wsync::v1::ROLE_SINK)).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s->Register(Reg("x", wsync::v1::ROLE_UNSPECIFIED)).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s->Register(Reg("x", wsync::v1::ROLE_SINK, 100'000'000)).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(CoordinatorState, LeasesExpireRenewAndEndWithTheirNode) {
  FakeClock clock;
  auto s = Make(&clock);
  ASSERT_TRUE(s->Register(Reg("rollout-1", wsync::v1::ROLE_SINK, 5000)).ok());
  ASSERT_TRUE(s->Publish(V(1)).ok());
  ASSERT_TRUE(s->Publish(V(2)).ok());
  EXPECT_EQ(s->AcquireLease("rollout-1", 9, 1000).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(s->AcquireLease("nobody", 1, 1000).status().code(), StatusCode::kNotFound);
  auto l1 = s->AcquireLease("rollout-1", 1, 1000);
  auto l2 = s->AcquireLease("rollout-1", 2, 3000);
  ASSERT_TRUE(l1.ok() && l2.ok());
  EXPECT_EQ(s->ListLeases().oldest_leased_version(), 1u);
  clock.Advance(800);
  ASSERT_TRUE(s->RenewLease(l1->id(), 1000).ok());
  clock.Advance(800);
  s->Tick();
  EXPECT_EQ(s->ListLeases().leases_size(), 2);  // renewed
  clock.Advance(300);
  s->Tick();
  EXPECT_EQ(s->ListLeases().leases_size(), 1);
  EXPECT_EQ(s->ListLeases().oldest_leased_version(), 2u);
  EXPECT_EQ(s->RenewLease(l1->id(), 1000).status().code(), StatusCode::kNotFound);
  // The node dies: its lease ends with it.
  clock.Advance(6000);
  s->Tick();
  EXPECT_EQ(s->ListLeases().leases_size(), 0);
  EXPECT_EQ(s->ListLeases().oldest_leased_version(), 0u);
}

TEST(CoordinatorState, ASinkReachingTheHeadTakesOverChildrenAtTheNextTickNotAtItsReport) {
  FakeClock clock;
  auto s = WithSourceAtVersion1(&clock, /*fanout=*/1);
  ASSERT_TRUE(s->Register(Reg("a", wsync::v1::ROLE_SINK)).ok());
  ASSERT_TRUE(s->Register(Reg("b", wsync::v1::ROLE_SINK)).ok());
  // No sink holds version 1 yet: both hang off the source, above its fan-out.
  ASSERT_EQ(FindNode(s->GetStatus(), "b")->parent(), "src");
  ASSERT_TRUE(s->ReportApplied("a", 1).ok());
  // Thousands of sinks report each version: the tree is not redone per report...
  EXPECT_EQ(FindNode(s->GetStatus(), "b")->parent(), "src");
  s->Tick();
  // ...but at the next tick (the server ticks every 200 ms).
  EXPECT_EQ(FindNode(s->GetStatus(), "b")->parent(), "a");
  EXPECT_EQ(FindNode(s->GetStatus(), "a")->parent(), "src");
}

TEST(CoordinatorState, ARegistrationStormInALargeFleetIsAttachedAtTheNextTick) {
  FakeClock clock;
  CoordinatorOptions o;
  o.fanout = 4;
  auto s = Make(&clock, o);
  constexpr uint64_t kTtl = 600'000;  // past the whole test's clock
  ASSERT_TRUE(s->Register(Reg("src", wsync::v1::ROLE_SOURCE, kTtl)).ok());
  ASSERT_TRUE(s->Publish(V(1)).ok());
  // A fleet: each registration a moment apart, a pass each (a moment is past the coalescing).
  for (int i = 0; i < 1000; ++i) {
    clock.Advance(250);
    ASSERT_TRUE(s->Register(Reg("sink-" + std::to_string(i), wsync::v1::ROLE_SINK, kTtl)).ok());
  }
  EXPECT_EQ(FindNode(s->GetStatus(), "sink-999")->parent(), "src") << "alone, a registration is attached at once";
  // A storm: in one instant, the first runs the pass, the others wait for the tick's.
  clock.Advance(250);
  for (int i = 1000; i < 1010; ++i) {
    ASSERT_TRUE(s->Register(Reg("sink-" + std::to_string(i), wsync::v1::ROLE_SINK, kTtl)).ok());
  }
  EXPECT_EQ(FindNode(s->GetStatus(), "sink-1000")->parent(), "src");
  EXPECT_EQ(FindNode(s->GetStatus(), "sink-1009")->parent(), "");
  s->Tick();
  for (int i = 1000; i < 1010; ++i) {
    EXPECT_EQ(FindNode(s->GetStatus(), "sink-" + std::to_string(i))->parent(), "src") << i;
  }
}

TEST(CoordinatorState, StalenessIsHeadMinusApplied) {
  FakeClock clock;
  auto s = Make(&clock);
  ASSERT_TRUE(s->Register(Reg("sink", wsync::v1::ROLE_SINK)).ok());
  for (uint64_t v = 1; v <= 5; ++v) ASSERT_TRUE(s->Publish(V(v)).ok());
  auto n = s->ReportApplied("sink", 3);
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(n->staleness(), 2u);
  EXPECT_EQ(s->ReportApplied("sink", 6).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s->GetStatus().oldest_needed_version(), 3u);
}

// In a large fleet with no staleness bound, sinks are told to let their
// heartbeats carry their applied versions; a carried version is taken as a
// report is, and one the coordinator cannot take leaves the heartbeat answered.
TEST(CoordinatorState, HeartbeatsCarryAppliedVersionsInALargeFleetWithNoStalenessBound) {
  FakeClock clock;
  CoordinatorOptions o;
  o.heartbeat_reports_from = 3;
  auto s = Make(&clock, o);
  ASSERT_TRUE(s->Register(Reg("src", wsync::v1::ROLE_SOURCE)).ok());
  ASSERT_TRUE(s->Register(Reg("sink", wsync::v1::ROLE_SINK)).ok());
  for (uint64_t v = 1; v <= 3; ++v) ASSERT_TRUE(s->Publish(V(v)).ok());
  wsync::v1::HeartbeatRequest h;
  h.set_name("sink");
  auto small = s->Heartbeat(h);
  ASSERT_TRUE(small.ok());
  EXPECT_FALSE(small->reports_on_heartbeats()) << "two nodes: reports are made as calls";

  ASSERT_TRUE(s->Register(Reg("other", wsync::v1::ROLE_SINK)).ok());
  h.set_applied_version(2);
  auto large = s->Heartbeat(h);
  ASSERT_TRUE(large.ok());
  EXPECT_TRUE(large->reports_on_heartbeats());
  EXPECT_EQ(large->node().applied_version(), 2u);
  EXPECT_EQ(large->node().staleness(), 1u);
  EXPECT_EQ(FindNode(s->GetStatus(), "sink")->applied_version(), 2u);

  h.set_applied_version(9);  // never published
  auto wrong = s->Heartbeat(h);
  ASSERT_TRUE(wrong.ok()) << wrong.status().ToString();
  EXPECT_EQ(wrong->node().applied_version(), 2u) << "the version it cannot take is not recorded";

  // With a staleness bound, publishing acts on the reports: they stay calls.
  o.max_staleness = 2;
  auto bounded = Make(&clock, o);
  for (const char* n : {"a", "b", "c"}) ASSERT_TRUE(bounded->Register(Reg(n, wsync::v1::ROLE_SINK)).ok());
  h.set_name("a");
  h.clear_applied_version();
  EXPECT_FALSE(bounded->Heartbeat(h)->reports_on_heartbeats());
}

// A fleet larger than the heartbeat budget allows at a quarter of the TTL is
// paced: each sink is asked for heartbeats every nodes/budget seconds and is
// dead only after four of those periods; sources are not paced, nor is any
// sink with a staleness bound; a registration starts over at a quarter.
TEST(CoordinatorState, AFleetPastTheHeartbeatBudgetIsPacedAndItsTtlsStretch) {
  FakeClock clock;
  CoordinatorOptions o;
  o.heartbeat_budget = 2;  // heartbeats per second
  auto s = Make(&clock, o);
  auto beat = [&](CoordinatorState* c, const std::string& name) {
    wsync::v1::HeartbeatRequest h;
    h.set_name(name);
    auto r = c->Heartbeat(h);
    EXPECT_TRUE(r.ok()) << name << ": " << r.status().ToString();
    return r.ok() ? r->heartbeat_interval_ms() : ~0ull;
  };
  ASSERT_TRUE(s->Register(Reg("src", wsync::v1::ROLE_SOURCE, 60'000)).ok());
  ASSERT_TRUE(s->Register(Reg("sink-a", wsync::v1::ROLE_SINK, 1000)).ok());
  // Two nodes at 2 heartbeats/s: one a second each, above a quarter of
  // sink-a's TTL (250 ms).
  EXPECT_EQ(beat(s.get(), "sink-a"), 1000u);
  ASSERT_TRUE(s->Register(Reg("sink-b", wsync::v1::ROLE_SINK, 8000)).ok());
  ASSERT_TRUE(s->Register(Reg("sink-c", wsync::v1::ROLE_SINK, 8000)).ok());
  // Four nodes at 2 heartbeats/s: one every 2 s each.
  EXPECT_EQ(beat(s.get(), "sink-a"), 2000u);
  EXPECT_EQ(beat(s.get(), "sink-b"), 0u) << "a quarter of its 8 s TTL is 2 s: not paced";
  EXPECT_EQ(beat(s.get(), "src"), 0u) << "sources are not paced";
  EXPECT_EQ(FindNode(s->GetStatus(), "sink-a")->heartbeat_interval_ms(), 2000u);

  // sink-a is dead after four periods (8 s), not after its TTL (1 s).
  clock.Advance(7900);
  s->Tick();
  EXPECT_EQ(FindNode(s->GetStatus(), "sink-a")->state(), wsync::v1::NODE_ALIVE);
  clock.Advance(200);
  s->Tick();
  EXPECT_EQ(FindNode(s->GetStatus(), "sink-a")->state(), wsync::v1::NODE_DEAD);
  // Registered again, it starts over at a quarter of its TTL.
  auto again = s->Register(Reg("sink-a", wsync::v1::ROLE_SINK, 1000));
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->node().heartbeat_interval_ms(), 0u);
  clock.Advance(1100);
  s->Tick();
  EXPECT_EQ(FindNode(s->GetStatus(), "sink-a")->state(), wsync::v1::NODE_DEAD) << "its TTL, unpaced, ran out";

  // With a staleness bound, liveness gates publishing: never paced.
  o.max_staleness = 2;
  auto bounded = Make(&clock, o);
  for (const char* n : {"a", "b", "c", "d"}) ASSERT_TRUE(bounded->Register(Reg(n, wsync::v1::ROLE_SINK, 1000)).ok());
  EXPECT_EQ(beat(bounded.get(), "a"), 0u);
  // Nor with no budget.
  o.max_staleness = 0;
  o.heartbeat_budget = 0;
  auto unpaced = Make(&clock, o);
  for (const char* n : {"a", "b", "c", "d"}) ASSERT_TRUE(unpaced->Register(Reg(n, wsync::v1::ROLE_SINK, 1000)).ok());
  EXPECT_EQ(beat(unpaced.get(), "a"), 0u);
}

// A coordinator recovered from its store (a failover) does not know what
// periods the sinks were asked for: it gives each the grace of the fleet's
// pace, four periods, not its TTL.
TEST(CoordinatorState, ARecoveredCoordinatorGivesPacedSinksFourPeriodsOfGrace) {
  const std::string dir = ::testing::TempDir() + "/wsync_paced_" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  FakeClock clock;
  CoordinatorOptions o;
  o.heartbeat_budget = 2;
  {
    auto s = Durable(dir, &clock, o);
    ASSERT_TRUE(s);
    for (const char* n : {"a", "b", "c", "d"}) ASSERT_TRUE(s->Register(Reg(n, wsync::v1::ROLE_SINK, 1000)).ok());
  }
  auto s = Durable(dir, &clock, o);
  ASSERT_TRUE(s);
  clock.Advance(7900);
  s->Tick();
  EXPECT_EQ(FindNode(s->GetStatus(), "a")->state(), wsync::v1::NODE_ALIVE) << "four periods of 2 s";
  clock.Advance(200);
  s->Tick();
  EXPECT_EQ(FindNode(s->GetStatus(), "a")->state(), wsync::v1::NODE_DEAD);
  std::filesystem::remove_all(dir);
}

TEST(CoordinatorState, BlockPolicyNamesTheLaggingSinks) {
  FakeClock clock;
  CoordinatorOptions o;
  o.max_staleness = 2;
  o.policy = wsync::v1::STALENESS_BLOCK;
  auto s = Make(&clock, o);
  ASSERT_TRUE(s->Register(Reg("fast", wsync::v1::ROLE_SINK)).ok());
  ASSERT_TRUE(s->Register(Reg("slow", wsync::v1::ROLE_SINK)).ok());
  ASSERT_TRUE(s->Register(Reg("new", wsync::v1::ROLE_SINK)).ok());  // never applied: does not block
  for (uint64_t v = 1; v <= 3; ++v) ASSERT_TRUE(s->Publish(V(v)).ok());
  ASSERT_TRUE(s->ReportApplied("fast", 3).ok());
  ASSERT_TRUE(s->ReportApplied("slow", 1).ok());
  auto may = s->MayPublish(4);
  ASSERT_TRUE(may.ok());
  EXPECT_FALSE(may->allowed());
  ASSERT_EQ(may->blocking_size(), 1);
  EXPECT_EQ(may->blocking(0), "slow");
  ASSERT_TRUE(s->ReportApplied("slow", 2).ok());
  EXPECT_TRUE(s->MayPublish(4)->allowed());
  EXPECT_EQ(s->MayPublish(3).status().code(), StatusCode::kFailedPrecondition);
}

// A source restarted after announcing the head holds no version (its
// heartbeat says so): a sink that lacks the head can only get the next one,
// so the block policy does not wait for it (it would wait forever). A sink
// behind a relay that holds the head still blocks; so does every sink while
// what the source holds is not known (registered again, no heartbeat yet).
TEST(CoordinatorState, BlockPolicyDoesNotWaitForAHeadNoSourceHolds) {
  FakeClock clock;
  CoordinatorOptions o;
  o.max_staleness = 1;
  o.policy = wsync::v1::STALENESS_BLOCK;
  o.fanout = 2;  // src -> relay, direct; relay -> leaf
  auto s = Make(&clock, o);
  ASSERT_TRUE(s->Register(Reg("src", wsync::v1::ROLE_SOURCE)).ok());
  for (uint64_t v = 1; v <= 3; ++v) {
    auto summary = V(v);
    summary.set_source("src");
    ASSERT_TRUE(s->Publish(summary).ok());
  }
  ASSERT_TRUE(s->Register(Reg("relay", wsync::v1::ROLE_SINK)).ok());
  ASSERT_TRUE(s->ReportApplied("relay", 3).ok());
  ASSERT_TRUE(s->Register(Reg("direct", wsync::v1::ROLE_SINK)).ok());
  ASSERT_TRUE(s->Register(Reg("leaf", wsync::v1::ROLE_SINK)).ok());
  ASSERT_TRUE(s->ReportApplied("direct", 1).ok());
  ASSERT_TRUE(s->ReportApplied("leaf", 1).ok());
  ASSERT_EQ(FindNode(s->GetStatus(), "direct")->parent(), "src");
  ASSERT_EQ(FindNode(s->GetStatus(), "leaf")->parent(), "relay");
  EXPECT_EQ(s->MayPublish(4)->blocking_size(), 2) << "the source holds version 3: both can get it";
  // The source restarts: registered again (holdings not known yet), then
  // its heartbeat says it holds nothing.
  ASSERT_TRUE(s->Register(Reg("src", wsync::v1::ROLE_SOURCE)).ok());
  EXPECT_EQ(s->MayPublish(4)->blocking_size(), 2) << "not known yet: as before";
  wsync::v1::HeartbeatRequest h;
  h.set_name("src");
  h.set_source_head(0);
  ASSERT_TRUE(s->Heartbeat(h).ok());
  auto may = s->MayPublish(4);
  ASSERT_EQ(may->blocking_size(), 1) << "'direct' cannot get version 3 from anyone: not waited for";
  EXPECT_EQ(may->blocking(0), "leaf") << "its relay holds version 3";
  // The restarted source publishes version 4 (it holds it): back to normal.
  ASSERT_TRUE(s->ReportApplied("leaf", 3).ok());
  auto four = V(4);
  four.set_source("src");
  ASSERT_TRUE(s->Publish(four).ok());
  EXPECT_EQ(s->MayPublish(5)->blocking_size(), 3) << "every sink can get version 4: each one lagging blocks";
}

TEST(CoordinatorState, EvictPolicyTellsLaggardsToResync) {
  FakeClock clock;
  CoordinatorOptions o;
  o.max_staleness = 1;
  o.policy = wsync::v1::STALENESS_EVICT;
  auto s = Make(&clock, o);
  ASSERT_TRUE(s->Register(Reg("slow", wsync::v1::ROLE_SINK)).ok());
  for (uint64_t v = 1; v <= 3; ++v) ASSERT_TRUE(s->Publish(V(v)).ok());
  ASSERT_TRUE(s->ReportApplied("slow", 1).ok());
  auto may = s->MayPublish(4);
  ASSERT_TRUE(may.ok());
  EXPECT_TRUE(may->allowed());
  ASSERT_EQ(may->evicted_size(), 1);
  wsync::v1::HeartbeatRequest h;
  h.set_name("slow");
  EXPECT_TRUE(s->Heartbeat(h)->node().resync_keyframe());
  ASSERT_TRUE(s->Publish(V(4)).ok());
  ASSERT_TRUE(s->ReportApplied("slow", 4).ok());  // after its keyframe
  EXPECT_FALSE(s->Heartbeat(h)->node().resync_keyframe());
}

TEST(CoordinatorState, ParentsFormATreeOfBoundedFanoutAndHeal) {
  FakeClock clock;
  auto s = WithSourceAtVersion1(&clock, 2);
  for (int i = 0; i < 2; ++i) {
    std::string name = "s" + std::to_string(i);
    ASSERT_TRUE(s->Register(Reg(name, wsync::v1::ROLE_SINK, 1000)).ok());
    ASSERT_TRUE(s->ReportApplied(name, 1).ok());
  }
  // The source is full; later sinks attach to sinks at head.
  for (int i = 2; i < 6; ++i) ASSERT_TRUE(s->Register(Reg("s" + std::to_string(i), wsync::v1::ROLE_SINK, 1000)).ok());
  auto st = s->GetStatus();
  std::map<std::string, int> children;
  for (const auto& n : st.nodes()) {
    if (n.role() != wsync::v1::ROLE_SINK) continue;
    ASSERT_FALSE(n.parent().empty()) << n.name();
    ASSERT_NE(n.parent(), n.name());
    ++children[n.parent()];
  }
  for (const auto& [p, c] : children) EXPECT_LE(c, 2) << p;
  EXPECT_EQ(FindNode(st, "s0")->parent(), "src");
  EXPECT_EQ(FindNode(st, "s1")->parent(), "src");
  // s0 dies: its children are reassigned to live parents.
  for (int step = 0; step < 3; ++step) {
    clock.Advance(600);
    for (const auto& n : st.nodes()) {
      if (n.name() == "s0") continue;
      wsync::v1::HeartbeatRequest h;
      h.set_name(n.name());
      ASSERT_TRUE(s->Heartbeat(h).ok()) << n.name();
    }
  }
  s->Tick();
  st = s->GetStatus();
  EXPECT_EQ(FindNode(st, "s0")->state(), wsync::v1::NODE_DEAD);
  for (const auto& n : st.nodes()) {
    if (n.role() != wsync::v1::ROLE_SINK || n.name() == "s0") continue;
    EXPECT_NE(n.parent(), "s0") << n.name();
    EXPECT_FALSE(n.parent().empty()) << n.name();
  }
}

// A relay whose watch stream breaks loses its children at once (not at its
// TTL); when it heartbeats again within its TTL, holding the head, the
// child that went to the source comes back to it.
TEST(CoordinatorState, ARelaysChildrenMoveWhenItsWatchBreaksAndComeBack) {
  FakeClock clock;
  auto s = WithSourceAtVersion1(&clock, 1);  // a chain: src -> relay -> leaf
  auto relay = s->Register(Reg("relay", wsync::v1::ROLE_SINK, 1000));
  ASSERT_TRUE(relay.ok());
  ASSERT_TRUE(s->ReportApplied("relay", 1).ok());
  ASSERT_TRUE(s->Register(Reg("leaf", wsync::v1::ROLE_SINK, 1000)).ok());
  ASSERT_EQ(FindNode(s->GetStatus(), "leaf")->parent(), "relay");
  s->WatchBroken("relay", relay->node().incarnation());
  auto st = s->GetStatus();
  EXPECT_EQ(FindNode(st, "relay")->state(), wsync::v1::NODE_DISCONNECTED);
  EXPECT_EQ(FindNode(st, "leaf")->parent(), "src") << "moved at once, not at the relay's TTL";
  clock.Advance(500);  // within the TTL
  wsync::v1::HeartbeatRequest h;
  h.set_name("relay");
  ASSERT_TRUE(s->Heartbeat(h).ok());
  st = s->GetStatus();
  EXPECT_EQ(FindNode(st, "relay")->state(), wsync::v1::NODE_ALIVE);
  EXPECT_EQ(FindNode(st, "relay")->parent(), "src");
  EXPECT_EQ(FindNode(st, "leaf")->parent(), "relay") << "given back";
}

// A sink that reports its parent unreachable gets another holder of the
// version, and not that parent again while another holds the head.
TEST(CoordinatorState, AnUnreachableParentIsReplacedAndAvoided) {
  FakeClock clock;
  auto s = WithSourceAtVersion1(&clock, 2);
  for (const char* r : {"r0", "r1"}) {
    ASSERT_TRUE(s->Register(Reg(r, wsync::v1::ROLE_SINK, 1000)).ok());
    ASSERT_TRUE(s->ReportApplied(r, 1).ok());
  }
  ASSERT_TRUE(s->Register(Reg("leaf", wsync::v1::ROLE_SINK, 1000)).ok());
  const std::string first = FindNode(s->GetStatus(), "leaf")->parent();
  ASSERT_TRUE(first == "r0" || first == "r1") << first;
  wsync::v1::HeartbeatRequest h;
  h.set_name("leaf");
  h.set_unreachable_parent("src");  // not its parent: ignored
  auto resp = s->Heartbeat(h);
  ASSERT_TRUE(resp.ok());
  EXPECT_EQ(resp->node().parent(), first);
  h.set_unreachable_parent(first);
  resp = s->Heartbeat(h);
  ASSERT_TRUE(resp.ok());
  const std::string second = resp->node().parent();
  EXPECT_FALSE(second.empty());
  EXPECT_NE(second, first) << "the same unreachable parent again";
  // The avoided parent restarts (registers again): it may be a parent again.
  ASSERT_TRUE(s->Register(Reg(first, wsync::v1::ROLE_SINK, 1000)).ok());
}

TEST(CoordinatorState, WaitForChangeWakesOnPublish) {
  FakeClock clock;
  auto s = Make(&clock);
  const uint64_t g = s->generation();
  std::thread publisher([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    ASSERT_TRUE(s->Publish(V(1)).ok());
  });
  uint64_t now = s->WaitForChange(g, std::chrono::steady_clock::now() + std::chrono::seconds(10));
  publisher.join();
  EXPECT_NE(now, g);
  EXPECT_EQ(s->head(), 1u);
}

// Watchers wait for versions only: a fleet's reports, heartbeats and
// registrations (thousands a second) must not wake every watcher.
TEST(CoordinatorState, WatchersWakeForVersionsNotForTheFleet) {
  FakeClock clock;
  auto s = Make(&clock);
  ASSERT_TRUE(s->Publish(V(1)).ok());
  const uint64_t g = s->versions_generation();
  ASSERT_TRUE(s->Register(Reg("sink-0", wsync::v1::ROLE_SINK, 1000)).ok());
  ASSERT_TRUE(s->ReportApplied("sink-0", 1).ok());
  wsync::v1::HeartbeatRequest hb;
  hb.set_name("sink-0");
  ASSERT_TRUE(s->Heartbeat(hb).ok());
  EXPECT_EQ(s->versions_generation(), g);
  EXPECT_EQ(s->WaitForVersions(g, std::chrono::steady_clock::now() + std::chrono::milliseconds(1)), g);
  std::thread publisher([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    ASSERT_TRUE(s->Publish(V(2)).ok());
  });
  EXPECT_NE(s->WaitForVersions(g, std::chrono::steady_clock::now() + std::chrono::seconds(10)), g);
  publisher.join();
}

TEST(CoordinatorState, RecoversEverythingFromItsStore) {
  const std::string dir = ::testing::TempDir() + "/wsync_state_" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  FakeClock clock;
  CoordinatorOptions o;
  o.compact_every = 5;  // exercise snapshot + log replay together
  wsync::v1::StatusResponse before;
  {
    Recovered rec;
    auto store = OpenLogStore(dir, &rec);
    ASSERT_TRUE(store.ok());
    auto s = CoordinatorState::Create(o, &clock, std::move(*store), rec);
    ASSERT_TRUE(s.ok());
    ASSERT_TRUE((*s)->Register(Reg("src", wsync::v1::ROLE_SOURCE)).ok());
    ASSERT_TRUE((*s)->Register(Reg("sink", wsync::v1::ROLE_SINK)).ok());
    for (uint64_t v = 1; v <= 7; ++v) ASSERT_TRUE((*s)->Publish(V(v)).ok());
    ASSERT_TRUE((*s)->ReportApplied("sink", 6).ok());
    ASSERT_TRUE((*s)->AcquireLease("sink", 6, 60'000).ok());
    before = (*s)->GetStatus();
  }
  Recovered rec;
  auto store = OpenLogStore(dir, &rec);
  ASSERT_TRUE(store.ok());
  auto s = CoordinatorState::Create(o, &clock, std::move(*store), rec);
  ASSERT_TRUE(s.ok());
  auto after = (*s)->GetStatus();
  EXPECT_EQ(after.head_version(), 7u);
  EXPECT_EQ(after.leases_size(), 1);
  EXPECT_EQ(after.leases(0).version(), 6u);
  EXPECT_EQ(FindNode(after, "sink")->applied_version(), 6u);
  EXPECT_EQ(FindNode(after, "sink")->incarnation(), FindNode(before, "sink")->incarnation());
  auto another7 = V(7);
  another7.set_set_checksum(99);
  EXPECT_EQ((*s)->Publish(another7).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ((*s)->Publish(V(8)).status().code(), StatusCode::kOk);
  // Lease ids keep growing too.
  auto l = (*s)->AcquireLease("sink", 7, 1000);
  ASSERT_TRUE(l.ok());
  EXPECT_GT(l->id(), before.leases(0).id());
  std::filesystem::remove_all(dir);
}

// A store that counts the calls made of it, over a real one.
class CountingStore : public Store {
 public:
  explicit CountingStore(std::unique_ptr<Store> inner) : inner_(std::move(inner)) {}
  Status Append(const wsync::store::v1::Record& r) override {
    ++appends;
    records.push_back(r);
    return inner_->Append(r);
  }
  Status AppendBatch(const std::vector<wsync::store::v1::Record>& rs) override {
    ++batches;
    if (during_batch) std::exchange(during_batch, nullptr)();
    if (fail_batches > 0) {
      --fail_batches;
      return UnavailableError("injected: the store did not confirm the write");
    }
    records.insert(records.end(), rs.begin(), rs.end());
    return inner_->AppendBatch(rs);
  }
  Status Compact(const wsync::store::v1::Snapshot& s) override { return inner_->Compact(s); }
  size_t LogRecords() const override { return inner_->LogRecords(); }
  int appends = 0, batches = 0;
  int fail_batches = 0;               // the next batches fail
  std::function<void()> during_batch;  // runs once, within the next batch's call
  std::vector<wsync::store::v1::Record> records;

 private:
  std::unique_ptr<Store> inner_;
};

// Applied versions that heartbeats carry are carried again by the next ones:
// stored once a second, not at every tick (each commit holds the state).
TEST(CoordinatorState, ReportsCarriedByHeartbeatsAreStoredOnceASecond) {
  const std::string dir = ::testing::TempDir() + "/wsync_hb_reports_" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  FakeClock clock;
  Recovered rec;
  auto store = OpenLogStore(dir, &rec);
  ASSERT_TRUE(store.ok());
  auto counting = std::make_unique<CountingStore>(std::move(*store));
  CountingStore* count = counting.get();
  CoordinatorOptions o;
  o.heartbeat_reports_from = 10;
  auto s = CoordinatorState::Create(o, &clock, std::move(counting), rec);
  ASSERT_TRUE(s.ok());
  for (int i = 0; i < 10; ++i) ASSERT_TRUE((*s)->Register(Reg("sink-" + std::to_string(i), wsync::v1::ROLE_SINK)).ok());
  ASSERT_TRUE((*s)->Publish(V(1)).ok());
  count->appends = count->batches = 0;
  wsync::v1::HeartbeatRequest h;
  h.set_applied_version(1);
  for (int i = 0; i < 10; ++i) {
    h.set_name("sink-" + std::to_string(i));
    auto hb = (*s)->Heartbeat(h);
    ASSERT_TRUE(hb.ok());
    EXPECT_TRUE(hb->reports_on_heartbeats());
  }
  (*s)->Tick();
  clock.Advance(999);
  (*s)->Tick();
  EXPECT_EQ(count->appends + count->batches, 0) << "held for a second";
  clock.Advance(1);
  (*s)->Tick();
  EXPECT_EQ(count->batches, 1);
  EXPECT_EQ(count->records.back().node_reports().nodes_size(), 10);
  std::filesystem::remove_all(dir);
}

// A tick stores the reports with the state's lock released: a heartbeat is
// answered while the store writes them, and a durable change made meanwhile
// is stored after them. A failed write keeps them for the next tick, except
// those of a node that is gone since (a report must not follow its end).
TEST(CoordinatorState, ReportsAreStoredWithoutHoldingTheStateAndInTheirOrder) {
  const std::string dir = ::testing::TempDir() + "/wsync_flush_" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  FakeClock clock;
  {
    CountingStore* count = nullptr;
    auto s = Durable(dir, &clock, {}, [&](std::unique_ptr<Store> inner) {
      auto counting = std::make_unique<CountingStore>(std::move(inner));
      count = counting.get();
      return counting;
    });
    ASSERT_TRUE(s);
    CoordinatorState* state = s.get();
    for (int i = 0; i < 4; ++i) ASSERT_TRUE(state->Register(Reg("sink-" + std::to_string(i), wsync::v1::ROLE_SINK)).ok());
    ASSERT_TRUE(state->Publish(V(1)).ok());
    for (int i = 0; i < 4; ++i) ASSERT_TRUE(state->ReportApplied("sink-" + std::to_string(i), 1).ok());
    count->records.clear();

    std::thread beat, publisher;
    std::atomic<bool> answered{false};
    count->during_batch = [&] {
      // With the state's lock held here, this heartbeat would wait until the
      // write ends.
      beat = std::thread([&] {
        wsync::v1::HeartbeatRequest h;
        h.set_name("sink-1");
        answered = state->Heartbeat(h).ok();
      });
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
      while (!answered && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      EXPECT_TRUE(answered) << "a heartbeat waited for the store's write";
      publisher = std::thread([&] { EXPECT_TRUE(state->Publish(V(2)).ok()); });
    };
    state->Tick();
    beat.join();
    publisher.join();
    ASSERT_EQ(count->records.size(), 2u);
    EXPECT_EQ(count->records[0].node_reports().nodes_size(), 4) << "the reports first";
    EXPECT_TRUE(count->records[1].has_version_published());

    // A failed write: the reports stay, except sink-0's, deregistered while
    // the write was made.
    for (int i = 0; i < 4; ++i) ASSERT_TRUE(state->ReportApplied("sink-" + std::to_string(i), 2).ok());
    count->records.clear();
    count->fail_batches = 1;
    std::thread leaving;
    count->during_batch = [&] { leaving = std::thread([&] { EXPECT_TRUE(state->Deregister("sink-0").ok()); }); };
    state->Tick();
    leaving.join();
    state->Tick();
    ASSERT_TRUE(state->Flush().ok());
    bool gone = false;
    for (const auto& r : count->records) {
      gone = gone || r.node_deregistered() == "sink-0";
      for (const auto& n : r.node_reports().nodes()) EXPECT_FALSE(gone && n.name() == "sink-0") << "a report after its end";
    }
    EXPECT_TRUE(gone);
  }
  auto s = Durable(dir, &clock);
  ASSERT_TRUE(s);
  const auto status = s->GetStatus();
  EXPECT_EQ(FindNode(status, "sink-0"), nullptr) << "deregistered, not brought back by its report";
  EXPECT_EQ(FindNode(status, "sink-3")->applied_version(), 2u) << "stored at the next try";
  EXPECT_EQ(status.head_version(), 2u);
  std::filesystem::remove_all(dir);
}

TEST(CoordinatorState, ReportsAreStoredTogetherAtTheTickOrAheadOfTheNextDurableChange) {
  const std::string dir = ::testing::TempDir() + "/wsync_reports_" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  FakeClock clock;
  {
    Recovered rec;
    auto store = OpenLogStore(dir, &rec);
    ASSERT_TRUE(store.ok());
    auto counting = std::make_unique<CountingStore>(std::move(*store));
    CountingStore* count = counting.get();
    auto s = CoordinatorState::Create({}, &clock, std::move(counting), rec);
    ASSERT_TRUE(s.ok());
    for (int i = 0; i < 100; ++i) ASSERT_TRUE((*s)->Register(Reg("sink-" + std::to_string(i), wsync::v1::ROLE_SINK)).ok());
    ASSERT_TRUE((*s)->Publish(V(1)).ok());
    ASSERT_TRUE((*s)->Publish(V(2)).ok());
    count->appends = count->batches = 0;
    count->records.clear();

    for (int i = 0; i < 100; ++i) ASSERT_TRUE((*s)->ReportApplied("sink-" + std::to_string(i), 2).ok());
    EXPECT_EQ(count->appends + count->batches, 0) << "answered before it is stored";
    EXPECT_EQ(FindNode((*s)->GetStatus(), "sink-7")->applied_version(), 2u);
    (*s)->Tick();
    ASSERT_EQ(count->batches, 1);
    ASSERT_EQ(count->records.size(), 1u);
    EXPECT_EQ(count->records[0].node_reports().nodes_size(), 100);
    (*s)->Tick();
    EXPECT_EQ(count->batches, 1) << "nothing new to store";

    // A report, then a version: one batch, the report first.
    ASSERT_TRUE((*s)->ReportApplied("sink-0", 1).ok());
    ASSERT_TRUE((*s)->ReportApplied("sink-0", 2).ok());
    ASSERT_TRUE((*s)->ReportApplied("sink-0", 1).ok());
    ASSERT_TRUE((*s)->Publish(V(3)).ok());
    ASSERT_EQ(count->batches, 2);
    ASSERT_EQ(count->records.size(), 3u);
    ASSERT_EQ(count->records[1].node_reports().nodes_size(), 1) << "a node's latest report only";
    EXPECT_EQ(count->records[1].node_reports().nodes(0).applied_version(), 1u);
    EXPECT_TRUE(count->records[2].has_version_published());

    // Reported, not yet stored, and the coordinator dies: forgotten.
    ASSERT_TRUE((*s)->ReportApplied("sink-1", 3).ok());
  }
  Recovered rec;
  auto store = OpenLogStore(dir, &rec);
  ASSERT_TRUE(store.ok());
  auto s = CoordinatorState::Create({}, &clock, std::move(*store), rec);
  ASSERT_TRUE(s.ok());
  const auto status = (*s)->GetStatus();
  EXPECT_EQ(FindNode(status, "sink-0")->applied_version(), 1u);
  EXPECT_EQ(FindNode(status, "sink-1")->applied_version(), 2u) << "the report of 3 was not stored";
  EXPECT_EQ(FindNode(status, "sink-99")->applied_version(), 2u);
  // Flush stores what a tick would.
  ASSERT_TRUE((*s)->ReportApplied("sink-1", 3).ok());
  ASSERT_TRUE((*s)->Flush().ok());
  std::filesystem::remove_all(dir);
}

// A store whose calls wait while the gate is closed, counting them.
class GatedStore : public Store {
 public:
  Status Append(const wsync::store::v1::Record& r) override { return AppendBatch({r}); }
  Status AppendBatch(const std::vector<wsync::store::v1::Record>& rs) override {
    std::unique_lock<std::mutex> lock(mu_);
    ++calls_;
    sizes.push_back(rs.size());
    changed_.notify_all();
    changed_.wait(lock, [&] { return open_; });
    return Status::Ok();
  }
  Status Compact(const wsync::store::v1::Snapshot&) override { return Status::Ok(); }
  size_t LogRecords() const override { return 0; }
  void WaitForCalls(int n) {
    std::unique_lock<std::mutex> lock(mu_);
    changed_.wait(lock, [&] { return calls_ >= n; });
  }
  void Open() {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = true;
    changed_.notify_all();
  }
  std::vector<size_t> sizes;  // records per call, read after the calls end

 private:
  std::mutex mu_;
  std::condition_variable changed_;
  int calls_ = 0;
  bool open_ = false;
};

TEST(CoordinatorState, RegistrationsArrivingDuringACommitAreCommittedTogether) {
  FakeClock clock;
  auto gated = std::make_unique<GatedStore>();
  GatedStore* store = gated.get();
  auto created = CoordinatorState::Create({}, &clock, std::move(gated), Recovered());
  ASSERT_TRUE(created.ok());
  CoordinatorState& s = **created;
  auto request = [](const std::string& name, const std::string& id) {
    auto r = Reg(name, wsync::v1::ROLE_SINK);
    r.set_request_id(id);
    return r;
  };
  std::vector<StatusOr<wsync::v1::RegisterResponse>> answers(12, InternalError("not run"));
  std::vector<std::thread> threads;
  threads.emplace_back([&] { answers[0] = s.Register(request("node-0", "a0")); });
  store->WaitForCalls(1);  // node-0's commit is under way, and waits
  for (int i = 1; i <= 9; ++i) {
    threads.emplace_back([&, i] { answers[i] = s.Register(request("node-" + std::to_string(i), "a" + std::to_string(i))); });
  }
  threads.emplace_back([&] { answers[10] = s.Register(request("node-3", "another")); });  // a second process of node-3
  threads.emplace_back([&] { answers[11] = s.Register(request("node-5", "a5")); });       // a retry of node-5's call
  while (s.RegistrationsQueued() < 11) std::this_thread::yield();
  store->Open();
  for (auto& t : threads) t.join();

  for (const auto& a : answers) ASSERT_TRUE(a.ok()) << a.status().ToString();
  // node-0 alone; the nine that queued behind it in one batch; node-3's
  // second registration after its first (the retry of node-5 is answered
  // without a record).
  EXPECT_EQ(store->sizes, (std::vector<size_t>{1, 9, 1}));
  std::set<uint64_t> incarnations;
  for (int i = 0; i <= 10; ++i) incarnations.insert(answers[i]->node().incarnation());
  EXPECT_EQ(incarnations.size(), 11u) << "each registration its own incarnation";
  EXPECT_EQ(answers[11]->node().incarnation(), answers[5]->node().incarnation()) << "a retry is the first call's answer";
  // node-3's two processes, in the order they queued: the later one's incarnation stands.
  const auto status = s.GetStatus();
  EXPECT_EQ(FindNode(status, "node-3")->incarnation(),
            std::max(answers[3]->node().incarnation(), answers[10]->node().incarnation()));
  for (int i = 0; i <= 9; ++i) EXPECT_NE(FindNode(status, "node-" + std::to_string(i)), nullptr);
}

// ---- Several sources, each a part of the tensors.

wsync::v1::Layout PartLayout(uint32_t part, const std::string& source, const std::vector<std::string>& names) {
  wsync::v1::Layout l;
  l.set_parts(2);
  l.set_source(source);
  for (const auto& n : names) {
    auto* t = l.add_tensors();
    t->set_name(n);
    t->set_dtype("BF16");
    t->add_shape(4);
    t->set_part(part);
  }
  return l;
}

wsync::v1::VersionSummary Part(uint64_t v, uint32_t part, uint64_t checksum = 0) {
  auto s = V(v);
  s.set_part(part);
  s.set_parts(2);
  s.set_source(part == 0 ? "src-a" : "src-b");
  s.set_set_checksum(checksum);
  s.set_patch_bytes(100 + part);
  return s;
}

TEST(CoordinatorState, AVersionOfSeveralSourcesExistsOnceEveryPartIsIn) {
  FakeClock clock;
  auto s = Make(&clock);
  ASSERT_TRUE(s->SetLayout(PartLayout(0, "src-a", {"a", "b"})).ok());
  EXPECT_FALSE(s->GetLayout().set()) << "half a layout";
  EXPECT_EQ(s->SetLayout(PartLayout(1, "src-b", {"b", "c"})).code(), StatusCode::kFailedPrecondition)
      << "a tensor in two parts";
  ASSERT_TRUE(s->SetLayout(PartLayout(1, "src-b", {"c"})).ok());
  EXPECT_TRUE(s->GetLayout().set());
  EXPECT_EQ(s->GetLayout().layout().part_sources(1), "src-b");
  EXPECT_EQ(s->SetLayout(PartLayout(1, "src-b", {"d"})).code(), StatusCode::kFailedPrecondition) << "part 1 differs";
  auto whole = PartLayout(0, "src", {"a", "b", "c"});
  whole.set_parts(0);
  EXPECT_EQ(s->SetLayout(whole).code(), StatusCode::kFailedPrecondition) << "a whole-set source";

  ASSERT_TRUE(s->Publish(Part(1, 0)).ok());
  EXPECT_EQ(s->head(), 0u) << "half a version is invisible";
  auto list = s->ListVersions(0);
  EXPECT_EQ(list.versions_size(), 0);
  ASSERT_EQ(list.partial_size(), 1);
  EXPECT_EQ(list.partial(0).part_summaries_size(), 1);
  ASSERT_TRUE(s->Publish(Part(1, 1)).ok());
  EXPECT_EQ(s->head(), 1u);
  list = s->ListVersions(0);
  ASSERT_EQ(list.versions_size(), 1);
  EXPECT_EQ(list.partial_size(), 0);
  EXPECT_EQ(list.versions(0).part_summaries_size(), 2);
  EXPECT_EQ(list.versions(0).patch_bytes(), 201u);
  EXPECT_EQ(list.versions(0).source(), "src-a+src-b");
  EXPECT_TRUE(s->Publish(Part(1, 1)).ok()) << "a retry of a stored part";

  // Source b dies after a announced version 2; restarted, it announces 2
  // again (a keyframe): the version is whole then, never before.
  ASSERT_TRUE(s->Publish(Part(2, 0)).ok());
  EXPECT_EQ(s->head(), 1u);
  auto b2 = Part(2, 1, 7);
  b2.set_keyframe(true);
  b2.set_base_version(0);
  ASSERT_TRUE(s->Publish(b2).ok());
  EXPECT_EQ(s->head(), 2u);
  // A part announced again before its version is whole replaces the first.
  ASSERT_TRUE(s->Publish(Part(3, 0, 1)).ok());
  ASSERT_TRUE(s->Publish(Part(3, 0, 2)).ok());
  EXPECT_EQ(s->ListVersions(2).partial(0).part_summaries(0).set_checksum(), 2u);
  // A version whole above a partial one leaves it behind.
  ASSERT_TRUE(s->Publish(Part(4, 0)).ok());
  ASSERT_TRUE(s->Publish(Part(4, 1)).ok());
  EXPECT_EQ(s->head(), 4u);
  EXPECT_EQ(s->ListVersions(0).partial_size(), 0);
  EXPECT_EQ(s->Publish(Part(3, 1)).status().code(), StatusCode::kFailedPrecondition) << "below the head";
}

TEST(CoordinatorState, PartsOfAVersionSurviveARestart) {
  const std::string dir = ::testing::TempDir() + "/wsync_parts_" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  FakeClock clock;
  CoordinatorOptions o;
  o.compact_every = 3;
  {
    auto s = Durable(dir, &clock, o);
    ASSERT_TRUE(s);
    ASSERT_TRUE(s->SetLayout(PartLayout(0, "src-a", {"a"})).ok());
    ASSERT_TRUE(s->SetLayout(PartLayout(1, "src-b", {"b"})).ok());
    ASSERT_TRUE(s->Publish(Part(1, 0)).ok());
    ASSERT_TRUE(s->Publish(Part(1, 1)).ok());
    ASSERT_TRUE(s->Publish(Part(2, 0)).ok());
  }
  auto s = Durable(dir, &clock, o);
  ASSERT_TRUE(s);
  EXPECT_EQ(s->head(), 1u);
  EXPECT_TRUE(s->GetLayout().set());
  ASSERT_EQ(s->ListVersions(0).partial_size(), 1);
  ASSERT_TRUE(s->Publish(Part(2, 1)).ok());
  EXPECT_EQ(s->head(), 2u) << "the part announced before the restart counts";
  std::filesystem::remove_all(dir);
}

// The layouts a source serves change (say the rollout fleet moves from TP 4
// to TP 8): the same tensors with other tile grids are taken, recorded
// durably, for a whole set and for one part; other tensors are still refused.
TEST(CoordinatorState, TileGridsChangeWithTheLayoutsServed) {
  const std::string dir = ::testing::TempDir() + "/wsync_regrid_" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  FakeClock clock;
  auto grid = [](wsync::v1::Layout l, const std::string& name, uint64_t cut) {
    for (auto& t : *l.mutable_tensors()) {
      if (t.name() == name) t.add_row_cuts(cut);
    }
    return l;
  };
  auto whole = PartLayout(0, "src", {"a", "b"});
  whole.set_parts(0);
  for (auto& t : *whole.mutable_tensors()) t.set_part(0);
  {
    Recovered rec;
    auto store = OpenLogStore(dir, &rec);
    ASSERT_TRUE(store.ok());
    auto s = CoordinatorState::Create(CoordinatorOptions{}, &clock, std::move(*store), rec);
    ASSERT_TRUE(s.ok());
    ASSERT_TRUE((*s)->SetLayout(grid(whole, "a", 2)).ok());
    ASSERT_TRUE((*s)->Publish(V(1)).ok());
    ASSERT_TRUE((*s)->SetLayout(grid(grid(whole, "a", 1), "b", 2)).ok()) << "the same tensors, other grids";
    EXPECT_EQ((*s)->GetLayout().layout().tensors(1).row_cuts_size(), 1);
    auto other = whole;
    other.mutable_tensors(0)->set_shape(0, 8);
    EXPECT_EQ((*s)->SetLayout(other).code(), StatusCode::kFailedPrecondition) << "another shape";
  }
  Recovered rec;
  auto store = OpenLogStore(dir, &rec);
  ASSERT_TRUE(store.ok());
  auto s = CoordinatorState::Create(CoordinatorOptions{}, &clock, std::move(*store), rec);
  ASSERT_TRUE(s.ok());
  const auto layout = (*s)->GetLayout().layout();
  ASSERT_EQ(layout.tensors_size(), 2);
  EXPECT_EQ(layout.tensors(0).row_cuts(0), 1u) << "the new grids survive a restart";
  EXPECT_EQ(layout.tensors(1).row_cuts(0), 2u);
  EXPECT_EQ((*s)->head(), 1u);
  std::filesystem::remove_all(dir);

  auto p = Make(&clock);
  ASSERT_TRUE(p->SetLayout(PartLayout(0, "src-a", {"a"})).ok());
  ASSERT_TRUE(p->SetLayout(PartLayout(1, "src-b", {"b"})).ok());
  ASSERT_TRUE(p->SetLayout(grid(PartLayout(1, "src-b", {"b"}), "b", 3)).ok());
  const auto parts = p->GetLayout().layout();
  EXPECT_EQ(parts.tensors(0).row_cuts_size(), 0) << "part 0 is untouched";
  ASSERT_EQ(parts.tensors(1).row_cuts_size(), 1);
  EXPECT_EQ(parts.tensors(1).row_cuts(0), 3u);
  EXPECT_EQ(parts.part_sources(1), "src-b");
}

}  // namespace
}  // namespace wsync::control
