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
// The coder's decisions and steps are written once for the host and the
// device: wsync/codec/sparse_encode.h (BitOut, ChooseTable, RansPut) and,
// for the decoder, wsync/codec/sparse_decode.h (BitIn, ReadTable, RansIn).
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
#include "wsync/codec/sparse_encode.h"

namespace wsync::codec::internal {

// The coder's constants are the format's (sparse_decode.h decodes the same
// streams on the device).
inline constexpr int kRansSymbols = sparse::kSymbols;
inline constexpr int kRansPrecision = sparse::kPrecision;  // tables scale to sum 2^10
inline constexpr uint32_t kRansScale = sparse::kScale;
inline constexpr uint32_t kRansLow = sparse::kLow;  // states live in [2^16, 2^32)

// ------------------------------------------------------------ bit stream

using sparse::GammaBits;

// A growing bit stream (sparse::BitOut's format: least significant first).
class BitWriter {
 public:
  // The fields of a coding loop: a local cursor keeps its pending bits and
  // its place in registers (the writer's own members would be reloaded after
  // every store to the buffer, which may alias them).
  using Cursor = sparse::BitOut;

  // A cursor with room for max_bits more bits; Close it before any other
  // use of the writer.
  Cursor Open(size_t max_bits) {
    const size_t byte = static_cast<size_t>(pos_ >> 3);
    const size_t need = byte + max_bits / 8 + 16;
    if (need > buf_.size()) buf_.resize(std::max(need, 2 * buf_.size()), 0);
    const int fill = static_cast<int>(pos_ & 7);
    open_byte_ = byte;
    return Cursor(buf_.data() + byte, buf_.size() - byte, fill == 0 ? 0 : buf_[byte] & ((1u << fill) - 1), fill);
  }
  void Close(Cursor& c) {
    pos_ = uint64_t{open_byte_} * 8 + c.bits();
    c.Close();
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
  size_t open_byte_ = 0;
};

// ---------------------------------------------------------------- tables

using RansEncSymbol = sparse::EncSymbol;

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

// The sparse coder's log2 table (sparse::kLog2Table).
inline const uint32_t* RansLog2() { return sparse::kLog2Table.data(); }

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
    sparse::RansPut(x, s, *out);
  }

  uint32_t state_[2] = {kRansLow, kRansLow};
  std::vector<uint16_t> words_;
};

}  // namespace wsync::codec::internal
