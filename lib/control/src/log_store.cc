#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include <spdlog/spdlog.h>

#include "wsync/control/store.h"
#include "wsync/util/crc32c.h"
#include "wsync/util/file.h"

namespace wsync::control {
namespace {

constexpr uint32_t kMaxRecordBytes = 64u << 20;

Status FsyncDir(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return ErrnoToStatus(errno, "open " + dir);
  Status s = ::fsync(fd) == 0 ? Status::Ok() : ErrnoToStatus(errno, "fsync " + dir);
  ::close(fd);
  return s;
}

class LogStore : public Store {
 public:
  LogStore(std::string dir, int fd, size_t records, off_t size)
      : dir_(std::move(dir)), fd_(fd), records_(records), size_(size) {}
  ~LogStore() override {
    if (fd_ >= 0) ::close(fd_);
  }

  Status Append(const wsync::store::v1::Record& record) override {
    std::string payload;
    if (!record.SerializeToString(&payload)) return InternalError("cannot serialize a store record");
    std::string frame(8, '\0');
    const uint32_t len = static_cast<uint32_t>(payload.size());
    const uint32_t crc = Crc32c(payload.data(), payload.size());
    std::memcpy(frame.data(), &len, 4);
    std::memcpy(frame.data() + 4, &crc, 4);
    frame += payload;
    if (broken_) return DataLossError(dir_ + "/wal.log could not be repaired after a failed write; restart");
    Status s = WriteAll(fd_, frame.data(), frame.size(), dir_ + "/wal.log");
    if (s.ok() && ::fdatasync(fd_) != 0) s = ErrnoToStatus(errno, "fdatasync " + dir_ + "/wal.log");
    if (!s.ok()) {
      // Take the partial record back, so later records do not follow garbage
      // (recovery would cut the log there and lose them).
      if (::ftruncate(fd_, size_) != 0) broken_ = true;
      return s;
    }
    size_ += static_cast<off_t>(frame.size());
    ++records_;
    return Status::Ok();
  }

  Status Compact(const wsync::store::v1::Snapshot& snapshot) override {
    std::string bytes;
    if (!snapshot.SerializeToString(&bytes)) return InternalError("cannot serialize the snapshot");
    // snapshot.pb first (atomic rename), then an empty log. A crash between
    // the two replays the old log over the new snapshot: every record is
    // idempotent, so the state is the same.
    WSYNC_RETURN_IF_ERROR(WriteFileAtomic(dir_ + "/snapshot.pb", bytes));
    const std::string tmp = dir_ + "/wal.log.new";
    int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0600);
    if (fd < 0) return ErrnoToStatus(errno, "create " + tmp);
    if (::fsync(fd) != 0 || ::rename(tmp.c_str(), (dir_ + "/wal.log").c_str()) != 0) {
      int err = errno;
      ::close(fd);
      return ErrnoToStatus(err, "replace " + dir_ + "/wal.log");
    }
    WSYNC_RETURN_IF_ERROR(FsyncDir(dir_));
    ::close(fd_);
    fd_ = fd;
    records_ = 0;
    size_ = 0;
    spdlog::info("store compacted: snapshot of {} bytes", bytes.size());
    return Status::Ok();
  }

  size_t LogRecords() const override { return records_; }

 private:
  std::string dir_;
  int fd_;
  size_t records_;
  off_t size_;           // bytes of complete records in the log
  bool broken_ = false;  // a failed write could not be taken back
};

class NullStore : public Store {
 public:
  Status Append(const wsync::store::v1::Record&) override { return Status::Ok(); }
  Status Compact(const wsync::store::v1::Snapshot&) override { return Status::Ok(); }
  size_t LogRecords() const override { return 0; }
};

}  // namespace

StatusOr<std::unique_ptr<Store>> OpenLogStore(const std::string& dir, Recovered* recovered) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return InternalError("create store directory " + dir + ": " + ec.message());
  *recovered = Recovered();
  const std::string snap_path = dir + "/snapshot.pb";
  if (std::filesystem::exists(snap_path)) {
    WSYNC_ASSIGN_OR_RETURN(std::string bytes, ReadFile(snap_path));
    if (!recovered->snapshot.ParseFromString(bytes)) {
      return DataLossError(snap_path + " is corrupt (it is written atomically: this is not a torn write)");
    }
  }
  const std::string log_path = dir + "/wal.log";
  std::string log;
  if (std::filesystem::exists(log_path)) {
    WSYNC_ASSIGN_OR_RETURN(log, ReadFile(log_path));
  }
  size_t pos = 0;
  while (pos < log.size()) {
    if (log.size() - pos < 8) break;
    uint32_t len, crc;
    std::memcpy(&len, log.data() + pos, 4);
    std::memcpy(&crc, log.data() + pos + 4, 4);
    if (len > kMaxRecordBytes || log.size() - pos - 8 < len) break;
    if (Crc32c(log.data() + pos + 8, len) != crc) break;
    wsync::store::v1::Record r;
    if (!r.ParseFromArray(log.data() + pos + 8, static_cast<int>(len))) break;
    recovered->records.push_back(std::move(r));
    pos += 8 + len;
  }
  if (pos < log.size()) {
    recovered->torn_bytes = log.size() - pos;
    spdlog::warn("store {}: cutting a torn or corrupt tail of {} bytes after {} complete records", log_path,
                 recovered->torn_bytes, recovered->records.size());
    if (::truncate(log_path.c_str(), static_cast<off_t>(pos)) != 0) {
      return ErrnoToStatus(errno, "truncate " + log_path);
    }
  }
  int fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
  if (fd < 0) return ErrnoToStatus(errno, "open " + log_path);
  if (::fsync(fd) != 0) {
    int err = errno;
    ::close(fd);
    return ErrnoToStatus(err, "fsync " + log_path);
  }
  return std::unique_ptr<Store>(new LogStore(dir, fd, recovered->records.size(), static_cast<off_t>(pos)));
}

std::unique_ptr<Store> NewNullStore() { return std::make_unique<NullStore>(); }

}  // namespace wsync::control
