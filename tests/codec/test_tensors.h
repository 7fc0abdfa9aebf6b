// Random tensor sets for codec tests.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "wsync/buffers/safetensors.h"
#include "wsync/codec/codec.h"

namespace wsync::testing {

using buffers::OwnedTensor;

// A tensor of n elements of `dtype` whose bit patterns look like weights:
// floats drawn from N(0, scale) (integers: uniform bytes).
inline OwnedTensor RandomTensor(const std::string& name, codec::DType dtype, std::vector<uint64_t> shape,
                                std::mt19937_64& rng, double scale = 0.02) {
  OwnedTensor t{name, dtype, shape, {}};
  uint64_t n = 1;
  for (auto d : shape) n *= d;
  const size_t w = codec::DTypeWidth(dtype);
  t.bytes.resize(n * w);
  std::normal_distribution<float> normal(0.0f, static_cast<float>(scale));
  for (uint64_t i = 0; i < n; ++i) {
    float f = normal(rng);
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    uint64_t v;
    switch (dtype) {
      case codec::DType::kBF16: v = bits >> 16; break;
      case codec::DType::kF32: v = bits; break;
      case codec::DType::kF64: {
        double d = f;
        std::memcpy(&v, &d, 8);
        break;
      }
      case codec::DType::kF16: {  // crude: sign, 5-bit exponent, 10-bit mantissa
        int e = static_cast<int>((bits >> 23) & 0xFF) - 127 + 15;
        e = std::clamp(e, 0, 30);
        v = ((bits >> 16) & 0x8000) | (static_cast<uint32_t>(e) << 10) | ((bits >> 13) & 0x3FF);
        break;
      }
      case codec::DType::kF8E4M3: {
        int e = static_cast<int>((bits >> 23) & 0xFF) - 127 + 7;
        e = std::clamp(e, 0, 15);
        v = ((bits >> 24) & 0x80) | (static_cast<uint32_t>(e) << 3) | ((bits >> 20) & 0x7);
        break;
      }
      default: v = rng(); break;
    }
    std::memcpy(t.bytes.data() + i * w, &v, w);  // little-endian
  }
  return t;
}

// A copy of `base` in which about `density` of the elements change: mostly
// by +-1 unit in the last place, sometimes by a random bit pattern.
inline OwnedTensor Perturb(const OwnedTensor& base, double density, std::mt19937_64& rng) {
  OwnedTensor t = base;
  const size_t w = codec::DTypeWidth(base.dtype);
  const size_t n = base.bytes.size() / w;
  std::uniform_real_distribution<double> u(0, 1);
  for (size_t i = 0; i < n; ++i) {
    if (density < 1 && u(rng) >= density) continue;
    uint64_t v = 0;
    std::memcpy(&v, t.bytes.data() + i * w, w);
    double r = u(rng);
    uint64_t nv = r < 0.45 ? v + 1 : r < 0.9 ? v - 1 : rng();
    if (w < 8) nv &= (uint64_t{1} << (8 * w)) - 1;
    if (nv == v) nv ^= 1;
    std::memcpy(t.bytes.data() + i * w, &nv, w);
  }
  return t;
}

// A BF16 copy of `base` changed like an optimizer step at a small learning
// rate: small-magnitude elements change often, large ones rarely (the
// probability halves per binade above `pivot_exponent`), all by +-1 ulp.
inline OwnedTensor PerturbByExponent(const OwnedTensor& base, double density, int pivot_exponent,
                                     std::mt19937_64& rng) {
  OwnedTensor t = base;
  auto* x = reinterpret_cast<uint16_t*>(t.bytes.data());
  std::uniform_real_distribution<double> u(0, 1);
  for (size_t i = 0; i < t.bytes.size() / 2; ++i) {
    int e = (x[i] >> 7) & 0xFF;
    double p = std::min(1.0, density * std::ldexp(1.0, pivot_exponent - e));
    if (u(rng) < p) x[i] = static_cast<uint16_t>(x[i] + (u(rng) < 0.5 ? 1 : -1));
  }
  return t;
}

inline bool SameBits(const std::vector<OwnedTensor>& a, const std::vector<OwnedTensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].name != b[i].name || a[i].bytes != b[i].bytes) return false;
  }
  return true;
}

// The safetensors snapshots of a directory, sorted by name (none if it
// does not exist).
inline std::vector<std::filesystem::path> SnapshotFiles(const std::filesystem::path& dir) {
  std::vector<std::filesystem::path> files;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    if (e.path().extension() == ".safetensors") files.push_back(e.path());
  }
  std::sort(files.begin(), files.end());
  return files;
}

// Calls f(base, target, name of the base's file) for each consecutive pair
// of snapshots in dir; false when it holds fewer than two. A file that does
// not open is an error message (and the pair is skipped).
template <typename F>
bool ForEachSnapshotPair(const std::filesystem::path& dir, F&& f, std::string* error) {
  const auto files = SnapshotFiles(dir);
  if (files.size() < 2) return false;
  for (size_t i = 0; i + 1 < files.size(); ++i) {
    auto a = buffers::SafetensorsFile::Open(files[i].string());
    auto b = buffers::SafetensorsFile::Open(files[i + 1].string());
    if (!a.ok() || !b.ok()) {
      *error += (a.ok() ? b.status() : a.status()).ToString() + "\n";
      continue;
    }
    f(buffers::CopyTensors((*a)->tensors()), buffers::CopyTensors((*b)->tensors()), files[i].filename().string());
  }
  return true;
}

}  // namespace wsync::testing
