// What the sink's in-process tests run on: SinkCore over the real
// coordinator state machine (control::InProcessClient, a fake clock), the
// loopback transport and a source made of a VersionHistory behind an
// exchange.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <thread>

#include "../codec/test_tensors.h"
#include "sink_core.h"
#include "tensor_layout.h"
#include "version_history.h"
#include "wsync/control/testing/fake_clock.h"
#include "wsync/control/testing/in_process_client.h"

namespace wsync::daemon::sinktest {

// How long a test waits for an event before calling it lost: a bound on a
// hang, not an expectation of speed (a loaded machine, the sanitizers or
// another process on the cores, takes many times an idle one's time).
constexpr std::chrono::seconds kEventDeadline{120};

namespace v1 = wsync::v1;
using buffers::OwnedTensor;
using namespace std::chrono_literals;

constexpr uint64_t kTtlMs = 400;  // heartbeats every 100 ms

inline std::vector<std::vector<OwnedTensor>> Versions(int n, uint64_t elements = 300000) {
  std::mt19937_64 rng(23);
  std::vector<std::vector<OwnedTensor>> v(n);
  v[0] = {testing::RandomTensor("w1", codec::DType::kBF16, {elements}, rng),
          testing::RandomTensor("w2", codec::DType::kBF16, {7000}, rng)};
  for (int k = 1; k < n; ++k) {
    for (const auto& t : v[k - 1]) v[k].push_back(testing::PerturbByExponent(t, 0.01, 120, rng));
  }
  return v;
}

// One daemon's data-plane end over the loopback fabric; Serve() attaches
// what it serves.
struct Plane {
  Plane(transport::LoopbackFabric& fabric, transport::TransportOptions o = {}) {
    transport = fabric.Create(o, &handler);
    EXPECT_TRUE(handler.Bind(transport.get()).ok());
    fetcher = std::make_unique<exchange::PatchFetcher>(&handler);
  }
  void Serve(exchange::PatchProvider* provider) {
    server = std::make_unique<exchange::PatchServer>(&handler, provider);
    handler.Attach(server.get(), fetcher.get());
  }
  // Before what it serves goes.
  void Close() {
    handler.Detach();
    if (fetcher) fetcher->FailAll(AbortedError("plane closing"));
    server.reset();
  }
  ~Plane() {
    Close();
    fetcher.reset();
    transport.reset();
  }
  exchange::ExchangeHandler handler;
  std::unique_ptr<transport::Transport> transport;
  std::unique_ptr<exchange::PatchServer> server;
  std::unique_ptr<exchange::PatchFetcher> fetcher;
};

inline v1::RegisterRequest Registration(const std::string& name, v1::Role role, const transport::Transport& t) {
  v1::RegisterRequest r;
  r.set_name(name);
  r.set_role(role);
  r.set_data_address(t.LocalConnInfo());
  r.set_ttl_ms(kTtlMs);
  return r;
}

// A source: a history served over the loopback transport, registered at the
// coordinator, publishing what the test gives it.
struct TestSource {
  TestSource(control::CoordinatorState* state, transport::LoopbackFabric& fabric, transport::TransportOptions o = {},
             std::string name = "source", VersionHistory::Options history_options = {})
      : name(std::move(name)), client(state), history(std::move(history_options)), plane(fabric, o) {
    plane.Serve(&history);
    EXPECT_TRUE(client.Register(Registration(this->name, v1::ROLE_SOURCE, *plane.transport)).ok());
  }
  ~TestSource() { plane.Close(); }
  // Serves sinks holding pieces of these layouts (as a source given
  // serve_layouts): every version coded on their grid.
  void Serve(const std::vector<std::vector<codec::RuntimeTensor>>& layouts, const std::vector<OwnedTensor>& like) {
    grids = codec::GridsFor(layouts, buffers::Views(like));
    ASSERT_TRUE(history.SetGrids(grids).ok());
    history.SetServedLayouts(layouts);
  }
  void Publish(uint64_t version, const std::vector<OwnedTensor>& w) {
    auto pub = history.Publish(version, buffers::Views(w));
    ASSERT_TRUE(pub.ok()) << pub.status().ToString();
    published = *pub;
    v1::Layout layout = LayoutOf(buffers::Views(w), true, grids);
    layout.set_source(name);
    if (parts > 1) {
      layout.set_parts(parts);
      for (auto& t : *layout.mutable_tensors()) t.set_part(part);
    }
    ASSERT_TRUE(client.SetLayout(layout).ok());
    Announce(client, *pub, name, part, parts);
  }
  static void Announce(control::CoordinatorClient& client, const PublishedVersion& p, const std::string& source = "source",
                       uint32_t part = 0, uint32_t parts = 1) {
    const PublishedVersion* pub = &p;
    v1::VersionSummary v;
    v.set_version(pub->version);
    v.set_base_version(pub->base_version);
    v.set_patch_bytes(pub->patch_bytes);
    v.set_dense_bytes(pub->dense_bytes);
    v.set_set_checksum(pub->set_checksum);
    v.set_keyframe(pub->base_version == 0);
    v.set_source(source);
    if (parts > 1) {
      v.set_part(part);
      v.set_parts(parts);
    }
    auto head = client.Publish(v);
    ASSERT_TRUE(head.ok()) << head.status().ToString();
  }
  std::string name;
  control::InProcessClient client;
  VersionHistory history;
  Plane plane;
  std::vector<codec::TileGrid> grids;
  uint32_t part = 0, parts = 1;  // one of several sources
  PublishedVersion published;    // the last version Publish published
};

// A sink: SinkCore with its membership, data plane and shared memory.
struct TestSink {
  TestSink(const std::string& name, control::CoordinatorState* state, transport::LoopbackFabric& fabric,
           transport::TransportOptions o = {}, bool decode_ahead = true, StoreTier* store = nullptr)
      : client(state), pool(2), plane(fabric, o) {
    DataDaemonConfig config;
    config.name = name;
    config.decode_ahead = decode_ahead;
    config.retry_first_ms = 20;
    config.retry_max_ms = 200;
    config.hold_ttl_ms = 2000;
    membership = std::make_unique<Membership>(
        &client, Registration(name, v1::ROLE_SINK, *plane.transport),
        Membership::Hooks{[this](v1::HeartbeatRequest* h) { core->FillHeartbeat(h); },
                          [this](const v1::HeartbeatResponse& hb) { core->OnHeartbeat(hb); },
                          [this](const v1::Node& n) { core->AfterRegister(n); }});
    core = std::make_unique<SinkCore>(config, SinkEnvironment{&client, plane.transport.get(), plane.fetcher.get(),
                                                              membership.get(), &pool, store});
    plane.Serve(core.get());  // what it holds or receives, to its children
    EXPECT_TRUE(membership->Register().ok());
    membership->Start();
    core->Start();
  }
  ~TestSink() {
    client.Cancel();  // as the daemon's shutdown does: the watch ends
    plane.Close();
    core->Stop();
    membership->Stop();
  }
  // Registers shared memory holding `content` (applied: the claimed version).
  // pieces[i]: what content[i] holds, when it is a runtime tensor.
  StatusOr<uint64_t> RegisterMemory(const std::vector<OwnedTensor>& content, uint64_t applied = 0,
                                    const std::vector<std::vector<codec::Piece>>& pieces = {}) {
    const std::string shm = "/wsync-sinkcore-" + std::to_string(::getpid()) + "-" + std::to_string(counter++);
    uint64_t size = 0;
    std::vector<buffers::TensorEntry> table;
    for (size_t i = 0; i < content.size(); ++i) {
      const auto& t = content[i];
      table.push_back({t.name, t.dtype, t.shape, size, 0, i < pieces.size() ? pieces[i] : std::vector<codec::Piece>{}});
      size += t.bytes.size();
    }
    WSYNC_ASSIGN_OR_RETURN(auto region, buffers::CreateShm(shm, size, /*unlink_on_close=*/true));
    for (size_t i = 0; i < content.size(); ++i) {
      std::memcpy(region->data() + table[i].offset, content[i].bytes.data(), content[i].bytes.size());
    }
    std::vector<std::unique_ptr<buffers::Region>> regions;
    regions.push_back(std::move(region));
    WSYNC_ASSIGN_OR_RETURN(auto mapped, buffers::MappedTensors::Create(std::move(regions), table));
    return core->RegisterTensors(std::move(mapped), applied);
  }
  // Waits until the sink holds `version`; then checks it bit for bit.
  void ExpectReaches(uint64_t version, const std::vector<OwnedTensor>& expected, std::chrono::seconds within = kEventDeadline) {
    auto w = core->weights();
    ASSERT_TRUE(w);
    Status s = w->WaitForVersion(version, std::chrono::steady_clock::now() + within);
    ASSERT_TRUE(s.ok()) << s.ToString() << " (applied " << w->applied() << ")";
    ASSERT_EQ(w->applied(), version);
    std::vector<OwnedTensor> got;
    w->Hold();
    for (const auto& v : w->Views()) {
      got.push_back({v.name, v.dtype, v.shape, std::vector<uint8_t>(v.data, v.data + v.NumBytes())});
    }
    w->Release();
    EXPECT_TRUE(testing::SameBits(got, expected)) << "version " << version << " differs";
  }
  static inline int counter = 0;
  control::InProcessClient client;
  ThreadPool pool;
  Plane plane;
  std::unique_ptr<Membership> membership;
  std::unique_ptr<SinkCore> core;
};

class SinkCoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    control::CoordinatorOptions o;
    o.fanout = 1;  // a chain: the second sink behind the first (a relay)
    UseCoordinator(o);
  }
  // The coordinator from now on: one of options `o`, in memory.
  void UseCoordinator(const control::CoordinatorOptions& o) {
    auto s = control::CoordinatorState::Create(o, &clock_, control::NewNullStore(), control::Recovered());
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    state_ = std::move(*s);
  }
  std::vector<OwnedTensor> Zeros(const std::vector<OwnedTensor>& like) {
    auto z = like;
    for (auto& t : z) std::fill(t.bytes.begin(), t.bytes.end(), 0);
    return z;
  }
  // Waits until the coordinator has `node` at `version` (reported after the apply).
  void WaitReported(const std::string& node, uint64_t version) {
    const auto until = std::chrono::steady_clock::now() + kEventDeadline;
    for (;;) {
      const v1::StatusResponse status = state_->GetStatus();
      for (const auto& n : status.nodes()) {
        if (n.name() == node && n.applied_version() >= version) return;
      }
      ASSERT_LT(std::chrono::steady_clock::now(), until) << node << " never reported version " << version;
      std::this_thread::sleep_for(10ms);
    }
  }
  std::string ParentOf(const std::string& node) {
    const v1::StatusResponse status = state_->GetStatus();
    for (const auto& n : status.nodes()) {
      if (n.name() == node) return n.parent();
    }
    return "";
  }
  // A source that published version 1 and a sink that holds it.
  struct Running {
    std::unique_ptr<TestSource> source;
    std::unique_ptr<TestSink> sink;  // destroyed first
  };
  Running AtFirstVersion(const std::vector<std::vector<OwnedTensor>>& v) {
    Running r;
    r.source = std::make_unique<TestSource>(state_.get(), fabric_);
    r.source->Publish(1, v[0]);
    r.sink = std::make_unique<TestSink>("sink-0", state_.get(), fabric_);
    EXPECT_TRUE(r.sink->RegisterMemory(Zeros(v[0])).ok());
    r.sink->ExpectReaches(1, v[0]);
    return r;
  }
  // A relay "sink-a" holding version 1 of `v`, known to the coordinator as
  // a holder of the head (a parent for the next sink: fan-out 1).
  std::unique_ptr<TestSink> RelayAtFirstVersion(const std::vector<std::vector<OwnedTensor>>& v,
                                                transport::TransportOptions o = {}) {
    auto relay = std::make_unique<TestSink>("sink-a", state_.get(), fabric_, o);
    EXPECT_TRUE(relay->RegisterMemory(Zeros(v[0])).ok());
    relay->ExpectReaches(1, v[0]);
    WaitReported("sink-a", 1);
    return relay;
  }
  // Waits until `relay` serves its first pull.
  static void WaitForAPullFrom(const TestSink& relay) {
    const auto until = std::chrono::steady_clock::now() + kEventDeadline;
    while (relay.plane.server->pulls_served() == 0 && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(10ms);
    }
    ASSERT_GT(relay.plane.server->pulls_served(), 0u) << "the child's pull never started";
  }
  control::FakeClock clock_;
  std::unique_ptr<control::CoordinatorState> state_;
  transport::LoopbackFabric fabric_;
};

}  // namespace wsync::daemon::sinktest
