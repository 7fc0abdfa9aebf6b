// The in-process transport: the same semantics as UCX (windows, rate limits,
// CRC-checked frames, ordered delivery on a progress thread, peer failure),
// without a network. Used by unit tests of everything above the transport.
#include <deque>
#include <map>

#include <spdlog/spdlog.h>

#include "common.h"

namespace wsync::transport {

namespace internal {

class LoopCore;

struct LoopLink {
  std::weak_ptr<LoopCore> remote;
  PeerId remote_peer = 0;
  std::shared_ptr<Window> window;
  std::shared_ptr<RateLimiter> limiter;
  bool trusted = true;  // false for an accepted peer until Trust()
};

// The receiving side of a loopback transport: an event queue drained by its
// own thread, which calls the handler.
class LoopCore : public std::enable_shared_from_this<LoopCore> {
 public:
  struct Event {
    enum Kind { kMessage, kAccept, kFailed } kind;
    PeerId peer = 0;
    FrameHeader header;
    std::string payload;
    std::shared_ptr<Window> sender_window;  // released once delivered
    Status why;
  };

  LoopCore(Handler* handler, const TransportOptions& options) : handler_(handler), options_(options) {}

  void Start() {
    thread_ = std::thread([self = shared_from_this()] { self->Run(); });
  }
  void Stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

  void Push(Event e) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) {
        if (e.sender_window) e.sender_window->Fail();
        return;
      }
      queue_.push_back(std::move(e));
    }
    cv_.notify_all();
  }

  PeerId AddLink(LoopLink link) {
    std::lock_guard<std::mutex> lock(mu_);
    const PeerId id = next_peer_++;
    links_[id] = std::move(link);
    return id;
  }
  void SetRemotePeer(PeerId id, PeerId remote_peer) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = links_.find(id);
    if (it != links_.end()) it->second.remote_peer = remote_peer;
  }
  bool GetLink(PeerId id, LoopLink* out) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = links_.find(id);
    if (it == links_.end()) return false;
    *out = it->second;
    return true;
  }
  bool RemoveLink(PeerId id, LoopLink* out) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = links_.find(id);
    if (it == links_.end()) return false;
    *out = it->second;
    links_.erase(it);
    return true;
  }
  std::map<PeerId, LoopLink> TakeLinks() {
    std::lock_guard<std::mutex> lock(mu_);
    return std::exchange(links_, {});
  }

  void Trust(PeerId id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = links_.find(id);
    if (it != links_.end()) it->second.trusted = true;
  }

  TransportStats stats() const {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }
  void CountSent(size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.messages_sent;
    stats_.bytes_sent += bytes;
  }
  const TransportOptions& options() const { return options_; }
  Corrupter& corrupter() { return corrupter_; }

 private:
  void Run() {
    for (;;) {
      Event e;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, drained
        e = std::move(queue_.front());
        queue_.pop_front();
      }
      Deliver(std::move(e));
    }
  }

  void Deliver(Event e) {
    switch (e.kind) {
      case Event::kAccept:
        handler_->OnAccept(e.peer);
        break;
      case Event::kFailed: {
        LoopLink link;
        if (RemoveLink(e.peer, &link)) {
          link.window->Fail();
          handler_->OnPeerFailed(e.peer, e.why);
        }
        break;
      }
      case Event::kMessage: {
        LoopLink link;
        if (!GetLink(e.peer, &link)) break;  // dropped already
        if (e.payload.size() > MessageLimit(options_, link.trusted)) {
          DropPeer(e.peer, "a message of " + std::to_string(e.payload.size()) + " bytes is over the limit of " +
                               std::to_string(MessageLimit(options_, link.trusted)));
          if (e.sender_window) e.sender_window->Release();
          break;
        }
        const bool intact = Crc32c(e.payload.data(), e.payload.size()) == e.header.crc;
        {
          std::lock_guard<std::mutex> lock(mu_);
          ++stats_.messages_received;
          stats_.bytes_received += e.payload.size();
          stats_.corrupt_received += intact ? 0 : 1;
        }
        if (intact) {
          handler_->OnMessage({e.peer, e.header.channel, e.header.seq, std::move(e.payload)});
        } else {
          handler_->OnCorrupt(e.peer, e.header.channel, e.header.seq);
        }
        if (e.sender_window) e.sender_window->Release();
        break;
      }
    }
  }

  // The transport drops a peer: both sides see it fail.
  void DropPeer(PeerId peer, const std::string& why) {
    LoopLink link;
    if (!RemoveLink(peer, &link)) return;
    spdlog::warn("transport: dropping peer {}: {}", peer, why);
    link.window->Fail();
    if (auto remote = link.remote.lock()) {
      remote->Push({Event::kFailed, link.remote_peer, {}, {}, nullptr, UnavailableError("dropped by the peer: " + why)});
    }
    handler_->OnPeerFailed(peer, UnavailableError("dropped: " + why));
  }

  Handler* handler_;
  TransportOptions options_;
  Corrupter corrupter_{options_.corrupt_every};
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Event> queue_;
  std::map<PeerId, LoopLink> links_;
  PeerId next_peer_ = 1;
  TransportStats stats_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace internal

struct LoopbackFabric::Rep {
  std::mutex mu;
  std::map<std::string, std::weak_ptr<internal::LoopCore>> by_name;
  uint64_t next = 1;
};

namespace {

using internal::LoopCore;
using internal::LoopLink;

class LoopTransport : public Transport {
 public:
  LoopTransport(std::shared_ptr<LoopbackFabric::Rep> fabric, std::string name, std::shared_ptr<LoopCore> core)
      : fabric_(std::move(fabric)), name_(std::move(name)), core_(std::move(core)) {}

  ~LoopTransport() override {
    {
      std::lock_guard<std::mutex> lock(fabric_->mu);
      fabric_->by_name.erase(name_);
    }
    for (auto& [peer, link] : core_->TakeLinks()) {
      link.window->Fail();
      if (auto remote = link.remote.lock()) {
        remote->Push({LoopCore::Event::kFailed, link.remote_peer, {}, {}, nullptr,
                      UnavailableError("peer transport closed")});
      }
    }
    core_->Stop();
  }

  std::string LocalConnInfo() const override { return name_; }

  StatusOr<PeerId> Connect(std::string_view conn_info) override {
    std::shared_ptr<LoopCore> remote;
    {
      std::lock_guard<std::mutex> lock(fabric_->mu);
      auto it = fabric_->by_name.find(std::string(conn_info));
      if (it != fabric_->by_name.end()) remote = it->second.lock();
    }
    if (!remote) return UnavailableError("no loopback transport at '" + std::string(conn_info) + "'");
    const auto& o = core_->options();
    const auto& ro = remote->options();
    // Each direction has its own window and limiter, owned by its sender.
    LoopLink mine{remote, 0, std::make_shared<internal::Window>(o.window),
                  std::make_shared<internal::RateLimiter>(o.rate_limit_bytes_per_s)};
    LoopLink theirs{core_, 0, std::make_shared<internal::Window>(ro.window),
                    std::make_shared<internal::RateLimiter>(ro.rate_limit_bytes_per_s), /*trusted=*/false};
    const PeerId local = core_->AddLink(mine);
    theirs.remote_peer = local;
    const PeerId remote_id = remote->AddLink(theirs);
    core_->SetRemotePeer(local, remote_id);
    remote->Push({LoopCore::Event::kAccept, remote_id, {}, {}, nullptr, Status::Ok()});
    return local;
  }

  Status Send(PeerId peer, uint32_t channel, uint64_t seq, std::string_view payload) override {
    LoopLink link;
    if (!core_->GetLink(peer, &link)) return UnavailableError("peer " + std::to_string(peer) + " is not connected");
    if (!link.window->Acquire()) return UnavailableError("peer " + std::to_string(peer) + " failed");
    link.limiter->Acquire(payload.size());
    auto remote = link.remote.lock();
    if (!remote) {
      link.window->Fail();
      return UnavailableError("peer " + std::to_string(peer) + " is gone");
    }
    LoopCore::Event e{LoopCore::Event::kMessage, link.remote_peer, internal::MakeHeader(channel, seq, payload),
                      std::string(payload), link.window, Status::Ok()};
    if (core_->corrupter().Next() && !e.payload.empty()) e.payload[e.payload.size() / 2] ^= 0x20;
    core_->CountSent(payload.size());
    remote->Push(std::move(e));
    return Status::Ok();
  }

  Status Flush(PeerId peer) override {
    LoopLink link;
    if (!core_->GetLink(peer, &link)) return UnavailableError("peer " + std::to_string(peer) + " is not connected");
    return link.window->Drain() ? Status::Ok() : UnavailableError("peer " + std::to_string(peer) + " failed");
  }

  void Disconnect(PeerId peer) override {
    LoopLink link;
    if (!core_->RemoveLink(peer, &link)) return;
    link.window->Fail();
    if (auto remote = link.remote.lock()) {
      remote->Push({LoopCore::Event::kFailed, link.remote_peer, {}, {}, nullptr,
                    UnavailableError("peer disconnected")});
    }
  }

  void Trust(PeerId peer) override { core_->Trust(peer); }

  TransportStats stats() const override { return core_->stats(); }

 private:
  std::shared_ptr<LoopbackFabric::Rep> fabric_;
  std::string name_;
  std::shared_ptr<LoopCore> core_;
};

}  // namespace

LoopbackFabric::LoopbackFabric() : rep_(std::make_shared<Rep>()) {}
LoopbackFabric::~LoopbackFabric() = default;

std::unique_ptr<Transport> LoopbackFabric::Create(const TransportOptions& options, Handler* handler) {
  auto core = std::make_shared<LoopCore>(handler, options);
  core->Start();
  std::string name;
  {
    std::lock_guard<std::mutex> lock(rep_->mu);
    name = "loop:" + std::to_string(rep_->next++);
    rep_->by_name[name] = core;
  }
  return std::make_unique<LoopTransport>(rep_, name, core);
}

}  // namespace wsync::transport
