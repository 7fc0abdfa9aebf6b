// The stream coders of a chunk (private): each coder_*.cc holds one coder
// of docs/patch-format.md "Chunk streams" (classes, values, sparse
// positions, runs, bitmap, byte planes); chunk_codec.cc chooses among them
// and runs the stages. What they share: the encoder's per-thread scratch,
// the value symbols and the classes of changes.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "block_ops.h"
#include "chunk_codec.h"
#include "rans.h"
#include "wsync/util/bytes.h"

namespace wsync::codec::internal {

template <typename T>
constexpr int kBits = static_cast<int>(sizeof(T) * 8);

// Applies M to every element type the coders are instantiated for (one per
// width).
#define WSYNC_FOR_EACH_WIDTH(M) M(uint8_t) M(uint16_t) M(uint32_t) M(uint64_t)

// A stream ready for its rANS pass: the tables its symbols code with and
// the bits that follow the rANS words (the symbols are the caller's).
struct PendingStream {
  RansTable tables[kMaxClasses];
  BitWriter bits;
  RansEncoder rans;
  // The stream: its rANS words (the symbols encoded into `rans`), then bits.
  void AppendTo(std::string* out) {
    rans.Finish(out);
    bits.AppendTo(out);
  }
};

// What the host encoder codes a chunk's change with, one per thread: its
// buffers keep their capacity from one chunk to the next, so that a chunk's
// coding neither allocates nor faults in fresh pages once its thread has
// coded one as large (a page fault costs more than coding its page's
// changes). Held until the thread exits: about 1 MB per worker at RL change
// rates (1-2%), up to about 25 MB after a fully changed 1 MiB chunk (the
// bit writers size for the longest codes).
struct CoderScratch {
  std::vector<uint8_t> value_sym;                // change i's symbol, in position order
  std::vector<uint32_t> gaps;                    // class after class
  std::vector<const RansEncSymbol*> gap_coded;   // gap i's table entry
  PendingStream values, positions;
};

CoderScratch& ThreadCoderScratch();

// ---- classes (coder_classes.cc)

void WriteClassHeader(const ClassSpec& spec, std::string* out);
// Parses the class header at the front of a position stream; *rest is what
// follows it.
bool ReadClassHeader(std::string_view stream, ExponentField ef, ClassSpec* spec, std::string_view* rest,
                     ByteReader* r);

// Classes of m changes from their old values old_of(i) (all 0 when
// unconditioned).
template <typename OldOf>
void ClassesInto(size_t m, const ClassSpec& spec, OldOf&& old_of, std::vector<uint8_t>* cls) {
  cls->assign(m, 0);
  if (spec.k > 1) {
    const std::vector<uint8_t> class_of = ClassTable(spec);
    for (size_t i = 0; i < m; ++i) (*cls)[i] = class_of[spec.Exponent(old_of(i))];
  }
}

template <typename T>
std::vector<uint8_t> ClassesOf(const T* old, size_t m, const ClassSpec& spec) {
  std::vector<uint8_t> cls;
  ClassesInto(m, spec, [old](size_t i) { return old[i]; }, &cls);
  return cls;
}

// ---- values (coder_values.cc)

// A delta's symbol and bits: sparse_encode.h (ValueSymbol, PutValueBits).
using sparse::kValueEscape;
using sparse::kValueFirstWithBits;

// Prepares a chunk's value stream: each change's symbol (value_sym; coded
// with its class's table) and the bits that refine the rarer, larger ones.
template <typename T>
void PrepareValues(const SparseDelta<T>& d, const std::vector<uint8_t>& cls, CoderScratch* scratch);
// Where a rANS stream's words and bits lie (its word count parsed); false
// for a malformed count.
bool RansSpanOf(std::string_view stream, sparse::RansSpan* span);
// Decodes the deltas of out->pos.size() changes of these classes.
template <typename T>
Status DecodeValues(std::string_view stream, const std::vector<uint8_t>& cls, SparseDelta<T>* out);

// ---- sparse positions (coder_sparse.cc)

// The ranks of a chunk's changes grouped by class: class c's, ascending,
// are rank[c][0 .. count[c]).
struct ClassRanks {
  const uint32_t* rank[kMaxClasses] = {};
  size_t count[kMaxClasses] = {};
};

// Groups ranks given in position order by the changes' classes into *storage.
ClassRanks GroupRanks(const std::vector<uint8_t>& cls, const uint32_t* rank, std::vector<uint32_t>* storage);
// Prepares a sparse chunk's position stream: its class header goes to *out,
// each gap's table entry to gap_coded (class after class), and the bits.
void PreparePositions(const ClassRanks& ranks, const ClassSpec& spec, CoderScratch* scratch, std::string* out);
// Decodes the per-class ranks of a sparse chunk; positions follow from
// them alone when k == 1, else from the base (ResolveRanks).
Status DecodeSparseRanks(std::string_view coded, size_t n, uint64_t changed, ChunkPositions* out);

// ---- run positions (coder_runs.cc)

size_t CountRuns(const std::vector<uint32_t>& pos);
void EncodeRunPositions(const std::vector<uint32_t>& pos, const ClassSpec& spec, std::string* out);
Status DecodeRunPositions(std::string_view coded, size_t n, uint64_t changed, std::vector<uint32_t>* pos);

// ---- bitmap positions (coder_bitmap.cc)

void EncodeBitmapPositions(const std::vector<uint32_t>& pos, size_t n, const ClassSpec& spec, int zstd_level,
                           std::string* out);
Status DecodeBitmapPositions(std::string_view coded, size_t n, uint64_t changed, std::vector<uint32_t>* pos);

// ---- byte planes: dense chunks and keyframes (coder_planes.cc)

template <typename T>
void EncodeDense(const SparseDelta<T>& d, size_t n, int zstd_level, std::string* out);
template <typename T>
Status DecodeDense(std::string_view coded, size_t n, uint64_t changed, SparseDelta<T>* out);

}  // namespace wsync::codec::internal
