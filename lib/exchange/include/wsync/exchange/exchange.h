// wsync::exchange: the pull protocol between daemons, over a Transport
// (docs/data-plane.md gives its grammar, docs/security.md its security).
//
// A sink pulls (from, to) from its parent: one PULL message, answered by a
// HEADER (kind, size, chunk size, or an error) and the patch bytes in CHUNK
// messages, each CRC-checked by the transport. A chunk reported corrupt is
// asked for again (REFETCH). The bytes land in a PatchStream, which a relay
// can serve to its own children while it still fills: chunks are forwarded
// as they arrive (cut-through).
//
// With a cluster token, every peer proves it holds the token before it may
// send a request or receive a byte (a challenge-response handshake), and
// every message after it may be encrypted and authenticated (AES-256-GCM).
//
// Thread safety: every class here is thread-safe.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "wsync/codec/codec.h"
#include "wsync/transport/transport.h"
#include "wsync/util/status.h"

namespace wsync::exchange {

// Limits on what a HEADER may announce (docs/data-plane.md): a stream is
// at most kMaxStreamChunks chunks of kMinChunkBytes..kMaxChunkBytes, so a
// header from a hostile or broken peer costs the puller at most a fixed
// bookkeeping allocation (kMaxStreamChunks entries), never `total` bytes.
inline constexpr uint32_t kMinChunkBytes = 4u << 10;
inline constexpr uint32_t kMaxChunkBytes = 64u << 20;
inline constexpr uint64_t kMaxStreamChunks = 1u << 20;
// Chunks a puller keeps that arrive before their header (the transport
// delivers in order; more than this is a broken peer).
inline constexpr size_t kMaxEarlyChunks = 64;
// Pulls a server serves at once, from one peer and from all peers; more are
// refused (ResourceExhausted), each refusal costing one small message.
inline constexpr size_t kMaxPullsPerPeer = 8;
inline constexpr size_t kMaxPulls = 128;
// Peers that connected and have not finished the handshake; more are
// refused at once. A handshake not finished in time is dropped.
inline constexpr size_t kMaxHandshakes = 64;
inline constexpr auto kHandshakeTimeout = std::chrono::seconds(10);
// Refusals and denials waiting to be sent off the progress thread.
inline constexpr size_t kMaxQueuedSends = 1024;
// A refused peer's connection is closed this long after its DENIED is sent,
// so that the DENIED arrives before the close (an immediate close could
// reset the connection and lose it: the peer then saw only "connection
// reset", not why). Its messages are ignored meanwhile.
inline constexpr auto kRefusalGrace = std::chrono::milliseconds(200);
// Transport limits for a daemon's options: the longest message at all (a
// sealed chunk of the largest size) and before the handshake.
inline constexpr uint32_t kMaxMessageBytes = kMaxChunkBytes + 64;
inline constexpr uint32_t kMaxUntrustedMessageBytes = 256;

// A HEADER's total for a stream whose length is not known yet (a growing
// stream: its END message says it).
inline constexpr uint64_t kUnknownTotal = ~uint64_t{0};

// Ok when a stream of `total_bytes` (or kUnknownTotal) in chunks of
// `chunk_bytes` is within the limits above; DataLoss naming the field
// otherwise.
Status CheckStreamShape(uint64_t total_bytes, uint32_t chunk_bytes);

// The bytes of one patch or keyframe, possibly still arriving, possibly of
// a length not known yet (growing: its producer appends and finishes it, or
// a puller learns its total from the END message).
class PatchStream {
 public:
  // total_bytes: kUnknownTotal for a growing stream. REQUIRES:
  // CheckStreamShape(total_bytes, chunk_bytes) ok, or the values come from
  // this process (FromBytes).
  PatchStream(codec::PatchKind kind, uint64_t from, uint64_t to, uint64_t total_bytes, uint32_t chunk_bytes);
  // A complete stream over `bytes`.
  static std::shared_ptr<PatchStream> FromBytes(codec::PatchKind kind, uint64_t from, uint64_t to,
                                                std::string bytes, uint32_t chunk_bytes);
  // A growing stream its producer fills with Append and ends with Finish.
  static std::shared_ptr<PatchStream> Growing(codec::PatchKind kind, uint64_t from, uint64_t to, uint32_t chunk_bytes);

  codec::PatchKind kind() const { return kind_; }
  uint64_t from() const { return from_; }
  uint64_t to() const { return to_; }
  uint32_t chunk_bytes() const { return chunk_bytes_; }
  // Whether the length is known (always, but for a growing stream before
  // its end).
  bool sized() const;
  // The length and the chunk count once sized (0 before).
  uint64_t total_bytes() const;
  size_t chunks() const;

  // Stores chunk i (InvalidArgument if its size is wrong; a repeat is
  // ignored). In a growing stream not yet sized, every chunk but the last
  // has chunk_bytes.
  Status Put(size_t i, std::string bytes);
  // A growing stream's producer: appends bytes (whole chunks become
  // present at once), then Finish() sizes it.
  Status Append(std::string_view bytes);
  Status Finish();
  // A growing stream's puller: sizes it at `total` (the END message).
  // DataLoss when the chunks present do not fit that total.
  Status SetTotal(uint64_t total);
  // Blocks until chunk i is present, the stream failed, or the deadline;
  // OutOfRange when the stream is sized and has no chunk i.
  StatusOr<std::string> Wait(size_t i, std::chrono::steady_clock::time_point deadline) const;
  // Blocks until the stream is sized and every chunk is present (or
  // failure / deadline).
  Status WaitComplete(std::chrono::steady_clock::time_point deadline) const;
  // The whole byte string. REQUIRES: complete.
  std::string Assemble() const;
  // When the last chunk came in (REQUIRES: complete; for a stream made
  // complete, its creation).
  std::chrono::steady_clock::time_point completed_at() const {
    std::lock_guard<std::mutex> lock(mu_);
    return completed_at_;
  }
  void Fail(const Status& why);

 private:
  bool CompleteLocked() const { return sized_ && present_count_ == chunks_; }
  void NoteCompleteLocked();

  const codec::PatchKind kind_;
  const uint64_t from_, to_;
  const uint32_t chunk_bytes_;
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  bool sized_;
  uint64_t total_;
  size_t chunks_;
  std::vector<std::string> data_;
  std::vector<bool> present_;
  size_t present_count_ = 0;
  std::string pending_;  // a producer's bytes past the last whole chunk
  std::chrono::steady_clock::time_point completed_at_ = std::chrono::steady_clock::now();
  Status failed_;
};

// What a server can serve: the source's encoder (merged patches, keyframes)
// or a relay's store (including streams still arriving from its parent).
class PatchProvider {
 public:
  virtual ~PatchProvider() = default;
  // The stream taking version `from` to `to` (from = 0: a keyframe of `to`).
  // NotFound / FailedPrecondition when it cannot be served.
  virtual StatusOr<std::shared_ptr<PatchStream>> Open(uint64_t from, uint64_t to) = 0;
  // The stream a puller asks for with more detail: `layout`, the pieces it
  // holds (codec::LayoutFingerprint; 0: the whole set), and `part`, which
  // part of a version published by several sources (a source has its own
  // only; a relay keeps each). A provider that does not know the layout
  // serves the whole stream, from which the puller applies its pieces all
  // the same.
  virtual StatusOr<std::shared_ptr<PatchStream>> OpenFor(uint64_t from, uint64_t to, uint64_t layout, uint32_t part) {
    (void)layout;
    (void)part;
    return Open(from, to);
  }
};

// Message types (first payload byte).
enum class ExchangeMessage : uint8_t {
  kPull = 1,
  kHeader = 2,
  kChunk = 3,
  kRefetch = 4,
  kCancel = 5,
  kAbort = 6,
  kHello = 7,
  kChallenge = 8,
  kProof = 9,
  kDenied = 10,
  kSealed = 11,
  kEnd = 12,
};
// The transport seq of an END message (and of a REFETCH asking for it).
inline constexpr uint64_t kEndSeq = uint64_t{1} << 63;

// What a daemon's data plane demands of its peers (docs/security.md).
enum class SecurityMode : uint8_t {
  kNone = 0,          // anyone who reaches the port may pull
  kAuthenticate = 1,  // peers prove the cluster token; bytes travel in clear
  kEncrypt = 2,       // and every message is encrypted and authenticated
};
std::string_view SecurityModeName(SecurityMode mode);
// "none", "auth" or "encrypt"; InvalidArgument otherwise.
StatusOr<SecurityMode> ParseSecurityMode(std::string_view name);

struct SecurityOptions {
  SecurityMode mode = SecurityMode::kNone;
  std::string cluster_token;  // REQUIRES: non-empty unless mode is kNone
};

struct ExchangeStats {
  uint64_t peers_authenticated = 0;
  uint64_t peers_refused = 0;  // wrong credential, wrong mode, requests before the handshake
  uint64_t messages_rejected = 0;  // failed to parse or to authenticate
};

// The gate between a transport and the pull protocol: authenticates peers,
// seals and opens messages, and routes requests to the server and responses
// to the fetcher. Install it as the transport's Handler, then Bind() the
// transport. Teardown order: Detach(), then destroy the server and fetcher,
// then the transport, then this.
class PatchServer;
class PatchFetcher;
class ExchangeHandler : public transport::Handler {
 public:
  // InvalidArgument (at Bind) when a mode needs a token and has none.
  explicit ExchangeHandler(SecurityOptions security = {});
  ~ExchangeHandler() override;

  Status Bind(transport::Transport* transport);
  void Attach(PatchServer* server, PatchFetcher* fetcher);
  // Returns once no callback runs into the server or fetcher any more and
  // nothing queued by SendSoon runs; later SendSoon calls are dropped.
  void Detach();

  // For a peer we connected to: runs the handshake (once per connection) and
  // returns when both sides have proved the credential. Unauthenticated or
  // PermissionDenied naming the reason when the peer refused us or could not
  // prove itself; DeadlineExceeded at the deadline. Ok at once without
  // security.
  Status Establish(transport::PeerId peer, std::chrono::steady_clock::time_point deadline);
  // Sends one exchange message (sealed when encrypting). Messages to one
  // peer go out in the order of the calls.
  Status Send(transport::PeerId peer, uint32_t channel, uint64_t seq, std::string_view message);
  // Send() from another thread, for callers on the transport's progress
  // thread (which must not block on a full window). At most kMaxQueuedSends
  // wait; past that the message is dropped (its pull times out) and false
  // is returned.
  bool SendSoon(transport::PeerId peer, uint32_t channel, uint64_t seq, std::string message);
  SecurityMode mode() const { return security_.mode; }
  ExchangeStats stats() const;

  void OnMessage(transport::Message m) override;
  void OnCorrupt(transport::PeerId peer, uint32_t channel, uint64_t seq) override;
  void OnAccept(transport::PeerId peer) override;
  void OnPeerFailed(transport::PeerId peer, const Status& why) override;

 private:
  struct Peer;
  // Hands a verified plaintext message to the server or the fetcher.
  void Route(transport::Message m);
  // Refuses a peer: DENIED with `why`, a log line, the connection closed.
  void Refuse(transport::PeerId peer, StatusCode code, const std::string& why);
  void OnHandshake(const std::shared_ptr<Peer>& p, const transport::Message& m);
  std::shared_ptr<Peer> Find(transport::PeerId peer);
  // Runs `task` on the outbox thread (not before `after` from now); false
  // when kMaxQueuedSends wait or the handler is detached.
  bool Post(std::function<void()> task, std::chrono::milliseconds after = std::chrono::milliseconds(0));
  void RunOutbox();

  const SecurityOptions security_;
  std::array<uint8_t, 32> key_{};
  std::atomic<transport::Transport*> transport_{nullptr};
  std::shared_mutex route_mu_;
  PatchServer* server_ = nullptr;
  PatchFetcher* fetcher_ = nullptr;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<transport::PeerId, std::shared_ptr<Peer>> peers_;
  ExchangeStats stats_;
  std::mutex outbox_mu_;
  std::condition_variable outbox_cv_;
  std::deque<std::function<void()>> outbox_;
  std::multimap<std::chrono::steady_clock::time_point, std::function<void()>> outbox_later_;
  bool outbox_open_ = false;
  std::thread outbox_thread_;
};

// Answers pulls: one sender thread per request, streaming chunks as the
// provider's stream makes them available.
class PatchServer {
 public:
  PatchServer(ExchangeHandler* link, PatchProvider* provider);
  ~PatchServer();
  void OnRequest(const transport::Message& m);
  void OnPeerFailed(transport::PeerId peer);
  uint64_t bytes_served() const { return bytes_served_.load(); }
  uint64_t pulls_served() const { return pulls_served_.load(); }
  uint64_t pulls_refused() const { return pulls_refused_.load(); }  // over kMaxPulls / kMaxPullsPerPeer
  size_t pulls_in_flight() const;

 private:
  struct Request;
  void Serve(std::shared_ptr<Request> r);

  void Refuse(const transport::Message& m, uint64_t from, uint64_t to, const Status& why);

  ExchangeHandler* link_;
  PatchProvider* provider_;
  mutable std::mutex mu_;
  std::map<std::pair<transport::PeerId, uint32_t>, std::shared_ptr<Request>> requests_;
  struct Worker {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> finished;
  };
  std::vector<Worker> workers_;  // reaped as new requests arrive
  std::atomic<bool> stopping_{false};
  std::atomic<uint64_t> bytes_served_{0};
  std::atomic<uint64_t> pulls_served_{0};  // PULL requests received
  std::atomic<uint64_t> pulls_refused_{0};
};

// Pulls patches from parents.
class PatchFetcher {
 public:
  explicit PatchFetcher(ExchangeHandler* link) : link_(link) {}

  // Starts pulling (from, to) from `parent`; returns the stream, which fills
  // as chunks arrive (the caller may serve it onwards at once). The stream
  // fails with the server's error, on peer failure, or at the deadline.
  // layout: the puller's pieces (codec::LayoutFingerprint; 0: the whole
  // set); part: which part of a version of several sources (0 otherwise).
  StatusOr<std::shared_ptr<PatchStream>> Pull(transport::PeerId parent, uint64_t from, uint64_t to, uint64_t layout,
                                               uint32_t part, std::chrono::milliseconds timeout);

  void OnResponse(const transport::Message& m);
  void OnCorrupt(transport::PeerId peer, uint32_t channel, uint64_t seq);
  void OnPeerFailed(transport::PeerId peer, const Status& why);
  // Fails every pull in flight with `why` (shutdown).
  void FailAll(const Status& why);
  uint64_t refetches() const { return refetches_.load(); }

 private:
  struct Pending {
    transport::PeerId parent;
    uint64_t from = 0, to = 0;            // what was asked for
    std::shared_ptr<PatchStream> stream;  // null until the header arrives
    std::string header_error;
    bool header_seen = false;
    StatusCode header_code = StatusCode::kOk;
    std::vector<std::pair<size_t, std::string>> early;  // chunks before the header (reordering-safe)
    std::map<uint64_t, int> corrupt;                     // times each message arrived corrupt
  };

  void FailPending(const std::function<bool(const Pending&)>& which, const Status& why);
  // Checks every field of a HEADER for pull `p` before use; on success sets
  // p's header code and text, or its stream (with the chunks that came
  // early). DataLoss naming the field otherwise. REQUIRES: mu_ held.
  static Status TakeHeader(std::string_view payload, Pending& p);
  // Fails one pull: its stream, or Pull's wait for the header. REQUIRES: mu_ held.
  static void FailLocked(Pending& p, const Status& why);

  ExchangeHandler* link_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint32_t, std::shared_ptr<Pending>> pending_;  // Pull keeps its own reference
  uint32_t next_channel_ = 1;
  std::atomic<uint64_t> refetches_{0};
};

}  // namespace wsync::exchange
