// Pieces shared by the transports (private): the message frame, per-peer
// send windows and rate limits.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>

#include "wsync/transport/transport.h"
#include "wsync/util/bytes.h"
#include "wsync/util/crc32c.h"

namespace wsync::transport::internal {

// Frame header of every message (docs/transport.md), little-endian.
struct FrameHeader {
  static constexpr uint32_t kMagic = 0x31545357;  // "WST1"
  static constexpr size_t kBytes = 32;
  static constexpr size_t kLinkSeqOffset = 24;
  uint32_t channel = 0;
  uint64_t seq = 0;
  uint32_t crc = 0;  // CRC-32C of the payload
  uint32_t length = 0;
  uint64_t link_seq = 0;  // per-connection send order (UCX may reorder across lanes and protocols)

  void EncodeTo(char* out) const {
    StoreLE<uint32_t>(out, kMagic);
    StoreLE(out + 4, channel);
    StoreLE(out + 8, seq);
    StoreLE(out + 16, crc);
    StoreLE(out + 20, length);
    StoreLE(out + kLinkSeqOffset, link_seq);
  }
  // False when the bytes are not a frame header.
  bool DecodeFrom(const void* data, size_t n) {
    if (n != kBytes) return false;
    const char* in = static_cast<const char*>(data);
    channel = LoadLE<uint32_t>(in + 4);
    seq = LoadLE<uint64_t>(in + 8);
    crc = LoadLE<uint32_t>(in + 16);
    length = LoadLE<uint32_t>(in + 20);
    link_seq = LoadLE<uint64_t>(in + kLinkSeqOffset);
    return LoadLE<uint32_t>(in) == kMagic;
  }
};

// Builds the header for `payload`; with fault injection, *corrupt says to
// flip a byte of the payload as sent (the CRC stays that of the original).
inline FrameHeader MakeHeader(uint32_t channel, uint64_t seq, std::string_view payload) {
  FrameHeader h;
  h.channel = channel;
  h.seq = seq;
  h.crc = Crc32c(payload.data(), payload.size());
  h.length = static_cast<uint32_t>(payload.size());
  return h;
}

// A token bucket: Acquire(n) sleeps until n bytes may go. Burst: 1/10 s.
class RateLimiter {
 public:
  explicit RateLimiter(uint64_t bytes_per_s) : rate_(bytes_per_s) {}
  void Acquire(size_t n) {
    if (rate_ == 0) return;
    std::unique_lock<std::mutex> lock(mu_);
    const double burst = std::max<double>(static_cast<double>(rate_) / 10, static_cast<double>(n));
    for (;;) {
      const auto now = std::chrono::steady_clock::now();
      tokens_ = std::min(burst, tokens_ + std::chrono::duration<double>(now - last_).count() * rate_);
      last_ = now;
      if (tokens_ >= static_cast<double>(n)) {
        tokens_ -= static_cast<double>(n);
        return;
      }
      const double wait_s = (static_cast<double>(n) - tokens_) / rate_;
      lock.unlock();
      std::this_thread::sleep_for(std::chrono::duration<double>(wait_s));
      lock.lock();
    }
  }

 private:
  const uint64_t rate_;
  std::mutex mu_;
  double tokens_ = 0;
  std::chrono::steady_clock::time_point last_ = std::chrono::steady_clock::now();
};

// Messages in flight to one peer, bounded; failure wakes every waiter.
class Window {
 public:
  explicit Window(uint32_t size) : size_(size == 0 ? 1 : size) {}
  // Blocks while full; false once the peer has failed.
  bool Acquire() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return failed_ || in_flight_ < size_; });
    if (failed_) return false;
    ++in_flight_;
    return true;
  }
  void Release() {
    std::lock_guard<std::mutex> lock(mu_);
    if (in_flight_ > 0) --in_flight_;
    cv_.notify_all();
  }
  void Fail() {
    std::lock_guard<std::mutex> lock(mu_);
    failed_ = true;
    cv_.notify_all();
  }
  bool failed() const {
    std::lock_guard<std::mutex> lock(mu_);
    return failed_;
  }
  // Blocks until nothing is in flight; false if the peer failed.
  bool Drain() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return failed_ || in_flight_ == 0; });
    return !failed_;
  }

 private:
  const uint32_t size_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  uint32_t in_flight_ = 0;
  bool failed_ = false;
};

// The longest payload accepted from a peer (TransportOptions).
inline uint32_t MessageLimit(const TransportOptions& o, bool trusted) {
  return trusted || o.max_untrusted_message_bytes == 0 ? o.max_message_bytes : o.max_untrusted_message_bytes;
}

// Counts sends for fault injection.
class Corrupter {
 public:
  explicit Corrupter(uint64_t every) : every_(every) {}
  // True when this send's payload is to be corrupted.
  bool Next() { return every_ != 0 && (++count_ % every_) == 0; }

 private:
  const uint64_t every_;
  std::atomic<uint64_t> count_{0};
};

}  // namespace wsync::transport::internal
