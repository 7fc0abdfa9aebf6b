// Memory passed between processes as descriptors instead of names: a
// process sends the descriptors of its memory files (memfds) with a token of
// its choosing over a unix socket (SCM_RIGHTS), then names them in its
// registration by token and index. Memory passed this way has no name in
// /dev/shm: it ends with the last process that maps it, so a process killed
// leaves nothing behind, and a daemon that restarts is given it again by the
// process that still holds it (docs/local-api.md, "Memory").
//
// Wire: a SOCK_SEQPACKET socket; each message carries the token (1 to 64
// characters of [0-9a-zA-Z_-]) as its bytes and 1 to 253 descriptors; the
// inbox answers each message with one byte: 'k' (kept) or 'e' (refused: a
// message without descriptors or token, a bad token, too many descriptors
// held). Messages of one token add up; descriptors not taken within the TTL
// are closed.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "wsync/buffers/region.h"
#include "wsync/util/status.h"

namespace wsync::buffers {

// A descriptor that is closed when it goes.
class OwnedFd {
 public:
  OwnedFd() = default;
  explicit OwnedFd(int fd) : fd_(fd) {}
  OwnedFd(OwnedFd&& o) noexcept : fd_(o.release()) {}
  OwnedFd& operator=(OwnedFd&& o) noexcept;
  OwnedFd(const OwnedFd&) = delete;
  OwnedFd& operator=(const OwnedFd&) = delete;
  ~OwnedFd();
  int get() const { return fd_; }
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_ = -1;
};

class DescriptorInbox {
 public:
  struct Options {
    std::chrono::milliseconds ttl{120'000};  // unclaimed descriptors are closed after this
    size_t max_held = 1 << 16;               // descriptors held at once, all tokens
  };

  // Listens on `path` (replaced if it exists; mode 0600) and serves from a
  // thread of its own until destroyed.
  static StatusOr<std::unique_ptr<DescriptorInbox>> Listen(const std::string& path, Options options);
  static StatusOr<std::unique_ptr<DescriptorInbox>> Listen(const std::string& path) { return Listen(path, Options()); }
  // Stops serving, closes the descriptors held, removes the socket.
  virtual ~DescriptorInbox() = default;

  // Every descriptor sent with `token`, in the order sent, handed over once.
  // NotFound naming the token and the socket when none were sent (or their
  // TTL passed).
  virtual StatusOr<std::vector<OwnedFd>> Take(const std::string& token) = 0;
  virtual const std::string& path() const = 0;
};

// A memory file (memfd) of `size` bytes, mapped read-write: the sending
// side's memory. `what` names it in /proc and errors.
struct MemoryFile {
  OwnedFd fd;
  std::unique_ptr<Region> region;
};
StatusOr<MemoryFile> CreateMemoryFile(size_t size, const std::string& what);

// A new token for PassDescriptors: 128 random bits in hex.
std::string NewDescriptorToken();

// Sends `fds` with `token` to the inbox at `path` (in messages of at most
// 253), waiting up to `wait` for the socket to exist and accept (a daemon
// starting). Unavailable naming the path when it does not, or when the inbox
// refuses a message.
Status PassDescriptors(const std::string& path, const std::string& token, const std::vector<int>& fds,
                       std::chrono::milliseconds wait);

}  // namespace wsync::buffers
