// Load: 1,000 simulated sinks register, heartbeat and report against one
// coordinator over real gRPC; the coordinator's view stays exact and the
// relay tree respects the fan-out bound.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <thread>

#include "wsync/control/client.h"
#include "wsync/control/server.h"

namespace wsync::control {
namespace {

namespace v1 = wsync::v1;

TEST(CoordinatorLoad, ThousandSinks) {
  constexpr int kSinks = 1000, kWorkers = 8, kRounds = 3;
  CoordinatorOptions so;
  so.fanout = 8;
  so.default_ttl_ms = 60'000;
  auto state = CoordinatorState::Create(so, SystemClock(), NewNullStore(), Recovered());
  ASSERT_TRUE(state.ok());
  ServerOptions o;
  o.listen = {"127.0.0.1:0"};
  auto server = CoordinatorServer::Start(o, state->get());
  ASSERT_TRUE(server.ok());
  ClientOptions co;
  co.address = "127.0.0.1:" + std::to_string((*server)->ports()[0]);
  co.timeout_ms = 20'000;
  auto admin = NewCoordinatorClient(co);
  ASSERT_TRUE(admin.ok());
  v1::RegisterRequest src;
  src.set_name("source");
  src.set_role(v1::ROLE_SOURCE);
  ASSERT_TRUE((*admin)->Register(src).ok());
  v1::VersionSummary v;
  v.set_version(1);
  v.set_keyframe(true);
  ASSERT_TRUE((*admin)->Publish(v).ok());

  std::atomic<int> errors{0};
  std::vector<std::thread> workers;
  for (int w = 0; w < kWorkers; ++w) {
    workers.emplace_back([&, w] {
      auto c = NewCoordinatorClient(co);
      if (!c.ok()) {
        ++errors;
        return;
      }
      for (int i = w; i < kSinks; i += kWorkers) {
        v1::RegisterRequest r;
        r.set_name("sink-" + std::to_string(i));
        r.set_role(v1::ROLE_SINK);
        if (!(*c)->Register(r).ok()) ++errors;
      }
      for (int round = 0; round < kRounds; ++round) {
        for (int i = w; i < kSinks; i += kWorkers) {
          v1::HeartbeatRequest h;
          h.set_name("sink-" + std::to_string(i));
          if (!(*c)->Heartbeat(h).ok()) ++errors;
          if (round == kRounds - 1 && !(*c)->ReportApplied(h.name(), 1).ok()) ++errors;
        }
      }
    });
  }
  for (auto& t : workers) t.join();
  EXPECT_EQ(errors.load(), 0);

  // Sinks reaching the head relieve the source of its excess children at the
  // coordinator's next tick (every 200 ms): wait for it, up to a bound on a hang.
  std::map<std::string, int> children;
  StatusOr<v1::StatusResponse> status = UnavailableError("not asked yet");
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  do {
    if (!children.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    status = (*admin)->GetStatus();
    ASSERT_TRUE(status.ok());
    children.clear();
    for (const auto& n : status->nodes()) {
      if (n.role() == v1::ROLE_SINK) ++children[n.parent()];
    }
  } while (std::any_of(children.begin(), children.end(), [](const auto& c) { return c.second > 8; }) &&
           std::chrono::steady_clock::now() < until);
  int alive_sinks = 0;
  for (const auto& n : status->nodes()) {
    if (n.role() != v1::ROLE_SINK) continue;
    alive_sinks += n.state() == v1::NODE_ALIVE;
    EXPECT_EQ(n.applied_version(), 1u) << n.name();
    EXPECT_EQ(n.staleness(), 0u) << n.name();
    EXPECT_FALSE(n.parent().empty()) << n.name();
  }
  EXPECT_EQ(alive_sinks, kSinks);
  for (const auto& [parent, count] : children) EXPECT_LE(count, 8) << parent;
  (*server)->Shutdown();
}

}  // namespace
}  // namespace wsync::control
