// What the pull-protocol tests share: a provider of fixed streams, one
// daemon's data-plane end (transport, gate, server, fetcher), and a fixture
// that builds them over the loopback transport or UCX (tcp on 127.0.0.1).
#pragma once

#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <mutex>

#include "wsync/exchange/exchange.h"

namespace wsync::exchange {

// Serves fixed streams by (from, to).
class MapProvider : public PatchProvider {
 public:
  StatusOr<std::shared_ptr<PatchStream>> Open(uint64_t from, uint64_t to) override {
    std::lock_guard<std::mutex> lock(mu);
    auto it = streams.find({from, to});
    if (it == streams.end()) {
      return NotFoundError("no patch " + std::to_string(from) + "->" + std::to_string(to) + " here");
    }
    return it->second;
  }
  std::mutex mu;
  std::map<std::pair<uint64_t, uint64_t>, std::shared_ptr<PatchStream>> streams;
};

// One daemon's data-plane end: transport + gate + server + fetcher.
struct Node {
  explicit Node(SecurityOptions security) : handler(std::move(security)) {}
  ~Node() {
    handler.Detach();
    server.reset();
    fetcher.reset();
    transport.reset();
  }
  ExchangeHandler handler;
  MapProvider provider;
  std::unique_ptr<transport::Transport> transport;
  std::unique_ptr<PatchServer> server;
  std::unique_ptr<PatchFetcher> fetcher;
};

enum class Kind { kLoopback, kUcx };

class ExchangeTest : public ::testing::TestWithParam<Kind> {
 protected:
  // With security, the transport limits untrusted peers as the daemon does.
  std::unique_ptr<Node> MakeNode(transport::TransportOptions o = {}, SecurityOptions security = {}) {
    auto n = std::make_unique<Node>(security);
    o.max_message_bytes = kMaxMessageBytes;
    if (security.mode != SecurityMode::kNone) o.max_untrusted_message_bytes = kMaxUntrustedMessageBytes;
    if (GetParam() == Kind::kLoopback) {
      n->transport = fabric_.Create(o, &n->handler);
    } else {
      o.listen = "127.0.0.1:0";
      auto t = transport::CreateUcxTransport(o, &n->handler);
      EXPECT_TRUE(t.ok()) << t.status().ToString();
      n->transport = std::move(*t);
    }
    EXPECT_TRUE(n->handler.Bind(n->transport.get()).ok());
    n->server = std::make_unique<PatchServer>(&n->handler, &n->provider);
    n->fetcher = std::make_unique<PatchFetcher>(&n->handler);
    n->handler.Attach(n->server.get(), n->fetcher.get());
    return n;
  }
  // A bare transport for a hostile peer that speaks bytes of its choosing.
  std::unique_ptr<transport::Transport> Raw(transport::Handler* handler) {
    if (GetParam() == Kind::kLoopback) return fabric_.Create({}, handler);
    return RawUcx(handler);
  }
  static std::unique_ptr<transport::Transport> RawUcx(transport::Handler* handler) {
    transport::TransportOptions o;
    o.listen = "127.0.0.1:0";
    auto t = transport::CreateUcxTransport(o, handler);
    EXPECT_TRUE(t.ok()) << t.status().ToString();
    return t.ok() ? std::move(*t) : nullptr;
  }
  transport::LoopbackFabric fabric_;
};

inline std::string KindName(const ::testing::TestParamInfo<Kind>& info) {
  return info.param == Kind::kLoopback ? "Loopback" : "Ucx";
}

}  // namespace wsync::exchange
