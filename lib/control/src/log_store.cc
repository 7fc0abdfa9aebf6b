#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>

#include <spdlog/spdlog.h>

#include "wsync/control/store.h"
#include "wsync/util/bytes.h"
#include "wsync/util/crc32c.h"
#include "wsync/util/file.h"

namespace wsync::control {
namespace {

constexpr uint32_t kMaxRecordBytes = 64u << 20;
constexpr char kSnapshotMagic[8] = {'W', 'S', 'Y', 'N', 'C', 'S', 'N', '1'};
constexpr size_t kSnapshotHeader = 8 + 8 + 4;  // magic, u64 length, u32 CRC-32C

Status FsyncDir(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return ErrnoToStatus(errno, "open " + dir);
  Status s = ::fsync(fd) == 0 ? Status::Ok() : ErrnoToStatus(errno, "fsync " + dir);
  ::close(fd);
  return s;
}

std::string EncodeSnapshot(const std::string& payload) {
  std::string out(kSnapshotMagic, sizeof(kSnapshotMagic));
  ByteWriter(&out).U64(payload.size());
  ByteWriter(&out).U32(Crc32c(payload.data(), payload.size()));
  return out + payload;
}

Status DecodeSnapshot(const std::string& path, const std::string& bytes, wsync::store::v1::Snapshot* snap) {
  if (bytes.size() < kSnapshotHeader) {
    return DataLossError(path + " is " + std::to_string(bytes.size()) + " bytes, shorter than its " +
                         std::to_string(kSnapshotHeader) + "-byte header: an empty or truncated snapshot");
  }
  if (std::memcmp(bytes.data(), kSnapshotMagic, sizeof(kSnapshotMagic)) != 0) {
    return DataLossError(path + ": bytes 0-7 are not the snapshot magic 'WSYNCSN1'");
  }
  const uint64_t len = LoadLE<uint64_t>(bytes.data() + 8);
  if (len != bytes.size() - kSnapshotHeader) {
    return DataLossError(path + ": the header (offset 8) says " + std::to_string(len) + " payload bytes, the file has " +
                         std::to_string(bytes.size() - kSnapshotHeader));
  }
  if (Crc32c(bytes.data() + kSnapshotHeader, len) != LoadLE<uint32_t>(bytes.data() + 16)) {
    return DataLossError(path + ": the payload (offset 20, " + std::to_string(len) + " bytes) fails its CRC-32C");
  }
  if (!snap->ParseFromArray(bytes.data() + kSnapshotHeader, static_cast<int>(len))) {
    return DataLossError(path + ": the payload (offset 20) is not a snapshot record");
  }
  return Status::Ok();
}

// A frame at `pos` that passes every check (the record it holds in *r).
bool ValidFrame(const std::string& log, size_t pos, wsync::store::v1::Record* r) {
  if (log.size() - pos < 8) return false;
  const uint32_t len = LoadLE<uint32_t>(log.data() + pos);
  if (len == 0 || len > kMaxRecordBytes || log.size() - pos - 8 < len) return false;
  if (Crc32c(log.data() + pos + 8, len) != LoadLE<uint32_t>(log.data() + pos + 4)) return false;
  return r->ParseFromArray(log.data() + pos + 8, static_cast<int>(len));
}

// Where the first valid frame after `pos` begins (npos: none). A torn write
// can only be the last record (each append is synced before the next), so a
// valid record after a bad one means the bad one was damaged in place.
size_t NextValidFrame(const std::string& log, size_t pos) {
  wsync::store::v1::Record r;
  for (size_t at = pos + 1; at + 8 < log.size(); ++at) {
    if (ValidFrame(log, at, &r)) return at;
  }
  return std::string::npos;
}

std::string Timestamp() {
  return std::to_string(
      std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count());
}

uint64_t HighestVersion(const Recovered& r) {
  uint64_t v = r.snapshot.version_floor();
  for (const auto& s : r.snapshot.versions()) v = std::max(v, s.version());
  for (const auto& rec : r.records) {
    if (rec.has_version_published()) v = std::max(v, rec.version_published().version());
    if (rec.kind_case() == wsync::store::v1::Record::kVersionFloor) v = std::max(v, rec.version_floor());
  }
  return v;
}

class LogStore : public Store {
 public:
  LogStore(std::string dir, int fd, size_t records, off_t size, uint64_t high_water)
      : dir_(std::move(dir)), fd_(fd), records_(records), size_(size), high_water_(high_water) {}
  ~LogStore() override {
    if (fd_ >= 0) ::close(fd_);
  }

  Status Append(const wsync::store::v1::Record& record) override {
    std::string payload;
    if (!record.SerializeToString(&payload)) return InternalError("cannot serialize a store record");
    std::string frame;
    ByteWriter(&frame).U32(static_cast<uint32_t>(payload.size()));
    ByteWriter(&frame).U32(Crc32c(payload.data(), payload.size()));
    frame += payload;
    if (broken_) return DataLossError(dir_ + "/wal.log could not be repaired after a failed write; restart");
    Status s = WriteAll(fd_, frame.data(), frame.size(), dir_ + "/wal.log");
    if (s.ok() && ::fdatasync(fd_) != 0) s = ErrnoToStatus(errno, "fdatasync " + dir_ + "/wal.log");
    if (!s.ok()) {
      // Take the partial record back, so later records do not follow garbage.
      if (::ftruncate(fd_, size_) != 0) broken_ = true;
      return s;
    }
    size_ += static_cast<off_t>(frame.size());
    ++records_;
    if (record.has_version_published() && record.version_published().version() > high_water_) {
      // The log holds the version now (acknowledged); the mark guards it
      // against a later loss of the log. Failing to move it is logged, not
      // returned: the client must not hear "failed" for a stored version.
      high_water_ = record.version_published().version();
      if (Status h = WriteHighWater(dir_, high_water_); !h.ok()) {
        spdlog::error("store {}: version {} is in the log, but its high-water mark was not written: {}", dir_,
                      high_water_, h.ToString());
      }
    }
    return Status::Ok();
  }

  Status Compact(const wsync::store::v1::Snapshot& snapshot) override {
    std::string bytes;
    if (!snapshot.SerializeToString(&bytes)) return InternalError("cannot serialize the snapshot");
    // snapshot.pb first (atomic rename), then an empty log. A crash between
    // the two replays the old log over the new snapshot: every record is
    // idempotent, so the state is the same.
    WSYNC_RETURN_IF_ERROR(WriteFileAtomic(dir_ + "/snapshot.pb", EncodeSnapshot(bytes), 0600));
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

  static Status WriteHighWater(const std::string& dir, uint64_t version) {
    std::string bytes;
    ByteWriter(&bytes).U64(version);
    ByteWriter(&bytes).U32(Crc32c(bytes.data(), 8));
    WSYNC_RETURN_IF_ERROR(WriteFileAtomic(dir + "/versions.hwm", bytes, 0600));
    return FsyncDir(dir);
  }

 private:
  std::string dir_;
  int fd_;
  size_t records_;
  off_t size_;           // bytes of complete records in the log
  uint64_t high_water_;  // highest version appended, as versions.hwm says
  bool broken_ = false;  // a failed write could not be taken back
};

class NullStore : public Store {
 public:
  Status Append(const wsync::store::v1::Record&) override { return Status::Ok(); }
  Status Compact(const wsync::store::v1::Snapshot&) override { return Status::Ok(); }
  size_t LogRecords() const override { return 0; }
};

// Sets a damaged file aside as PATH.corrupt.TIME (nothing is deleted).
Status SetAside(const std::string& path, Recovered* recovered, const std::string& why) {
  const std::string to = path + ".corrupt." + Timestamp();
  if (::rename(path.c_str(), to.c_str()) != 0) return ErrnoToStatus(errno, "rename " + path);
  recovered->salvage_report.push_back(why + "; the file is kept as " + to);
  spdlog::warn("store salvage: {}; the file is kept as {}", why, to);
  return Status::Ok();
}

// Restricts the store to its owner: node names and addresses are in it.
Status Restrict(const std::string& path, mode_t mode) {
  if (::chmod(path.c_str(), mode) != 0 && errno != ENOENT) return ErrnoToStatus(errno, "chmod " + path);
  return Status::Ok();
}

}  // namespace

StatusOr<std::unique_ptr<Store>> OpenLogStore(const std::string& dir, Recovered* recovered,
                                              const StoreOptions& options) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return InternalError("create store directory " + dir + ": " + ec.message());
  WSYNC_RETURN_IF_ERROR(Restrict(dir, 0700));
  *recovered = Recovered();
  const std::string snap_path = dir + "/snapshot.pb";
  const std::string log_path = dir + "/wal.log";
  const std::string hwm_path = dir + "/versions.hwm";
  for (const auto& p : {snap_path, log_path, hwm_path}) WSYNC_RETURN_IF_ERROR(Restrict(p, 0600));
  const char* salvage_hint = " (refusing to start: `wsyncd coordinator --salvage-store` starts from what verifies)";

  if (std::filesystem::exists(snap_path)) {
    WSYNC_ASSIGN_OR_RETURN(std::string bytes, ReadFile(snap_path));
    Status s = DecodeSnapshot(snap_path, bytes, &recovered->snapshot);
    if (!s.ok()) {
      if (!options.salvage) return Status(s.code(), s.message() + salvage_hint);
      recovered->snapshot.Clear();
      WSYNC_RETURN_IF_ERROR(SetAside(snap_path, recovered, "dropped the snapshot: " + s.message()));
    }
  }

  std::string log;
  if (std::filesystem::exists(log_path)) {
    WSYNC_ASSIGN_OR_RETURN(log, ReadFile(log_path));
  }
  size_t pos = 0;
  for (wsync::store::v1::Record r; pos < log.size(); r.Clear()) {
    if (!ValidFrame(log, pos, &r)) break;
    recovered->records.push_back(std::move(r));
    pos += 8 + LoadLE<uint32_t>(log.data() + pos);
  }
  if (pos < log.size()) {
    const size_t next = NextValidFrame(log, pos);
    if (next == std::string::npos) {
      // The last write was torn (it never completed, so it was never acknowledged).
      recovered->torn_bytes = log.size() - pos;
      spdlog::warn("store {}: cutting a torn last write of {} bytes at offset {} after {} complete records", log_path,
                   recovered->torn_bytes, pos, recovered->records.size());
    } else {
      const std::string why = log_path + ": record " + std::to_string(recovered->records.size()) + " at offset " +
                              std::to_string(pos) + " fails its checks and a valid record follows at offset " +
                              std::to_string(next) + ": the log is damaged before its end";
      if (!options.salvage) return DataLossError(why + salvage_hint);
      // Keep the original; start from the records before the damage.
      const std::string kept = log_path + ".corrupt." + Timestamp();
      WSYNC_RETURN_IF_ERROR(WriteFileAtomic(kept, log, 0600));
      const std::string line = why + "; dropped " + std::to_string(log.size() - pos) +
                               " bytes from offset " + std::to_string(pos) + "; the original is kept as " + kept;
      recovered->salvage_report.push_back(line);
      spdlog::warn("store salvage: {}", line);
    }
    if (::truncate(log_path.c_str(), static_cast<off_t>(pos)) != 0) {
      return ErrnoToStatus(errno, "truncate " + log_path);
    }
  }

  uint64_t high_water = 0;
  if (std::filesystem::exists(hwm_path)) {
    WSYNC_ASSIGN_OR_RETURN(std::string bytes, ReadFile(hwm_path));
    if (bytes.size() != 12 || Crc32c(bytes.data(), 8) != LoadLE<uint32_t>(bytes.data() + 8)) {
      const std::string why = hwm_path + " (" + std::to_string(bytes.size()) + " bytes) fails its checks";
      if (!options.salvage) return DataLossError(why + salvage_hint);
      WSYNC_RETURN_IF_ERROR(SetAside(hwm_path, recovered, why));
    } else {
      high_water = LoadLE<uint64_t>(bytes.data());
    }
  }
  const uint64_t highest = HighestVersion(*recovered);
  if (highest < high_water) {
    const std::string why = "the store holds versions up to " + std::to_string(highest) + ", but version " +
                            std::to_string(high_water) + " was acknowledged (" + hwm_path + "): records were lost";
    if (!options.salvage) return DataLossError(why + salvage_hint);
    recovered->salvage_report.push_back(why + "; versions continue above " + std::to_string(high_water));
    spdlog::warn("store salvage: {}", recovered->salvage_report.back());
  }
  recovered->version_floor = std::max(high_water, highest);
  if (recovered->version_floor > high_water) {
    // A store written before the mark existed, or a mark whose write failed.
    WSYNC_RETURN_IF_ERROR(LogStore::WriteHighWater(dir, recovered->version_floor));
  }

  int fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
  if (fd < 0) return ErrnoToStatus(errno, "open " + log_path);
  if (::fsync(fd) != 0) {
    int err = errno;
    ::close(fd);
    return ErrnoToStatus(err, "fsync " + log_path);
  }
  auto store = std::make_unique<LogStore>(dir, fd, recovered->records.size(), static_cast<off_t>(pos),
                                          recovered->version_floor);
  if (highest < high_water) {
    // The salvaged store remembers the floor itself: the next start verifies.
    wsync::store::v1::Record r;
    r.set_version_floor(high_water);
    WSYNC_RETURN_IF_ERROR(store->Append(r));
    recovered->records.push_back(r);
  }
  return std::unique_ptr<Store>(std::move(store));
}

std::unique_ptr<Store> NewNullStore() { return std::make_unique<NullStore>(); }

}  // namespace wsync::control
