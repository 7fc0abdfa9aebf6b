// The sink's state machine in-process: SinkCore over the real coordinator
// state machine (control::InProcessClient, a fake clock), the loopback
// transport and a source made of a VersionHistory behind an exchange. Every
// transition of the sync loop: register, watch, pull, apply; a patch that
// does not fit (verify, undo, keyframe); the parent lost and back; a relay
// lost mid-stream; the coordinator unreachable; a layout that does not
// match; holds that defer an apply and expire.
#include "sink_core.h"

#include <gtest/gtest.h>

#include <future>

#include <cstring>
#include <random>
#include <thread>

#include "sink_fixture.h"

namespace wsync::daemon {
namespace {

using namespace sinktest;  // NOLINT

// register -> watch -> pull (a keyframe: it holds nothing) -> apply ->
// report, then one patch per version.
TEST_F(SinkCoreTest, RegistersPullsAKeyframeThenPatches) {
  auto v = Versions(5);
  TestSource source(state_.get(), fabric_);
  for (int k = 0; k < 2; ++k) source.Publish(k + 1, v[k]);
  TestSink sink("sink-0", state_.get(), fabric_);
  ASSERT_TRUE(sink.RegisterMemory(Zeros(v[0])).ok());
  sink.ExpectReaches(2, v[1]);
  for (int k = 2; k < 5; ++k) {
    source.Publish(k + 1, v[k]);
    sink.ExpectReaches(k + 1, v[k]);
  }
  const SinkStatus st = sink.core->status();
  EXPECT_EQ(st.applied, 5u);
  EXPECT_EQ(st.head, 5u);
  EXPECT_TRUE(st.sync_error.ok());
  EXPECT_LE(st.pulls_made, 5u);  // one per version at most (a keyframe, then patches)
  // The coordinator sees what it holds (reported right after the apply).
  WaitReported("sink-0", 5);
}

// In a large fleet the coordinator takes applied versions from heartbeats:
// after each apply the sink makes no ReportApplied call, and the coordinator
// learns every version from its next heartbeat.
TEST_F(SinkCoreTest, AppliedVersionsRideOnHeartbeatsWhenTheCoordinatorSaysSo) {
  control::CoordinatorOptions o;
  o.heartbeat_reports_from = 1;
  ASSERT_NO_FATAL_FAILURE(UseCoordinator(o));
  auto v = Versions(4);
  TestSource source(state_.get(), fabric_);
  source.Publish(1, v[0]);
  TestSink sink("sink-0", state_.get(), fabric_);
  ASSERT_TRUE(sink.RegisterMemory(Zeros(v[0])).ok());
  sink.ExpectReaches(1, v[0]);
  WaitReported("sink-0", 1);
  const auto until = std::chrono::steady_clock::now() + kEventDeadline;
  while (!sink.core->status().reports_on_heartbeats && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(10ms);
  }
  ASSERT_TRUE(sink.core->status().reports_on_heartbeats) << "a heartbeat's answer says so";
  const uint64_t reports = sink.client.report_calls();  // the registration's, perhaps the first apply's
  for (int k = 1; k < 4; ++k) {
    source.Publish(k + 1, v[k]);
    sink.ExpectReaches(k + 1, v[k]);
    WaitReported("sink-0", k + 1);
  }
  EXPECT_EQ(sink.client.report_calls(), reports) << "every later version reached the coordinator on a heartbeat";
}

// A patch that arrives over a slow link in many chunks is decoded while it
// arrives: what is left at the end is the adds and the checks. The result
// is bit for bit the trainer's; with decoding ahead turned off too.
// A fleet past the coordinator's heartbeat budget is paced: the sink's
// heartbeats come at the period the last answer asked for, and a sink that
// registers again starts over at a quarter of its TTL.
TEST_F(SinkCoreTest, ASinkHeartbeatsAtThePeriodTheCoordinatorAsks) {
  control::CoordinatorOptions o;
  o.heartbeat_budget = 1;  // two nodes at one heartbeat a second: one every 2 s each
  ASSERT_NO_FATAL_FAILURE(UseCoordinator(o));
  auto v = Versions(1);
  TestSource source(state_.get(), fabric_);
  source.Publish(1, v[0]);
  TestSink sink("sink-0", state_.get(), fabric_);
  sink.membership->HeartbeatNow(kEventDeadline);
  EXPECT_EQ(sink.membership->period(), 2000ms);
  ASSERT_TRUE(sink.membership->Register().ok());
  EXPECT_EQ(sink.membership->period(), std::chrono::milliseconds(kTtlMs / 4)) << "a new incarnation starts over";
}

TEST_F(SinkCoreTest, PatchesAreDecodedWhileTheyArrive) {
  auto v = Versions(4, 3'000'000);  // patches of 6 codec chunks, streams of ~20 transport chunks
  transport::TransportOptions slow;
  slow.rate_limit_bytes_per_s = 256 << 10;
  VersionHistory::Options small_chunks;
  small_chunks.stream_chunk_bytes = 4096;
  TestSource source(state_.get(), fabric_, slow, "source", small_chunks);
  source.Publish(1, v[0]);
  TestSink ahead("sink-ahead", state_.get(), fabric_);
  TestSink after("sink-after", state_.get(), fabric_, {}, /*decode_ahead=*/false);
  ASSERT_TRUE(ahead.RegisterMemory(v[0], 1).ok());
  ASSERT_TRUE(after.RegisterMemory(v[0], 1).ok());
  for (int k = 1; k < 4; ++k) {
    source.Publish(k + 1, v[k]);
    ahead.ExpectReaches(k + 1, v[k]);
    after.ExpectReaches(k + 1, v[k]);
  }
  EXPECT_GT(ahead.core->status().chunks_staged_ahead, 0u) << "patches are staged while they arrive";
  EXPECT_EQ(after.core->status().chunks_staged_ahead, 0u);
}

// A source that encodes in segments announces the version once its first
// segment is out (incomplete: no checksum yet) and serves the patch as it
// is encoded: the sink pulls it while the encode is held after its first
// segment, decodes what came, and applies the whole version, bit for bit,
// once the last segment is in. The coordinator then holds the complete
// summary, and a sink that claims the version is checked against it.
TEST_F(SinkCoreTest, AVersionIsPulledWhileItsSourceEncodesIt) {
  std::mt19937_64 rng(31);
  std::vector<std::vector<OwnedTensor>> v(3);
  for (const char* name : {"a", "b", "c", "d"}) v[0].push_back(testing::RandomTensor(name, codec::DType::kBF16, {600000}, rng));
  for (int k = 1; k < 3; ++k) {
    for (const auto& t : v[k - 1]) v[k].push_back(testing::PerturbByExponent(t, 0.01, 120, rng));
  }
  std::promise<void> streaming;
  std::promise<void> go_on;
  auto go = go_on.get_future().share();
  std::atomic<bool> hold_next{false};
  control::InProcessClient announcer(state_.get());
  VersionHistory::Options o;
  o.stream_chunk_bytes = 4096;
  o.segment_bytes = 1 << 20;
  o.on_stream = [&](const PublishedVersion& early) {
    v1::VersionSummary s;
    s.set_version(early.version);
    s.set_base_version(early.base_version);
    s.set_dense_bytes(early.dense_bytes);
    s.set_source("source");
    s.set_incomplete(true);
    ASSERT_TRUE(announcer.Publish(s).ok());
  };
  o.after_segment = [&](size_t k) {
    if (k == 0 && hold_next.exchange(false)) {
      streaming.set_value();
      go.wait();
    }
  };
  TestSource source(state_.get(), fabric_, {}, "source", o);
  source.Publish(1, v[0]);
  TestSink sink("sink-0", state_.get(), fabric_);
  ASSERT_TRUE(sink.RegisterMemory(v[0], 1).ok());
  hold_next = true;
  // What the source served before version 2 (its first full chunks may go
  // out before this thread learns that the encode paused).
  const uint64_t served = source.plane.server->bytes_served();
  auto publishing = std::async(std::launch::async, [&] { source.Publish(2, v[1]); });
  if (streaming.get_future().wait_for(kEventDeadline) != std::future_status::ready) {
    go_on.set_value();
    publishing.get();
    FAIL() << "version 2 was not streamed while it was encoded";
  }
  // The sink has learned of version 2 and receives it while it is encoded.
  const auto until = std::chrono::steady_clock::now() + kEventDeadline;
  while (source.plane.server->bytes_served() == served && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_GT(source.plane.server->bytes_served(), served) << "the first segment went out before the encode ended";
  EXPECT_EQ(sink.core->weights()->applied(), 1u) << "nothing applied before the last segment";
  go_on.set_value();
  publishing.get();
  sink.ExpectReaches(2, v[1]);
  auto listed = source.client.ListVersions(1);
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->versions_size(), 1);
  EXPECT_FALSE(listed->versions(0).incomplete()) << "completed by the source's announce";
  EXPECT_EQ(listed->versions(0).set_checksum(), codec::SetChecksum(buffers::Views(v[1])));
  // A version streamed the same way and then a restart claiming it: trusted.
  source.Publish(3, v[2]);
  sink.ExpectReaches(3, v[2]);
  TestSink restarted("sink-1", state_.get(), fabric_);
  ASSERT_TRUE(restarted.RegisterMemory(v[2], 3).ok());
  restarted.ExpectReaches(3, v[2]);
  EXPECT_EQ(restarted.core->status().pulls_made, 0u) << "its claim was checked, no keyframe";
}

// Weights changed behind the sink's back: the next patch does not fit its
// base; the sink verifies, undoes, and takes a keyframe in the same attempt.
TEST_F(SinkCoreTest, APatchThatDoesNotFitFallsBackToAKeyframe) {
  auto v = Versions(3);
  auto [source, sink] = AtFirstVersion(v);
  {
    auto w = sink->core->weights();
    w->Hold();
    auto views = w->Views();
    const_cast<uint8_t*>(views[0].data)[100] ^= 0x40;  // someone wrote the inference server's weights
    w->Release();
  }
  const uint64_t pulls = sink->core->status().pulls_made;
  source->Publish(2, v[1]);
  sink->ExpectReaches(2, v[1]);
  EXPECT_EQ(sink->core->status().pulls_made, pulls + 2) << "the patch, then a keyframe";
  EXPECT_TRUE(sink->core->status().sync_error.ok());
}

// The parent goes away: the pull fails, the sink reports why and retries
// with backoff; the parent comes back at another address: the sink
// reconnects and catches up.
TEST_F(SinkCoreTest, AParentLostAndBackIsReconnected) {
  auto v = Versions(4);
  auto source = std::make_unique<TestSource>(state_.get(), fabric_);
  source->Publish(1, v[0]);
  source->Publish(2, v[1]);
  TestSink sink("sink-0", state_.get(), fabric_);
  ASSERT_TRUE(sink.RegisterMemory(Zeros(v[0])).ok());
  sink.ExpectReaches(2, v[1]);
  // The source dies after announcing version 3 (the summary its restarted
  // process will announce again: its first version, a keyframe).
  source.reset();
  VersionHistory scratch(VersionHistory::Options{});
  auto three = scratch.Publish(3, buffers::Views(v[2]));
  ASSERT_TRUE(three.ok());
  control::InProcessClient announcer(state_.get());
  TestSource::Announce(announcer, *three);
  const auto until = std::chrono::steady_clock::now() + kEventDeadline;
  while (sink.core->status().sync_error.ok() && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(20ms);
  }
  const SinkStatus failing = sink.core->status();
  EXPECT_FALSE(failing.sync_error.ok());
  EXPECT_GT(failing.sync_failures, 0u);
  EXPECT_NE(failing.sync_error.message().find("'source'"), std::string::npos) << failing.sync_error.ToString();
  EXPECT_EQ(sink.core->weights()->applied(), 2u);
  // Restarted at another address: the sink reconnects and catches up.
  TestSource back(state_.get(), fabric_);
  back.Publish(3, v[2]);
  sink.ExpectReaches(3, v[2]);
  back.Publish(4, v[3]);
  sink.ExpectReaches(4, v[3]);
  EXPECT_TRUE(sink.core->status().sync_error.ok());
}

// A relay (a sink at the head, parent of another) dies while its child pulls
// a keyframe from it (the relay's link trickles): the child's pull fails,
// the coordinator gives it the source as parent, and it syncs from there.
TEST_F(SinkCoreTest, ARelayLostMidStreamIsReplacedByItsParent) {
  auto v = Versions(1, 2'500'000);
  TestSource source(state_.get(), fabric_);
  source.Publish(1, v[0]);
  transport::TransportOptions slow;
  slow.rate_limit_bytes_per_s = 2 << 20;  // the relay's keyframe (4 chunks of 1 MiB) takes ~2 s
  auto relay = RelayAtFirstVersion(v, slow);
  TestSink child("sink-b", state_.get(), fabric_);
  ASSERT_EQ(ParentOf("sink-b"), "sink-a");  // fan-out 1: the source has its one child
  ASSERT_TRUE(child.RegisterMemory(Zeros(v[0])).ok());
  WaitForAPullFrom(*relay);
  std::this_thread::sleep_for(300ms);  // the keyframe is on its way
  EXPECT_EQ(child.core->weights()->applied(), 0u);
  relay.reset();  // the relay process dies mid-stream
  control::InProcessClient admin(state_.get());
  ASSERT_TRUE(admin.Deregister("sink-a").ok());  // the coordinator forgets it (as after its TTL)
  child.ExpectReaches(1, v[0]);
  EXPECT_EQ(ParentOf("sink-b"), "source");
  EXPECT_GT(child.core->status().pulls_made, 1u);
}

// The same, without the coordinator being told: the relay's process dies
// (its connections close) and the coordinator still counts it alive (its
// TTL has not passed: the fake clock never moves). The child's pull fails
// with the peer gone; it says so in a heartbeat at once, the coordinator
// gives it another holder of the version, and it reaches the head.
TEST_F(SinkCoreTest, AChildLeavesARelayItCannotReachWithoutWaitingForItsTtl) {
  auto v = Versions(2, 2'500'000);
  TestSource source(state_.get(), fabric_);
  source.Publish(1, v[0]);
  transport::TransportOptions slow;
  slow.rate_limit_bytes_per_s = 2 << 20;
  auto relay = RelayAtFirstVersion(v, slow);
  TestSink child("sink-b", state_.get(), fabric_);
  ASSERT_EQ(ParentOf("sink-b"), "sink-a");
  ASSERT_TRUE(child.RegisterMemory(Zeros(v[0])).ok());
  WaitForAPullFrom(*relay);
  const int64_t t0 = clock_.NowMs();
  relay.reset();  // the relay process dies mid-stream; nobody tells the coordinator
  child.ExpectReaches(1, v[0]);
  EXPECT_EQ(ParentOf("sink-b"), "source");
  source.Publish(2, v[1]);
  child.ExpectReaches(2, v[1]);
  EXPECT_LT(clock_.NowMs() - t0, static_cast<int64_t>(kTtlMs)) << "reassigned by the TTL, not by the report";
  const v1::StatusResponse status = state_->GetStatus();
  for (const auto& n : status.nodes()) {
    if (n.name() == "sink-a") {
      EXPECT_EQ(n.state(), v1::NODE_ALIVE) << "the relay was not declared dead meanwhile";
    }
  }
}

// A relay's process restarts (a new incarnation registers under its name,
// holding nothing): its children go to another holder of their version at
// once, and everyone reaches the next version, the restarted relay too.
TEST_F(SinkCoreTest, ARestartedRelaysChildrenGoToAnotherHolder) {
  auto v = Versions(2);
  TestSource source(state_.get(), fabric_);
  source.Publish(1, v[0]);
  auto relay = RelayAtFirstVersion(v);
  TestSink child("sink-b", state_.get(), fabric_);
  ASSERT_EQ(ParentOf("sink-b"), "sink-a");
  ASSERT_TRUE(child.RegisterMemory(Zeros(v[0])).ok());
  child.ExpectReaches(1, v[0]);
  relay.reset();
  relay = std::make_unique<TestSink>("sink-a", state_.get(), fabric_);  // back at once, empty
  EXPECT_NE(ParentOf("sink-b"), "sink-a") << "a restarted relay kept its child";
  source.Publish(2, v[1]);
  child.ExpectReaches(2, v[1]);
  ASSERT_TRUE(relay->RegisterMemory(Zeros(v[0])).ok());
  relay->ExpectReaches(2, v[1]);
}

// The coordinator unreachable from the sink: no versions learned, no pulls;
// reachable again, it catches up.
TEST_F(SinkCoreTest, AnUnreachableCoordinatorDelaysButLosesNothing) {
  auto v = Versions(4);
  auto [source, sink] = AtFirstVersion(v);
  sink->client.SetUnreachable(true);
  source->Publish(2, v[1]);
  source->Publish(3, v[2]);
  std::this_thread::sleep_for(500ms);
  EXPECT_EQ(sink->core->weights()->applied(), 1u);
  sink->client.SetUnreachable(false);
  source->Publish(4, v[3]);
  sink->ExpectReaches(4, v[3]);
}

// Tensors of another layout are refused at registration, naming the tensor;
// registered before the layout existed, they are never pulled into.
TEST_F(SinkCoreTest, AMismatchedLayoutIsRefusedAndNeverPulled) {
  auto v = Versions(2);
  TestSource source(state_.get(), fabric_);
  TestSink early("sink-0", state_.get(), fabric_);
  std::vector<OwnedTensor> other = v[0];
  other[0].name = "not-w1";
  ASSERT_TRUE(early.RegisterMemory(other).ok());  // no layout published yet
  source.Publish(1, v[0]);
  auto w = early.core->weights();
  Status s = w->WaitForVersion(1, std::chrono::steady_clock::now() + kEventDeadline);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  EXPECT_NE(s.message().find("w1"), std::string::npos) << s.ToString();
  const uint64_t pulls = early.core->status().pulls_made;
  TestSink late("sink-1", state_.get(), fabric_);
  auto refused = late.RegisterMemory(other);
  EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition) << refused.status().ToString();
  std::this_thread::sleep_for(300ms);
  EXPECT_EQ(early.core->status().pulls_made, pulls);
  EXPECT_EQ(pulls, 0u);
}

// A hold keeps the weights at their version while the next one waits; the
// hold ends at its TTL if not renewed, and the apply follows.
TEST_F(SinkCoreTest, HoldsDeferAppliesAndExpire) {
  auto v = Versions(2);
  auto [source, sink] = AtFirstVersion(v);
  auto grant = sink->core->BeginHold("generator", 600);
  ASSERT_TRUE(grant.ok()) << grant.status().ToString();
  EXPECT_EQ(grant->version, 1u);
  EXPECT_EQ(sink->core->status().active_holds, 1u);
  source->Publish(2, v[1]);
  std::this_thread::sleep_for(300ms);
  EXPECT_EQ(sink->core->weights()->applied(), 1u) << "applied under a hold";
  const std::string why = sink->core->AwaitHold(grant->id, [] { return false; });
  EXPECT_NE(why.find("TTL"), std::string::npos) << why;
  sink->ExpectReaches(2, v[1]);
  EXPECT_EQ(sink->core->ReleaseHold(grant->id).code(), StatusCode::kNotFound);
  EXPECT_EQ(sink->core->status().active_holds, 0u);
}

// Told to resync (the staleness bound, policy evict, flagged it while a
// hold kept it behind): its next sync is a keyframe, though the source
// holds patches from its version; back within the bound, the flag clears
// and patches follow.
TEST_F(SinkCoreTest, ASinkToldToResyncTakesAKeyframe) {
  control::CoordinatorOptions o;
  o.fanout = 1;
  o.max_staleness = 1;
  o.policy = v1::STALENESS_EVICT;
  ASSERT_NO_FATAL_FAILURE(UseCoordinator(o));
  auto v = Versions(6);
  auto [source, sink] = AtFirstVersion(v);
  WaitReported("sink-0", 1);  // a sink that never reported a version is not held to the bound
  auto grant = sink->core->BeginHold("generator", 60'000);
  ASSERT_TRUE(grant.ok()) << grant.status().ToString();
  // Version 2 is pulled and waits for the hold; 3..5 come meanwhile.
  const uint64_t first = sink->core->status().bytes_received;
  source->Publish(2, v[1]);
  for (const auto until = std::chrono::steady_clock::now() + kEventDeadline;
       sink->core->status().bytes_received == first && std::chrono::steady_clock::now() < until;) {
    std::this_thread::sleep_for(5ms);
  }
  ASSERT_GT(sink->core->status().bytes_received, first) << "version 2 was not pulled";
  for (int k = 3; k <= 5; ++k) source->Publish(k, v[k - 1]);
  auto may = source->client.MayPublish(6, 0);
  ASSERT_TRUE(may.ok()) << may.status().ToString();
  EXPECT_TRUE(may->allowed()) << "evict: allowed, the laggard flagged";
  sink->membership->HeartbeatNow(2s);  // the sink hears of it
  const uint64_t before = sink->core->status().bytes_received;
  ASSERT_TRUE(sink->core->ReleaseHold(grant->id).ok());
  // The pulled patch applies (2), then, still flagged (5 - 2 > 1), a keyframe.
  sink->ExpectReaches(5, v[4]);
  const uint64_t keyframe = sink->core->status().bytes_received - before;
  EXPECT_GT(keyframe, 100'000u) << "a keyframe (~450 KB), not the 2->5 patch (~15 KB)";
  WaitReported("sink-0", 5);
  sink->membership->HeartbeatNow(2s);  // within the bound again: the flag clears
  source->Publish(6, v[5]);
  sink->ExpectReaches(6, v[5]);
  EXPECT_LT(sink->core->status().bytes_received - before - keyframe, 50'000u) << "a patch again";
}

// A sink holding pieces (half of w1's rows, w2 whole) from a source serving
// that layout: it pulls selections, applies only its pieces bit for bit, is
// never a parent, and recovers from weights changed behind its back (the
// tile digests fail, everything is undone, a keyframe selection follows).
TEST_F(SinkCoreTest, PiecesSinkAppliesItsSelectionsAndRecovers) {
  auto v = Versions(4);
  const uint64_t half = 150000;
  auto held = [&](const std::vector<OwnedTensor>& version) {
    OwnedTensor h{"w1.half", codec::DType::kBF16, {half}, {}};
    h.bytes.assign(version[0].bytes.begin() + half * 2, version[0].bytes.end());
    return std::vector<OwnedTensor>{h, version[1]};
  };
  const std::vector<std::vector<codec::Piece>> pieces = {{{"w1", {half}, {half}, {0}}}, {{"w2", {0}, {7000}, {0}}}};
  std::vector<codec::RuntimeTensor> layout;
  auto zeros = Zeros(held(v[0]));
  for (size_t i = 0; i < zeros.size(); ++i) {
    layout.push_back({{zeros[i].name, zeros[i].dtype, zeros[i].shape, nullptr}, pieces[i]});
  }
  TestSource source(state_.get(), fabric_);
  source.Serve({layout}, v[0]);
  source.Publish(1, v[0]);
  TestSink sink("sink-0", state_.get(), fabric_);
  ASSERT_TRUE(sink.RegisterMemory(zeros, 0, pieces).ok());
  sink.ExpectReaches(1, held(v[0]));
  source.Publish(2, v[1]);
  sink.ExpectReaches(2, held(v[1]));
  EXPECT_LT(sink.core->status().bytes_received, (*source.history.Open(0, 2))->total_bytes() * 7 / 10)
      << "selections: about half of each stream";
  // A whole sink is never put behind it (fan-out 1 would chain them).
  TestSink whole("sink-1", state_.get(), fabric_);
  ASSERT_TRUE(whole.RegisterMemory(Zeros(v[0])).ok());
  whole.ExpectReaches(2, v[1]);
  EXPECT_EQ(ParentOf("sink-1"), "source");
  {
    auto w = sink.core->weights();
    w->Hold();
    const_cast<uint8_t*>(w->Views()[0].data)[1000] ^= 0x40;  // written behind the sink's back
    w->Release();
  }
  const uint64_t pulls = sink.core->status().pulls_made;
  source.Publish(3, v[2]);
  sink.ExpectReaches(3, held(v[2]));
  EXPECT_EQ(sink.core->status().pulls_made, pulls + 2) << "the patch (refused by its digests), then a keyframe";
  source.Publish(4, v[3]);
  sink.ExpectReaches(4, held(v[3]));
  whole.ExpectReaches(4, v[3]);
}

// Versions coded on a tile grid carry checksums taken over its cells: a
// whole sink registering weights it says are version 2 is believed (its
// checksum is taken on the published grid), and a sink holding pieces
// behind it (fan-out 1) gets its keyframe from it, coded on that grid.
TEST_F(SinkCoreTest, GriddedVersionsAreClaimedAndRelayedOnTheirGrid) {
  auto v = Versions(3);
  const uint64_t half = 150000;  // w1's cells: 300 KB each, not flat 1 MiB blocks
  auto held = [&](const std::vector<OwnedTensor>& version) {
    OwnedTensor h{"w1.half", codec::DType::kBF16, {half}, {}};
    h.bytes.assign(version[0].bytes.begin() + half * 2, version[0].bytes.end());
    return std::vector<OwnedTensor>{h, version[1]};
  };
  const std::vector<std::vector<codec::Piece>> pieces = {{{"w1", {half}, {half}, {0}}}, {{"w2", {0}, {7000}, {0}}}};
  auto zeros = Zeros(held(v[0]));
  std::vector<codec::RuntimeTensor> layout;
  for (size_t i = 0; i < zeros.size(); ++i) {
    layout.push_back({{zeros[i].name, zeros[i].dtype, zeros[i].shape, nullptr}, pieces[i]});
  }
  TestSource source(state_.get(), fabric_);
  source.Serve({layout}, v[0]);
  source.Publish(1, v[0]);
  source.Publish(2, v[1]);
  ASSERT_NE(state_->ListVersions(1).versions(0).set_checksum(), codec::SetChecksum(buffers::Views(v[1])))
      << "the grid changes this set's checksum";
  TestSink whole("sink-0", state_.get(), fabric_);
  auto claimed = whole.RegisterMemory(v[1], 2);
  ASSERT_TRUE(claimed.ok()) << claimed.status().ToString();
  whole.ExpectReaches(2, v[1]);
  EXPECT_EQ(whole.core->status().pulls_made, 0u) << "the claim of version 2 is believed";
  TestSink shard("sink-1", state_.get(), fabric_);
  ASSERT_TRUE(shard.RegisterMemory(zeros, 0, pieces).ok());
  shard.ExpectReaches(2, held(v[1]));
  EXPECT_EQ(ParentOf("sink-1"), "sink-0");
  source.Publish(3, v[2]);
  whole.ExpectReaches(3, v[2]);
  shard.ExpectReaches(3, held(v[2]));
}

// The layouts served change (a rollout fleet resized): the source codes the
// next versions on the new grid; a whole sink at the head takes the next
// version as a patch, a sink holding pieces of the old layout (whole cells
// of the new grid too) goes on, and one of the new layout syncs.
TEST_F(SinkCoreTest, TheLayoutsServedMayChange) {
  auto v = Versions(4);
  auto holding = [](uint64_t from, uint64_t to) {
    return [from, to](const std::vector<OwnedTensor>& version) {
      OwnedTensor h{"w1.part", codec::DType::kBF16, {to - from}, {}};
      h.bytes.assign(version[0].bytes.begin() + from * 2, version[0].bytes.begin() + to * 2);
      return std::vector<OwnedTensor>{h, version[1]};
    };
  };
  auto layout_of = [&](uint64_t from, uint64_t to, std::vector<std::vector<codec::Piece>>* pieces) {
    *pieces = {{{"w1", {from}, {to - from}, {0}}}, {{"w2", {0}, {7000}, {0}}}};
    auto zeros = Zeros(holding(from, to)(v[0]));
    std::vector<codec::RuntimeTensor> layout;
    for (size_t i = 0; i < zeros.size(); ++i) {
      layout.push_back({{zeros[i].name, zeros[i].dtype, zeros[i].shape, nullptr}, (*pieces)[i]});
    }
    return layout;
  };
  std::vector<std::vector<codec::Piece>> pieces_a, pieces_b;
  const auto layout_a = layout_of(150000, 300000, &pieces_a);
  const auto layout_b = layout_of(0, 100000, &pieces_b);
  TestSource source(state_.get(), fabric_);
  source.Serve({layout_a}, v[0]);
  source.Publish(1, v[0]);
  source.Publish(2, v[1]);
  TestSink whole("sink-0", state_.get(), fabric_);
  ASSERT_TRUE(whole.RegisterMemory(Zeros(v[0])).ok());
  whole.ExpectReaches(2, v[1]);
  TestSink shard_a("sink-a", state_.get(), fabric_);
  ASSERT_TRUE(shard_a.RegisterMemory(Zeros(holding(150000, 300000)(v[0])), 0, pieces_a).ok());
  shard_a.ExpectReaches(2, holding(150000, 300000)(v[1]));
  // Serving layouts a and b: w1 is cut at 100000 and 150000 from version 3 on.
  source.Serve({layout_a, layout_b}, v[0]);
  const uint64_t before = whole.core->status().bytes_received;
  source.Publish(3, v[2]);
  whole.ExpectReaches(3, v[2]);
  EXPECT_LT(whole.core->status().bytes_received - before, 100000u) << "a patch across the new grid, not a keyframe";
  shard_a.ExpectReaches(3, holding(150000, 300000)(v[2]));
  TestSink shard_b("sink-b", state_.get(), fabric_);
  ASSERT_TRUE(shard_b.RegisterMemory(Zeros(holding(0, 100000)(v[0])), 0, pieces_b).ok());
  shard_b.ExpectReaches(3, holding(0, 100000)(v[2]));
  source.Publish(4, v[3]);
  whole.ExpectReaches(4, v[3]);
  shard_a.ExpectReaches(4, holding(150000, 300000)(v[3]));
  shard_b.ExpectReaches(4, holding(0, 100000)(v[3]));
}

// Two sources, each publishing one tensor of every version: the sink applies
// a version only once both parts are in, pulling each from its source; a
// second sink behind it (fan-out 1) pulls both parts from it, and a late
// third behind that gets a keyframe of each part from it; when one source dies after the other announced a version, both
// stay at the last whole version; the restarted source (an empty history: a
// keyframe of its part) completes it, and the sinks apply the patch of one
// part and the keyframe of the other as one.
TEST_F(SinkCoreTest, AVersionOfTwoSourcesIsAppliedWholeOnly) {
  auto v = Versions(4);
  auto part = [&](int k, int p) { return std::vector<OwnedTensor>{v[k][p]}; };
  auto make = [&](const std::string& name, uint32_t p) {
    auto s = std::make_unique<TestSource>(state_.get(), fabric_, transport::TransportOptions{}, name);
    s->part = p;
    s->parts = 2;
    return s;
  };
  auto a = make("source-a", 0);
  auto b = make("source-b", 1);
  a->Publish(1, part(0, 0));
  b->Publish(1, part(0, 1));
  TestSink sink("sink-0", state_.get(), fabric_);
  ASSERT_TRUE(sink.RegisterMemory(Zeros(v[0])).ok());
  sink.ExpectReaches(1, v[0]);
  WaitReported("sink-0", 1);  // a parent candidate once the coordinator has it at the head
  TestSink relayed("sink-1", state_.get(), fabric_);
  ASSERT_TRUE(relayed.RegisterMemory(Zeros(v[0])).ok());
  relayed.ExpectReaches(1, v[0]);
  EXPECT_EQ(ParentOf("sink-1"), "sink-0");
  a->Publish(2, part(1, 0));
  std::this_thread::sleep_for(300ms);
  EXPECT_EQ(sink.core->weights()->applied(), 1u) << "half of version 2 is not applied";
  EXPECT_EQ(relayed.core->weights()->applied(), 1u);
  b->Publish(2, part(1, 1));
  sink.ExpectReaches(2, v[1]);
  relayed.ExpectReaches(2, v[1]);
  // A late sink behind the second: it gets a keyframe of each part, made by
  // its parent from what it holds.
  WaitReported("sink-1", 2);  // a parent candidate once the coordinator has it at the head
  TestSink late("sink-2", state_.get(), fabric_);
  ASSERT_TRUE(late.RegisterMemory(Zeros(v[0])).ok());
  late.ExpectReaches(2, v[1]);
  EXPECT_EQ(ParentOf("sink-2"), "sink-1");
  // Source b dies once a has announced version 3.
  a->Publish(3, part(2, 0));
  b.reset();
  std::this_thread::sleep_for(300ms);
  EXPECT_EQ(sink.core->weights()->applied(), 2u);
  EXPECT_EQ(state_->ListVersions(0).partial_size(), 1);
  b = make("source-b", 1);  // restarted: another address, an empty history
  b->Publish(3, part(2, 1));
  sink.ExpectReaches(3, v[2]);
  relayed.ExpectReaches(3, v[2]);
  a->Publish(4, part(3, 0));
  b->Publish(4, part(3, 1));
  sink.ExpectReaches(4, v[3]);
  relayed.ExpectReaches(4, v[3]);
  late.ExpectReaches(4, v[3]);
  EXPECT_EQ(ParentOf("sink-1"), "sink-0");
  // Both parts of versions 1..4 (a pull that came before the first sink had
  // the stream is refused, NotFound, and made again).
  EXPECT_GE(sink.plane.server->pulls_served(), 8u) << "the second sink pulled every part from the first";
}

}  // namespace
}  // namespace wsync::daemon
