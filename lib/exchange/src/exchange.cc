#include "patch_exchange.h"
#include "wsync/util/text.h"

#include <spdlog/spdlog.h>

#include <cstring>

namespace wsync::daemon {
namespace {

using transport::Message;
using transport::PeerId;

template <typename T>
void Put(std::string* out, T v) {
  out->append(reinterpret_cast<const char*>(&v), sizeof(T));
}

template <typename T>
bool Get(std::string_view in, size_t* pos, T* v) {
  if (in.size() - *pos < sizeof(T)) return false;
  std::memcpy(v, in.data() + *pos, sizeof(T));
  *pos += sizeof(T);
  return true;
}

std::string Typed(ExchangeMessage type) { return std::string(1, static_cast<char>(type)); }

constexpr auto kServeTimeout = std::chrono::minutes(10);  // longest wait for a relayed chunk
constexpr auto kLinger = std::chrono::seconds(30);        // refetch window after the last chunk
constexpr int kMaxRefetchesPerMessage = 4;                  // then the pull fails with DataLoss

}  // namespace

// ------------------------------------------------------------ PatchStream

Status CheckStreamShape(uint64_t total_bytes, uint32_t chunk_bytes) {
  if (chunk_bytes < kMinChunkBytes || chunk_bytes > kMaxChunkBytes) {
    return DataLossError("header: chunk size " + std::to_string(chunk_bytes) + " outside [" +
                         std::to_string(kMinChunkBytes) + ", " + std::to_string(kMaxChunkBytes) + "]");
  }
  if (total_bytes / chunk_bytes >= kMaxStreamChunks) {
    return DataLossError("header: " + std::to_string(total_bytes) + " bytes in chunks of " +
                         std::to_string(chunk_bytes) + " is more than " + std::to_string(kMaxStreamChunks) + " chunks");
  }
  return Status::Ok();
}

PatchStream::PatchStream(codec::PatchKind kind, uint64_t from, uint64_t to, uint64_t total_bytes,
                         uint32_t chunk_bytes)
    : kind_(kind),
      from_(from),
      to_(to),
      total_(total_bytes),
      chunk_bytes_(chunk_bytes),
      chunks_(static_cast<size_t>((total_bytes + chunk_bytes - 1) / chunk_bytes)),
      data_(chunks_),
      present_(chunks_, false) {}

std::shared_ptr<PatchStream> PatchStream::FromBytes(codec::PatchKind kind, uint64_t from, uint64_t to,
                                                    std::string bytes, uint32_t chunk_bytes) {
  auto s = std::make_shared<PatchStream>(kind, from, to, bytes.size(), chunk_bytes);
  for (size_t i = 0; i < s->chunks(); ++i) {
    (void)s->Put(i, bytes.substr(i * chunk_bytes, chunk_bytes));
  }
  return s;
}

Status PatchStream::Put(size_t i, std::string bytes) {
  if (i >= chunks_) return InvalidArgumentError("chunk " + std::to_string(i) + " of " + std::to_string(chunks_));
  const uint64_t want = std::min<uint64_t>(chunk_bytes_, total_ - i * chunk_bytes_);
  if (bytes.size() != want) {
    return InvalidArgumentError("chunk " + std::to_string(i) + " has " + std::to_string(bytes.size()) +
                                " bytes, expected " + std::to_string(want));
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (present_[i]) return Status::Ok();
  data_[i] = std::move(bytes);
  present_[i] = true;
  ++present_count_;
  cv_.notify_all();
  return Status::Ok();
}

StatusOr<std::string> PatchStream::Wait(size_t i, std::chrono::steady_clock::time_point deadline) const {
  std::unique_lock<std::mutex> lock(mu_);
  if (i >= chunks_) return OutOfRangeError("chunk " + std::to_string(i) + " of " + std::to_string(chunks_));
  if (!cv_.wait_until(lock, deadline, [&] { return present_[i] || !failed_.ok(); })) {
    return DeadlineExceededError("chunk " + std::to_string(i) + " did not arrive in time");
  }
  if (present_[i]) return data_[i];
  return failed_;
}

Status PatchStream::WaitComplete(std::chrono::steady_clock::time_point deadline) const {
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_until(lock, deadline, [&] { return present_count_ == chunks_ || !failed_.ok(); })) {
    return DeadlineExceededError("patch " + std::to_string(from_) + "->" + std::to_string(to_) + ": " +
                                 std::to_string(present_count_) + " of " + std::to_string(chunks_) +
                                 " chunks arrived in time");
  }
  return present_count_ == chunks_ ? Status::Ok() : failed_;
}

std::string PatchStream::Assemble() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string out;
  out.reserve(total_);
  for (const auto& d : data_) out += d;
  return out;
}

void PatchStream::Fail(const Status& why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (failed_.ok() && present_count_ < chunks_) failed_ = why;
  cv_.notify_all();
}

// -------------------------------------------------------- ExchangeHandler

void ExchangeHandler::OnMessage(Message m) {
  if (m.payload.empty()) return;
  std::shared_lock<std::shared_mutex> lock(mu_);
  switch (static_cast<ExchangeMessage>(m.payload[0])) {
    case ExchangeMessage::kPull:
    case ExchangeMessage::kRefetch:
    case ExchangeMessage::kCancel:
      if (server_ != nullptr) server_->OnRequest(m);
      break;
    case ExchangeMessage::kHeader:
    case ExchangeMessage::kChunk:
    case ExchangeMessage::kAbort:
      if (fetcher_ != nullptr) fetcher_->OnResponse(m);
      break;
    default:
      spdlog::warn("peer {}: unknown exchange message type {}", m.peer, static_cast<int>(m.payload[0]));
  }
}

void ExchangeHandler::OnCorrupt(transport::PeerId peer, uint32_t channel, uint64_t seq) {
  std::shared_lock<std::shared_mutex> lock(mu_);
  if (fetcher_ != nullptr) fetcher_->OnCorrupt(peer, channel, seq);
}

void ExchangeHandler::OnPeerFailed(transport::PeerId peer, const Status& why) {
  std::shared_lock<std::shared_mutex> lock(mu_);
  if (server_ != nullptr) server_->OnPeerFailed(peer);
  if (fetcher_ != nullptr) fetcher_->OnPeerFailed(peer, why);
}

// ------------------------------------------------------------- PatchServer

struct PatchServer::Request {
  PeerId peer;
  uint32_t channel;
  uint64_t from, to;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<size_t> refetch;
  bool done = false;  // cancelled, completed or peer failed
};

PatchServer::PatchServer(transport::Transport* transport, PatchProvider* provider)
    : transport_(transport), provider_(provider) {}

PatchServer::~PatchServer() {
  stopping_ = true;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [key, r] : requests_) {
      std::lock_guard<std::mutex> rl(r->mu);
      r->done = true;
      r->cv.notify_all();
    }
  }
  for (auto& w : workers_) w.thread.join();
}

void PatchServer::OnRequest(const Message& m) {
  const auto type = static_cast<ExchangeMessage>(m.payload[0]);
  const auto key = std::make_pair(m.peer, m.channel);
  std::lock_guard<std::mutex> lock(mu_);
  if (type == ExchangeMessage::kPull) {
    size_t pos = 1;
    auto r = std::make_shared<Request>();
    r->peer = m.peer;
    r->channel = m.channel;
    if (!Get(m.payload, &pos, &r->from) || !Get(m.payload, &pos, &r->to) || stopping_) return;
    ++pulls_served_;
    requests_[key] = r;
    for (auto it = workers_.begin(); it != workers_.end();) {
      if (it->finished->load()) {
        it->thread.join();
        it = workers_.erase(it);
      } else {
        ++it;
      }
    }
    auto finished = std::make_shared<std::atomic<bool>>(false);
    workers_.push_back({std::thread([this, r, finished] {
                          Serve(r);
                          *finished = true;
                        }),
                        finished});
    return;
  }
  auto it = requests_.find(key);
  if (it == requests_.end()) return;
  std::lock_guard<std::mutex> rl(it->second->mu);
  if (type == ExchangeMessage::kRefetch) {
    it->second->refetch.push_back(static_cast<size_t>(m.seq));
  } else {
    it->second->done = true;
  }
  it->second->cv.notify_all();
}

void PatchServer::OnPeerFailed(PeerId peer) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [key, r] : requests_) {
    if (key.first != peer) continue;
    std::lock_guard<std::mutex> rl(r->mu);
    r->done = true;
    r->cv.notify_all();
  }
}

void PatchServer::Serve(std::shared_ptr<Request> r) {
  auto finish = [&] {
    std::lock_guard<std::mutex> lock(mu_);
    requests_.erase({r->peer, r->channel});
  };
  auto stream = provider_->Open(r->from, r->to);
  std::string header = Typed(ExchangeMessage::kHeader);
  if (!stream.ok()) {
    Put<uint8_t>(&header, static_cast<uint8_t>(stream.status().code()));
    Put<uint8_t>(&header, 0);
    Put<uint64_t>(&header, r->from);
    Put<uint64_t>(&header, r->to);
    Put<uint64_t>(&header, 0);
    Put<uint32_t>(&header, 0);
    header += stream.status().message();
    (void)transport_->Send(r->peer, r->channel, 0, header);
    spdlog::info("peer {} pull {}->{} refused: {}", r->peer, r->from, r->to, stream.status().ToString());
    return finish();
  }
  const auto& s = *stream;
  Put<uint8_t>(&header, 0);
  Put<uint8_t>(&header, static_cast<uint8_t>(s->kind()));
  Put<uint64_t>(&header, s->from());
  Put<uint64_t>(&header, s->to());
  Put<uint64_t>(&header, s->total_bytes());
  Put<uint32_t>(&header, s->chunk_bytes());
  if (!transport_->Send(r->peer, r->channel, 0, header).ok()) return finish();
  auto cancelled = [&] {
    std::lock_guard<std::mutex> lock(r->mu);
    return r->done;
  };
  auto send_chunk = [&](size_t i) {
    // Wait in slices, so a cancelled request or a stopping server gives up.
    const auto give_up = std::chrono::steady_clock::now() + kServeTimeout;
    StatusOr<std::string> bytes = DeadlineExceededError("not yet");
    while (!cancelled()) {
      bytes = s->Wait(i, std::min(give_up, std::chrono::steady_clock::now() + std::chrono::milliseconds(200)));
      if (bytes.ok() || bytes.status().code() != StatusCode::kDeadlineExceeded ||
          std::chrono::steady_clock::now() >= give_up) {
        break;
      }
    }
    if (!bytes.ok()) return false;
    std::string msg = Typed(ExchangeMessage::kChunk);
    msg += *bytes;
    if (!transport_->Send(r->peer, r->channel, i + 1, msg).ok()) return false;
    bytes_served_ += bytes->size();
    return true;
  };
  auto take_refetches = [&] {
    std::lock_guard<std::mutex> lock(r->mu);
    return std::exchange(r->refetch, {});
  };
  // After the header, a stream that fails (a relay's own parent went away,
  // or it stalled past kServeTimeout) is reported: the puller fails its pull
  // now instead of waiting for chunks that will not come.
  auto abort = [&] {
    if (cancelled()) return finish();
    Status why = s->WaitComplete(std::chrono::steady_clock::now());
    if (why.ok()) why = UnavailableError("the stream stalled");
    std::string msg = Typed(ExchangeMessage::kAbort);
    Put<uint8_t>(&msg, static_cast<uint8_t>(why.code()));
    msg += why.message();
    (void)transport_->Send(r->peer, r->channel, 0, msg);
    spdlog::info("peer {} pull {}->{} aborted: {}", r->peer, r->from, r->to, why.ToString());
    finish();
  };
  // A refetch names a message by its seq: 0 is the header, i + 1 chunk i.
  auto resend = [&](size_t seq) {
    if (seq == 0) return transport_->Send(r->peer, r->channel, 0, header).ok();
    return seq - 1 >= s->chunks() || send_chunk(seq - 1);
  };
  for (size_t i = 0; i < s->chunks(); ++i) {
    for (size_t again : take_refetches()) {
      if (again <= i && !resend(again)) return abort();
    }
    if (cancelled()) return finish();
    if (!send_chunk(i)) return abort();
  }
  // Linger for refetches until the fetcher says it is done.
  const auto until = std::chrono::steady_clock::now() + kLinger;
  for (;;) {
    std::vector<size_t> again;
    {
      std::unique_lock<std::mutex> lock(r->mu);
      if (!r->cv.wait_until(lock, until, [&] { return r->done || !r->refetch.empty(); }) || r->done) break;
      again = std::exchange(r->refetch, {});
    }
    for (size_t seq : again) {
      if (!resend(seq)) return finish();
    }
  }
  finish();
}

// ------------------------------------------------------------ PatchFetcher

StatusOr<std::shared_ptr<PatchStream>> PatchFetcher::Pull(PeerId parent, uint64_t from, uint64_t to,
                                                          std::chrono::milliseconds timeout) {
  uint32_t channel;
  auto p = std::make_shared<Pending>();
  p->parent = parent;
  p->from = from;
  p->to = to;
  {
    std::lock_guard<std::mutex> lock(mu_);
    channel = next_channel_++;
    pending_[channel] = p;
  }
  std::string msg = Typed(ExchangeMessage::kPull);
  Put<uint64_t>(&msg, from);
  Put<uint64_t>(&msg, to);
  Status sent = transport_->Send(parent, channel, 0, msg);
  std::unique_lock<std::mutex> lock(mu_);
  if (!sent.ok()) {
    pending_.erase(channel);
    return sent;
  }
  if (!cv_.wait_for(lock, timeout, [&] { return p->header_seen; })) {
    pending_.erase(channel);
    return DeadlineExceededError("pull " + std::to_string(from) + "->" + std::to_string(to) +
                                 ": no answer from the parent in time");
  }
  if (p->header_code != StatusCode::kOk || !p->stream) {
    pending_.erase(channel);
    return Status(p->header_code == StatusCode::kOk ? StatusCode::kUnavailable : p->header_code,
                  "parent: " + p->header_error);
  }
  return p->stream;
}

void PatchFetcher::OnResponse(const Message& m) {
  const auto type = static_cast<ExchangeMessage>(m.payload[0]);
  std::shared_ptr<PatchStream> complete;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pending_.find(m.channel);
    if (it == pending_.end() || it->second->parent != m.peer) return;
    Pending& p = *it->second;
    if (type == ExchangeMessage::kAbort) {
      uint8_t code = 0;
      size_t pos = 1;
      const bool known = Get(m.payload, &pos, &code) && code != 0 && code <= static_cast<uint8_t>(StatusCode::kUnauthenticated);
      FailLocked(p, Status(known ? static_cast<StatusCode>(code) : StatusCode::kUnavailable,
                           "parent: " + Quoted(m.payload.substr(std::min(pos, m.payload.size())), 400)));
      pending_.erase(it);
      cv_.notify_all();
      return;
    }
    if (type == ExchangeMessage::kHeader) {
      if (p.header_seen) return;  // a repeated header (a refetch of seq 0) changes nothing
      Status checked = ParseHeader(m.payload, p);
      if (!checked.ok()) {
        spdlog::warn("peer {}: pull {}: {}", m.peer, m.channel, checked.ToString());
        p.header_code = checked.code();
        p.header_error = checked.message();
        p.stream.reset();
      }
      p.header_seen = true;
      cv_.notify_all();
      if (!p.stream) return;
    } else if (m.seq == 0) {
      return;  // a chunk never has seq 0
    } else if (!p.stream) {
      if (p.early.size() >= kMaxEarlyChunks) {
        FailLocked(p, DataLossError("more than " + std::to_string(kMaxEarlyChunks) + " chunks before the header"));
        pending_.erase(it);
        cv_.notify_all();
        return;
      }
      p.early.push_back({static_cast<size_t>(m.seq - 1), m.payload.substr(1)});
      return;
    } else {
      Status s = p.stream->Put(static_cast<size_t>(m.seq - 1), m.payload.substr(1));
      if (!s.ok()) spdlog::warn("peer {}: {}", m.peer, s.ToString());
    }
    if (p.stream->WaitComplete(std::chrono::steady_clock::now()).ok()) {
      complete = p.stream;
      pending_.erase(it);
    }
  }
  if (complete) (void)transport_->Send(m.peer, m.channel, 0, Typed(ExchangeMessage::kCancel));
}

void PatchFetcher::OnCorrupt(PeerId peer, uint32_t channel, uint64_t seq) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pending_.find(channel);
    if (it == pending_.end() || it->second->parent != peer) return;
    if (++it->second->corrupt[seq] > kMaxRefetchesPerMessage) {
      // A link that corrupts the same message again and again: the pull
      // fails (the sink retries later, with backoff) instead of looping.
      const Status why = DataLossError((seq == 0 ? std::string("the header") : "chunk " + std::to_string(seq - 1)) +
                                       " of pull " + std::to_string(channel) + " arrived corrupt " +
                                       std::to_string(kMaxRefetchesPerMessage + 1) + " times");
      FailLocked(*it->second, why);
      pending_.erase(it);
      cv_.notify_all();
      spdlog::warn("peer {}: {}", peer, why.ToString());
      return;
    }
  }
  ++refetches_;
  spdlog::warn("peer {}: {} of pull {} arrived corrupt: fetching it again", peer,
               seq == 0 ? std::string("the header") : "chunk " + std::to_string(seq - 1), channel);
  (void)transport_->Send(peer, channel, seq, Typed(ExchangeMessage::kRefetch));
}

void PatchFetcher::OnPeerFailed(PeerId peer, const Status& why) {
  FailPending([peer](const Pending& p) { return p.parent == peer; }, why);
}

void PatchFetcher::FailAll(const Status& why) {
  FailPending([](const Pending&) { return true; }, why);
}

Status PatchFetcher::ParseHeader(std::string_view payload, Pending& p) {
  size_t pos = 1;
  uint8_t code = 0, kind = 0;
  uint64_t from = 0, to = 0, total = 0;
  uint32_t chunk = 0;
  if (!Get(payload, &pos, &code) || !Get(payload, &pos, &kind) || !Get(payload, &pos, &from) ||
      !Get(payload, &pos, &to) || !Get(payload, &pos, &total) || !Get(payload, &pos, &chunk)) {
    return DataLossError("header: " + std::to_string(payload.size()) + " bytes, shorter than its 31 fixed bytes");
  }
  if (code > static_cast<uint8_t>(StatusCode::kUnauthenticated)) {
    return DataLossError("header: status " + std::to_string(code) + " is not a status code");
  }
  if (code != 0) {
    p.header_code = static_cast<StatusCode>(code);
    p.header_error = Quoted(payload.substr(pos), 400);
    return Status::Ok();
  }
  if (kind != static_cast<uint8_t>(codec::PatchKind::kPatch) && kind != static_cast<uint8_t>(codec::PatchKind::kKeyframe)) {
    return DataLossError("header: kind " + std::to_string(kind) + " is neither a patch (1) nor a keyframe (2)");
  }
  // The answer to (from, to) is that patch, or a keyframe of `to`.
  const bool keyframe = kind == static_cast<uint8_t>(codec::PatchKind::kKeyframe);
  if (to != p.to || (keyframe ? from != 0 : from != p.from)) {
    return DataLossError("header: announces " + std::string(keyframe ? "a keyframe " : "a patch ") + std::to_string(from) +
                         "->" + std::to_string(to) + " for a pull of " + std::to_string(p.from) + "->" +
                         std::to_string(p.to));
  }
  WSYNC_RETURN_IF_ERROR(CheckStreamShape(total, chunk));
  p.header_code = StatusCode::kOk;
  p.stream = std::make_shared<PatchStream>(static_cast<codec::PatchKind>(kind), from, to, total, chunk);
  for (auto& [i, bytes] : p.early) (void)p.stream->Put(i, std::move(bytes));
  p.early.clear();
  return Status::Ok();
}

void PatchFetcher::FailLocked(Pending& p, const Status& why) {
  if (p.stream) p.stream->Fail(why);
  if (!p.header_seen) {
    p.header_seen = true;
    p.header_code = why.code();
    p.header_error = why.message();
  }
}

void PatchFetcher::FailPending(const std::function<bool(const Pending&)>& which, const Status& why) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = pending_.begin(); it != pending_.end();) {
    Pending& p = *it->second;
    if (!which(p)) {
      ++it;
      continue;
    }
    FailLocked(p, why);
    it = pending_.erase(it);
  }
  cv_.notify_all();
}

}  // namespace wsync::daemon
