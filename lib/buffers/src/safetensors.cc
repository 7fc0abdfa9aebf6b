#include "wsync/buffers/safetensors.h"

#include "wsync/codec/bf16.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <nlohmann/json.hpp>

#include "wsync/util/file.h"
#include "wsync/util/text.h"

namespace wsync::buffers {
namespace {

constexpr uint64_t kMaxHeaderBytes = 100u << 20;  // the reference implementation's limit

}  // namespace

StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoToStatus(errno, "open " + path);
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    return ErrnoToStatus(err, "stat " + path);
  }
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path;
  f->map_size_ = static_cast<size_t>(st.st_size);
  if (f->map_size_ < 8) {
    ::close(fd);
    return InvalidArgumentError(path + ": not a safetensors file (" + std::to_string(f->map_size_) + " bytes)");
  }
  void* m = ::mmap(nullptr, f->map_size_, PROT_READ, MAP_PRIVATE, fd, 0);
  int err = errno;
  ::close(fd);
  if (m == MAP_FAILED) return ErrnoToStatus(err, "mmap " + path);
  f->map_ = m;
  const auto* bytes = static_cast<const uint8_t*>(m);
  uint64_t header_len = 0;
  for (int i = 0; i < 8; ++i) header_len |= uint64_t{bytes[i]} << (8 * i);
  if (header_len > kMaxHeaderBytes || header_len > f->map_size_ - 8) {
    return InvalidArgumentError(path + ": header length " + std::to_string(header_len) +
                                " exceeds the file or the 100 MiB limit");
  }
  const uint64_t data_begin = 8 + header_len;
  const uint64_t data_len = f->map_size_ - data_begin;
  nlohmann::json header = nlohmann::json::parse(bytes + 8, bytes + data_begin, nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded() || !header.is_object()) {
    return InvalidArgumentError(path + ": header is not a JSON object");
  }
  struct Entry {
    uint64_t begin, end;
    codec::TensorView view;
  };
  std::vector<Entry> entries;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const auto& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) return InvalidArgumentError(path + ": __metadata__ is not an object");
      for (auto m2 = v.begin(); m2 != v.end(); ++m2) {
        if (!m2.value().is_string()) return InvalidArgumentError(path + ": metadata '" + m2.key() + "' is not a string");
        f->metadata_[m2.key()] = m2.value().get<std::string>();
      }
      continue;
    }
    const std::string where = path + ": tensor '" + name + "'";
    if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") || !v.contains("data_offsets") ||
        !v["dtype"].is_string() || !v["shape"].is_array() || !v["data_offsets"].is_array() ||
        v["data_offsets"].size() != 2) {
      return InvalidArgumentError(where + ": needs dtype, shape and data_offsets [begin, end]");
    }
    auto dtype = codec::ParseDType(v["dtype"].get<std::string>());
    if (!dtype.ok()) return dtype.status().WithContext(where);
    codec::TensorView view;
    view.name = name;
    view.dtype = *dtype;
    for (const auto& d : v["shape"]) {
      if (!d.is_number_unsigned()) return InvalidArgumentError(where + ": shape holds a non-natural number");
      view.shape.push_back(d.get<uint64_t>());
    }
    if (view.shape.size() > 16) return InvalidArgumentError(where + ": rank exceeds 16");
    const auto& off = v["data_offsets"];
    if (!off[0].is_number_unsigned() || !off[1].is_number_unsigned()) {
      return InvalidArgumentError(where + ": data_offsets are not natural numbers");
    }
    uint64_t begin = off[0].get<uint64_t>(), end = off[1].get<uint64_t>();
    if (begin > end || end > data_len) {
      return InvalidArgumentError(where + ": data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
                                  ") outside the " + std::to_string(data_len) + " data bytes");
    }
    if (view.NumBytes() != end - begin) {
      return InvalidArgumentError(where + ": shape and dtype need " + std::to_string(view.NumBytes()) +
                                  " bytes, data_offsets give " + std::to_string(end - begin));
    }
    view.data = bytes + data_begin + begin;
    entries.push_back({begin, end, std::move(view)});
  }
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.view.name < b.view.name;
  });
  for (size_t i = 1; i < entries.size(); ++i) {
    if (entries[i].begin < entries[i - 1].end) {
      return InvalidArgumentError(path + ": tensors '" + entries[i - 1].view.name + "' and '" +
                                  entries[i].view.name + "' overlap");
    }
  }
  for (auto& e : entries) f->tensors_.push_back(std::move(e.view));
  return f;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) ::munmap(map_, map_size_);
}

const codec::TensorView* SafetensorsFile::Find(const std::string& name) const {
  for (const auto& t : tensors_) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

Status WriteSafetensors(const std::string& path, std::span<const codec::TensorView> tensors,
                        const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json m = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    header["__metadata__"] = m;
  }
  uint64_t offset = 0;
  for (const auto& t : tensors) {
    if (header.contains(t.name)) return InvalidArgumentError("tensor " + Quoted(t.name) + " appears twice");
    header[t.name] = {{"dtype", std::string(codec::DTypeName(t.dtype))},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + t.NumBytes()}}};
    offset += t.NumBytes();
  }
  std::string json = header.dump();
  // Pad the header with spaces to a multiple of 8 so the data is aligned.
  json.append((8 - (json.size() + 8) % 8) % 8, ' ');
  std::string tmp = path + ".tmp." + std::to_string(::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoToStatus(errno, "create " + tmp);
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(static_cast<uint64_t>(json.size()) >> (8 * i));
  Status s = WriteAll(fd, len, 8, tmp);
  if (s.ok()) s = WriteAll(fd, json.data(), json.size(), tmp);
  for (const auto& t : tensors) {
    if (!s.ok()) break;
    s = WriteAll(fd, t.data, t.NumBytes(), tmp);
  }
  if (s.ok() && ::fsync(fd) != 0) s = ErrnoToStatus(errno, "fsync " + tmp);
  if (::close(fd) != 0 && s.ok()) s = ErrnoToStatus(errno, "close " + tmp);
  if (s.ok() && ::rename(tmp.c_str(), path.c_str()) != 0) s = ErrnoToStatus(errno, "rename to " + path);
  if (!s.ok()) ::unlink(tmp.c_str());
  return s;
}

std::vector<OwnedTensor> CopyTensors(std::span<const codec::TensorView> tensors) {
  std::vector<OwnedTensor> out;
  out.reserve(tensors.size());
  for (const auto& t : tensors) {
    out.push_back({t.name, t.dtype, t.shape, std::vector<uint8_t>(t.data, t.data + t.NumBytes())});
  }
  return out;
}

bool SameLayout(const std::vector<OwnedTensor>& to, std::span<const codec::TensorView> from) {
  if (to.size() != from.size()) return false;
  for (size_t i = 0; i < to.size(); ++i) {
    if (to[i].name != from[i].name || to[i].dtype != from[i].dtype || to[i].shape != from[i].shape) return false;
  }
  return true;
}

std::vector<OwnedTensor> PublishedCopy(std::span<const codec::TensorView> tensors) {
  std::vector<OwnedTensor> out;
  out.reserve(tensors.size());
  for (const auto& t : tensors) {
    OwnedTensor o{t.name, PublishedDType(t.dtype), t.shape, {}};
    o.bytes.resize(o.View().NumBytes());
    out.push_back(std::move(o));
  }
  return out;
}

codec::DType PublishedDType(codec::DType d) { return d == codec::DType::kF32 ? codec::DType::kBF16 : d; }

Status CopyInto(std::span<const codec::TensorView> from, std::vector<OwnedTensor>& to, ThreadPool* pool) {
  bool layout_ok = to.size() == from.size();
  for (size_t i = 0; layout_ok && i < to.size(); ++i) {
    layout_ok = to[i].name == from[i].name && to[i].shape == from[i].shape &&
                (to[i].dtype == from[i].dtype || (from[i].dtype == codec::DType::kF32 && to[i].dtype == codec::DType::kBF16));
  }
  if (!layout_ok) return InvalidArgumentError("copy: tensor names, dtypes or shapes differ");
  // Pieces of 16 MiB of the destination, each a plain copy or a cast.
  constexpr size_t kPiece = size_t{16} << 20;
  struct Piece {
    uint8_t* to;
    const uint8_t* from;
    size_t bytes;  // of the destination
    bool cast;
  };
  std::vector<Piece> pieces;
  for (size_t i = 0; i < from.size(); ++i) {
    const bool cast = from[i].dtype != to[i].dtype;
    const size_t n = to[i].bytes.size();
    for (size_t at = 0; at < n; at += kPiece) {
      pieces.push_back({to[i].bytes.data() + at, from[i].data + (cast ? 2 * at : at), std::min(kPiece, n - at), cast});
    }
  }
  ParallelFor(pool, pieces.size(), [&](size_t p) {
    const Piece& c = pieces[p];
    if (!c.cast) {
      std::memcpy(c.to, c.from, c.bytes);
      return;
    }
    // F32 tensors are 4-byte aligned (ValidateTable), pieces start at 16 MiB multiples.
    codec::CastFp32ToBf16(reinterpret_cast<const uint32_t*>(c.from), reinterpret_cast<uint16_t*>(c.to), c.bytes / 2);
  });
  return Status::Ok();
}

std::vector<codec::TensorView> Views(const std::vector<OwnedTensor>& tensors) {
  std::vector<codec::TensorView> out;
  for (const auto& t : tensors) out.push_back(t.View());
  return out;
}

std::vector<codec::MutableTensorView> MutableViews(std::vector<OwnedTensor>& tensors) {
  std::vector<codec::MutableTensorView> out;
  for (auto& t : tensors) out.push_back(t.MutableView());
  return out;
}

}  // namespace wsync::buffers
