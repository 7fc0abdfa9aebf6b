// Pulling patches between daemons over a Transport (docs/data-plane.md).
//
// A sink pulls (from, to) from its parent: one PULL message, answered by a
// HEADER (kind, size, chunk size, or an error) and the patch bytes in CHUNK
// messages, each CRC-checked by the transport. A chunk reported corrupt is
// asked for again (REFETCH). The bytes land in a PatchStream, which a relay
// can serve to its own children while it still fills: chunks are forwarded
// as they arrive (cut-through).
//
// Thread safety: PatchStream, PatchServer and PatchFetcher are thread-safe.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <thread>
#include <vector>

#include "wsync/codec/codec.h"
#include "wsync/transport/transport.h"
#include "wsync/util/status.h"

namespace wsync::daemon {

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

// Ok when a stream of `total_bytes` in chunks of `chunk_bytes` is within
// the limits above; DataLoss naming the field otherwise.
Status CheckStreamShape(uint64_t total_bytes, uint32_t chunk_bytes);

// The bytes of one patch or keyframe, possibly still arriving.
class PatchStream {
 public:
  // REQUIRES: CheckStreamShape(total_bytes, chunk_bytes) ok, or the values
  // come from this process (FromBytes).
  PatchStream(codec::PatchKind kind, uint64_t from, uint64_t to, uint64_t total_bytes, uint32_t chunk_bytes);
  // A complete stream over `bytes`.
  static std::shared_ptr<PatchStream> FromBytes(codec::PatchKind kind, uint64_t from, uint64_t to,
                                                std::string bytes, uint32_t chunk_bytes);

  codec::PatchKind kind() const { return kind_; }
  uint64_t from() const { return from_; }
  uint64_t to() const { return to_; }
  uint64_t total_bytes() const { return total_; }
  uint32_t chunk_bytes() const { return chunk_bytes_; }
  size_t chunks() const { return chunks_; }

  // Stores chunk i (InvalidArgument if its size is wrong; a repeat is ignored).
  Status Put(size_t i, std::string bytes);
  // Blocks until chunk i is present, the stream failed, or the deadline.
  StatusOr<std::string> Wait(size_t i, std::chrono::steady_clock::time_point deadline) const;
  // Blocks until every chunk is present (or failure / deadline).
  Status WaitComplete(std::chrono::steady_clock::time_point deadline) const;
  // The whole byte string. REQUIRES: complete.
  std::string Assemble() const;
  void Fail(const Status& why);

 private:
  const codec::PatchKind kind_;
  const uint64_t from_, to_, total_;
  const uint32_t chunk_bytes_;
  const size_t chunks_;
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  std::vector<std::string> data_;
  std::vector<bool> present_;
  size_t present_count_ = 0;
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
};

// Message types (first payload byte).
enum class ExchangeMessage : uint8_t { kPull = 1, kHeader = 2, kChunk = 3, kRefetch = 4, kCancel = 5, kAbort = 6 };

// Routes a transport's messages: requests to the server, responses to the
// fetcher. Install it as the transport's Handler. Teardown order: Detach(),
// then destroy the server and fetcher, then the transport.
class PatchServer;
class PatchFetcher;
class ExchangeHandler : public transport::Handler {
 public:
  void Attach(PatchServer* server, PatchFetcher* fetcher) {
    std::unique_lock<std::shared_mutex> lock(mu_);
    server_ = server;
    fetcher_ = fetcher;
  }
  // Returns once no callback runs into the server or fetcher any more.
  void Detach() { Attach(nullptr, nullptr); }
  void OnMessage(transport::Message m) override;
  void OnCorrupt(transport::PeerId peer, uint32_t channel, uint64_t seq) override;
  void OnPeerFailed(transport::PeerId peer, const Status& why) override;

 private:
  std::shared_mutex mu_;
  PatchServer* server_ = nullptr;
  PatchFetcher* fetcher_ = nullptr;
};

// Answers pulls: one sender thread per request, streaming chunks as the
// provider's stream makes them available.
class PatchServer {
 public:
  PatchServer(transport::Transport* transport, PatchProvider* provider);
  ~PatchServer();
  void OnRequest(const transport::Message& m);
  void OnPeerFailed(transport::PeerId peer);
  uint64_t bytes_served() const { return bytes_served_.load(); }
  uint64_t pulls_served() const { return pulls_served_.load(); }

 private:
  struct Request;
  void Serve(std::shared_ptr<Request> r);

  transport::Transport* transport_;
  PatchProvider* provider_;
  std::mutex mu_;
  std::map<std::pair<transport::PeerId, uint32_t>, std::shared_ptr<Request>> requests_;
  struct Worker {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> finished;
  };
  std::vector<Worker> workers_;  // reaped as new requests arrive
  std::atomic<bool> stopping_{false};
  std::atomic<uint64_t> bytes_served_{0};
  std::atomic<uint64_t> pulls_served_{0};  // PULL requests received
};

// Pulls patches from parents.
class PatchFetcher {
 public:
  explicit PatchFetcher(transport::Transport* transport) : transport_(transport) {}

  // Starts pulling (from, to) from `parent`; returns the stream, which fills
  // as chunks arrive (the caller may serve it onwards at once). The stream
  // fails with the server's error, on peer failure, or at the deadline.
  StatusOr<std::shared_ptr<PatchStream>> Pull(transport::PeerId parent, uint64_t from, uint64_t to,
                                               std::chrono::milliseconds timeout);

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
  static Status ParseHeader(std::string_view payload, Pending& p);
  // Fails one pull: its stream, or Pull's wait for the header. REQUIRES: mu_ held.
  static void FailLocked(Pending& p, const Status& why);

  transport::Transport* transport_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint32_t, std::shared_ptr<Pending>> pending_;  // Pull keeps its own reference
  uint32_t next_channel_ = 1;
  std::atomic<uint64_t> refetches_{0};
};

}  // namespace wsync::daemon
