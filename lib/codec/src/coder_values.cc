// Values (docs/patch-format.md "Values"): one rANS symbol per delta, with
// tables per class, and the bits that refine the larger ones.
#include "chunk_coders.h"

#include <algorithm>
#include <memory>

namespace wsync::codec::internal {
template <typename T>
void PrepareValues(const SparseDelta<T>& d, const std::vector<uint8_t>& cls, CoderScratch* scratch) {
  const size_t m = d.pos.size();
  scratch->value_sym.resize(m);
  uint8_t* sym = scratch->value_sym.data();
  // Two histograms take alternate changes: runs of one symbol (nearly every
  // change is +-1) then do not chain their increments through memory.
  uint32_t counts[2][kMaxClasses][kRansSymbols] = {};
  for (size_t i = 0; i < m; ++i) {
    sym[i] = static_cast<uint8_t>(sparse::ValueSymbol(d.delta[i]));
    ++counts[i & 1][cls[i]][sym[i]];
  }
  PendingStream& out = scratch->values;
  out.bits.Clear();
  bool refined = false;  // a symbol with bits occurs
  for (int c = 0; c < kMaxClasses; ++c) {
    uint32_t* both = counts[0][c];
    for (int v = 0; v < kRansSymbols; ++v) both[v] += counts[1][c][v];
    if (std::any_of(both, both + kRansSymbols, [](uint32_t v) { return v > 0; })) {
      out.tables[c] = ChooseRansTable(both, &out.bits);
    }
    refined = refined || std::any_of(both + kValueFirstWithBits, both + kRansSymbols, [](uint32_t v) { return v > 0; });
  }
  if (refined) {
    // At most a sign and a gamma code (1 + 127 bits) per change.
    BitWriter::Cursor fields = out.bits.Open(m * 128);
    for (size_t i = 0; i < m; ++i) {
      if (sym[i] < kValueFirstWithBits) continue;  // |d| <= 5: nearly every change at RL rates
      sparse::PutValueBits(d.delta[i], sym[i], fields);
    }
    out.bits.Close(fields);
  }
}

bool RansSpanOf(std::string_view stream, sparse::RansSpan* span) {
  ByteReader r(stream, "rANS stream");
  uint64_t count = 0;
  if (!r.Varint(&count, "word count") || count < 4 || count > stream.size() / 2) return false;
  std::string_view words;
  if (!r.Bytes(static_cast<size_t>(count) * 2, &words, "words")) return false;
  const std::string_view bits = stream.substr(r.position());
  *span = {reinterpret_cast<const uint8_t*>(words.data()), count, reinterpret_cast<const uint8_t*>(bits.data()),
           bits.size()};
  return true;
}

template <typename T>
Status DecodeValues(std::string_view stream, const std::vector<uint8_t>& cls, SparseDelta<T>* out) {
  const size_t m = out->pos.size();
  sparse::RansSpan span;
  if (!RansSpanOf(stream, &span)) return DataLossError("value stream: malformed word count");
  out->delta.resize(m);
  // The same agent the device runs, with the host's slot lookup.
  auto tables = std::make_unique_for_overwrite<sparse::SlotTables>();  // filled where used
  const uint8_t* c = cls.data();
  const sparse::SparseResult r =
      sparse::DecodeSparseValuesOf<T>(span, m, [c](uint64_t i) { return c[i]; }, out->delta.data(), tables.get());
  switch (r.code) {
    case sparse::kSparseOk: return Status::Ok();
    case sparse::kBadTable: return DataLossError("value stream: class " + std::to_string(r.cls) + ": bad table");
    case sparse::kDeltaRange: return DataLossError("value stream: delta " + std::to_string(r.at) + " out of range");
    default: return DataLossError("value stream: truncated or corrupt");
  }
}

#define WSYNC_INSTANTIATE(T) \
  template void PrepareValues<T>(const SparseDelta<T>&, const std::vector<uint8_t>&, CoderScratch*); \
  template Status DecodeValues<T>(std::string_view, const std::vector<uint8_t>&, SparseDelta<T>*);

WSYNC_FOR_EACH_WIDTH(WSYNC_INSTANTIATE)
#undef WSYNC_INSTANTIATE

}  // namespace wsync::codec::internal
