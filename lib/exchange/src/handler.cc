// ExchangeHandler: the handshake, sealing, and routing (docs/security.md).
#include <spdlog/spdlog.h>

#include "crypto.h"
#include "wire.h"
#include "wsync/exchange/exchange.h"

namespace wsync::exchange {
namespace {

using transport::Message;
using transport::PeerId;

}  // namespace

std::string_view SecurityModeName(SecurityMode mode) {
  switch (mode) {
    case SecurityMode::kNone: return "none";
    case SecurityMode::kAuthenticate: return "auth";
    case SecurityMode::kEncrypt: return "encrypt";
  }
  return "unknown";
}

StatusOr<SecurityMode> ParseSecurityMode(std::string_view name) {
  for (SecurityMode m : {SecurityMode::kNone, SecurityMode::kAuthenticate, SecurityMode::kEncrypt}) {
    if (name == SecurityModeName(m)) return m;
  }
  return InvalidArgumentError("data-plane security '" + std::string(name) + "': expected none, auth or encrypt");
}

// One connection's handshake and keys. The side that connected is the
// client: it sends HELLO; the side that accepted answers CHALLENGE and
// checks the client's PROOF.
struct ExchangeHandler::Peer {
  enum class State { kNew, kHelloSent, kChallenged, kEstablished, kFailed };
  PeerId id = 0;
  bool accepted = false;
  State state = State::kNew;
  Status failure;
  std::chrono::steady_clock::time_point since = std::chrono::steady_clock::now();
  wire::Nonce client{}, server{};
  std::unique_ptr<crypto::Sealer> sealer;  // encrypt mode, once established
  std::unique_ptr<crypto::Opener> opener;
  std::mutex send_mu;  // seal + send in counter order
};

ExchangeHandler::ExchangeHandler(SecurityOptions security) : security_(std::move(security)) {
  if (security_.mode != SecurityMode::kNone && !security_.cluster_token.empty()) {
    key_ = crypto::ClusterKey(security_.cluster_token);
  }
}

ExchangeHandler::~ExchangeHandler() { Detach(); }

Status ExchangeHandler::Bind(transport::Transport* transport) {
  if (security_.mode != SecurityMode::kNone && security_.cluster_token.empty()) {
    return InvalidArgumentError("data-plane security '" + std::string(SecurityModeName(security_.mode)) +
                                "' needs the cluster token (--token-file or WSYNC_TOKEN)");
  }
  transport_ = transport;
  std::lock_guard<std::mutex> lock(outbox_mu_);
  if (!outbox_open_ && !outbox_thread_.joinable()) {
    outbox_open_ = true;
    outbox_thread_ = std::thread([this] { RunOutbox(); });
  }
  return Status::Ok();
}

void ExchangeHandler::Attach(PatchServer* server, PatchFetcher* fetcher) {
  std::unique_lock<std::shared_mutex> lock(route_mu_);
  server_ = server;
  fetcher_ = fetcher;
}

void ExchangeHandler::Detach() {
  Attach(nullptr, nullptr);
  {
    std::lock_guard<std::mutex> lock(outbox_mu_);
    outbox_open_ = false;
    outbox_.clear();
    outbox_later_.clear();
  }
  outbox_cv_.notify_all();
  if (outbox_thread_.joinable()) outbox_thread_.join();
}

bool ExchangeHandler::Post(std::function<void()> task, std::chrono::milliseconds after) {
  {
    std::lock_guard<std::mutex> lock(outbox_mu_);
    if (!outbox_open_ || outbox_.size() + outbox_later_.size() >= kMaxQueuedSends) return false;
    if (after.count() > 0) {
      outbox_later_.emplace(std::chrono::steady_clock::now() + after, std::move(task));
    } else {
      outbox_.push_back(std::move(task));
    }
  }
  outbox_cv_.notify_one();
  return true;
}

void ExchangeHandler::RunOutbox() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(outbox_mu_);
      for (;;) {
        if (!outbox_open_) return;
        if (!outbox_.empty()) {
          task = std::move(outbox_.front());
          outbox_.pop_front();
          break;
        }
        if (!outbox_later_.empty() && outbox_later_.begin()->first <= std::chrono::steady_clock::now()) {
          task = std::move(outbox_later_.begin()->second);
          outbox_later_.erase(outbox_later_.begin());
          break;
        }
        if (outbox_later_.empty()) {
          outbox_cv_.wait(lock);
        } else {
          outbox_cv_.wait_until(lock, outbox_later_.begin()->first);
        }
      }
    }
    task();
  }
}

bool ExchangeHandler::SendSoon(PeerId peer, uint32_t channel, uint64_t seq, std::string message) {
  return Post([this, peer, channel, seq, message = std::move(message)] { (void)Send(peer, channel, seq, message); });
}

ExchangeStats ExchangeHandler::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

std::shared_ptr<ExchangeHandler::Peer> ExchangeHandler::Find(PeerId peer) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = peers_.find(peer);
  return it == peers_.end() ? nullptr : it->second;
}

void ExchangeHandler::OnAccept(PeerId peer) {
  if (security_.mode == SecurityMode::kNone || transport_ == nullptr) return;
  std::vector<PeerId> expired;
  PeerId oldest = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto now = std::chrono::steady_clock::now();
    size_t waiting = 0;
    auto oldest_since = now;
    for (auto& [id, p] : peers_) {
      if (!p->accepted || p->state == Peer::State::kEstablished || p->state == Peer::State::kFailed) continue;
      if (now - p->since > kHandshakeTimeout) {
        expired.push_back(id);
        continue;
      }
      ++waiting;
      if (p->since <= oldest_since) {
        oldest_since = p->since;
        oldest = id;
      }
    }
    if (waiting < kMaxHandshakes) oldest = 0;
    auto p = std::make_shared<Peer>();
    p->id = peer;
    p->accepted = true;
    peers_[peer] = p;
  }
  // Bounded: a peer that never finishes its handshake is dropped after
  // kHandshakeTimeout, or sooner when kMaxHandshakes others wait (the oldest
  // goes: a real peer finishes in milliseconds, so idle ones cannot lock it out).
  for (PeerId id : expired) {
    Refuse(id, StatusCode::kDeadlineExceeded,
           "no handshake within " + std::to_string(kHandshakeTimeout.count()) + " s");
  }
  if (oldest != 0) {
    Refuse(oldest, StatusCode::kResourceExhausted,
           std::to_string(kMaxHandshakes) + " peers are in the middle of their handshake; the oldest goes");
  }
}

void ExchangeHandler::OnPeerFailed(PeerId peer, const Status& why) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = peers_.find(peer);
    if (it != peers_.end()) {
      if (it->second->state != Peer::State::kFailed) {
        it->second->state = Peer::State::kFailed;
        it->second->failure = why;
      }
      peers_.erase(it);
    }
    cv_.notify_all();
  }
  std::shared_lock<std::shared_mutex> lock(route_mu_);
  if (server_ != nullptr) server_->OnPeerFailed(peer);
  if (fetcher_ != nullptr) fetcher_->OnPeerFailed(peer, why);
}

void ExchangeHandler::OnCorrupt(PeerId peer, uint32_t channel, uint64_t seq) {
  if (security_.mode != SecurityMode::kNone) {
    auto p = Find(peer);
    if (!p || p->state != Peer::State::kEstablished) return;  // a broken handshake times out
  }
  std::shared_lock<std::shared_mutex> lock(route_mu_);
  if (fetcher_ != nullptr) fetcher_->OnCorrupt(peer, channel, seq);
}

void ExchangeHandler::Refuse(PeerId peer, StatusCode code, const std::string& why) {
  spdlog::warn("data plane: refusing peer {}: {}", peer, why);
  // The DENIED goes out from the outbox (this may run on the progress
  // thread) and the connection closes kRefusalGrace later, so that the
  // peer reads why before the close. The transport does not report our own
  // close.
  auto* t = transport_.load();
  if (!Post([t, peer, denied = wire::Encode(ExchangeMessage::kDenied, {code, why})] {
        (void)t->Send(peer, 0, 0, denied);
      }) ||
      !Post([t, peer] { t->Disconnect(peer); }, kRefusalGrace)) {
    t->Disconnect(peer);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.peers_refused;
  }
  OnPeerFailed(peer, Status(code, "refused: " + why));
}

Status ExchangeHandler::Establish(PeerId peer, std::chrono::steady_clock::time_point deadline) {
  if (security_.mode == SecurityMode::kNone) return Status::Ok();
  std::shared_ptr<Peer> p;
  bool send_hello = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto& slot = peers_[peer];
    if (!slot) {
      slot = std::make_shared<Peer>();
      slot->id = peer;
      slot->state = Peer::State::kHelloSent;
      slot->client = crypto::RandomNonce();
      send_hello = true;
    }
    p = slot;
  }
  if (send_hello) {
    wire::Hello hello;
    hello.mode = static_cast<uint8_t>(security_.mode);
    hello.nonce = p->client;
    if (Status s = transport_.load()->Send(peer, 0, 0, wire::Encode(hello)); !s.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      if (auto it = peers_.find(peer); it != peers_.end() && it->second == p) peers_.erase(it);  // the next try starts over
      return s;
    }
  }
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_until(lock, deadline, [&] {
        return p->state == Peer::State::kEstablished || p->state == Peer::State::kFailed;
      })) {
    return DeadlineExceededError("peer " + std::to_string(peer) + " did not finish the data-plane handshake in time");
  }
  return p->state == Peer::State::kEstablished ? Status::Ok() : p->failure;
}

Status ExchangeHandler::Send(PeerId peer, uint32_t channel, uint64_t seq, std::string_view message) {
  if (security_.mode != SecurityMode::kEncrypt) return transport_.load()->Send(peer, channel, seq, message);
  auto p = Find(peer);
  if (!p || p->state != Peer::State::kEstablished || !p->sealer) {
    return UnavailableError("peer " + std::to_string(peer) + " has no data-plane session");
  }
  std::lock_guard<std::mutex> lock(p->send_mu);
  return transport_.load()->Send(peer, channel, seq, p->sealer->Seal(channel, seq, message));
}

void ExchangeHandler::OnMessage(Message m) {
  if (transport_ == nullptr) return;  // not bound yet
  const auto type = static_cast<ExchangeMessage>(wire::TypeOf(m.payload));
  if (security_.mode == SecurityMode::kNone) {
    if (type == ExchangeMessage::kHello) {
      // A peer that wants security: say why it will not get it.
      (void)SendSoon(m.peer, 0, 0,
                     wire::Encode(ExchangeMessage::kDenied,
                                  {StatusCode::kFailedPrecondition,
                                   "this daemon's data plane runs without security (--data-security none)"}));
      return;
    }
    return Route(std::move(m));
  }
  auto p = Find(m.peer);
  if (!p) return;  // a peer already refused: its messages go nowhere
  if (p->state != Peer::State::kEstablished) return OnHandshake(p, m);
  if (security_.mode == SecurityMode::kAuthenticate || (!p->accepted && type == ExchangeMessage::kDenied)) {
    return Route(std::move(m));  // a DENIED from our parent comes in clear
  }
  if (type != ExchangeMessage::kSealed) {
    return Refuse(m.peer, StatusCode::kUnauthenticated,
                  "sent a message of type " + std::to_string(static_cast<int>(type)) + " in clear; this daemon encrypts");
  }
  auto plain = p->opener->Open(m.channel, m.seq, m.payload);
  if (!plain.ok()) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++stats_.messages_rejected;
    }
    return Refuse(m.peer, StatusCode::kUnauthenticated, plain.status().message());
  }
  m.payload = std::move(*plain);
  Route(std::move(m));
}

void ExchangeHandler::OnHandshake(const std::shared_ptr<Peer>& p, const Message& m) {
  const auto type = static_cast<ExchangeMessage>(wire::TypeOf(m.payload));
  const auto mode = static_cast<uint8_t>(security_.mode);
  auto mode_name = [](uint8_t v) {
    return v <= 2 ? std::string(SecurityModeName(static_cast<SecurityMode>(v))) : "mode " + std::to_string(v);
  };
  // The side that accepted: HELLO, then PROOF.
  if (p->accepted && p->state == Peer::State::kNew && type == ExchangeMessage::kHello) {
    auto hello = wire::ParseHello(m.payload);
    if (!hello.ok()) return Refuse(p->id, StatusCode::kInvalidArgument, hello.status().message());
    if (hello->mode != mode) {
      return Refuse(p->id, StatusCode::kPermissionDenied,
                    "data-plane security mismatch: this daemon runs '" + mode_name(mode) + "', the peer '" +
                        mode_name(hello->mode) + "'");
    }
    wire::Challenge c;
    c.mode = mode;
    c.nonce = crypto::RandomNonce();
    c.proof = crypto::Prove(key_, "server", hello->nonce, c.nonce, mode);
    {
      std::lock_guard<std::mutex> lock(mu_);
      p->client = hello->nonce;
      p->server = c.nonce;
      p->state = Peer::State::kChallenged;
    }
    (void)transport_.load()->Send(p->id, 0, 0, wire::Encode(c));
    return;
  }
  if (p->accepted && p->state == Peer::State::kChallenged && type == ExchangeMessage::kProof) {
    auto proof = wire::ParseProof(m.payload);
    if (!proof.ok()) return Refuse(p->id, StatusCode::kInvalidArgument, proof.status().message());
    if (!crypto::SameMac(proof->proof, crypto::Prove(key_, "client", p->client, p->server, mode))) {
      return Refuse(p->id, StatusCode::kUnauthenticated, "wrong cluster credential");
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (security_.mode == SecurityMode::kEncrypt) {
        p->sealer = std::make_unique<crypto::Sealer>(crypto::SessionKey(key_, "server->client", p->client, p->server));
        p->opener = std::make_unique<crypto::Opener>(crypto::SessionKey(key_, "client->server", p->client, p->server));
      }
      p->state = Peer::State::kEstablished;
      ++stats_.peers_authenticated;
    }
    transport_.load()->Trust(p->id);
    spdlog::info("data plane: peer {} authenticated ({})", p->id, SecurityModeName(security_.mode));
    return;
  }
  // The side that connected: CHALLENGE or DENIED.
  if (!p->accepted && p->state == Peer::State::kHelloSent && type == ExchangeMessage::kChallenge) {
    auto c = wire::ParseChallenge(m.payload);
    Status failed;
    if (!c.ok()) {
      failed = c.status();
    } else if (c->mode != mode) {
      failed = PermissionDeniedError("data-plane security mismatch: this daemon runs '" + mode_name(mode) +
                                     "', the parent '" + mode_name(c->mode) + "'");
    } else if (!crypto::SameMac(c->proof, crypto::Prove(key_, "server", p->client, c->nonce, mode))) {
      failed = UnauthenticatedError("the parent could not prove the cluster credential");
    }
    if (!failed.ok()) {
      spdlog::warn("data plane: peer {}: {}", p->id, failed.ToString());
      transport_.load()->Disconnect(p->id);
      {
        std::lock_guard<std::mutex> lock(mu_);
        ++stats_.peers_refused;
      }
      OnPeerFailed(p->id, failed);
      return;
    }
    wire::Proof proof;
    proof.proof = crypto::Prove(key_, "client", p->client, c->nonce, mode);
    (void)transport_.load()->Send(p->id, 0, 0, wire::Encode(proof));
    std::lock_guard<std::mutex> lock(mu_);
    p->server = c->nonce;
    if (security_.mode == SecurityMode::kEncrypt) {
      p->sealer = std::make_unique<crypto::Sealer>(crypto::SessionKey(key_, "client->server", p->client, p->server));
      p->opener = std::make_unique<crypto::Opener>(crypto::SessionKey(key_, "server->client", p->client, p->server));
    }
    p->state = Peer::State::kEstablished;
    cv_.notify_all();
    return;
  }
  if (!p->accepted && type == ExchangeMessage::kDenied) {
    auto denied = wire::ParseRefusal(m.payload, ExchangeMessage::kDenied);
    const Status why = denied.ok() ? Status(denied->code, "the parent refused this daemon: " + denied->text)
                                   : denied.status();
    spdlog::warn("data plane: peer {}: {}", p->id, why.ToString());
    OnPeerFailed(p->id, why);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.messages_rejected;
  }
  Refuse(p->id, StatusCode::kUnauthenticated,
         "sent a message of type " + std::to_string(static_cast<int>(type)) +
             " before completing the handshake; this daemon requires '" +
             std::string(SecurityModeName(security_.mode)) + "'");
}

void ExchangeHandler::Route(Message m) {
  std::shared_lock<std::shared_mutex> lock(route_mu_);
  switch (static_cast<ExchangeMessage>(wire::TypeOf(m.payload))) {
    case ExchangeMessage::kPull:
    case ExchangeMessage::kRefetch:
    case ExchangeMessage::kCancel:
      if (server_ != nullptr) server_->OnRequest(m);
      break;
    case ExchangeMessage::kHeader:
    case ExchangeMessage::kChunk:
    case ExchangeMessage::kEnd:
    case ExchangeMessage::kAbort:
      if (fetcher_ != nullptr) fetcher_->OnResponse(m);
      break;
    case ExchangeMessage::kDenied:
      if (fetcher_ != nullptr) {
        auto denied = wire::ParseRefusal(m.payload, ExchangeMessage::kDenied);
        fetcher_->OnPeerFailed(m.peer, denied.ok() ? Status(denied->code, "the parent refused this daemon: " + denied->text)
                                                   : denied.status());
      }
      break;
    default:
      spdlog::warn("peer {}: unknown exchange message type {}", m.peer, static_cast<int>(wire::TypeOf(m.payload)));
  }
}

}  // namespace wsync::exchange
