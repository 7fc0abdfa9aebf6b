// Adaptive binary range coder (private).
//
// The coder is the carry-propagating range coder of LZMA (32-bit range, 33-bit
// low, byte-wise output with a cache byte). Probabilities are 16-bit and
// adaptive: each context keeps two estimates that learn at rates 1/16 and
// 1/128 and codes with their mean, which tracks both short and long-range
// statistics. Integers are binarized as Exp-Golomb codes whose prefix bits and
// two leading mantissa bits have contexts of their own; lower mantissa bits are
// coded at probability 1/2.
//
// The decoder never reads outside its input: bytes past the end read as zero
// and are counted, so a truncated stream decodes to garbage that the caller's
// checks (counts, bounds, checksums) reject.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace wsync::codec::internal {

inline constexpr int kProbBits = 16;

struct BitModel {
  uint16_t fast = 1u << (kProbBits - 1);
  uint16_t slow = 1u << (kProbBits - 1);
  // Probability that the next bit is 0, in units of 2^-16; in [71, 65465].
  uint32_t P0() const { return (uint32_t{fast} + slow) >> 1; }
  // Both outcomes are computed and one is selected, so that coding a bit
  // costs no branch (coded bits are unpredictable by nature).
  __attribute__((always_inline)) void Update(int bit) {
    const uint32_t f = fast, s = slow;
    const uint32_t f1 = f - (f >> 4), s1 = s - (s >> 7);
    const uint32_t f0 = f + ((65536u - f) >> 4), s0 = s + ((65536u - s) >> 7);
    fast = static_cast<uint16_t>(bit ? f1 : f0);
    slow = static_cast<uint16_t>(bit ? s1 : s0);
  }
};

// Contexts of one Exp-Golomb coded integer class.
struct EGModel {
  static constexpr int kMaxPrefix = 66;  // bit length of values up to 2^64
  static constexpr int kPrefixContexts = 24;
  BitModel prefix[kPrefixContexts];
  BitModel mantissa[kPrefixContexts][3];  // [k][0]: first bit; [k][1..2]: second given first
};

class RangeEncoder {
 public:
  // Appends to *out. The string is grown ahead and trimmed by Finish(), so
  // that the coding loop writes bytes through a pointer: until Finish(),
  // which every use must call, *out ends in scratch bytes.
  explicit RangeEncoder(std::string* out) : out_(out) {
    const size_t used = out_->size();
    out_->resize(used + 256);
    cur_ = out_->data() + used;
    end_ = out_->data() + out_->size();
  }

  __attribute__((always_inline)) void Encode(BitModel& m, int bit) {
    const uint32_t bound = (range_ >> kProbBits) * m.P0();
    const uint32_t mask = 0u - static_cast<uint32_t>(bit != 0);
    low_ += bound & mask;
    range_ = bit ? range_ - bound : bound;
    m.Update(bit);
    Normalize();
  }

  // The low n bits of value at probability 1/2, up to 16 at a time.
  // REQUIRES: n <= 64.
  void EncodeDirect(uint64_t value, int n) {
    while (n > 0) {
      const int take = n < 16 ? n : 16;
      n -= take;
      const uint32_t part = static_cast<uint32_t>(value >> n) & ((1u << take) - 1);
      range_ >>= take;  // range >= 2^24, so at least 2^8 remain
      low_ += static_cast<uint64_t>(part) * range_;
      Normalize();
    }
  }

  // Exp-Golomb code of v (any u64).
  void EncodeEG(EGModel& m, uint64_t v) {
    // v + 1 as a 65-bit number: k = bit length - 1.
    unsigned __int128 v1 = static_cast<unsigned __int128>(v) + 1;
    int k = 0;
    while ((v1 >> (k + 1)) != 0) ++k;
    for (int i = 0; i < k; ++i) Encode(m.prefix[Ctx(i)], 1);
    Encode(m.prefix[Ctx(k)], 0);
    if (k == 0) return;
    const int kc = Ctx(k);
    int b1 = static_cast<int>((v1 >> (k - 1)) & 1);
    Encode(m.mantissa[kc][0], b1);
    if (k == 1) return;
    int b2 = static_cast<int>((v1 >> (k - 2)) & 1);
    Encode(m.mantissa[kc][1 + b1], b2);
    if (k == 2) return;
    // The remaining k-2 bits (k <= 64, so at most 62 of them).
    uint64_t rest = static_cast<uint64_t>(v1 & ((static_cast<unsigned __int128>(1) << (k - 2)) - 1));
    EncodeDirect(rest, k - 2);
  }

  void Finish() {
    for (int i = 0; i < 5; ++i) ShiftLow();
    out_->resize(static_cast<size_t>(cur_ - out_->data()));
  }

 private:
  static int Ctx(int i) { return i < EGModel::kPrefixContexts ? i : EGModel::kPrefixContexts - 1; }

  __attribute__((always_inline)) void Normalize() {
    while (range_ < (1u << 24)) {
      range_ <<= 8;
      ShiftLow();
    }
  }

  // LZMA's byte output: a byte is held back (cache_) while a carry may
  // still reach it.
  void ShiftLow() {
    if (static_cast<uint32_t>(low_) < 0xFF000000u || (low_ >> 32) != 0) {
      const uint8_t carry = static_cast<uint8_t>(low_ >> 32);
      uint8_t temp = cache_;
      do {
        if (!first_) Put(static_cast<uint8_t>(temp + carry));
        first_ = false;
        temp = 0xFF;
      } while (--cache_size_ != 0);
      cache_ = static_cast<uint8_t>(low_ >> 24);
    }
    ++cache_size_;
    low_ = (low_ & 0x00FFFFFFu) << 8;
  }

  void Put(uint8_t byte) {
    if (cur_ == end_) Grow();
    *cur_++ = static_cast<char>(byte);
  }

  __attribute__((noinline)) void Grow() {
    const size_t used = static_cast<size_t>(cur_ - out_->data());
    out_->resize(used * 2);
    cur_ = out_->data() + used;
    end_ = out_->data() + out_->size();
  }

  std::string* out_;
  char* cur_;
  char* end_;
  uint64_t low_ = 0;
  uint32_t range_ = 0xFFFFFFFFu;
  uint8_t cache_ = 0;
  uint64_t cache_size_ = 1;
  bool first_ = true;  // LZMA's first output byte is always 0: not written
};

class RangeDecoder {
 public:
  explicit RangeDecoder(std::string_view in) : in_(in) {
    for (int i = 0; i < 4; ++i) code_ = (code_ << 8) | NextByte();
  }

  __attribute__((always_inline)) int Decode(BitModel& m) {
    const uint32_t bound = (range_ >> kProbBits) * m.P0();
    const int bit = code_ >= bound;
    const uint32_t mask = 0u - static_cast<uint32_t>(bit);
    code_ -= bound & mask;
    range_ = bit ? range_ - bound : bound;
    m.Update(bit);
    Normalize();
    return bit;
  }

  uint64_t DecodeDirect(int n) {
    uint64_t v = 0;
    while (n > 0) {
      const int take = n < 16 ? n : 16;
      n -= take;
      range_ >>= take;
      uint32_t part = code_ / range_;
      if (part >> take) {  // only a corrupt stream gets here
        part = (1u << take) - 1;
        corrupt_ = true;
      }
      code_ -= part * range_;
      v = (v << take) | part;
      Normalize();
    }
    return v;
  }

  // Decodes an Exp-Golomb value whose result must be <= max. Returns false
  // (value unspecified) when the code says otherwise: corrupt input.
  bool DecodeEG(EGModel& m, uint64_t max, uint64_t* out) {
    int k = 0;
    while (Decode(m.prefix[Ctx(k)]) == 1) {
      if (++k >= EGModel::kMaxPrefix - 1) return false;
    }
    unsigned __int128 v1 = 1;
    if (k >= 1) {
      const int kc = Ctx(k);
      int b1 = Decode(m.mantissa[kc][0]);
      v1 = (v1 << 1) | static_cast<unsigned>(b1);
      if (k >= 2) {
        int b2 = Decode(m.mantissa[kc][1 + b1]);
        v1 = (v1 << 1) | static_cast<unsigned>(b2);
        if (k >= 3) v1 = (v1 << (k - 2)) | DecodeDirect(k - 2);
      }
    }
    unsigned __int128 v = v1 - 1;
    if (v > max) return false;
    *out = static_cast<uint64_t>(v);
    return true;
  }

  // Bytes read past the end of the input (as zeros). A stream written by
  // RangeEncoder never needs more than a few.
  size_t overrun() const { return overrun_; }
  // True when a direct-bit field decoded out of range (corrupt input).
  bool corrupt() const { return corrupt_; }

 private:
  static int Ctx(int i) { return i < EGModel::kPrefixContexts ? i : EGModel::kPrefixContexts - 1; }

  uint8_t NextByte() {
    if (pos_ < in_.size()) return static_cast<uint8_t>(in_[pos_++]);
    ++overrun_;
    return 0;
  }

  __attribute__((always_inline)) void Normalize() {
    while (range_ < (1u << 24)) {
      range_ <<= 8;
      code_ = (code_ << 8) | NextByte();
    }
  }

  std::string_view in_;
  size_t pos_ = 0;
  size_t overrun_ = 0;
  bool corrupt_ = false;
  uint32_t code_ = 0;
  uint32_t range_ = 0xFFFFFFFFu;
};

}  // namespace wsync::codec::internal
