// A hostile data-plane peer, for the system test against a running wsyncd:
//
//   exchange_attacker ADDRESS unauthenticated   a PULL without the handshake: expects a refusal
//   exchange_attacker ADDRESS oversized         1 MiB before the handshake: expects the connection dropped
//   exchange_attacker ADDRESS wrong-token       the handshake with another token: expects Unauthenticated
//   exchange_attacker ADDRESS flood TOKEN N     N PULLs with the right token, at once
//
// Prints one line saying what happened; exits 0 when the daemon answered as
// it should (a refusal, a drop), 1 otherwise.
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <string>
#include <thread>

#include "wsync/exchange/exchange.h"
#include "wire.h"

namespace {

using namespace wsync;
using namespace std::chrono_literals;

std::string Pull(uint64_t from, uint64_t to) { return exchange::wire::Encode(exchange::wire::Pull{from, to}); }

// Raw bytes in, raw bytes out.
struct Raw : transport::Handler {
  void OnMessage(transport::Message m) override {
    std::lock_guard<std::mutex> lock(mu);
    if (!m.payload.empty() && m.payload[0] == static_cast<char>(exchange::ExchangeMessage::kDenied)) denied = true;
  }
  void OnCorrupt(transport::PeerId, uint32_t, uint64_t) override {}
  void OnPeerFailed(transport::PeerId, const Status&) override {
    std::lock_guard<std::mutex> lock(mu);
    dropped = true;
    cv.notify_all();
  }
  bool WaitDropped() {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, 10s, [&] { return dropped; });
  }
  std::mutex mu;
  std::condition_variable cv;
  bool denied = false, dropped = false;
};

int RawAttack(const std::string& address, const std::string& payload, const char* what) {
  Raw handler;
  transport::TransportOptions o;
  o.listen = "127.0.0.1:0";
  auto t = transport::CreateUcxTransport(o, &handler);
  if (!t.ok()) return std::printf("cannot start a transport: %s\n", t.status().ToString().c_str()), 1;
  auto peer = (*t)->Connect(address);
  if (!peer.ok()) return std::printf("cannot connect: %s\n", peer.status().ToString().c_str()), 1;
  if (!(*t)->Send(*peer, 1, 0, payload).ok()) return std::printf("send failed\n"), 1;
  const bool dropped = handler.WaitDropped();
  std::printf("%s: %s%s\n", what, dropped ? "the daemon dropped the connection" : "STILL CONNECTED after 10 s",
              handler.denied ? " (after a DENIED)" : "");
  return dropped ? 0 : 1;
}

struct Gate {
  explicit Gate(const std::string& token)
      : handler(exchange::SecurityOptions{exchange::SecurityMode::kAuthenticate, token}) {
    transport::TransportOptions o;
    o.listen = "127.0.0.1:0";
    auto t = transport::CreateUcxTransport(o, &handler);
    if (t.ok()) transport = std::move(*t);
    if (transport) (void)handler.Bind(transport.get());
  }
  ~Gate() {
    handler.Detach();
    transport.reset();
  }
  exchange::ExchangeHandler handler;
  std::unique_ptr<transport::Transport> transport;
};

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: exchange_attacker ADDRESS unauthenticated|oversized|wrong-token|flood [TOKEN N]\n");
    return 2;
  }
  const std::string address = argv[1], mode = argv[2];
  if (mode == "unauthenticated") return RawAttack(address, Pull(0, 1), "a PULL without the handshake");
  if (mode == "oversized") {
    return RawAttack(address, std::string(1 << 20, static_cast<char>(exchange::ExchangeMessage::kHello)),
                     "1 MiB before the handshake");
  }
  if (mode == "wrong-token") {
    Gate g("not-the-cluster-token");
    if (!g.transport) return 1;
    auto peer = g.transport->Connect(address);
    if (!peer.ok()) return 1;
    Status s = g.handler.Establish(*peer, std::chrono::steady_clock::now() + 10s);
    std::printf("a wrong token: %s\n", s.ToString().c_str());
    return s.code() == StatusCode::kUnauthenticated ? 0 : 1;
  }
  if (mode == "flood" && argc == 5) {
    Gate g(argv[3]);
    const int n = std::stoi(argv[4]);
    if (!g.transport) return 1;
    auto peer = g.transport->Connect(address);
    if (!peer.ok()) return 1;
    if (Status s = g.handler.Establish(*peer, std::chrono::steady_clock::now() + 10s); !s.ok()) {
      std::printf("flood: the handshake failed: %s\n", s.ToString().c_str());
      return 1;
    }
    int sent = 0;
    for (int i = 0; i < n; ++i) sent += g.handler.Send(*peer, 100 + i, 0, Pull(0, 1 + i % 3)).ok() ? 1 : 0;
    std::this_thread::sleep_for(1s);  // let the daemon answer
    std::printf("flood: %d PULLs sent\n", sent);
    return sent == n ? 0 : 1;
  }
  std::fprintf(stderr, "unknown mode %s\n", mode.c_str());
  return 2;
}
