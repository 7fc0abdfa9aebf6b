// Pulling patches between daemons, over the loopback transport and over UCX
// (tcp on 127.0.0.1): bit-exact delivery, refetch of corrupted chunks,
// errors from the provider, cut-through relaying, parent failure.
#include "wsync/exchange/exchange.h"

#include <gtest/gtest.h>

#include <random>
#include <thread>

#include "../codec/test_tensors.h"
#include "exchange_testlib.h"
#include "wire.h"

namespace wsync::exchange {
namespace {

using namespace std::chrono_literals;

constexpr uint32_t kChunk = 4 << 10;

class PatchExchangeTest : public ExchangeTest {};

// A real patch between two random versions, and the versions.
struct Versions {
  std::vector<buffers::OwnedTensor> v1, v2;
  std::string patch;
};

Versions MakeVersions() {
  std::mt19937_64 rng(17);
  Versions v;
  v.v1 = {testing::RandomTensor("w", codec::DType::kBF16, {1 << 20}, rng)};
  v.v2 = {testing::Perturb(v.v1[0], 0.05, rng)};
  v.patch = *codec::EncodePatch(buffers::Views(v.v1), buffers::Views(v.v2), {});
  return v;
}

// `source` offers patch 1->2; `sink` connects to it and pulls it.
StatusOr<std::shared_ptr<PatchStream>> OfferAndPull(Node& source, Node& sink, const std::string& patch,
                                                    transport::PeerId* parent = nullptr) {
  source.provider.streams[{1, 2}] = PatchStream::FromBytes(codec::PatchKind::kPatch, 1, 2, patch, kChunk);
  WSYNC_ASSIGN_OR_RETURN(transport::PeerId peer, sink.transport->Connect(source.transport->LocalConnInfo()));
  if (parent != nullptr) *parent = peer;
  return sink.fetcher->Pull(peer, 1, 2, 0, 0, 10s);
}

// `source` offers patch 1->2; `relay` pulls it and serves the stream it is
// still receiving (cut-through); `sink` pulls it from the relay.
void ThroughRelay(Node& source, Node& relay, Node& sink, const std::string& patch,
                  std::shared_ptr<PatchStream>* incoming, std::shared_ptr<PatchStream>* outgoing) {
  source.provider.streams[{1, 2}] = PatchStream::FromBytes(codec::PatchKind::kPatch, 1, 2, patch, kChunk);
  auto up = relay.transport->Connect(source.transport->LocalConnInfo());
  ASSERT_TRUE(up.ok());
  auto in = relay.fetcher->Pull(*up, 1, 2, 0, 0, 10s);
  ASSERT_TRUE(in.ok()) << in.status().ToString();
  relay.provider.streams[{1, 2}] = *in;
  auto down = sink.transport->Connect(relay.transport->LocalConnInfo());
  ASSERT_TRUE(down.ok());
  auto out = sink.fetcher->Pull(*down, 1, 2, 0, 0, 10s);
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  *incoming = *in;
  *outgoing = *out;
}

void ExpectAppliesExactly(const Versions& v, const std::string& bytes) {
  auto dst = v.v1;
  auto views = buffers::MutableViews(dst);
  Status s = codec::Apply(bytes, views, {});
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_TRUE(testing::SameBits(dst, v.v2));
}

TEST_P(PatchExchangeTest, PullsAPatchBitExactly) {
  Versions v = MakeVersions();
  ASSERT_GT(v.patch.size(), 3 * kChunk);  // several chunks
  auto source = MakeNode();
  auto sink = MakeNode();
  transport::PeerId parent = 0;
  auto stream = OfferAndPull(*source, *sink, v.patch, &parent);
  ASSERT_TRUE(stream.ok()) << stream.status().ToString();
  ASSERT_TRUE((*stream)->WaitComplete(std::chrono::steady_clock::now() + 20s).ok());
  EXPECT_EQ((*stream)->Assemble(), v.patch);
  ExpectAppliesExactly(v, (*stream)->Assemble());
  // An unknown range: the provider's error travels back with its code.
  auto missing = sink->fetcher->Pull(parent, 5, 9, 0, 0, 10s);
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound) << missing.status().ToString();
  EXPECT_NE(missing.status().message().find("no patch 5->9"), std::string::npos);
}

TEST_P(PatchExchangeTest, CorruptedChunksAreFetchedAgain) {
  Versions v = MakeVersions();
  transport::TransportOptions bad;
  bad.corrupt_every = 3;  // the source's link corrupts every third message
  auto source = MakeNode(bad);
  auto sink = MakeNode();
  auto stream = OfferAndPull(*source, *sink, v.patch);
  ASSERT_TRUE(stream.ok()) << stream.status().ToString();
  ASSERT_TRUE((*stream)->WaitComplete(std::chrono::steady_clock::now() + 20s).ok());
  EXPECT_GT(sink->fetcher->refetches(), 0u);
  ExpectAppliesExactly(v, (*stream)->Assemble());
}

TEST_P(PatchExchangeTest, RelayForwardsChunksAsTheyArrive) {
  Versions v = MakeVersions();
  transport::TransportOptions slow;
  slow.rate_limit_bytes_per_s = 64 << 10;  // the source trickles (~0.8 s): the relay overlaps
  auto source = MakeNode(slow);
  auto relay = MakeNode();
  auto sink = MakeNode();
  std::shared_ptr<PatchStream> incoming, outgoing;
  ASSERT_NO_FATAL_FAILURE(ThroughRelay(*source, *relay, *sink, v.patch, &incoming, &outgoing));
  // The sink had its first chunk before the relay had its last.
  ASSERT_TRUE(outgoing->Wait(0, std::chrono::steady_clock::now() + 10s).ok());
  EXPECT_FALSE(incoming->WaitComplete(std::chrono::steady_clock::now()).ok()) << "no overlap: not cut-through";
  ASSERT_TRUE(outgoing->WaitComplete(std::chrono::steady_clock::now() + 30s).ok());
  ExpectAppliesExactly(v, outgoing->Assemble());
  // The source sent it once (its sender counts a chunk after the send: the
  // sink may have it first).
  for (const auto until = std::chrono::steady_clock::now() + 5s;
       source->server->bytes_served() < v.patch.size() && std::chrono::steady_clock::now() < until;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(source->server->bytes_served(), v.patch.size());
}

// A stream whose length is not known when it is served (a version still
// being encoded): the producer appends as it goes, the server sends chunks
// as they exist and END with the total; a relay forwards it as it grows,
// and both pullers end with the exact bytes.
TEST_P(PatchExchangeTest, AGrowingStreamIsServedAndRelayedAsItGrows) {
  Versions v = MakeVersions();
  auto source = MakeNode();
  auto relay = MakeNode();
  auto sink = MakeNode();
  auto growing = PatchStream::Growing(codec::PatchKind::kPatch, 1, 2, kChunk);
  source.get()->provider.streams[{1, 2}] = growing;
  auto up = relay->transport->Connect(source->transport->LocalConnInfo());
  ASSERT_TRUE(up.ok());
  auto in = relay->fetcher->Pull(*up, 1, 2, 0, 0, 10s);
  ASSERT_TRUE(in.ok()) << in.status().ToString();
  relay->provider.streams[{1, 2}] = *in;
  auto down = sink->transport->Connect(relay->transport->LocalConnInfo());
  ASSERT_TRUE(down.ok());
  auto out = sink->fetcher->Pull(*down, 1, 2, 0, 0, 10s);
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_FALSE((*out)->sized()) << "the header said: length unknown";
  // The producer appends in uneven pieces; the sink has the first chunk
  // before the producer is done.
  const std::string& bytes = v.patch;
  const size_t half = bytes.size() / 2 + 123;
  ASSERT_TRUE(growing->Append(std::string_view(bytes).substr(0, half)).ok());
  ASSERT_TRUE((*out)->Wait(0, std::chrono::steady_clock::now() + 10s).ok());
  EXPECT_FALSE((*out)->WaitComplete(std::chrono::steady_clock::now()).ok());
  ASSERT_TRUE(growing->Append(std::string_view(bytes).substr(half)).ok());
  ASSERT_TRUE(growing->Finish().ok());
  for (const auto& s : {*in, *out}) {
    ASSERT_TRUE(s->WaitComplete(std::chrono::steady_clock::now() + 20s).ok());
    EXPECT_EQ(s->total_bytes(), bytes.size());
    EXPECT_TRUE(s->Assemble() == bytes);
  }
  ExpectAppliesExactly(v, (*out)->Assemble());
}

TEST(PatchStreamTest, GrowingStreamsAreSizedByTheirProducerOrTheirEnd) {
  const uint32_t chunk = 4096;
  auto s = PatchStream::Growing(codec::PatchKind::kPatch, 1, 2, chunk);
  EXPECT_FALSE(s->sized());
  ASSERT_TRUE(s->Append(std::string(chunk + 10, 'a')).ok());
  ASSERT_TRUE(s->Wait(0, std::chrono::steady_clock::now()).ok()) << "a whole chunk is there at once";
  EXPECT_EQ(s->Wait(1, std::chrono::steady_clock::now()).status().code(), StatusCode::kDeadlineExceeded);
  ASSERT_TRUE(s->Finish().ok());
  EXPECT_EQ(s->total_bytes(), chunk + 10u);
  EXPECT_EQ(s->Wait(1, std::chrono::steady_clock::now())->size(), 10u);
  EXPECT_EQ(s->Wait(2, std::chrono::steady_clock::now()).status().code(), StatusCode::kOutOfRange);
  EXPECT_FALSE(s->Append("x").ok());
  EXPECT_FALSE(s->Finish().ok());
  // A puller's: END must fit the chunks that came.
  auto p = std::make_shared<PatchStream>(codec::PatchKind::kPatch, 1, 2, kUnknownTotal, chunk);
  ASSERT_TRUE(p->Put(0, std::string(chunk, 'a')).ok());
  ASSERT_TRUE(p->Put(1, std::string(7, 'b')).ok());
  EXPECT_FALSE(p->Put(2, std::string(chunk + 1, 'c')).ok()) << "longer than a chunk";
  EXPECT_FALSE(p->Put(kMaxStreamChunks, std::string(chunk, 'c')).ok()) << "past the limit on chunks";
  EXPECT_EQ(p->SetTotal(2 * chunk).code(), StatusCode::kDataLoss) << "chunk 1 is short";
  EXPECT_EQ(p->SetTotal(kMaxStreamChunks * uint64_t{chunk}).code(), StatusCode::kDataLoss);
  EXPECT_FALSE(p->WaitComplete(std::chrono::steady_clock::now()).ok());
  ASSERT_TRUE(p->SetTotal(chunk + 7).ok());
  ASSERT_TRUE(p->WaitComplete(std::chrono::steady_clock::now()).ok());
  EXPECT_EQ(p->Assemble(), std::string(chunk, 'a') + std::string(7, 'b'));
  // A failed producer fails its pullers' waits.
  auto f = PatchStream::Growing(codec::PatchKind::kPatch, 1, 2, chunk);
  f->Fail(DataLossError("encode failed"));
  EXPECT_EQ(f->Wait(0, std::chrono::steady_clock::now() + 1s).status().code(), StatusCode::kDataLoss);
}

TEST_P(PatchExchangeTest, ParentFailureFailsThePull) {
  Versions v = MakeVersions();
  transport::TransportOptions slow;
  slow.rate_limit_bytes_per_s = 64 << 10;
  auto source = MakeNode(slow);
  auto sink = MakeNode();
  auto stream = OfferAndPull(*source, *sink, v.patch);
  ASSERT_TRUE(stream.ok());
  source.reset();  // the parent dies mid-transfer
  Status s = (*stream)->WaitComplete(std::chrono::steady_clock::now() + 20s);
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
}

// A relay whose own parent dies mid-stream: its child's pull fails at once
// (ABORT), not after the child's deadline. (Found by scripts/fault_campaign.py:
// a sink behind a relay waited 5 minutes for chunks that would never come.)
TEST_P(PatchExchangeTest, RelayWhoseParentFailsAbortsItsChildren) {
  Versions v = MakeVersions();
  transport::TransportOptions slow;
  slow.rate_limit_bytes_per_s = 64 << 10;
  auto source = MakeNode(slow);
  auto relay = MakeNode();
  auto sink = MakeNode();
  std::shared_ptr<PatchStream> incoming, outgoing;
  ASSERT_NO_FATAL_FAILURE(ThroughRelay(*source, *relay, *sink, v.patch, &incoming, &outgoing));
  ASSERT_TRUE(outgoing->Wait(0, std::chrono::steady_clock::now() + 10s).ok());
  source.reset();  // the relay's parent dies mid-stream
  const auto t0 = std::chrono::steady_clock::now();
  Status s = outgoing->WaitComplete(t0 + 60s);
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
  EXPECT_NE(s.message().find("parent:"), std::string::npos) << s.ToString();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 15s);
}

// A peer that answers every PULL with a crafted HEADER (or other bytes),
// from a thread of its own (handlers must not block on a full window).
class HostileServer : public transport::Handler {
 public:
  ~HostileServer() override {
    for (auto& t : senders) t.join();
  }
  void OnMessage(transport::Message m) override {
    if (m.payload.empty() || m.payload[0] != static_cast<char>(ExchangeMessage::kPull)) return;
    std::lock_guard<std::mutex> lock(mu);
    senders.emplace_back([this, peer = m.peer, channel = m.channel, answer = answer] {
      for (const auto& [seq, payload] : answer) {
        if (!transport->Send(peer, channel, seq, payload).ok()) return;
      }
    });
  }
  void OnCorrupt(transport::PeerId, uint32_t, uint64_t) override {}
  void OnPeerFailed(transport::PeerId, const Status&) override {}
  std::mutex mu;
  std::vector<std::pair<uint64_t, std::string>> answer;  // (seq, payload) sent for every PULL
  std::vector<std::thread> senders;
  transport::Transport* transport = nullptr;
};

std::string Header(uint8_t code, uint8_t kind, uint64_t from, uint64_t to, uint64_t total, uint32_t chunk,
                   size_t cut = 0) {
  std::string h(1, static_cast<char>(ExchangeMessage::kHeader));
  auto put = [&](const void* v, size_t n) { h.append(static_cast<const char*>(v), n); };
  put(&code, 1);
  put(&kind, 1);
  put(&from, 8);
  put(&to, 8);
  put(&total, 8);
  put(&chunk, 4);
  h.resize(h.size() - cut);
  return h;
}

// Issue 19: header fields were used unchecked (`total` and `chunk` sized an
// allocation: 2^60 bytes threw on the transport's progress thread; the
// status code was cast unchecked). Every bad header now fails the pull with
// DataLoss naming the field, at a fixed cost.
TEST_P(PatchExchangeTest, HostileHeadersFailThePullCleanly) {
  HostileServer hostile;
  std::unique_ptr<transport::Transport> t;
  if (GetParam() == Kind::kLoopback) {
    t = fabric_.Create({}, &hostile);
  } else {
    t = RawUcx(&hostile);
  }
  hostile.transport = t.get();
  auto sink = MakeNode();
  auto peer = sink->transport->Connect(t->LocalConnInfo());
  ASSERT_TRUE(peer.ok());
  const struct {
    const char* what;
    std::vector<std::pair<uint64_t, std::string>> answer;
    const char* expect;
  } cases[] = {
      {"2^60 bytes", {{0, Header(0, 1, 1, 2, uint64_t{1} << 60, 1 << 20)}}, "chunks"},
      {"zero chunk size", {{0, Header(0, 1, 1, 2, 100, 0)}}, "chunk size"},
      {"huge chunk size", {{0, Header(0, 1, 1, 2, 100, 1u << 31)}}, "chunk size"},
      {"status 200", {{0, Header(200, 1, 1, 2, 100, 1 << 20)}}, "status"},
      {"kind 7", {{0, Header(0, 7, 1, 2, 100, 1 << 20)}}, "kind"},
      {"other versions", {{0, Header(0, 1, 1, 9, 100, 1 << 20)}}, "announces"},
      {"truncated", {{0, Header(0, 1, 1, 2, 100, 1 << 20, 5)}}, "truncated"},
      {"only a type byte", {{0, std::string(1, static_cast<char>(ExchangeMessage::kHeader))}}, "truncated"},
  };
  for (const auto& c : cases) {
    {
      std::lock_guard<std::mutex> lock(hostile.mu);
      hostile.answer = c.answer;
    }
    auto pulled = sink->fetcher->Pull(*peer, 1, 2, 0, 0, 10s);
    ASSERT_FALSE(pulled.ok()) << c.what;
    EXPECT_EQ(pulled.status().code(), StatusCode::kDataLoss) << c.what << ": " << pulled.status().ToString();
    EXPECT_NE(pulled.status().message().find(c.expect), std::string::npos) << c.what << ": " << pulled.status().ToString();
  }
  // A flood of chunks before any header: the pull fails, memory stays bounded.
  std::vector<std::pair<uint64_t, std::string>> flood;
  for (uint64_t i = 1; i <= kMaxEarlyChunks + 10; ++i) {
    flood.push_back({i, std::string(1, static_cast<char>(ExchangeMessage::kChunk)) + std::string(kChunk, 'x')});
  }
  {
    std::lock_guard<std::mutex> lock(hostile.mu);
    hostile.answer = flood;
  }
  auto flooded = sink->fetcher->Pull(*peer, 1, 2, 0, 0, 10s);
  EXPECT_EQ(flooded.status().code(), StatusCode::kDataLoss) << flooded.status().ToString();
  EXPECT_NE(flooded.status().message().find("before the header"), std::string::npos) << flooded.status().ToString();
  // The hostile peer's answer with a valid header still works: the puller is unharmed.
  {
    std::lock_guard<std::mutex> lock(hostile.mu);
    hostile.answer = {{0, Header(5, 0, 0, 0, 0, 0) + "no such version"}};
  }
  auto refused = sink->fetcher->Pull(*peer, 1, 2, 0, 0, 10s);
  EXPECT_EQ(refused.status().code(), StatusCode::kNotFound) << refused.status().ToString();
  sink.reset();
  t.reset();
}

// A PULL that reuses a channel replaces the pull before it. When the old one
// ends it must not take the new one's entry with it: the new pull's CANCEL
// and refetches would go nowhere, and the count of pulls in flight (the flood
// limit) would be short.
TEST_P(PatchExchangeTest, AReusedChannelKeepsTheNewPull) {
  auto source = MakeNode();
  auto client = MakeNode();
  {
    std::lock_guard<std::mutex> lock(source->provider.mu);
    // 1->2 never completes; 1->3 is whole.
    source->provider.streams[{1, 2}] = std::make_shared<PatchStream>(codec::PatchKind::kPatch, 1, 2, 4 * kChunk, kChunk);
    source->provider.streams[{1, 3}] =
        PatchStream::FromBytes(codec::PatchKind::kPatch, 1, 3, std::string(2 * kChunk, 'x'), kChunk);
  }
  auto peer = client->transport->Connect(source->transport->LocalConnInfo());
  ASSERT_TRUE(peer.ok());
  auto wait_in_flight = [&](size_t n) {
    const auto until = std::chrono::steady_clock::now() + 5s;
    while (source->server->pulls_in_flight() != n && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(10ms);
    }
    return source->server->pulls_in_flight();
  };
  ASSERT_TRUE(client->handler.Send(*peer, 7, 0, wire::Encode(wire::Pull{1, 2})).ok());
  ASSERT_EQ(wait_in_flight(1), 1u);
  ASSERT_TRUE(client->handler.Send(*peer, 7, 0, wire::Encode(wire::Pull{1, 3})).ok());
  std::this_thread::sleep_for(600ms);  // the first pull ends (it waits in 200 ms slices); the second lingers
  EXPECT_EQ(source->server->pulls_served(), 2u);
  EXPECT_EQ(source->server->pulls_in_flight(), 1u) << "the ended pull took the new one's entry";
  ASSERT_TRUE(client->handler.Send(*peer, 7, 0, wire::EncodeBare(ExchangeMessage::kCancel)).ok());
  EXPECT_EQ(wait_in_flight(0), 0u) << "the CANCEL did not reach the new pull";
}

INSTANTIATE_TEST_SUITE_P(Both, PatchExchangeTest, ::testing::Values(Kind::kLoopback, Kind::kUcx), KindName);

}  // namespace
}  // namespace wsync::exchange
