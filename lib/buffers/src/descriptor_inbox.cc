#include "wsync/buffers/descriptor_inbox.h"

#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "wsync/util/text.h"

namespace wsync::buffers {

OwnedFd& OwnedFd::operator=(OwnedFd&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.release();
  }
  return *this;
}

OwnedFd::~OwnedFd() {
  if (fd_ >= 0) ::close(fd_);
}

namespace {

constexpr size_t kMaxToken = 64;
constexpr int kMaxPerMessage = 253;  // the kernel's SCM_MAX_FD

using Clock = std::chrono::steady_clock;

// The address of the unix socket at `path`; InvalidArgument when it is
// empty or does not fit.
StatusOr<sockaddr_un> UnixAddress(const std::string& path) {
  sockaddr_un addr{};
  if (path.empty() || path.size() >= sizeof addr.sun_path) {
    return InvalidArgumentError("memory socket path " + Quoted(path) + " is empty or longer than " +
                                std::to_string(sizeof addr.sun_path - 1) + " bytes");
  }
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  return addr;
}

bool ValidToken(const std::string& t) {
  if (t.empty() || t.size() > kMaxToken) return false;
  for (char c : t) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-')) return false;
  }
  return true;
}

class Inbox final : public DescriptorInbox {
 public:
  Inbox(std::string path, Options options, OwnedFd listener, OwnedFd stop)
      : path_(std::move(path)), options_(options), listener_(std::move(listener)), stop_(std::move(stop)) {
    thread_ = std::thread([this] { Serve(); });
  }
  ~Inbox() override {
    const uint64_t one = 1;
    (void)!::write(stop_.get(), &one, sizeof one);
    thread_.join();
    ::unlink(path_.c_str());
  }

  StatusOr<std::vector<OwnedFd>> Take(const std::string& token) override {
    std::lock_guard<std::mutex> lock(mu_);
    ExpireLocked();
    auto it = held_.find(token);
    if (it == held_.end()) {
      return NotFoundError("no memory descriptors were sent with token " + Quoted(token) + " to " + path_ +
                           " (or they were not claimed within " + std::to_string(options_.ttl.count()) + " ms)");
    }
    std::vector<OwnedFd> out = std::move(it->second.fds);
    count_ -= out.size();
    held_.erase(it);
    return out;
  }
  const std::string& path() const override { return path_; }

 private:
  struct Held {
    std::vector<OwnedFd> fds;
    Clock::time_point since;
  };

  void Serve() {
    std::vector<OwnedFd> conns;
    for (;;) {
      std::vector<pollfd> fds{{stop_.get(), POLLIN, 0}, {listener_.get(), POLLIN, 0}};
      for (const auto& c : conns) fds.push_back({c.get(), POLLIN, 0});
      if (::poll(fds.data(), fds.size(), 1000) < 0 && errno != EINTR) {
        spdlog::error("memory descriptor inbox {}: poll: {}", path_, std::strerror(errno));
        return;
      }
      if (fds[0].revents != 0) return;
      // Connections whose peer left (or that misbehaved) are dropped.
      std::vector<OwnedFd> alive;
      for (size_t i = 0; i < conns.size(); ++i) {
        const short ev = fds[i + 2].revents;
        if (ev == 0 || ((ev & POLLIN) && Receive(conns[i].get()))) alive.push_back(std::move(conns[i]));
      }
      conns = std::move(alive);
      if (fds[1].revents & POLLIN) {
        const int c = ::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (c >= 0) conns.emplace_back(c);
      }
      std::lock_guard<std::mutex> lock(mu_);
      ExpireLocked();
    }
  }

  // One message from connection `c`; false when the connection is done.
  bool Receive(int c) {
    char token[kMaxToken + 1];
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxPerMessage)];
    iovec iov{token, sizeof token};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    const ssize_t n = ::recvmsg(c, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return true;
    if (n <= 0) return false;  // closed by the peer, or failed
    std::vector<OwnedFd> got;
    for (cmsghdr* h = CMSG_FIRSTHDR(&msg); h != nullptr; h = CMSG_NXTHDR(&msg, h)) {
      if (h->cmsg_level != SOL_SOCKET || h->cmsg_type != SCM_RIGHTS) continue;
      const size_t count = (h->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < count; ++i) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(h) + i * sizeof(int), sizeof fd);
        got.emplace_back(fd);
      }
    }
    const std::string t(token, static_cast<size_t>(n));
    std::string why;
    if ((msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) != 0) {
      why = "a message longer than a token, or with more than " + std::to_string(kMaxPerMessage) + " descriptors";
    } else if (!ValidToken(t)) {
      why = "a token that is not 1 to 64 characters of [0-9a-zA-Z_-]";
    } else if (got.empty()) {
      why = "a message without descriptors";
    }
    if (why.empty()) {
      std::lock_guard<std::mutex> lock(mu_);
      if (count_ + got.size() > options_.max_held) {
        why = "more than " + std::to_string(options_.max_held) + " descriptors held, unclaimed";
      } else {
        Held& h = held_[t];
        if (h.fds.empty()) h.since = Clock::now();
        count_ += got.size();
        for (auto& fd : got) h.fds.push_back(std::move(fd));
      }
    }
    if (!why.empty()) spdlog::warn("memory descriptor inbox {}: refused {}", path_, why);
    const char answer = why.empty() ? 'k' : 'e';
    return ::send(c, &answer, 1, MSG_NOSIGNAL | MSG_DONTWAIT) == 1 && why.empty();
  }

  void ExpireLocked() {
    const auto now = Clock::now();
    for (auto it = held_.begin(); it != held_.end();) {
      if (now - it->second.since > options_.ttl) {
        spdlog::warn("memory descriptor inbox {}: {} descriptors sent with token {} were not claimed within {} ms; "
                     "closed", path_, it->second.fds.size(), it->first, options_.ttl.count());
        count_ -= it->second.fds.size();
        it = held_.erase(it);
      } else {
        ++it;
      }
    }
  }

  const std::string path_;
  const Options options_;
  OwnedFd listener_, stop_;
  std::mutex mu_;
  std::map<std::string, Held> held_;
  size_t count_ = 0;
  std::thread thread_;
};

}  // namespace

StatusOr<std::unique_ptr<DescriptorInbox>> DescriptorInbox::Listen(const std::string& path, Options options) {
  WSYNC_ASSIGN_OR_RETURN(const sockaddr_un addr, UnixAddress(path));
  OwnedFd s(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (s.get() < 0) return ErrnoToStatus(errno, "socket for " + path);
  ::unlink(path.c_str());
  if (::bind(s.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0) return ErrnoToStatus(errno, "bind " + path);
  if (::chmod(path.c_str(), 0600) != 0) return ErrnoToStatus(errno, "chmod 0600 " + path);
  if (::listen(s.get(), 64) != 0) return ErrnoToStatus(errno, "listen on " + path);
  OwnedFd stop(::eventfd(0, EFD_CLOEXEC));
  if (stop.get() < 0) return ErrnoToStatus(errno, "eventfd");
  return std::unique_ptr<DescriptorInbox>(new Inbox(path, options, std::move(s), std::move(stop)));
}

StatusOr<MemoryFile> CreateMemoryFile(size_t size, const std::string& what) {
  MemoryFile m;
  m.fd = OwnedFd(::memfd_create(what.c_str(), MFD_CLOEXEC));
  if (m.fd.get() < 0) return ErrnoToStatus(errno, "memfd_create " + what);
  if (::ftruncate(m.fd.get(), static_cast<off_t>(size)) != 0) return ErrnoToStatus(errno, "size memfd " + what);
  WSYNC_ASSIGN_OR_RETURN(m.region, MapDescriptor(m.fd.get(), what));
  return m;
}

std::string NewDescriptorToken() {
  std::random_device rd;
  char buf[33];
  std::snprintf(buf, sizeof buf, "%08x%08x%08x%08x", rd(), rd(), rd(), rd());
  return buf;
}

Status PassDescriptors(const std::string& path, const std::string& token, const std::vector<int>& fds,
                       std::chrono::milliseconds wait) {
  WSYNC_ASSIGN_OR_RETURN(const sockaddr_un addr, UnixAddress(path));
  const auto deadline = Clock::now() + wait;
  OwnedFd s;
  for (;;) {
    s = OwnedFd(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    if (s.get() < 0) return ErrnoToStatus(errno, "socket for " + path);
    if (::connect(s.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof addr) == 0) break;
    const int err = errno;
    if ((err != ENOENT && err != ECONNREFUSED) || Clock::now() >= deadline) {
      return UnavailableError("the daemon's memory socket " + path + ": " + std::strerror(err) +
                              " (is the daemon running, and as new as this client?)");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  const timeval tv{std::max<time_t>(1, std::chrono::duration_cast<std::chrono::seconds>(deadline - Clock::now()).count()), 0};
  ::setsockopt(s.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  for (size_t at = 0; at < fds.size(); at += kMaxPerMessage) {
    const size_t n = std::min<size_t>(kMaxPerMessage, fds.size() - at);
    iovec iov{const_cast<char*>(token.data()), token.size()};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxPerMessage)];
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * n);
    cmsghdr* h = CMSG_FIRSTHDR(&msg);
    h->cmsg_level = SOL_SOCKET;
    h->cmsg_type = SCM_RIGHTS;
    h->cmsg_len = CMSG_LEN(sizeof(int) * n);
    std::memcpy(CMSG_DATA(h), fds.data() + at, sizeof(int) * n);
    if (::sendmsg(s.get(), &msg, MSG_NOSIGNAL) < 0) return ErrnoToStatus(errno, "send descriptors to " + path);
    char answer = 0;
    if (::recv(s.get(), &answer, 1, 0) != 1 || answer != 'k') {
      return UnavailableError("the daemon's memory socket " + path + " refused " + std::to_string(n) +
                              " descriptors (its log says why)");
    }
  }
  return Status::Ok();
}

}  // namespace wsync::buffers
