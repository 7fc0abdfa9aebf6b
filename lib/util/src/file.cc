#include "wsync/util/file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

namespace wsync {

StatusOr<std::string> ReadFile(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoToStatus(errno, "open " + path);
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    return ErrnoToStatus(err, "stat " + path);
  }
  std::string out(static_cast<size_t>(st.st_size), '\0');
  size_t done = 0;
  while (done < out.size()) {
    ssize_t r = ::read(fd, out.data() + done, out.size() - done);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      int err = r < 0 ? errno : EIO;
      ::close(fd);
      return ErrnoToStatus(err, "read " + path);
    }
    done += static_cast<size_t>(r);
  }
  ::close(fd);
  return out;
}

Status WriteAll(int fd, const void* data, size_t n, const std::string& what) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) return ErrnoToStatus(errno, "write " + what);
    p += w;
    n -= static_cast<size_t>(w);
  }
  return Status::Ok();
}

Status WriteFileAtomic(const std::string& path, std::string_view data, unsigned mode) {
  std::string tmp = path + ".tmp." + std::to_string(::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, mode);
  if (fd < 0) return ErrnoToStatus(errno, "create " + tmp);
  Status s = WriteAll(fd, data.data(), data.size(), tmp);
  if (s.ok() && ::fsync(fd) != 0) s = ErrnoToStatus(errno, "fsync " + tmp);
  if (::close(fd) != 0 && s.ok()) s = ErrnoToStatus(errno, "close " + tmp);
  if (s.ok() && ::rename(tmp.c_str(), path.c_str()) != 0) s = ErrnoToStatus(errno, "rename to " + path);
  if (!s.ok()) ::unlink(tmp.c_str());
  return s;
}

}  // namespace wsync
