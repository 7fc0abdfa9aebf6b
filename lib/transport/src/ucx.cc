// The UCX transport: ucp active messages over a listener/sockaddr connection,
// one worker with one progress thread that makes every UCX call. User threads
// hand operations to it through a queue and wake it with ucp_worker_signal.
//
// Frames: active message id kAmId, header = FrameHeader (24 bytes), data =
// payload. Large payloads arrive by rendezvous; per-peer arrival slots keep
// delivery in order.
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <deque>
#include <future>
#include <map>

#include <spdlog/spdlog.h>
#include <ucp/api/ucp.h>

#include "common.h"

namespace wsync::transport {
namespace {

using internal::FrameHeader;

constexpr unsigned kAmId = 7;

Status UcsError(ucs_status_t s, const std::string& what) {
  return UnavailableError(what + ": " + ucs_status_string(s));
}

// "host:port" -> sockaddr (IPv4 or IPv6, numeric or resolved).
StatusOr<sockaddr_storage> ParseHostPort(std::string_view text, socklen_t* len) {
  const size_t colon = text.rfind(':');
  if (colon == std::string_view::npos) return InvalidArgumentError("'" + std::string(text) + "' is not host:port");
  std::string host(text.substr(0, colon)), port(text.substr(colon + 1));
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  int rc = ::getaddrinfo(host.c_str(), port.c_str(), &hints, &res);
  if (rc != 0 || res == nullptr) {
    return InvalidArgumentError("cannot resolve '" + std::string(text) + "': " + gai_strerror(rc));
  }
  sockaddr_storage out{};
  std::memcpy(&out, res->ai_addr, res->ai_addrlen);
  *len = res->ai_addrlen;
  ::freeaddrinfo(res);
  return out;
}

class UcxTransport;

struct SendOp {
  UcxTransport* self;
  PeerId peer;
  std::shared_ptr<internal::Window> window;
  char header[FrameHeader::kBytes];
  std::string payload;
};

struct RecvOp {
  UcxTransport* self;
  PeerId peer;
  uint64_t slot;
  FrameHeader header;
  std::string payload;
};

class UcxTransport : public Transport {
 public:
  UcxTransport(const TransportOptions& options, Handler* handler)
      : options_(options), handler_(handler), corrupter_(options.corrupt_every) {}

  ~UcxTransport() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    if (worker_ != nullptr) ucp_worker_signal(worker_);
    if (thread_.joinable()) thread_.join();
    // The progress thread has stopped: tear down from here.
    for (auto& [id, p] : peers_) {
      p.window->Fail();
      if (p.ep != nullptr) CloseEp(p.ep, /*force=*/true);
    }
    if (listener_ != nullptr) ucp_listener_destroy(listener_);
    if (worker_ != nullptr) ucp_worker_destroy(worker_);
    if (context_ != nullptr) ucp_cleanup(context_);
  }

  Status Init() {
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
    ucs_status_t s = ucp_init(&params, nullptr, &context_);
    if (s != UCS_OK) return UcsError(s, "ucp_init");
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;  // only the progress thread calls UCX
    s = ucp_worker_create(context_, &wp, &worker_);
    if (s != UCS_OK) return UcsError(s, "ucp_worker_create");

    ucp_am_handler_param_t am{};
    am.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
    am.id = kAmId;
    am.cb = &UcxTransport::OnAm;
    am.arg = this;
    s = ucp_worker_set_am_recv_handler(worker_, &am);
    if (s != UCS_OK) return UcsError(s, "ucp_worker_set_am_recv_handler");

    socklen_t len = 0;
    WSYNC_ASSIGN_OR_RETURN(sockaddr_storage addr, ParseHostPort(options_.listen, &len));
    ucp_listener_params_t lp{};
    lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
    lp.sockaddr.addr = reinterpret_cast<const sockaddr*>(&addr);
    lp.sockaddr.addrlen = len;
    lp.conn_handler.cb = &UcxTransport::OnConnRequest;
    lp.conn_handler.arg = this;
    s = ucp_listener_create(worker_, &lp, &listener_);
    if (s != UCS_OK) return UcsError(s, "listen on " + options_.listen);
    ucp_listener_attr_t attr{};
    attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
    s = ucp_listener_query(listener_, &attr);
    if (s != UCS_OK) return UcsError(s, "ucp_listener_query");
    uint16_t port = attr.sockaddr.ss_family == AF_INET6
                        ? ntohs(reinterpret_cast<sockaddr_in6*>(&attr.sockaddr)->sin6_port)
                        : ntohs(reinterpret_cast<sockaddr_in*>(&attr.sockaddr)->sin_port);
    const std::string host = options_.listen.substr(0, options_.listen.rfind(':'));
    conn_info_ = host + ":" + std::to_string(port);
    thread_ = std::thread([this] { Run(); });
    return Status::Ok();
  }

  std::string LocalConnInfo() const override { return conn_info_; }

  StatusOr<PeerId> Connect(std::string_view conn_info) override {
    socklen_t len = 0;
    WSYNC_ASSIGN_OR_RETURN(sockaddr_storage addr, ParseHostPort(conn_info, &len));
    auto done = std::make_shared<std::promise<StatusOr<PeerId>>>();
    auto result = done->get_future();
    Post([this, addr, len, done, where = std::string(conn_info)] {
      ucp_ep_params_t ep{};
      ep.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER;
      ep.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
      ep.sockaddr.addr = reinterpret_cast<const sockaddr*>(&addr);
      ep.sockaddr.addrlen = len;
      ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
      ep.err_handler.cb = &UcxTransport::OnEpError;
      ep.err_handler.arg = this;
      ucp_ep_h h = nullptr;
      ucs_status_t s = ucp_ep_create(worker_, &ep, &h);
      if (s != UCS_OK) {
        done->set_value(UcsError(s, "connect to " + where));
        return;
      }
      done->set_value(AddPeer(h, /*trusted=*/true));
    });
    return result.get();
  }

  Status Send(PeerId peer, uint32_t channel, uint64_t seq, std::string_view payload) override {
    std::shared_ptr<internal::Window> window;
    std::shared_ptr<internal::RateLimiter> limiter;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = peers_.find(peer);
      if (it == peers_.end()) return UnavailableError("peer " + std::to_string(peer) + " is not connected");
      window = it->second.window;
      limiter = it->second.limiter;
    }
    if (!window->Acquire()) return UnavailableError("peer " + std::to_string(peer) + " failed");
    limiter->Acquire(payload.size());
    auto* op = new SendOp{this, peer, window, {}, std::string(payload)};
    internal::MakeHeader(channel, seq, payload).EncodeTo(op->header);
    if (corrupter_.Next() && !op->payload.empty()) op->payload[op->payload.size() / 2] ^= 0x20;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++stats_.messages_sent;
      stats_.bytes_sent += payload.size();
    }
    Post([this, op] { PostSend(op); });
    return Status::Ok();
  }

  Status Flush(PeerId peer) override {
    std::shared_ptr<internal::Window> window;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = peers_.find(peer);
      if (it == peers_.end()) return UnavailableError("peer " + std::to_string(peer) + " is not connected");
      window = it->second.window;
    }
    return window->Drain() ? Status::Ok() : UnavailableError("peer " + std::to_string(peer) + " failed");
  }

  void Disconnect(PeerId peer) override {
    Post([this, peer] {
      if (ucp_ep_h ep = TakePeer(peer)) CloseEp(ep, /*force=*/false);
    });
  }

  void Trust(PeerId peer) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = peers_.find(peer);
    if (it != peers_.end()) it->second.trusted = true;
  }

  TransportStats stats() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }

 private:
  struct Peer {
    ucp_ep_h ep = nullptr;
    std::shared_ptr<internal::Window> window;
    std::shared_ptr<internal::RateLimiter> limiter;
    // In-order delivery: arrivals take the slot of their link sequence
    // number (nullptr while the data is still arriving); delivered in order
    // from next_deliver once complete.
    uint64_t next_send = 0;     // link sequence of the next message posted (progress thread)
    uint64_t next_deliver = 0;
    std::map<uint64_t, RecvOp*> slots;
    bool trusted = true;    // false for an accepted peer until Trust()
    bool dropping = false;  // over a limit: being dropped, its messages ignored
  };

  // Link sequence numbers ahead of the next one to deliver that a receive
  // may take (the sender's window is far smaller; a peer past it is broken).
  static constexpr uint64_t kMaxReorder = 4096;

  void Post(std::function<void()> op) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      ops_.push_back(std::move(op));
    }
    ucp_worker_signal(worker_);
  }

  PeerId AddPeer(ucp_ep_h ep, bool trusted) {
    std::lock_guard<std::mutex> lock(mu_);
    const PeerId id = next_peer_++;
    Peer& p = peers_[id];
    p.ep = ep;
    p.trusted = trusted;
    p.window = std::make_shared<internal::Window>(options_.window);
    p.limiter = std::make_shared<internal::RateLimiter>(options_.rate_limit_bytes_per_s);
    ep_to_peer_[ep] = id;
    return id;
  }

  void Run() {
    for (;;) {
      std::deque<std::function<void()>> ops;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (stop_) return;
        ops.swap(ops_);
      }
      for (auto& op : ops) op();
      while (ucp_worker_progress(worker_) != 0) {
      }
      DeliverReady();
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (stop_ || !ops_.empty()) continue;
      }
      if (ucp_worker_arm(worker_) == UCS_OK) ucp_worker_wait(worker_);
    }
  }

  void PostSend(SendOp* op) {
    ucp_ep_h ep = nullptr;
    uint64_t link_seq = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = peers_.find(op->peer);
      if (it != peers_.end()) {
        ep = it->second.ep;
        link_seq = it->second.next_send++;  // posted in this order
      }
    }
    if (ep == nullptr) {
      op->window->Fail();
      delete op;
      return;
    }
    StoreLE(op->header + FrameHeader::kLinkSeqOffset, link_seq);
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    param.cb.send = &UcxTransport::OnSendDone;
    param.user_data = op;
    param.flags = UCP_AM_SEND_FLAG_REPLY;
    ucs_status_ptr_t req =
        ucp_am_send_nbx(ep, kAmId, op->header, FrameHeader::kBytes, op->payload.data(), op->payload.size(), &param);
    if (req == nullptr) {
      op->window->Release();
      delete op;
    } else if (UCS_PTR_IS_ERR(req)) {
      spdlog::warn("transport: send to peer {} failed: {}", op->peer, ucs_status_string(UCS_PTR_STATUS(req)));
      op->window->Release();
      delete op;
    }
  }

  static void OnSendDone(void* request, ucs_status_t status, void* user_data) {
    auto* op = static_cast<SendOp*>(user_data);
    if (status != UCS_OK && status != UCS_ERR_CANCELED) {
      spdlog::warn("transport: send to peer {} failed: {}", op->peer, ucs_status_string(status));
    }
    op->window->Release();
    delete op;
    ucp_request_free(request);
  }

  static void OnConnRequest(ucp_conn_request_h request, void* arg) {
    auto* self = static_cast<UcxTransport*>(arg);
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.conn_request = request;
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = &UcxTransport::OnEpError;
    ep.err_handler.arg = self;
    ucp_ep_h h = nullptr;
    ucs_status_t s = ucp_ep_create(self->worker_, &ep, &h);
    if (s != UCS_OK) {
      spdlog::warn("transport: cannot accept a connection: {}", ucs_status_string(s));
      return;
    }
    self->handler_->OnAccept(self->AddPeer(h, /*trusted=*/false));
  }

  static void OnEpError(void* arg, ucp_ep_h ep, ucs_status_t status) {
    auto* self = static_cast<UcxTransport*>(arg);
    PeerId peer = 0;
    {
      std::lock_guard<std::mutex> lock(self->mu_);
      auto it = self->ep_to_peer_.find(ep);
      if (it == self->ep_to_peer_.end()) return;  // already closed by us
      peer = it->second;
      auto p = self->peers_.find(peer);
      if (p != self->peers_.end()) self->ErasePeerLocked(p);
    }
    self->CloseEp(ep, /*force=*/true);
    self->handler_->OnPeerFailed(peer, UnavailableError(std::string("peer connection failed: ") +
                                                        ucs_status_string(status)));
  }

  // Drops a peer that broke the transport's limits: closes it, tells the
  // handler (the other side sees its connection fail). Progress thread.
  void DropPeer(PeerId peer, const std::string& why) {
    ucp_ep_h ep = TakePeer(peer);
    if (ep == nullptr) return;
    spdlog::warn("transport: dropping peer {}: {}", peer, why);
    CloseEp(ep, /*force=*/true);
    handler_->OnPeerFailed(peer, UnavailableError("dropped: " + why));
  }

  // Forgets `peer` (ErasePeerLocked); its endpoint, to close, or null if unknown.
  ucp_ep_h TakePeer(PeerId peer) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = peers_.find(peer);
    if (it == peers_.end()) return nullptr;
    ucp_ep_h ep = it->second.ep;
    ErasePeerLocked(it);
    return ep;
  }

  // Fails the peer's window and forgets it. Completed but undelivered
  // receives go; pending ones are dropped when they complete.
  void ErasePeerLocked(std::map<PeerId, Peer>::iterator it) {
    it->second.window->Fail();
    for (auto& [slot, op] : it->second.slots) delete op;
    ep_to_peer_.erase(it->second.ep);
    peers_.erase(it);
  }

  void CloseEp(ucp_ep_h ep, bool force) {
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    ucs_status_ptr_t req = ucp_ep_close_nbx(ep, &param);
    if (req == nullptr || UCS_PTR_IS_ERR(req)) return;
    // Progress until the close completes (bounded: the peer may be gone).
    for (int i = 0; i < 100000 && ucp_request_check_status(req) == UCS_INPROGRESS; ++i) ucp_worker_progress(worker_);
    ucp_request_free(req);
  }

  static ucs_status_t OnAm(void* arg, const void* header, size_t header_length, void* data, size_t length,
                           const ucp_am_recv_param_t* param) {
    auto* self = static_cast<UcxTransport*>(arg);
    FrameHeader h;
    PeerId peer = 0;
    uint64_t slot = 0;
    std::string drop;  // why the peer is dropped
    {
      std::lock_guard<std::mutex> lock(self->mu_);
      if ((param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0) {
        auto it = self->ep_to_peer_.find(param->reply_ep);
        if (it != self->ep_to_peer_.end()) peer = it->second;
      }
      if (peer == 0 || !h.DecodeFrom(header, header_length) || h.length != length) {
        spdlog::warn("transport: dropping a malformed or unattributed message ({} header bytes, {} data bytes)",
                     header_length, length);
        return UCS_OK;
      }
      Peer& p = self->peers_[peer];
      if (p.dropping) return UCS_OK;
      slot = h.link_seq;
      const uint32_t limit = internal::MessageLimit(self->options_, p.trusted);
      if (length > limit) {
        drop = "a message of " + std::to_string(length) + " bytes is over the limit of " + std::to_string(limit);
      } else if (slot < p.next_deliver || slot > p.next_deliver + kMaxReorder || p.slots.count(slot)) {
        drop = "link sequence " + std::to_string(slot) + " where " + std::to_string(p.next_deliver) + " was next";
      }
      if (drop.empty()) {
        p.slots[slot] = nullptr;
      } else {
        p.dropping = true;
      }
    }
    if (!drop.empty()) {
      // Nothing is allocated for the message; the peer goes (from the
      // progress loop, outside this callback).
      self->Post([self, peer, drop] { self->DropPeer(peer, drop); });
      return UCS_OK;
    }
    auto* op = new RecvOp{self, peer, slot, h, std::string(length, '\0')};
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) == 0) {
      if (length > 0) std::memcpy(op->payload.data(), data, length);
      self->Complete(op);
      return UCS_OK;
    }
    // Rendezvous: fetch the data into our buffer; completes later.
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    rp.cb.recv_am = &UcxTransport::OnRecvDone;
    rp.user_data = op;
    ucs_status_ptr_t req = ucp_am_recv_data_nbx(self->worker_, data, op->payload.data(), length, &rp);
    if (req == nullptr) {
      self->Complete(op);
    } else if (UCS_PTR_IS_ERR(req)) {
      op->payload.clear();
      op->header.crc = ~Crc32c("", 0);  // reported as corrupt: the application re-fetches
      self->Complete(op);
    }
    return UCS_INPROGRESS;
  }

  static void OnRecvDone(void* request, ucs_status_t status, size_t length, void* user_data) {
    auto* op = static_cast<RecvOp*>(user_data);
    if (status != UCS_OK) op->header.crc = ~Crc32c(op->payload.data(), op->payload.size());
    op->self->Complete(op);
    ucp_request_free(request);
  }

  void Complete(RecvOp* op) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = peers_.find(op->peer);
    if (op->peer == 0 || it == peers_.end()) {
      delete op;
      return;
    }
    it->second.slots[op->slot] = op;
  }

  // Delivers, per peer, the completed receives at the front of its slots.
  void DeliverReady() {
    std::vector<RecvOp*> ready;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& [id, p] : peers_) {
        for (auto it = p.slots.find(p.next_deliver); it != p.slots.end() && it->first == p.next_deliver &&
                                                     it->second != nullptr;
             it = p.slots.find(p.next_deliver)) {
          ready.push_back(it->second);
          p.slots.erase(it);
          ++p.next_deliver;
        }
      }
    }
    for (RecvOp* op : ready) {
      const bool intact = Crc32c(op->payload.data(), op->payload.size()) == op->header.crc;
      {
        std::lock_guard<std::mutex> lock(mu_);
        ++stats_.messages_received;
        stats_.bytes_received += op->payload.size();
        stats_.corrupt_received += intact ? 0 : 1;
      }
      if (intact) {
        handler_->OnMessage({op->peer, op->header.channel, op->header.seq, std::move(op->payload)});
      } else {
        handler_->OnCorrupt(op->peer, op->header.channel, op->header.seq);
      }
      delete op;
    }
  }

  TransportOptions options_;
  Handler* handler_;
  internal::Corrupter corrupter_;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  ucp_listener_h listener_ = nullptr;
  std::string conn_info_;
  std::thread thread_;

  mutable std::mutex mu_;
  bool stop_ = false;
  std::deque<std::function<void()>> ops_;
  std::map<PeerId, Peer> peers_;
  std::map<ucp_ep_h, PeerId> ep_to_peer_;
  PeerId next_peer_ = 1;
  TransportStats stats_;
};

}  // namespace

StatusOr<std::unique_ptr<Transport>> CreateUcxTransport(const TransportOptions& options, Handler* handler) {
  auto t = std::make_unique<UcxTransport>(options, handler);
  WSYNC_RETURN_IF_ERROR(t->Init());
  return std::unique_ptr<Transport>(std::move(t));
}

}  // namespace wsync::transport
