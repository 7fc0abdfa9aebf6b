// Static-model rANS encoding with a side bit stream (private). The format is
// in docs/patch-format.md ("rANS streams").
//
// A stream codes symbols of a 16-letter alphabet, each with one of several
// frequency tables that the encoder chose from the symbols' own counts and
// wrote at the front of the stream. Two rANS states alternate (symbol i uses
// state i % 2), so the decoder runs two independent dependency chains; the
// bits that refine a symbol (low bits of a gap, the tail of a magnitude) go
// to a plain bit stream beside the rANS words and cost no coding step.
//
// The decoder is written once for the host and the device:
// wsync/codec/sparse_decode.h (BitIn, ReadTable, RansIn).
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "wsync/codec/sparse_decode.h"

namespace wsync::codec::internal {

// The coder's constants are the format's (sparse_decode.h decodes the same
// streams on the device).
inline constexpr int kRansSymbols = sparse::kSymbols;
inline constexpr int kRansPrecision = sparse::kPrecision;  // tables scale to sum 2^10
inline constexpr uint32_t kRansScale = sparse::kScale;
inline constexpr uint32_t kRansLow = sparse::kLow;  // states live in [2^16, 2^32)

// ------------------------------------------------------------ bit stream

// Bits of BitWriter::PutGamma(v).
inline int GammaBits(uint64_t v) { return 2 * (std::bit_width(v + 1) - 1) + 1; }

// Bits are packed least significant first: bit i of the stream is bit
// i % 8 of byte i / 8, and an n-bit field has its low bit first.
class BitWriter {
 public:
  // The fields of a coding loop: a local cursor keeps its pending bits and
  // its place in registers (the writer's own members would be reloaded after
  // every store to the buffer, which may alias them).
  class Cursor {
   public:
    // n <= 64.
    __attribute__((always_inline)) void Put(uint64_t v, int n) {
      if (n > 32) {
        Put32(v & 0xFFFFFFFFu, 32);
        Put32(v >> 32, n - 32);
      } else {
        Put32(v, n);
      }
    }
    // Elias gamma of v + 1: k = bitlen(v + 1) - 1 zeros, a one, then the k
    // low bits of v + 1 (at most 127 bits). REQUIRES: v < 2^64 - 1.
    __attribute__((always_inline)) void PutGamma(uint64_t v) {
      const uint64_t u = v + 1;
      const int k = std::bit_width(u) - 1;
      Put(uint64_t{1} << k, k + 1);
      Put(u, k);
    }

   private:
    friend class BitWriter;
    // Bits gather in a register and leave 32 at a time: a store per field
    // that the next field's load overlaps at another offset would miss
    // store-to-load forwarding, a stall per field.
    __attribute__((always_inline)) void Put32(uint64_t v, int n) {  // n <= 32, fill_ < 32
      acc_ |= (v & ~(~uint64_t{0} << n)) << fill_;
      fill_ += n;
      if (fill_ >= 32) {
        const uint32_t word = static_cast<uint32_t>(acc_);
        std::memcpy(out_, &word, 4);
        out_ += 4;
        acc_ >>= 32;
        fill_ -= 32;
      }
    }
    Cursor(uint8_t* out, uint64_t acc, int fill) : out_(out), acc_(acc), fill_(fill) {}
    uint8_t* out_;
    uint64_t acc_;
    int fill_;
  };

  // A cursor with room for max_bits more bits; Close it before any other
  // use of the writer.
  Cursor Open(size_t max_bits) {
    const size_t byte = static_cast<size_t>(pos_ >> 3);
    const size_t need = byte + max_bits / 8 + 16;
    if (need > buf_.size()) buf_.resize(std::max(need, 2 * buf_.size()), 0);
    const int fill = static_cast<int>(pos_ & 7);
    return Cursor(buf_.data() + byte, fill == 0 ? 0 : buf_[byte] & ((1u << fill) - 1), fill);
  }
  void Close(const Cursor& c) {
    // The bits still in the register (fewer than 32), then zeros.
    std::memcpy(c.out_, &c.acc_, 8);
    pos_ = static_cast<uint64_t>(c.out_ - buf_.data()) * 8 + static_cast<uint64_t>(c.fill_);
  }

  // One field (n <= 64) or one gamma code.
  void Put(uint64_t v, int n) {
    Cursor c = Open(64);
    c.Put(v, n);
    Close(c);
  }
  void PutGamma(uint64_t v) {
    Cursor c = Open(128);
    c.PutGamma(v);
    Close(c);
  }
  // Appends the bits (the last byte zero-padded) to *out.
  void AppendTo(std::string* out) const {
    out->append(reinterpret_cast<const char*>(buf_.data()), static_cast<size_t>((pos_ + 7) >> 3));
  }
  size_t bits() const { return static_cast<size_t>(pos_); }
  // Empties the writer; its buffer is kept for the next bits.
  void Clear() { pos_ = 0; }

 private:
  std::vector<uint8_t> buf_;
  uint64_t pos_ = 0;
};

// ---------------------------------------------------------------- tables

// What the encoder needs of a symbol: x' = x + bias + q * cmpl with
// q = floor(x / freq) = (x * rcp) >> 63, exact for every 32-bit state
// (rcp = ceil(2^63 / freq), and rcp * freq - 2^63 < freq <= 2^31).
struct RansEncSymbol {
  uint64_t rcp = 0;
  uint32_t freq = 0;
  uint32_t bias = 0;  // start
  uint32_t cmpl = 0;  // 2^10 - freq
};

// A frequency table: freq[s] of 2^kRansPrecision (0: s never occurs),
// start[s] the cumulative sum before s.
struct RansTable {
  std::array<uint16_t, kRansSymbols> freq{};
  std::array<uint16_t, kRansSymbols> start{};
  std::array<RansEncSymbol, kRansSymbols> enc{};  // of the present symbols
};

// Chooses a table for symbols with these counts (not all zero) and writes
// its header: the precision P (4 bits, 0..10), the mask of present symbols
// (16 bits), then the frequency of every present symbol but the last, at
// precision P, as Elias gamma of freq - 1 (the last takes the rest). P is
// the one that minimizes header plus coded bits.
RansTable ChooseRansTable(const uint32_t* counts, BitWriter* w);

// Estimated bits of coding symbols with these counts by ChooseRansTable's
// table, its header included (0 when every count is zero).
double RansCostBits(const uint32_t* counts);

// ----------------------------------------------------------------- coder

// Encodes n symbols, symbol i with state i % 2. rANS is last-in,
// first-out: the symbols are coded from the last to the first.
class RansEncoder {
 public:
  // sym(i) returns symbol i's RansEncSymbol (a present one). An encoder
  // codes one stream; Encode starts it afresh (the word buffer is reused).
  template <typename F>
  void Encode(size_t n, F&& sym) {
    Pass p(this, n);
    p.Start(sym);
    p.Rest(sym);
    p.Done();
  }

  // Encodes two streams, a's na symbols and b's nb, in one loop: each
  // stream's bytes are Encode's, and the four states' dependency chains
  // (a step waits for its state's previous one) run side by side.
  template <typename FA, typename FB>
  static void EncodePair(RansEncoder* a, size_t na, FA&& sym_a, RansEncoder* b, size_t nb, FB&& sym_b) {
    Pass pa(a, na), pb(b, nb);
    pa.Start(sym_a);
    pb.Start(sym_b);
    while (pa.i > 0 && pb.i > 0) {
      pa.Two(sym_a);
      pb.Two(sym_b);
    }
    pa.Rest(sym_a);
    pb.Rest(sym_b);
    pa.Done();
    pb.Done();
  }
  // Appends the stream: varint word count, then the words in decoding order
  // (both final states first, high half first), little-endian.
  void Finish(std::string* out);

 private:
  // One stream's encoding in progress: symbols [0, i) remain, coded from
  // the last (symbol j with state j % 2): an odd count's last one first
  // (Start), then two at a time.
  struct Pass {
    Pass(RansEncoder* e, size_t n) : enc(e), i(n) {
      e->words_.resize(n + 1);  // at most one word per symbol, and a spare slot for the unconditional store
      out = e->words_.data();
    }
    template <typename F>
    void Start(F& sym) {
      if (i & 1) Step(x0, sym(--i), &out);
    }
    template <typename F>
    __attribute__((always_inline)) void Two(F& sym) {  // REQUIRES: i even, > 0
      Step(x1, sym(i - 1), &out);
      Step(x0, sym(i - 2), &out);
      i -= 2;
    }
    template <typename F>
    void Rest(F& sym) {
      while (i > 0) Two(sym);
    }
    void Done() {
      enc->words_.resize(static_cast<size_t>(out - enc->words_.data()));
      enc->state_[0] = x0;
      enc->state_[1] = x1;
    }
    RansEncoder* enc;
    size_t i;
    uint16_t* out;
    uint32_t x0 = kRansLow, x1 = kRansLow;
  };

  __attribute__((always_inline)) static void Step(uint32_t& x, const RansEncSymbol& s, uint16_t** out) {
    // Renormalize so that the coded state stays below 2^32 (a symbol of
    // probability 1 never needs it: its bound is 2^32).
    // Without a branch: the word is stored either way and kept when the
    // state had to shrink (about one symbol in several, at random). The
    // shift by 0 or 16 is what keeps it branch-free: GCC 12 compiled the
    // select form (shrink ? x >> 16 : x) to a conditional jump on the
    // state, which no predictor can learn.
    const uint64_t x_max = uint64_t{(kRansLow >> kRansPrecision) << 16} * s.freq;
    const uint32_t shrink = x >= x_max ? 1u : 0u;
    **out = static_cast<uint16_t>(x & 0xFFFF);
    *out += shrink;
    x >>= 16 * shrink;
    const uint32_t q = static_cast<uint32_t>((static_cast<unsigned __int128>(x) * s.rcp) >> 63);
    x += s.bias + q * s.cmpl;
  }

  uint32_t state_[2] = {kRansLow, kRansLow};
  std::vector<uint16_t> words_;
};

}  // namespace wsync::codec::internal
