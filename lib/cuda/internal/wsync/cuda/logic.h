// The per-element and per-block logic of the device kernels, as WSYNC_HD
// functions of plain arguments: the kernels in cuda/src/kernels.cu call them
// on the GPU, and tests/cuda runs them on the CPU against the host codec and
// libxxhash bit for bit. Nothing here includes CUDA headers.
//
// XXH3-64 (seed 0, default secret) is reimplemented here from the xxHash
// specification, because the device cannot call libxxhash. The long-input
// path is split by accumulator lane: lane i's accumulator depends only on
// words i and i^1 of every stripe, so eight threads hash one block together
// and merge at the end (Xxh3LongLane + Xxh3Merge == XXH3_64bits).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "wsync/codec/block_logic.h"

namespace wsync::cuda::logic {

// ---------------------------------------------------------------- XXH3-64

inline constexpr uint64_t kPrime32_1 = 0x9E3779B1u;
inline constexpr uint64_t kPrime32_2 = 0x85EBCA77u;
inline constexpr uint64_t kPrime32_3 = 0xC2B2AE3Du;
inline constexpr uint64_t kPrime64_1 = 0x9E3779B185EBCA87ull;
inline constexpr uint64_t kPrime64_2 = 0xC2B2AE3D27D4EB4Full;
inline constexpr uint64_t kPrime64_3 = 0x165667B19E3779F9ull;
inline constexpr uint64_t kPrime64_4 = 0x85EBCA77C2B2AE63ull;
inline constexpr uint64_t kPrime64_5 = 0x27D4EB2F165667C5ull;
inline constexpr uint64_t kPrimeMx1 = 0x165667919E3779F9ull;
inline constexpr uint64_t kPrimeMx2 = 0x9FB21C651E98DF25ull;
inline constexpr size_t kSecretBytes = 192;
inline constexpr size_t kStripeBytes = 64;
inline constexpr size_t kStripesPerBlock = (kSecretBytes - kStripeBytes) / 8;  // 16
inline constexpr size_t kHashBlockBytes = kStripeBytes * kStripesPerBlock;     // 1024

// The default secret of XXH3 (the xxHash specification's kSecret).
#define WSYNC_XXH3_SECRET_BYTES \
  0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c, \
  0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f, \
  0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21, \
  0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c, \
  0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3, \
  0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8, \
  0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d, \
  0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64, \
  0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb, \
  0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e, \
  0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce, \
  0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e
inline constexpr uint8_t kHostSecret[kSecretBytes] = {WSYNC_XXH3_SECRET_BYTES};
#if defined(__CUDACC__)
static __constant__ uint8_t kDeviceSecret[kSecretBytes] = {WSYNC_XXH3_SECRET_BYTES};
#endif
#undef WSYNC_XXH3_SECRET_BYTES

WSYNC_HD inline const uint8_t* Secret() {
#if defined(__CUDA_ARCH__)
  return kDeviceSecret;
#else
  return kHostSecret;
#endif
}

WSYNC_HD inline uint64_t Read64(const uint8_t* p) {
#if defined(__CUDA_ARCH__)
  if ((reinterpret_cast<uintptr_t>(p) & 7) == 0) return *reinterpret_cast<const uint64_t*>(p);
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
#else
  uint64_t v;
  std::memcpy(&v, p, 8);  // every supported host is little-endian
  return v;
#endif
}
WSYNC_HD inline uint32_t Read32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 | static_cast<uint32_t>(p[2]) << 16 |
         static_cast<uint32_t>(p[3]) << 24;
}
WSYNC_HD inline uint64_t Rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
WSYNC_HD inline uint64_t Swap64(uint64_t x) {
  uint64_t r = 0;
  for (int i = 0; i < 8; ++i) r = (r << 8) | ((x >> (8 * i)) & 0xFF);
  return r;
}
// Low 64 bits xor high 64 bits of the 128-bit product.
WSYNC_HD inline uint64_t MulFold64(uint64_t a, uint64_t b) {
#if defined(__CUDA_ARCH__)
  return (a * b) ^ __umul64hi(a, b);
#else
  const unsigned __int128 p = static_cast<unsigned __int128>(a) * b;
  return static_cast<uint64_t>(p) ^ static_cast<uint64_t>(p >> 64);
#endif
}
WSYNC_HD inline uint64_t Xxh64Avalanche(uint64_t h) {
  h ^= h >> 33;
  h *= kPrime64_2;
  h ^= h >> 29;
  h *= kPrime64_3;
  return h ^ (h >> 32);
}
WSYNC_HD inline uint64_t Xxh3Avalanche(uint64_t h) {
  h ^= h >> 37;
  h *= kPrimeMx1;
  return h ^ (h >> 32);
}
WSYNC_HD inline uint64_t Mix16(const uint8_t* in, const uint8_t* secret) {
  return MulFold64(Read64(in) ^ Read64(secret), Read64(in + 8) ^ Read64(secret + 8));
}

// XXH3-64 of inputs of at most 240 bytes.
WSYNC_HD inline uint64_t Xxh3Short(const uint8_t* in, size_t len) {
  const uint8_t* s = Secret();
  if (len == 0) return Xxh64Avalanche(Read64(s + 56) ^ Read64(s + 64));
  if (len <= 3) {
    const uint32_t combined = static_cast<uint32_t>(in[0]) << 16 | static_cast<uint32_t>(in[len >> 1]) << 24 |
                              static_cast<uint32_t>(in[len - 1]) | static_cast<uint32_t>(len) << 8;
    const uint64_t flip = static_cast<uint64_t>(Read32(s) ^ Read32(s + 4));
    return Xxh64Avalanche(combined ^ flip);
  }
  if (len <= 8) {
    const uint64_t flip = Read64(s + 8) ^ Read64(s + 16);
    const uint64_t input = Read32(in + len - 4) + (static_cast<uint64_t>(Read32(in)) << 32);
    uint64_t h = input ^ flip;
    h ^= Rotl64(h, 49) ^ Rotl64(h, 24);
    h *= kPrimeMx2;
    h ^= (h >> 35) + len;
    h *= kPrimeMx2;
    return h ^ (h >> 28);
  }
  if (len <= 16) {
    const uint64_t lo = Read64(in) ^ (Read64(s + 24) ^ Read64(s + 32));
    const uint64_t hi = Read64(in + len - 8) ^ (Read64(s + 40) ^ Read64(s + 48));
    return Xxh3Avalanche(len + Swap64(lo) + hi + MulFold64(lo, hi));
  }
  uint64_t acc = len * kPrime64_1;
  if (len <= 128) {
    if (len > 32) {
      if (len > 64) {
        if (len > 96) {
          acc += Mix16(in + 48, s + 96);
          acc += Mix16(in + len - 64, s + 112);
        }
        acc += Mix16(in + 32, s + 64);
        acc += Mix16(in + len - 48, s + 80);
      }
      acc += Mix16(in + 16, s + 32);
      acc += Mix16(in + len - 32, s + 48);
    }
    acc += Mix16(in, s);
    acc += Mix16(in + len - 16, s + 16);
    return Xxh3Avalanche(acc);
  }
  for (int i = 0; i < 8; ++i) acc += Mix16(in + 16 * i, s + 16 * i);
  acc = Xxh3Avalanche(acc);
  const int rounds = static_cast<int>(len / 16);
  for (int i = 8; i < rounds; ++i) acc += Mix16(in + 16 * i, s + 16 * (i - 8) + 3);
  acc += Mix16(in + len - 16, s + 136 - 17);
  return Xxh3Avalanche(acc);
}

WSYNC_HD inline uint64_t Xxh3InitAcc(int lane) {
  switch (lane) {
    case 0: return kPrime32_3;
    case 1: return kPrime64_1;
    case 2: return kPrime64_2;
    case 3: return kPrime64_3;
    case 4: return kPrime64_4;
    case 5: return kPrime32_2;
    case 6: return kPrime64_5;
    default: return kPrime32_1;
  }
}

// One stripe's effect on accumulator `lane`: the lane's own word multiplied
// with its key, plus the neighbour word (lane ^ 1) added raw.
WSYNC_HD inline uint64_t Xxh3StripeLane(uint64_t acc, const uint8_t* stripe, const uint8_t* secret, int lane) {
  const uint64_t own = Read64(stripe + 8 * lane);
  const uint64_t key = own ^ Read64(secret + 8 * lane);
  acc += Read64(stripe + 8 * (lane ^ 1));
  acc += (key & 0xFFFFFFFFull) * (key >> 32);
  return acc;
}

// The long path's accumulator only adds stripe contributions between the
// scrambles that end each 1 KiB block, so a block's contribution to lane
// `lane` is a sum that threads compute independently; the chain of
// scrambles is then cheap and sequential:
//   acc = init; for each full block b: acc = Scramble(acc + BlockSum(b));
//   acc = TailLane(acc, ...);   (== Xxh3LongLane)
WSYNC_HD inline uint64_t Xxh3BlockSum(const uint8_t* block, int lane) {
  const uint8_t* s = Secret();
  uint64_t sum = 0;
  for (size_t st = 0; st < kStripesPerBlock; ++st) sum = Xxh3StripeLane(sum, block + st * kStripeBytes, s + st * 8, lane);
  return sum;
}
// The same sums by a warp. Its 32 threads read a 1 KiB block as 128 words,
// thread t the words t + 32 j (j < 4; coalesced); word i is word i % 8 of
// stripe i / 8, so all of thread t's words are of lane t % 8. Xxh3WarpTerms
// gives thread t's two sums: `own`, its words multiplied with their keys
// (lane t % 8's terms), and `raw`, its words added raw (lane t % 8 ^ 1's).
// Lane l's block sum is the sum over the threads t with t % 8 == l of
// own[t] + raw[t ^ 1]: one exchange with thread t ^ 1 and two butterfly
// steps (t ^ 8, t ^ 16), as Xxh3WarpBlockSums does on the host.
inline constexpr int kWarpWords = 4;  // words of a 1 KiB block per thread of a warp
WSYNC_HD inline uint64_t Xxh3WarpKey(int t, int j) {
  const int i = t + 32 * j;
  return Read64(Secret() + 8 * (i / 8) + 8 * (i % 8));
}
WSYNC_HD inline void Xxh3WarpTerms(const uint8_t* block, int t, const uint64_t* keys, uint64_t* own, uint64_t* raw) {
  uint64_t o = 0, r = 0;
  for (int j = 0; j < kWarpWords; ++j) {
    const uint64_t w = Read64(block + 8 * (t + 32 * j));
    const uint64_t key = w ^ keys[j];
    o += (key & 0xFFFFFFFFull) * (key >> 32);
    r += w;
  }
  *own = o;
  *raw = r;
}
// The kernel's exchanges, thread by thread on the host: sums[lane] for the
// eight lanes, equal to Xxh3BlockSum(block, lane).
inline void Xxh3WarpBlockSums(const uint8_t* block, uint64_t* sums) {
  uint64_t own[32], raw[32], x[32], y[32];
  for (int t = 0; t < 32; ++t) {
    uint64_t keys[kWarpWords];
    for (int j = 0; j < kWarpWords; ++j) keys[j] = Xxh3WarpKey(t, j);
    Xxh3WarpTerms(block, t, keys, &own[t], &raw[t]);
  }
  for (int t = 0; t < 32; ++t) x[t] = own[t] + raw[t ^ 1];
  for (int d : {8, 16}) {
    for (int t = 0; t < 32; ++t) y[t] = x[t] + x[t ^ d];
    for (int t = 0; t < 32; ++t) x[t] = y[t];
  }
  for (int lane = 0; lane < 8; ++lane) sums[lane] = x[lane];
}
WSYNC_HD inline uint64_t Xxh3ScrambleKey(int lane) { return Read64(Secret() + kSecretBytes - kStripeBytes + 8 * lane); }
WSYNC_HD inline uint64_t Xxh3Scramble(uint64_t acc, uint64_t key) {
  acc ^= acc >> 47;
  acc ^= key;
  return acc * kPrime32_1;
}
// Number of full (scrambled) 1 KiB blocks of the long path for len > 240.
WSYNC_HD inline size_t Xxh3FullBlocks(size_t len) { return (len - 1) / kHashBlockBytes; }
// What follows the full blocks: the remaining stripes and the last stripe.
WSYNC_HD inline uint64_t Xxh3TailLane(uint64_t acc, const uint8_t* in, size_t len, int lane) {
  const uint8_t* s = Secret();
  const size_t blocks = Xxh3FullBlocks(len);
  const size_t stripes = ((len - 1) - blocks * kHashBlockBytes) / kStripeBytes;
  const uint8_t* last = in + blocks * kHashBlockBytes;
  for (size_t st = 0; st < stripes; ++st) acc = Xxh3StripeLane(acc, last + st * kStripeBytes, s + st * 8, lane);
  return Xxh3StripeLane(acc, in + len - kStripeBytes, s + kSecretBytes - kStripeBytes - 7, lane);
}

// Accumulator `lane` (0..7) of XXH3-64's long path over len > 240 bytes.
WSYNC_HD inline uint64_t Xxh3LongLane(const uint8_t* in, size_t len, int lane) {
  uint64_t acc = Xxh3InitAcc(lane);
  const uint64_t key = Xxh3ScrambleKey(lane);
  const size_t blocks = Xxh3FullBlocks(len);
  for (size_t b = 0; b < blocks; ++b) acc = Xxh3Scramble(acc + Xxh3BlockSum(in + b * kHashBlockBytes, lane), key);
  return Xxh3TailLane(acc, in, len, lane);
}

// XXH3-64 of len > 240 bytes from its eight lanes' accumulators.
WSYNC_HD inline uint64_t Xxh3Merge(const uint64_t* acc, size_t len) {
  const uint8_t* s = Secret() + 11;
  uint64_t h = len * kPrime64_1;
  for (int i = 0; i < 4; ++i) h += MulFold64(acc[2 * i] ^ Read64(s + 16 * i), acc[2 * i + 1] ^ Read64(s + 16 * i + 8));
  return Xxh3Avalanche(h);
}

// XXH3_64bits(in, len) on one thread.
WSYNC_HD inline uint64_t Xxh3(const uint8_t* in, size_t len) {
  if (len <= 240) return Xxh3Short(in, len);
  uint64_t acc[8];
  for (int lane = 0; lane < 8; ++lane) acc[lane] = Xxh3LongLane(in, len, lane);
  return Xxh3Merge(acc, len);
}

// ------------------------------------------------------------ chunk logic

// Where a tensor's elements fall: blocks of kBlock elements, chunks of
// chunk_elems (a multiple of kBlock).
struct Layout {
  uint64_t n = 0;            // elements
  uint64_t chunk_elems = 0;  // elements per chunk

  WSYNC_HD uint64_t Blocks() const { return (n + codec::kBlock - 1) / codec::kBlock; }
  WSYNC_HD uint64_t ChunkBlocks() const { return chunk_elems / codec::kBlock; }
  WSYNC_HD uint64_t Chunks() const { return (n + chunk_elems - 1) / chunk_elems; }
  WSYNC_HD int BlockLen(uint64_t b) const {
    const uint64_t left = n - b * codec::kBlock;
    return left >= static_cast<uint64_t>(codec::kBlock) ? codec::kBlock : static_cast<int>(left);
  }
  // Whether block b is counted by its chunk's sampled histogram.
  WSYNC_HD bool Sampled(uint64_t b) const {
    const uint64_t in_chunk = b % ChunkBlocks();
    return BlockLen(b) == codec::kBlock && in_chunk % codec::kSampleStride == 0;
  }
};

// Bit j: element j of a block differs.
template <typename T>
WSYNC_HD inline uint32_t DiffMask(const T* base, const T* target, int len) {
  uint32_t m = 0;
  for (int j = 0; j < len; ++j) m |= static_cast<uint32_t>(base[j] != target[j]) << j;
  return m;
}

// Elements of each class in a block (counts[0..k), the rest zero).
template <typename T>
WSYNC_HD inline void BlockClassCounts(const codec::ClassSpec& spec, const T* x, int len, uint32_t* counts) {
  uint32_t ge[codec::kMaxClasses - 1];
  codec::BlockGeMasks(spec, x, len, ge);
  const uint32_t valid = codec::ValidMask(len);
  for (int c = 0; c < codec::kMaxClasses; ++c) {
    counts[c] = c < spec.k ? static_cast<uint32_t>(codec::Popcount32(codec::ClassMask(ge, spec.k, valid, c))) : 0u;
  }
}

// Elements of class c in a block before element j.
template <typename T>
WSYNC_HD inline uint32_t ClassCountBelow(const codec::ClassSpec& spec, const T* x, int len, int c, int j) {
  uint32_t ge[codec::kMaxClasses - 1];
  codec::BlockGeMasks(spec, x, len, ge);
  const uint32_t below = (j >= 32 ? ~0u : (1u << j) - 1);
  return static_cast<uint32_t>(codec::Popcount32(codec::ClassMask(ge, spec.k, codec::ValidMask(len), c) & below));
}

// Index in a block of the r-th element (0-based) of class c.
// REQUIRES: the block has more than r elements of class c.
template <typename T>
WSYNC_HD inline int ClassSelect(const codec::ClassSpec& spec, const T* x, int len, int c, uint32_t r) {
  uint32_t ge[codec::kMaxClasses - 1];
  codec::BlockGeMasks(spec, x, len, ge);
  return codec::SelectBit(codec::ClassMask(ge, spec.k, codec::ValidMask(len), c), r);
}

}  // namespace wsync::cuda::logic
