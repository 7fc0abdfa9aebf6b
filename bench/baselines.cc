#include "baselines.h"

#include <cstring>
#include <memory>
#include <vector>

#include <zstd.h>

namespace wsync::bench {
namespace {

template <typename T>
void Put(std::string* out, T v) {
  out->append(reinterpret_cast<const char*>(&v), sizeof(T));
}

template <typename T>
bool Get(const std::string& in, size_t* pos, T* v) {
  if (in.size() - *pos < sizeof(T)) return false;
  std::memcpy(v, in.data() + *pos, sizeof(T));
  *pos += sizeof(T);
  return true;
}

std::string Compress(const std::string& raw, int level) {
  std::string out(ZSTD_compressBound(raw.size()) + 8, '\0');
  uint64_t n = raw.size();
  std::memcpy(out.data(), &n, 8);
  size_t z = ZSTD_compress(out.data() + 8, out.size() - 8, raw.data(), raw.size(), level);
  out.resize(8 + z);
  return out;
}

StatusOr<std::string> Decompress(const std::string& in) {
  uint64_t n;
  if (in.size() < 8) return DataLossError("short");
  std::memcpy(&n, in.data(), 8);
  std::string raw(n, '\0');
  size_t r = ZSTD_decompress(raw.data(), n, in.data() + 8, in.size() - 8);
  if (ZSTD_isError(r) || r != n) return DataLossError("zstd");
  return raw;
}

class Naive : public Baseline {
 public:
  std::string name() const override { return "naive int32+raw"; }
  StatusOr<std::string> Encode(std::span<const codec::TensorView> base,
                               std::span<const codec::TensorView> target) override {
    std::string out;
    for (size_t t = 0; t < base.size(); ++t) {
      const size_t w = codec::DTypeWidth(base[t].dtype), n = base[t].NumElements();
      size_t count_at = out.size();
      Put<uint32_t>(&out, 0);
      uint32_t count = 0;
      for (size_t i = 0; i < n; ++i) {
        if (std::memcmp(base[t].data + i * w, target[t].data + i * w, w) != 0) {
          Put<int32_t>(&out, static_cast<int32_t>(i));
          out.append(reinterpret_cast<const char*>(target[t].data + i * w), w);
          ++count;
        }
      }
      std::memcpy(out.data() + count_at, &count, 4);
    }
    return out;
  }
  Status Apply(const std::string& patch, std::span<const codec::MutableTensorView> dst) override {
    size_t pos = 0;
    for (const auto& t : dst) {
      const size_t w = codec::DTypeWidth(t.dtype), n = t.NumElements();
      uint32_t count;
      if (!Get(patch, &pos, &count)) return DataLossError("count");
      for (uint32_t k = 0; k < count; ++k) {
        int32_t i;
        if (!Get(patch, &pos, &i) || static_cast<size_t>(i) >= n || patch.size() - pos < w) {
          return DataLossError("entry");
        }
        std::memcpy(t.data + static_cast<size_t>(i) * w, patch.data() + pos, w);
        pos += w;
      }
    }
    return Status::Ok();
  }
};

class Pulse : public Baseline {
 public:
  std::string name() const override { return "PULSE-style"; }
  StatusOr<std::string> Encode(std::span<const codec::TensorView> base,
                               std::span<const codec::TensorView> target) override {
    std::string raw;
    std::vector<uint64_t> idx;
    for (size_t t = 0; t < base.size(); ++t) {
      const size_t w = codec::DTypeWidth(base[t].dtype), n = base[t].NumElements();
      idx.clear();
      uint64_t max_gap = 0, prev = 0;
      for (size_t i = 0; i < n; ++i) {
        if (std::memcmp(base[t].data + i * w, target[t].data + i * w, w) != 0) {
          max_gap = std::max<uint64_t>(max_gap, i - prev);
          prev = i;
          idx.push_back(i);
        }
      }
      const uint8_t width = max_gap < (1u << 8) ? 1 : max_gap < (1u << 16) ? 2 : max_gap < (1ull << 32) ? 4 : 8;
      Put<uint64_t>(&raw, idx.size());
      Put<uint8_t>(&raw, width);
      prev = 0;
      for (uint64_t i : idx) {
        uint64_t gap = i - prev;
        prev = i;
        raw.append(reinterpret_cast<const char*>(&gap), width);
      }
      for (uint64_t i : idx) raw.append(reinterpret_cast<const char*>(target[t].data + i * w), w);
    }
    return Compress(raw, 1);
  }
  Status Apply(const std::string& patch, std::span<const codec::MutableTensorView> dst) override {
    auto raw = Decompress(patch);
    if (!raw.ok()) return raw.status();
    size_t pos = 0;
    std::vector<uint64_t> idx;
    for (const auto& t : dst) {
      const size_t w = codec::DTypeWidth(t.dtype), n = t.NumElements();
      uint64_t count;
      uint8_t width;
      if (!Get(*raw, &pos, &count) || !Get(*raw, &pos, &width) || count > n) return DataLossError("header");
      if (raw->size() - pos < count * (width + w)) return DataLossError("short");
      idx.resize(count);
      uint64_t prev = 0;
      for (uint64_t k = 0; k < count; ++k) {
        uint64_t gap = 0;
        std::memcpy(&gap, raw->data() + pos, width);
        pos += width;
        prev += gap;
        if (prev >= n) return DataLossError("index");
        idx[k] = prev;
      }
      for (uint64_t k = 0; k < count; ++k) {
        std::memcpy(t.data + idx[k] * w, raw->data() + pos, w);
        pos += w;
      }
    }
    return Status::Ok();
  }
};

class DenseZstd : public Baseline {
 public:
  std::string name() const override { return "zstd -3 dense"; }
  StatusOr<std::string> Encode(std::span<const codec::TensorView>,
                               std::span<const codec::TensorView> target) override {
    std::string raw;
    for (const auto& t : target) raw.append(reinterpret_cast<const char*>(t.data), t.NumBytes());
    return Compress(raw, 3);
  }
  Status Apply(const std::string& patch, std::span<const codec::MutableTensorView> dst) override {
    auto raw = Decompress(patch);
    if (!raw.ok()) return raw.status();
    size_t pos = 0;
    for (const auto& t : dst) {
      if (raw->size() - pos < t.NumBytes()) return DataLossError("short");
      std::memcpy(t.data, raw->data() + pos, t.NumBytes());
      pos += t.NumBytes();
    }
    return Status::Ok();
  }
};

}  // namespace

std::unique_ptr<Baseline> MakeNaiveBaseline() { return std::make_unique<Naive>(); }
std::unique_ptr<Baseline> MakePulseBaseline() { return std::make_unique<Pulse>(); }
std::unique_ptr<Baseline> MakeDenseZstdBaseline() { return std::make_unique<DenseZstd>(); }

}  // namespace wsync::bench
