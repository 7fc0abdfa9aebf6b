// Helper process for the peer-failure test: connects to the UCX transport at
// argv[1], sends one message, then waits to be killed.
#include <chrono>
#include <cstdio>
#include <thread>

#include "wsync/transport/transport.h"

namespace {
class Quiet : public wsync::transport::Handler {
 public:
  void OnMessage(wsync::transport::Message) override {}
  void OnCorrupt(wsync::transport::PeerId, uint32_t, uint64_t) override {}
  void OnPeerFailed(wsync::transport::PeerId, const wsync::Status&) override {}
};
}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  Quiet handler;
  wsync::transport::TransportOptions o;
  auto t = wsync::transport::CreateUcxTransport(o, &handler);
  if (!t.ok()) return 1;
  auto peer = (*t)->Connect(argv[1]);
  if (!peer.ok() || !(*t)->Send(*peer, 0, 1, "alive").ok()) return 1;
  for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
}
