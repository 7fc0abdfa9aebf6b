// Data-plane security over the loopback transport and over UCX (tcp on
// 127.0.0.1): peers holding the cluster token pull, bit-exact, in clear or
// encrypted; everyone else is refused, named in the log and the error, and
// costs the server a bounded amount; a flood of pulls from a peer that holds
// the token is refused past its limits while real pullers are served.
#include <gtest/gtest.h>

#include <random>
#include <thread>

#include "exchange_testlib.h"
#include "wire.h"

namespace wsync::exchange {
namespace {

using namespace std::chrono_literals;

constexpr uint32_t kChunk = 4 << 10;

SecurityOptions With(SecurityMode mode, std::string token = "cluster-token-1") {
  return SecurityOptions{mode, std::move(token)};
}

std::string RandomBytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::string s(n, '\0');
  for (auto& c : s) c = static_cast<char>(rng());
  return s;
}

std::string PullMessage(uint64_t from, uint64_t to) { return wire::Encode(wire::Pull{from, to}); }

// A peer that records what reaches it.
struct Recorder : transport::Handler {
  void OnMessage(transport::Message m) override {
    std::lock_guard<std::mutex> lock(mu);
    received.push_back(std::move(m.payload));
  }
  void OnCorrupt(transport::PeerId, uint32_t, uint64_t) override {}
  void OnPeerFailed(transport::PeerId, const Status&) override {
    std::lock_guard<std::mutex> lock(mu);
    failed = true;
    cv.notify_all();
  }
  bool WaitFailed(std::chrono::seconds within) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, within, [&] { return failed; });
  }
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::string> received;
  bool failed = false;
};

class PeerSecurityTest : public ExchangeTest {
 protected:
  // A source offering `bytes` as the patch 1->2.
  std::unique_ptr<Node> Source(SecurityOptions security, const std::string& bytes,
                               transport::TransportOptions o = {}) {
    auto n = MakeNode(o, std::move(security));
    n->provider.streams[{1, 2}] = PatchStream::FromBytes(codec::PatchKind::kPatch, 1, 2, bytes, kChunk);
    return n;
  }
  StatusOr<std::string> PullAll(Node& sink, const Node& source) {
    WSYNC_ASSIGN_OR_RETURN(transport::PeerId parent, sink.transport->Connect(source.transport->LocalConnInfo()));
    WSYNC_ASSIGN_OR_RETURN(auto stream, sink.fetcher->Pull(parent, 1, 2, 0, 0, 10s));
    WSYNC_RETURN_IF_ERROR(stream->WaitComplete(std::chrono::steady_clock::now() + 20s));
    return stream->Assemble();
  }
};

TEST_P(PeerSecurityTest, PeersWithTheTokenPullBitExactInEveryMode) {
  const std::string bytes = RandomBytes(10 * kChunk + 123, 1);
  for (SecurityMode mode : {SecurityMode::kNone, SecurityMode::kAuthenticate, SecurityMode::kEncrypt}) {
    auto source = Source(With(mode), bytes);
    auto sink = MakeNode({}, With(mode));
    auto got = PullAll(*sink, *source);
    ASSERT_TRUE(got.ok()) << SecurityModeName(mode) << ": " << got.status().ToString();
    EXPECT_EQ(*got, bytes) << SecurityModeName(mode);
    EXPECT_EQ(source->handler.stats().peers_authenticated, mode == SecurityMode::kNone ? 0u : 1u);
    EXPECT_EQ(source->handler.stats().peers_refused, 0u);
  }
}

// Encrypted: what crosses the link is not the patch, and a link that
// corrupts messages still delivers it (the transport's CRC catches the
// damage before decryption; the chunk is fetched again).
TEST_P(PeerSecurityTest, EncryptedBytesAreNotTheDataAndSurviveCorruption) {
  const std::string bytes = RandomBytes(10 * kChunk, 2);
  transport::TransportOptions bad;
  bad.corrupt_every = 4;
  auto source = Source(With(SecurityMode::kEncrypt), bytes, bad);
  auto sink = MakeNode({}, With(SecurityMode::kEncrypt));
  auto got = PullAll(*sink, *source);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, bytes);
  EXPECT_GT(sink->fetcher->refetches(), 0u);
  EXPECT_EQ(sink->handler.stats().messages_rejected, 0u);
}

TEST_P(PeerSecurityTest, AWrongTokenIsRefusedAndGetsNothing) {
  for (SecurityMode mode : {SecurityMode::kAuthenticate, SecurityMode::kEncrypt}) {
    auto source = Source(With(mode), RandomBytes(3 * kChunk, 3));
    auto sink = MakeNode({}, With(mode, "another-token"));
    const auto t0 = std::chrono::steady_clock::now();
    auto got = PullAll(*sink, *source);
    EXPECT_EQ(got.status().code(), StatusCode::kUnauthenticated) << got.status().ToString();
    EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
    EXPECT_EQ(source->server->pulls_served(), 0u);
    EXPECT_EQ(source->server->bytes_served(), 0u);
    // The server could not prove itself to the sink either way: whoever
    // speaks first with a wrong key is found out.
    EXPECT_GE(source->handler.stats().peers_refused + sink->handler.stats().peers_refused, 1u);
  }
}

TEST_P(PeerSecurityTest, MismatchedModesAreNamed) {
  const struct {
    SecurityMode source, sink;
    StatusCode code;
    const char* expect;
  } cases[] = {
      {SecurityMode::kEncrypt, SecurityMode::kAuthenticate, StatusCode::kPermissionDenied, "mismatch"},
      {SecurityMode::kNone, SecurityMode::kEncrypt, StatusCode::kFailedPrecondition, "without security"},
      {SecurityMode::kAuthenticate, SecurityMode::kNone, StatusCode::kUnauthenticated, "before completing the handshake"},
  };
  for (const auto& c : cases) {
    auto source = Source(With(c.source), RandomBytes(kChunk, 4));
    auto sink = MakeNode({}, With(c.sink));
    auto got = PullAll(*sink, *source);
    EXPECT_EQ(got.status().code(), c.code) << got.status().ToString();
    EXPECT_NE(got.status().message().find(c.expect), std::string::npos) << got.status().ToString();
    EXPECT_EQ(source->server->bytes_served(), 0u);
  }
}

// A peer without the token: a PULL, a stream of junk, an oversized message.
// Each is refused at once, the server allocates nothing for it beyond the
// untrusted-message bound, and a real sink is served throughout.
TEST_P(PeerSecurityTest, UnauthenticatedPeersAreDroppedAndRealSinksServed) {
  const std::string bytes = RandomBytes(6 * kChunk, 5);
  auto source = Source(With(SecurityMode::kAuthenticate), bytes);
  const std::vector<std::pair<const char*, std::string>> attacks = {
      {"a PULL before the handshake", PullMessage(0, 2)},
      {"junk", std::string("\x63\x01\x02", 3)},
      {"a CHALLENGE it was never asked for", std::string(66, static_cast<char>(ExchangeMessage::kChallenge))},
      {"1 MiB in one message", std::string(1 << 20, static_cast<char>(ExchangeMessage::kHello))},
  };
  uint64_t served = 0;  // by the real sinks
  for (const auto& [what, payload] : attacks) {
    Recorder hostile;
    auto raw = Raw(&hostile);
    auto peer = raw->Connect(source->transport->LocalConnInfo());
    ASSERT_TRUE(peer.ok());
    ASSERT_TRUE(raw->Send(*peer, 1, 0, payload).ok());
    EXPECT_TRUE(hostile.WaitFailed(10s)) << what << ": still connected";
    {
      std::lock_guard<std::mutex> lock(hostile.mu);
      for (const auto& m : hostile.received) {
        EXPECT_EQ(m[0], static_cast<char>(ExchangeMessage::kDenied)) << what << ": got message type " << int(m[0]);
      }
    }
    EXPECT_EQ(source->server->pulls_served(), served) << what;
    auto sink = MakeNode({}, With(SecurityMode::kAuthenticate));
    auto got = PullAll(*sink, *source);
    ASSERT_TRUE(got.ok()) << what << ": " << got.status().ToString();
    EXPECT_EQ(*got, bytes);
    ++served;
    raw.reset();
  }
}

// Peers that connect and never finish their handshake: at most
// kMaxHandshakes are kept (the oldest goes first), and a real sink still
// gets through.
TEST_P(PeerSecurityTest, IdleConnectionsCannotLockOutRealSinks) {
  const std::string bytes = RandomBytes(2 * kChunk, 6);
  auto source = Source(With(SecurityMode::kAuthenticate), bytes);
  std::vector<std::unique_ptr<Recorder>> handlers;
  std::vector<std::unique_ptr<transport::Transport>> idle;
  for (size_t i = 0; i < kMaxHandshakes + 8; ++i) {
    handlers.push_back(std::make_unique<Recorder>());
    idle.push_back(Raw(handlers.back().get()));
    ASSERT_TRUE(idle.back()->Connect(source->transport->LocalConnInfo()).ok());
  }
  size_t dropped = 0;
  for (const auto until = std::chrono::steady_clock::now() + 10s;
       dropped < 8 && std::chrono::steady_clock::now() < until; std::this_thread::sleep_for(20ms)) {
    dropped = 0;
    for (auto& h : handlers) dropped += h->WaitFailed(0s) ? 1 : 0;
  }
  EXPECT_EQ(dropped, 8u);
  EXPECT_TRUE(handlers.front()->WaitFailed(0s)) << "the oldest goes first";
  auto sink = MakeNode({}, With(SecurityMode::kAuthenticate));
  auto got = PullAll(*sink, *source);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, bytes);
  idle.clear();
}

// A peer with the token floods PULLs for a stream that never completes (each
// would hold a sender): past kMaxPullsPerPeer they are refused with
// ResourceExhausted, and another sink is served.
TEST_P(PeerSecurityTest, APullFloodIsBoundedAndOthersAreServed) {
  const std::string bytes = RandomBytes(4 * kChunk, 7);
  auto source = Source(With(SecurityMode::kEncrypt), bytes);
  // 1->3 is announced but its chunks never come.
  source->provider.streams[{1, 3}] = std::make_shared<PatchStream>(codec::PatchKind::kPatch, 1, 3, 4 * kChunk, kChunk);
  auto flooder = MakeNode({}, With(SecurityMode::kEncrypt));
  auto parent = flooder->transport->Connect(source->transport->LocalConnInfo());
  ASSERT_TRUE(parent.ok());
  ASSERT_TRUE(flooder->handler.Establish(*parent, std::chrono::steady_clock::now() + 10s).ok());
  constexpr uint32_t kFlood = 500;
  for (uint32_t channel = 1000; channel < 1000 + kFlood; ++channel) {
    ASSERT_TRUE(flooder->handler.Send(*parent, channel, 0, PullMessage(1, 3)).ok());
  }
  const auto until = std::chrono::steady_clock::now() + 20s;
  while (source->server->pulls_served() + source->server->pulls_refused() < kFlood &&
         std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_EQ(source->server->pulls_served(), kMaxPullsPerPeer);
  EXPECT_EQ(source->server->pulls_refused(), kFlood - kMaxPullsPerPeer);
  EXPECT_LE(source->server->pulls_in_flight(), kMaxPullsPerPeer);
  auto sink = MakeNode({}, With(SecurityMode::kEncrypt));
  auto got = PullAll(*sink, *source);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, bytes);
  flooder.reset();  // its pulls end with its connection
}

INSTANTIATE_TEST_SUITE_P(Both, PeerSecurityTest, ::testing::Values(Kind::kLoopback, Kind::kUcx), KindName);

}  // namespace
}  // namespace wsync::exchange
