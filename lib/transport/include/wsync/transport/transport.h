// wsync::transport: moves byte messages between daemons. It knows nothing of
// patches: a message is (channel, sequence number, payload) and arrives
// verified by a CRC-32C, or is reported corrupt.
//
// A transport listens; its LocalConnInfo() is an opaque blob that peers pass
// to Connect() (the coordinator carries it without parsing it). Sends are
// asynchronous with a bounded window per peer (Send blocks while the window
// is full: back-pressure), optionally rate-limited per peer, and delivered
// in order per peer. Peer failure (a closed or dead connection) is reported
// once per peer through the Handler.
//
// Two implementations: UCX (ucp active messages, one progress thread per
// worker, error handling mode PEER) and an in-process loopback for unit
// tests, with the same semantics.
//
// Thread safety: every method may be called from any thread. Handler
// callbacks run on the transport's progress thread, one at a time; they must
// not block on Send to a full window of the same transport.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "wsync/util/status.h"

namespace wsync::transport {

using PeerId = uint64_t;

struct Message {
  PeerId peer = 0;
  uint32_t channel = 0;
  uint64_t seq = 0;
  std::string payload;
};

class Handler {
 public:
  virtual ~Handler() = default;
  // A message whose CRC verified.
  virtual void OnMessage(Message message) = 0;
  // A message whose payload does not match its CRC (payload dropped).
  virtual void OnCorrupt(PeerId peer, uint32_t channel, uint64_t seq) = 0;
  // A peer connected to us (its first message follows).
  virtual void OnAccept(PeerId peer) {}
  // The connection to `peer` failed, was closed by the other side, or was
  // dropped by the transport (a message over the limits); no further
  // messages from it will arrive and sends to it fail.
  virtual void OnPeerFailed(PeerId peer, const Status& why) = 0;
};

struct TransportOptions {
  std::string listen = "127.0.0.1:0";    // UCX: host:port of the listener
  uint32_t window = 16;                  // messages in flight per peer
  uint64_t rate_limit_bytes_per_s = 0;   // per peer; 0: unlimited
  // Fault injection for tests: corrupt every Nth payload sent (0: never).
  uint64_t corrupt_every = 0;
  // The longest payload accepted from a peer; a longer one is not received:
  // the peer is dropped (OnPeerFailed) before any buffer is allocated for it.
  uint32_t max_message_bytes = (64u << 20) + 4096;
  // The longest payload accepted from a peer that connected to us until
  // Trust(peer) (0: max_message_bytes). A peer that has not proved who it is
  // costs the receiver at most window * this many bytes.
  uint32_t max_untrusted_message_bytes = 0;
};

struct TransportStats {
  uint64_t messages_sent = 0;
  uint64_t bytes_sent = 0;      // payload bytes
  uint64_t messages_received = 0;
  uint64_t bytes_received = 0;
  uint64_t corrupt_received = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;

  // Opaque connection information for peers.
  virtual std::string LocalConnInfo() const = 0;

  // Connects to the transport whose LocalConnInfo() is `conn_info`.
  virtual StatusOr<PeerId> Connect(std::string_view conn_info) = 0;

  // Queues a message to `peer`; blocks while the peer's window is full or
  // its rate limit is exhausted. Unavailable when the peer has failed or is
  // unknown.
  virtual Status Send(PeerId peer, uint32_t channel, uint64_t seq, std::string_view payload) = 0;

  // Waits until every message queued to `peer` has completed (or failed).
  virtual Status Flush(PeerId peer) = 0;

  // Closes the connection to `peer` (the other side sees OnPeerFailed).
  virtual void Disconnect(PeerId peer) = 0;

  // Lifts the limit of max_untrusted_message_bytes for a peer that connected
  // to us (peers we connected to are trusted from the start).
  virtual void Trust(PeerId peer) = 0;

  virtual TransportStats stats() const = 0;
};

// UCX transport over the listen address of `options` (UCX_TLS chooses the
// transports, e.g. tcp). REQUIRES: handler outlives the transport.
StatusOr<std::unique_ptr<Transport>> CreateUcxTransport(const TransportOptions& options, Handler* handler);

// In-process transports that reach each other through one fabric (tests).
class LoopbackFabric {
 public:
  LoopbackFabric();
  ~LoopbackFabric();
  // REQUIRES: handler outlives the transport; the fabric outlives both.
  std::unique_ptr<Transport> Create(const TransportOptions& options, Handler* handler);

  struct Rep;

 private:
  std::shared_ptr<Rep> rep_;
};

}  // namespace wsync::transport
