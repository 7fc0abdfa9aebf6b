#include "wsync/buffers/region.h"

#include "wsync/util/text.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <unordered_set>

namespace wsync::buffers {
namespace {

// Host memory mapped from shared memory (`unlink`: the name this process
// created, removed when the region goes) or from a memory file another
// process passed as a descriptor (no name). Unmapped on destruction.
class MappedRegion : public Region {
 public:
  MappedRegion(std::string description, uint8_t* data, size_t size, std::string unlink = "")
      : description_(std::move(description)), data_(data), size_(size), unlink_(std::move(unlink)) {}
  ~MappedRegion() override {
    if (data_ != nullptr && size_ > 0) ::munmap(data_, size_);
    if (!unlink_.empty()) ::shm_unlink(unlink_.c_str());
  }
  uint8_t* data() override { return data_; }
  size_t size() const override { return size_; }
  bool writable() const override { return true; }
  std::string description() const override { return description_; }

 private:
  std::string description_;
  uint8_t* data_;
  size_t size_;
  std::string unlink_;
};

Status CheckShmName(const std::string& name) {
  if (name.size() < 2 || name[0] != '/' || name.find('/', 1) != std::string::npos || name.size() > 250) {
    return InvalidArgumentError("shared memory name '" + name + "' must be '/' followed by up to 249 characters without '/'");
  }
  return Status::Ok();
}

StatusOr<uint8_t*> Map(int fd, size_t size, const std::string& what) {
  if (size == 0) return static_cast<uint8_t*>(nullptr);
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return ErrnoToStatus(errno, "mmap " + what);
  return static_cast<uint8_t*>(p);
}

}  // namespace

uint64_t TensorEntry::NumBytes() const {
  return codec::TensorView{name, dtype, shape, nullptr}.NumBytes();
}

StatusOr<std::unique_ptr<Region>> CreateShm(const std::string& name, size_t size, bool unlink_on_close) {
  WSYNC_RETURN_IF_ERROR(CheckShmName(name));
  int fd = ::shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return ErrnoToStatus(errno, "create shared memory " + name);
  if (::ftruncate(fd, static_cast<off_t>(size)) != 0) {
    int err = errno;
    ::close(fd);
    ::shm_unlink(name.c_str());
    return ErrnoToStatus(err, "size shared memory " + name);
  }
  auto mapped = Map(fd, size, name);
  ::close(fd);
  if (!mapped.ok()) {
    ::shm_unlink(name.c_str());
    return mapped.status();
  }
  return std::unique_ptr<Region>(new MappedRegion("shm:" + name, *mapped, size, unlink_on_close ? name : ""));
}

StatusOr<std::unique_ptr<Region>> OpenShm(const std::string& name) {
  WSYNC_RETURN_IF_ERROR(CheckShmName(name));
  int fd = ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) return ErrnoToStatus(errno, "open shared memory " + name);
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    return ErrnoToStatus(err, "stat shared memory " + name);
  }
  auto mapped = Map(fd, static_cast<size_t>(st.st_size), name);
  ::close(fd);
  if (!mapped.ok()) return mapped.status();
  return std::unique_ptr<Region>(new MappedRegion("shm:" + name, *mapped, static_cast<size_t>(st.st_size)));
}

StatusOr<std::unique_ptr<Region>> MapDescriptor(int fd, const std::string& what) {
  struct stat st;
  if (::fstat(fd, &st) != 0) return ErrnoToStatus(errno, "stat " + what);
  if (!S_ISREG(st.st_mode)) return InvalidArgumentError(what + " is not a memory file (memfd)");
  WSYNC_ASSIGN_OR_RETURN(uint8_t* mapped, Map(fd, static_cast<size_t>(st.st_size), what));
  return std::unique_ptr<Region>(new MappedRegion("fd:" + what, mapped, static_cast<size_t>(st.st_size)));
}

Status ValidateTable(const std::vector<TensorEntry>& table, size_t region_size) {
  std::unordered_set<std::string> names;
  std::vector<std::pair<uint64_t, const TensorEntry*>> spans;
  for (const auto& t : table) {
    if (t.name.empty()) return InvalidArgumentError("a tensor has an empty name");
    if (!names.insert(t.name).second) return InvalidArgumentError("tensor " + Quoted(t.name) + " appears twice");
    const size_t width = codec::DTypeWidth(t.dtype);
    if (width == 0) return InvalidArgumentError("tensor " + Quoted(t.name) + ": invalid dtype");
    const uint64_t bytes = t.NumBytes();
    if (bytes == UINT64_MAX || t.offset > region_size || bytes > region_size - t.offset) {
      return InvalidArgumentError("tensor " + Quoted(t.name) + ": bytes [" + std::to_string(t.offset) + ", +" +
                                  std::to_string(bytes) + ") outside the region of " + std::to_string(region_size) +
                                  " bytes");
    }
    if (t.offset % width != 0) {
      return InvalidArgumentError("tensor " + Quoted(t.name) + ": offset " + std::to_string(t.offset) +
                                  " is not aligned to its element width " + std::to_string(width));
    }
    if (bytes > 0) spans.push_back({t.offset, &t});
  }
  std::sort(spans.begin(), spans.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  for (size_t i = 1; i < spans.size(); ++i) {
    const TensorEntry& prev = *spans[i - 1].second;
    if (prev.offset + prev.NumBytes() > spans[i].first) {
      return InvalidArgumentError("tensors " + Quoted(prev.name) + " and " + Quoted(spans[i].second->name) + " overlap");
    }
  }
  return Status::Ok();
}

std::vector<codec::TensorView> TableViews(const std::vector<TensorEntry>& table, Region& region) {
  std::vector<codec::TensorView> out;
  for (const auto& t : table) out.push_back({t.name, t.dtype, t.shape, region.data() + t.offset});
  return out;
}

std::vector<codec::MutableTensorView> TableMutableViews(const std::vector<TensorEntry>& table, Region& region) {
  std::vector<codec::MutableTensorView> out;
  for (const auto& t : table) out.push_back({t.name, t.dtype, t.shape, region.data() + t.offset});
  return out;
}

}  // namespace wsync::buffers

namespace wsync::buffers {

StatusOr<MappedTensors> MappedTensors::Create(std::vector<std::unique_ptr<Region>> regions,
                                              std::vector<TensorEntry> table) {
  if (regions.empty()) return InvalidArgumentError("no memory region given");
  std::vector<std::vector<TensorEntry>> by_region(regions.size());
  for (const auto& t : table) {
    if (t.region >= regions.size()) {
      return InvalidArgumentError("tensor " + Quoted(t.name) + ": region " + std::to_string(t.region) + " of " +
                                  std::to_string(regions.size()) + " given");
    }
    by_region[t.region].push_back(t);
  }
  std::unordered_set<std::string> names;
  for (const auto& t : table) {
    if (!names.insert(t.name).second) return InvalidArgumentError("tensor " + Quoted(t.name) + " appears twice");
  }
  for (size_t r = 0; r < regions.size(); ++r) {
    WSYNC_RETURN_IF_ERROR(ValidateTable(by_region[r], regions[r]->size()).WithContext(regions[r]->description()));
    if (regions[r]->on_device() != regions[0]->on_device() || regions[r]->device() != regions[0]->device()) {
      return InvalidArgumentError("regions " + regions[0]->description() + " and " + regions[r]->description() +
                                  " are in different memories: all regions of a registration must be host memory "
                                  "or memory of one device");
    }
  }
  MappedTensors m;
  m.device_ = regions[0]->on_device() ? regions[0]->device() : -1;
  m.regions_ = std::move(regions);
  m.table_ = std::move(table);
  return m;
}

std::vector<codec::TensorView> MappedTensors::Views() const {
  std::vector<codec::TensorView> out;
  out.reserve(table_.size());
  for (const auto& t : table_) out.push_back({t.name, t.dtype, t.shape, regions_[t.region]->data() + t.offset});
  return out;
}

std::vector<codec::MutableTensorView> MappedTensors::MutableViews() const {
  std::vector<codec::MutableTensorView> out;
  out.reserve(table_.size());
  for (const auto& t : table_) out.push_back({t.name, t.dtype, t.shape, regions_[t.region]->data() + t.offset});
  return out;
}

bool MappedTensors::has_pieces() const {
  for (const auto& t : table_) {
    if (!t.pieces.empty()) return true;
  }
  return false;
}

std::vector<codec::RuntimeTensor> MappedTensors::Runtime() const {
  std::vector<codec::RuntimeTensor> out;
  out.reserve(table_.size());
  auto views = MutableViews();
  for (size_t i = 0; i < table_.size(); ++i) out.push_back({std::move(views[i]), table_[i].pieces});
  return out;
}

std::string MappedTensors::description() const {
  std::string s = std::to_string(table_.size()) + " tensors in ";
  for (size_t r = 0; r < regions_.size() && r < 3; ++r) s += (r ? ", " : "") + regions_[r]->description();
  if (regions_.size() > 3) s += " and " + std::to_string(regions_.size() - 3) + " more regions";
  return s;
}

}  // namespace wsync::buffers
