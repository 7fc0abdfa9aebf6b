#include "wsync/exchange/exchange.h"

#include <spdlog/spdlog.h>

#include "wire.h"

namespace wsync::exchange {
namespace {

using transport::Message;
using transport::PeerId;

constexpr auto kServeTimeout = std::chrono::minutes(10);  // longest wait for a relayed chunk
constexpr auto kLinger = std::chrono::seconds(30);        // refetch window after the last chunk
constexpr int kMaxRefetchesPerMessage = 4;                  // then the pull fails with DataLoss

// The size of chunk i of a stream of `total` bytes. REQUIRES: i < its chunk count.
uint64_t ChunkSize(uint64_t total, uint32_t chunk_bytes, size_t i) {
  return std::min<uint64_t>(chunk_bytes, total - i * uint64_t{chunk_bytes});
}

// The message a seq names, for errors.
std::string What(uint64_t seq) {
  if (seq == 0) return "the header";
  if (seq == kEndSeq) return "the end";
  return "chunk " + std::to_string(seq - 1);
}

// The HEADER that refuses pull (from, to), with the code and text of `why`.
std::string RefusalHeader(uint64_t from, uint64_t to, const Status& why) {
  wire::Header h;
  h.code = why.code();
  h.error = why.message();
  h.from = from;
  h.to = to;
  return wire::Encode(h);
}

}  // namespace

// ------------------------------------------------------------ PatchStream

Status CheckStreamShape(uint64_t total_bytes, uint32_t chunk_bytes) {
  if (chunk_bytes < kMinChunkBytes || chunk_bytes > kMaxChunkBytes) {
    return DataLossError("header: chunk size " + std::to_string(chunk_bytes) + " outside [" +
                         std::to_string(kMinChunkBytes) + ", " + std::to_string(kMaxChunkBytes) + "]");
  }
  if (total_bytes != kUnknownTotal && total_bytes / chunk_bytes >= kMaxStreamChunks) {
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
      chunk_bytes_(chunk_bytes),
      sized_(total_bytes != kUnknownTotal),
      total_(sized_ ? total_bytes : 0),
      chunks_(sized_ ? static_cast<size_t>((total_bytes + chunk_bytes - 1) / chunk_bytes) : 0),
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

std::shared_ptr<PatchStream> PatchStream::Growing(codec::PatchKind kind, uint64_t from, uint64_t to,
                                                  uint32_t chunk_bytes) {
  return std::make_shared<PatchStream>(kind, from, to, kUnknownTotal, chunk_bytes);
}

bool PatchStream::sized() const {
  std::lock_guard<std::mutex> lock(mu_);
  return sized_;
}

uint64_t PatchStream::total_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return total_;
}

size_t PatchStream::chunks() const {
  std::lock_guard<std::mutex> lock(mu_);
  return chunks_;
}

void PatchStream::NoteCompleteLocked() {
  if (CompleteLocked()) completed_at_ = std::chrono::steady_clock::now();
  cv_.notify_all();
}

Status PatchStream::Put(size_t i, std::string bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  if (sized_) {
    if (i >= chunks_) return InvalidArgumentError("chunk " + std::to_string(i) + " of " + std::to_string(chunks_));
    const uint64_t want = ChunkSize(total_, chunk_bytes_, i);
    if (bytes.size() != want) {
      return InvalidArgumentError("chunk " + std::to_string(i) + " has " + std::to_string(bytes.size()) +
                                  " bytes, expected " + std::to_string(want));
    }
  } else {
    // Not sized yet: a chunk is whole, or (the last) shorter; no index past
    // the limit on chunks is taken (bounded bookkeeping).
    if (i >= kMaxStreamChunks) {
      return InvalidArgumentError("chunk " + std::to_string(i) + " past the limit of " +
                                  std::to_string(kMaxStreamChunks) + " chunks");
    }
    if (bytes.size() > chunk_bytes_ || bytes.empty()) {
      return InvalidArgumentError("chunk " + std::to_string(i) + " has " + std::to_string(bytes.size()) +
                                  " bytes, chunks have " + std::to_string(chunk_bytes_));
    }
    if (i >= data_.size()) {
      data_.resize(i + 1);
      present_.resize(i + 1, false);
    }
  }
  if (present_[i]) return Status::Ok();
  data_[i] = std::move(bytes);
  present_[i] = true;
  ++present_count_;
  NoteCompleteLocked();
  return Status::Ok();
}

Status PatchStream::Append(std::string_view bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  if (sized_) return FailedPreconditionError("append to a stream already sized");
  pending_.append(bytes);
  size_t taken = 0;
  while (pending_.size() - taken >= chunk_bytes_) {
    if (data_.size() >= kMaxStreamChunks) return ResourceExhaustedError("stream longer than the limit on chunks");
    data_.push_back(pending_.substr(taken, chunk_bytes_));
    present_.push_back(true);
    ++present_count_;
    taken += chunk_bytes_;
  }
  pending_.erase(0, taken);
  cv_.notify_all();
  return Status::Ok();
}

Status PatchStream::Finish() {
  std::lock_guard<std::mutex> lock(mu_);
  if (sized_) return FailedPreconditionError("stream already sized");
  uint64_t total = data_.size() * uint64_t{chunk_bytes_};
  if (!pending_.empty()) {
    total += pending_.size();
    data_.push_back(std::exchange(pending_, {}));
    present_.push_back(true);
    ++present_count_;
  }
  sized_ = true;
  total_ = total;
  chunks_ = data_.size();
  NoteCompleteLocked();
  return Status::Ok();
}

Status PatchStream::SetTotal(uint64_t total) {
  std::lock_guard<std::mutex> lock(mu_);
  if (sized_) return total == total_ ? Status::Ok() : DataLossError("END: total " + std::to_string(total) +
                                                                    " for a stream of " + std::to_string(total_));
  WSYNC_RETURN_IF_ERROR(CheckStreamShape(total, chunk_bytes_).WithContext("END"));
  const size_t chunks = static_cast<size_t>((total + chunk_bytes_ - 1) / chunk_bytes_);
  for (size_t i = 0; i < data_.size(); ++i) {
    if (!present_[i]) continue;
    const uint64_t want = i < chunks ? ChunkSize(total, chunk_bytes_, i) : 0;
    if (data_[i].size() != want) {
      return DataLossError("END: a total of " + std::to_string(total) + " bytes, but chunk " + std::to_string(i) +
                           " has " + std::to_string(data_[i].size()));
    }
  }
  data_.resize(chunks);
  present_.resize(chunks, false);
  sized_ = true;
  total_ = total;
  chunks_ = chunks;
  NoteCompleteLocked();
  return Status::Ok();
}

StatusOr<std::string> PatchStream::Wait(size_t i, std::chrono::steady_clock::time_point deadline) const {
  std::unique_lock<std::mutex> lock(mu_);
  auto beyond = [&] { return sized_ && i >= chunks_; };
  auto here = [&] { return i < present_.size() && present_[i]; };
  if (!cv_.wait_until(lock, deadline, [&] { return beyond() || here() || !failed_.ok(); })) {
    return DeadlineExceededError("chunk " + std::to_string(i) + " did not arrive in time");
  }
  if (here()) return data_[i];
  if (beyond()) return OutOfRangeError("chunk " + std::to_string(i) + " of " + std::to_string(chunks_));
  return failed_;
}

Status PatchStream::WaitComplete(std::chrono::steady_clock::time_point deadline) const {
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_until(lock, deadline, [&] { return CompleteLocked() || !failed_.ok(); })) {
    return DeadlineExceededError("patch " + std::to_string(from_) + "->" + std::to_string(to_) + ": " +
                                 std::to_string(present_count_) + " of " +
                                 (sized_ ? std::to_string(chunks_) : std::string("an unknown number of")) +
                                 " chunks arrived in time");
  }
  return CompleteLocked() ? Status::Ok() : failed_;
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
  if (failed_.ok() && !CompleteLocked()) failed_ = why;
  cv_.notify_all();
}

// ------------------------------------------------------------- PatchServer

struct PatchServer::Request {
  PeerId peer;
  uint32_t channel;
  uint64_t from, to;
  uint64_t layout = 0;
  uint32_t part = 0;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<uint64_t> refetch;  // seqs
  bool done = false;  // cancelled, completed or peer failed
};

PatchServer::PatchServer(ExchangeHandler* link, PatchProvider* provider) : link_(link), provider_(provider) {}

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
  const auto type = static_cast<ExchangeMessage>(wire::TypeOf(m.payload));
  const auto key = std::make_pair(m.peer, m.channel);
  if (type == ExchangeMessage::kPull) {
    auto pull = wire::ParsePull(m.payload);
    if (!pull.ok()) {
      spdlog::warn("peer {}: {}", m.peer, pull.status().ToString());
      return Refuse(m, 0, 0, InvalidArgumentError(pull.status().message()));
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    for (auto it = workers_.begin(); it != workers_.end();) {
      if (it->finished->load()) {
        it->thread.join();
        it = workers_.erase(it);
      } else {
        ++it;
      }
    }
    size_t from_peer = 0;
    for (const auto& [k, r] : requests_) from_peer += k.first == m.peer ? 1 : 0;
    if (requests_.size() >= kMaxPulls || from_peer >= kMaxPullsPerPeer) {
      if (const uint64_t n = ++pulls_refused_; (n & (n - 1)) == 0) {  // 1, 2, 4, ...: a flood is not a log flood
        spdlog::warn("peer {}: {} pulls refused so far for too many in flight", m.peer, n);
      }
      return Refuse(m, pull->from, pull->to,
                    ResourceExhaustedError(std::to_string(from_peer) + " pulls from this peer and " +
                                           std::to_string(requests_.size()) + " in all in flight (limits " +
                                           std::to_string(kMaxPullsPerPeer) + " and " + std::to_string(kMaxPulls) + ")"));
    }
    auto r = std::make_shared<Request>();
    r->peer = m.peer;
    r->channel = m.channel;
    r->from = pull->from;
    r->to = pull->to;
    r->layout = pull->layout;
    r->part = pull->part;
    ++pulls_served_;
    if (auto old = requests_.find(key); old != requests_.end()) {
      std::lock_guard<std::mutex> rl(old->second->mu);  // a channel reused: the old pull ends
      old->second->done = true;
      old->second->cv.notify_all();
    }
    requests_[key] = r;
    auto finished = std::make_shared<std::atomic<bool>>(false);
    workers_.push_back({std::thread([this, r, finished] {
                          Serve(r);
                          *finished = true;
                        }),
                        finished});
    return;
  }
  if (Status bare = wire::ParseBare(m.payload, type); !bare.ok()) {
    spdlog::warn("peer {}: {}", m.peer, bare.ToString());
    return;
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto it = requests_.find(key);
  if (it == requests_.end()) return;
  std::lock_guard<std::mutex> rl(it->second->mu);
  if (type == ExchangeMessage::kRefetch) {
    if (it->second->refetch.size() < kMaxStreamChunks) it->second->refetch.push_back(m.seq);
  } else {
    it->second->done = true;
  }
  it->second->cv.notify_all();
}

void PatchServer::Refuse(const Message& m, uint64_t from, uint64_t to, const Status& why) {
  // On the progress thread: the answer goes from the handler's outbox.
  if (!link_->SendSoon(m.peer, m.channel, 0, RefusalHeader(from, to, why))) return;
  spdlog::debug("peer {} pull {}->{} refused: {}", m.peer, from, to, why.ToString());
}

size_t PatchServer::pulls_in_flight() const {
  std::lock_guard<std::mutex> lock(mu_);
  return requests_.size();
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
    // Only this request's entry: a PULL that reused the channel has its own.
    if (auto it = requests_.find({r->peer, r->channel}); it != requests_.end() && it->second == r) requests_.erase(it);
  };
  auto stream = r->layout == 0 && r->part == 0 ? provider_->Open(r->from, r->to)
                                               : provider_->OpenFor(r->from, r->to, r->layout, r->part);
  if (!stream.ok()) {
    (void)link_->Send(r->peer, r->channel, 0, RefusalHeader(r->from, r->to, stream.status()));
    spdlog::info("peer {} pull {}->{} refused: {}", r->peer, r->from, r->to, stream.status().ToString());
    return finish();
  }
  const auto& s = *stream;
  // A stream still growing (a version being encoded, or a relay's stream
  // from such a source) goes out as it grows; END gives its total.
  const bool growing = !s->sized();
  wire::Header h;
  h.kind = s->kind();
  h.from = s->from();
  h.to = s->to();
  h.total = growing ? kUnknownTotal : s->total_bytes();
  h.chunk = s->chunk_bytes();
  const std::string header = wire::Encode(h);
  if (!link_->Send(r->peer, r->channel, 0, header).ok()) return finish();
  auto cancelled = [&] {
    std::lock_guard<std::mutex> lock(r->mu);
    return r->done;
  };
  // Sends chunk i once it is there: Ok, OutOfRange past the stream's
  // last chunk, another error when it cannot be sent.
  auto send_chunk = [&](size_t i) -> Status {
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
    if (!bytes.ok()) return bytes.status();
    WSYNC_RETURN_IF_ERROR(link_->Send(r->peer, r->channel, i + 1, wire::EncodeChunk(*bytes)));
    bytes_served_ += bytes->size();
    return Status::Ok();
  };
  auto send_end = [&] { return link_->Send(r->peer, r->channel, kEndSeq, wire::EncodeEnd(s->total_bytes())).ok(); };
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
    (void)link_->Send(r->peer, r->channel, 0, wire::Encode(ExchangeMessage::kAbort, {why.code(), why.message()}));
    spdlog::info("peer {} pull {}->{} aborted: {}", r->peer, r->from, r->to, why.ToString());
    finish();
  };
  // A refetch names a message by its seq: 0 is the header, i + 1 chunk i,
  // kEndSeq the END.
  auto resend = [&](uint64_t seq) {
    if (seq == 0) return link_->Send(r->peer, r->channel, 0, header).ok();
    if (seq == kEndSeq) return !growing || !s->sized() || send_end();
    Status sent = send_chunk(static_cast<size_t>(seq - 1));
    return sent.ok() || sent.code() == StatusCode::kOutOfRange;
  };
  for (size_t i = 0;; ++i) {
    for (uint64_t again : take_refetches()) {
      if ((again == kEndSeq || again <= i) && !resend(again)) return abort();
    }
    if (cancelled()) return finish();
    Status sent = send_chunk(i);
    if (sent.code() == StatusCode::kOutOfRange) break;  // past the last chunk
    if (!sent.ok()) return abort();
  }
  if (growing && !send_end()) return abort();
  // Linger for refetches until the fetcher says it is done.
  const auto until = std::chrono::steady_clock::now() + kLinger;
  for (;;) {
    std::vector<uint64_t> again;
    {
      std::unique_lock<std::mutex> lock(r->mu);
      if (!r->cv.wait_until(lock, until, [&] { return r->done || !r->refetch.empty(); }) || r->done) break;
      again = std::exchange(r->refetch, {});
    }
    for (uint64_t seq : again) {
      if (!resend(seq)) return finish();
    }
  }
  finish();
}

// ------------------------------------------------------------ PatchFetcher

StatusOr<std::shared_ptr<PatchStream>> PatchFetcher::Pull(PeerId parent, uint64_t from, uint64_t to, uint64_t layout,
                                                          uint32_t part, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  WSYNC_RETURN_IF_ERROR(link_->Establish(parent, deadline));
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
  Status sent = link_->Send(parent, channel, 0, wire::Encode(wire::Pull{from, to, layout, part}));
  std::unique_lock<std::mutex> lock(mu_);
  if (!sent.ok()) {
    pending_.erase(channel);
    return sent;
  }
  if (!cv_.wait_until(lock, deadline, [&] { return p->header_seen; })) {
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
  const auto type = static_cast<ExchangeMessage>(wire::TypeOf(m.payload));
  std::shared_ptr<PatchStream> complete;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pending_.find(m.channel);
    if (it == pending_.end() || it->second->parent != m.peer) return;
    Pending& p = *it->second;
    if (type == ExchangeMessage::kAbort) {
      auto abort = wire::ParseRefusal(m.payload, ExchangeMessage::kAbort);
      FailLocked(p, abort.ok() ? Status(abort->code, "parent: " + abort->text) : abort.status());
      pending_.erase(it);
      cv_.notify_all();
      return;
    }
    if (type == ExchangeMessage::kHeader) {
      if (p.header_seen) return;  // a repeated header (a refetch of seq 0) changes nothing
      Status checked = TakeHeader(m.payload, p);
      if (!checked.ok()) {
        spdlog::warn("peer {}: pull {}: {}", m.peer, m.channel, checked.ToString());
        p.header_code = checked.code();
        p.header_error = checked.message();
        p.stream.reset();
      }
      p.header_seen = true;
      cv_.notify_all();
      if (!p.stream) return;
    } else if (type == ExchangeMessage::kEnd) {
      auto total = wire::ParseEnd(m.payload);
      Status sized = !total.ok()           ? total.status()
                     : m.seq != kEndSeq    ? DataLossError("END with seq " + std::to_string(m.seq))
                     : !p.stream           ? DataLossError("END before the header")
                                           : p.stream->SetTotal(*total);
      if (!sized.ok()) {
        spdlog::warn("peer {}: pull {}: {}", m.peer, m.channel, sized.ToString());
        FailLocked(p, sized);
        pending_.erase(it);
        cv_.notify_all();
        return;
      }
    } else {
      auto chunk = wire::ParseChunk(m.payload);
      if (!chunk.ok() || m.seq == 0) {  // a chunk never has seq 0
        spdlog::warn("peer {}: pull {}: {}", m.peer, m.channel,
                     chunk.ok() ? std::string("a chunk with seq 0") : chunk.status().ToString());
        return;
      }
      if (!p.stream) {
        if (p.early.size() >= kMaxEarlyChunks) {
          FailLocked(p, DataLossError("more than " + std::to_string(kMaxEarlyChunks) + " chunks before the header"));
          pending_.erase(it);
          cv_.notify_all();
          return;
        }
        p.early.push_back({static_cast<size_t>(m.seq - 1), std::string(*chunk)});
        return;
      }
      Status s = p.stream->Put(static_cast<size_t>(m.seq - 1), std::string(*chunk));
      if (!s.ok()) spdlog::warn("peer {}: {}", m.peer, s.ToString());
    }
    if (p.stream->WaitComplete(std::chrono::steady_clock::now()).ok()) {
      complete = p.stream;
      pending_.erase(it);
    }
  }
  if (complete) (void)link_->Send(m.peer, m.channel, 0, wire::EncodeBare(ExchangeMessage::kCancel));
}

void PatchFetcher::OnCorrupt(PeerId peer, uint32_t channel, uint64_t seq) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pending_.find(channel);
    if (it == pending_.end() || it->second->parent != peer) return;
    if (++it->second->corrupt[seq] > kMaxRefetchesPerMessage) {
      // A link that corrupts the same message again and again: the pull
      // fails (the sink retries later, with backoff) instead of looping.
      const Status why = DataLossError(What(seq) +
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
  spdlog::warn("peer {}: {} of pull {} arrived corrupt: fetching it again", peer, What(seq), channel);
  (void)link_->Send(peer, channel, seq, wire::EncodeBare(ExchangeMessage::kRefetch));
}

void PatchFetcher::OnPeerFailed(PeerId peer, const Status& why) {
  FailPending([peer](const Pending& p) { return p.parent == peer; }, why);
}

void PatchFetcher::FailAll(const Status& why) {
  FailPending([](const Pending&) { return true; }, why);
}

Status PatchFetcher::TakeHeader(std::string_view payload, Pending& p) {
  WSYNC_ASSIGN_OR_RETURN(wire::Header h, wire::ParseHeader(payload));
  if (h.code != StatusCode::kOk) {
    p.header_code = h.code;
    p.header_error = h.error;
    return Status::Ok();
  }
  const uint64_t from = h.from, to = h.to;
  // The answer to (from, to) is that patch, or a keyframe of `to`.
  const bool keyframe = h.kind == codec::PatchKind::kKeyframe;
  if (to != p.to || (keyframe ? from != 0 : from != p.from)) {
    return DataLossError("header: announces " + std::string(keyframe ? "a keyframe " : "a patch ") + std::to_string(from) +
                         "->" + std::to_string(to) + " for a pull of " + std::to_string(p.from) + "->" +
                         std::to_string(p.to));
  }
  p.header_code = StatusCode::kOk;
  p.stream = std::make_shared<PatchStream>(h.kind, from, to, h.total, h.chunk);
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

}  // namespace wsync::exchange
