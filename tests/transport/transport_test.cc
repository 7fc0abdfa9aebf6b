// The same behaviour from both transports: the in-process loopback and UCX
// (tcp over 127.0.0.1). Ordered CRC-checked delivery of every size (large
// ones go by rendezvous on UCX), replies to accepted peers, back-pressure and
// flush, corruption detection, disconnect and peer failure, rate limits.
#include "wsync/transport/transport.h"

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <random>
#include <thread>

namespace wsync::transport {
namespace {

using namespace std::chrono_literals;

// Records what the transport reports.
class Recorder : public Handler {
 public:
  void OnMessage(Message m) override {
    std::lock_guard<std::mutex> lock(mu_);
    messages_.push_back(std::move(m));
    cv_.notify_all();
  }
  void OnCorrupt(PeerId peer, uint32_t channel, uint64_t seq) override {
    std::lock_guard<std::mutex> lock(mu_);
    corrupt_.push_back(seq);
    cv_.notify_all();
  }
  void OnAccept(PeerId peer) override {
    std::lock_guard<std::mutex> lock(mu_);
    accepted_.push_back(peer);
    cv_.notify_all();
  }
  void OnPeerFailed(PeerId peer, const Status& why) override {
    std::lock_guard<std::mutex> lock(mu_);
    failed_.push_back(peer);
    cv_.notify_all();
  }
  // Waits until pred() holds (under the lock) or 20 s pass.
  template <typename P>
  bool WaitFor(P pred) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, 20s, [&] { return pred(); });
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Message> messages_;
  std::vector<uint64_t> corrupt_;
  std::vector<PeerId> accepted_;
  std::vector<PeerId> failed_;
};

enum class Kind { kLoopback, kUcx };

class TransportTest : public ::testing::TestWithParam<Kind> {
 protected:
  std::unique_ptr<Transport> Make(Handler* h, TransportOptions o = {}) {
    if (GetParam() == Kind::kLoopback) return fabric_.Create(o, h);
    o.listen = "127.0.0.1:0";
    auto t = CreateUcxTransport(o, h);
    EXPECT_TRUE(t.ok()) << t.status().ToString();
    return t.ok() ? std::move(*t) : nullptr;
  }
  LoopbackFabric fabric_;
};

std::string Bytes(size_t n, uint64_t seed) {
  std::string s(n, '\0');
  std::mt19937_64 rng(seed);
  for (auto& c : s) c = static_cast<char>(rng());
  return s;
}

TEST_P(TransportTest, DeliversEverySizeInOrderBothWays) {
  Recorder server_events, client_events;
  auto server = Make(&server_events);
  auto client = Make(&client_events);
  ASSERT_TRUE(server && client);
  auto peer = client->Connect(server->LocalConnInfo());
  ASSERT_TRUE(peer.ok()) << peer.status().ToString();
  const std::vector<size_t> sizes = {0, 1, 100, 8192, 1 << 20, 4 << 20, 3};
  for (size_t i = 0; i < sizes.size(); ++i) {
    ASSERT_TRUE(client->Send(*peer, 9, i, Bytes(sizes[i], i)).ok());
  }
  ASSERT_TRUE(client->Flush(*peer).ok());
  ASSERT_TRUE(server_events.WaitFor([&] { return server_events.messages_.size() == sizes.size(); }));
  for (size_t i = 0; i < sizes.size(); ++i) {
    const Message& m = server_events.messages_[i];
    EXPECT_EQ(m.seq, i);
    EXPECT_EQ(m.channel, 9u);
    EXPECT_EQ(m.payload, Bytes(sizes[i], i)) << "message " << i;
  }
  // The server answers through the peer id it saw.
  ASSERT_EQ(server_events.accepted_.size(), 1u);
  const PeerId back = server_events.messages_[0].peer;
  EXPECT_EQ(back, server_events.accepted_[0]);
  ASSERT_TRUE(server->Send(back, 1, 42, "pong").ok());
  ASSERT_TRUE(client_events.WaitFor([&] { return client_events.messages_.size() == 1; }));
  EXPECT_EQ(client_events.messages_[0].payload, "pong");
  EXPECT_EQ(client_events.messages_[0].peer, *peer);
  EXPECT_EQ(client->stats().messages_sent, sizes.size());
}

TEST_P(TransportTest, ManyMessagesThroughASmallWindow) {
  Recorder server_events, client_events;
  auto server = Make(&server_events);
  TransportOptions o;
  o.window = 2;
  auto client = Make(&client_events, o);
  auto peer = client->Connect(server->LocalConnInfo());
  ASSERT_TRUE(peer.ok());
  constexpr int kCount = 500;
  for (int i = 0; i < kCount; ++i) ASSERT_TRUE(client->Send(*peer, 0, i, Bytes(1000 + i, i)).ok());
  ASSERT_TRUE(client->Flush(*peer).ok());
  ASSERT_TRUE(server_events.WaitFor([&] { return server_events.messages_.size() == kCount; }));
  for (int i = 0; i < kCount; ++i) ASSERT_EQ(server_events.messages_[i].seq, static_cast<uint64_t>(i));
}

TEST_P(TransportTest, CorruptedPayloadsAreDetected) {
  Recorder server_events, client_events;
  auto server = Make(&server_events);
  TransportOptions o;
  o.corrupt_every = 3;
  auto client = Make(&client_events, o);
  auto peer = client->Connect(server->LocalConnInfo());
  ASSERT_TRUE(peer.ok());
  for (int i = 1; i <= 9; ++i) ASSERT_TRUE(client->Send(*peer, 0, i, Bytes(i == 6 ? (2 << 20) : 500, i)).ok());
  ASSERT_TRUE(server_events.WaitFor([&] { return server_events.messages_.size() + server_events.corrupt_.size() == 9; }));
  EXPECT_EQ(server_events.corrupt_, (std::vector<uint64_t>{3, 6, 9}));
  for (const auto& m : server_events.messages_) EXPECT_EQ(m.payload, Bytes(m.seq == 6 ? (2 << 20) : 500, m.seq));
  EXPECT_EQ(server->stats().corrupt_received, 3u);
}

TEST_P(TransportTest, DisconnectAndDestructionAreReportedToThePeer) {
  Recorder server_events, client_events;
  auto server = Make(&server_events);
  auto client = Make(&client_events);
  auto peer = client->Connect(server->LocalConnInfo());
  ASSERT_TRUE(peer.ok());
  ASSERT_TRUE(client->Send(*peer, 0, 1, "hello").ok());
  ASSERT_TRUE(server_events.WaitFor([&] { return server_events.messages_.size() == 1; }));
  client->Disconnect(*peer);
  ASSERT_TRUE(server_events.WaitFor([&] { return server_events.failed_.size() == 1; }));
  EXPECT_EQ(client->Send(*peer, 0, 2, "late").code(), StatusCode::kUnavailable);
  // A second client whose transport goes away entirely.
  Recorder other_events;
  auto other = Make(&other_events);
  auto p2 = other->Connect(server->LocalConnInfo());
  ASSERT_TRUE(p2.ok());
  ASSERT_TRUE(other->Send(*p2, 0, 1, "hi").ok());
  ASSERT_TRUE(server_events.WaitFor([&] { return server_events.messages_.size() == 2; }));
  other.reset();
  ASSERT_TRUE(server_events.WaitFor([&] { return server_events.failed_.size() == 2; }));
  // Sending to a failed peer fails instead of blocking.
  const PeerId gone = server_events.messages_[1].peer;
  EXPECT_EQ(server->Send(gone, 0, 1, "x").code(), StatusCode::kUnavailable);
}

TEST_P(TransportTest, ConnectToNothingFails) {
  Recorder events;
  auto t = Make(&events);
  if (GetParam() == Kind::kLoopback) {
    EXPECT_EQ(t->Connect("loop:999").status().code(), StatusCode::kUnavailable);
  } else {
    EXPECT_EQ(t->Connect("not-an-address").status().code(), StatusCode::kInvalidArgument);
  }
}

TEST_P(TransportTest, RateLimitBoundsThroughput) {
  Recorder server_events, client_events;
  auto server = Make(&server_events);
  TransportOptions o;
  o.rate_limit_bytes_per_s = 20 << 20;  // 20 MiB/s
  auto client = Make(&client_events, o);
  auto peer = client->Connect(server->LocalConnInfo());
  ASSERT_TRUE(peer.ok());
  const std::string chunk(256 << 10, 'x');
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 40; ++i) ASSERT_TRUE(client->Send(*peer, 0, i, chunk).ok());  // 10 MiB
  ASSERT_TRUE(client->Flush(*peer).ok());
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // 10 MiB at 20 MiB/s: at least ~0.45 s (a burst of 1/10 s is allowed).
  EXPECT_GE(seconds, 0.4);
}

INSTANTIATE_TEST_SUITE_P(Both, TransportTest, ::testing::Values(Kind::kLoopback, Kind::kUcx),
                         [](const auto& info) { return info.param == Kind::kLoopback ? "Loopback" : "Ucx"; });

}  // namespace
}  // namespace wsync::transport
