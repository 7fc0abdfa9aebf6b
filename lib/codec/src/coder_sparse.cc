// Sparse positions (docs/patch-format.md "Sparse positions"): per-class gaps
// between ranks as rANS symbols and bits; ranks to positions over the base.
#include "chunk_coders.h"

#include <algorithm>
#include <array>
#include <bit>
#include <memory>

#include "sweep.h"

namespace wsync::codec::internal {
namespace {

// Gaps and their symbols: sparse_encode.h (GapSymbol, PutGapBits,
// ChooseShift), the device's encoder's own functions.
using sparse::kGapEscape;

// GapSymbol of quotients below 128 (else the escape), looked up.
constexpr std::array<uint8_t, 128> kGapSymbol = [] {
  std::array<uint8_t, 128> t{};
  for (int q = 0; q < 128; ++q) t[q] = static_cast<uint8_t>(sparse::GapSymbol(static_cast<uint64_t>(q)));
  return t;
}();

uint8_t GapSymbol(uint64_t q) { return q < 128 ? kGapSymbol[q] : kGapEscape; }

// A class's gaps by sparse::GapBin.
struct GapHistogram {
  uint32_t n[sparse::kGapBins] = {};
};

// Elements of class c in a chunk (for error messages).
template <typename T>
size_t ClassSize(const T* base, size_t n, const ClassSpec& spec, int c) {
  size_t count = 0;
  for (size_t i = 0; i < n; ++i) count += spec.ClassOf(base[i]) == c;
  return count;
}

// Per-class ranks of the changed positions (ascending, below n), by
// sweeping the class masks of every 64-element word, segment by segment.
// Running counts: total elements, and elements reaching each threshold; a
// class's count before an element is the difference of neighbours.
template <int K, typename T>
void RanksByClassK(const T* base, size_t n, const std::vector<uint32_t>& pos, const ClassSpec& spec,
                   std::vector<uint32_t>* rank) {
  constexpr size_t kSegmentWords = kSweepSegment / kWord;
  const WordMasker<T> masker(spec);
  auto ge = std::make_unique_for_overwrite<WordGe[]>(kSegmentWords);
  uint32_t total = 0;
  uint32_t reach[K - 1] = {};
  size_t i = 0;
  for (size_t seg = 0; seg < n && i < pos.size(); seg += kSegmentWords * kWord) {
    const size_t seg_n = std::min(n - seg, kSegmentWords * kWord);
    masker.template Run<K, false>(base + seg, nullptr, seg_n, nullptr, ge.get());
    for (size_t w = 0; w * kWord < seg_n; ++w) {
      const size_t first = seg + w * kWord;
      const uint64_t valid = WordValid(seg_n, w);
      const uint64_t* g = ge[w];
      for (; i < pos.size() && pos[i] < first + kWord; ++i) {
        const int j = static_cast<int>(pos[i] - first);
        const uint64_t below = (uint64_t{1} << j) - 1;
        int c = 0;
        while (c < K - 1 && ((g[c] >> j) & 1)) ++c;
        const uint32_t upper = c == 0 ? total + std::popcount(valid & below) : reach[c - 1] + std::popcount(g[c - 1] & below);
        const uint32_t lower = c == K - 1 ? 0u : reach[c] + std::popcount(g[c] & below);
        (*rank)[i] = upper - lower;
      }
      total += static_cast<uint32_t>(std::popcount(valid));
      for (int t = 0; t < K - 1; ++t) reach[t] += static_cast<uint32_t>(std::popcount(g[t]));
    }
  }
}

}  // namespace

// Groups ranks given in position order by the changes' classes (a counting
// sort: class after class, each in position order) into *storage.
ClassRanks GroupRanks(const std::vector<uint8_t>& cls, const uint32_t* rank, std::vector<uint32_t>* storage) {
  ClassRanks g;
  for (uint8_t c : cls) ++g.count[c];
  storage->resize(cls.size());
  size_t fill[kMaxClasses];
  for (size_t c = 0, start = 0; c < kMaxClasses; start += g.count[c++]) {
    fill[c] = start;
    g.rank[c] = storage->data() + start;
  }
  for (size_t i = 0; i < cls.size(); ++i) (*storage)[fill[cls[i]]++] = rank[i];
  return g;
}

// Prepares a sparse chunk's position stream: its class header goes to *out,
// each gap's table entry to gap_coded (class after class), and the bits.
void PreparePositions(const ClassRanks& ranks, const ClassSpec& spec, CoderScratch* scratch, std::string* out) {
  WriteClassHeader(spec, out);
  // Each class's gaps (class after class), sum and histogram. Within a
  // class nothing carries from one change to the next but its rank, and
  // two histograms take alternate gaps, so that runs of gaps in one bin do
  // not chain their increments.
  size_t start[kMaxClasses + 1] = {};
  for (int c = 0; c < kMaxClasses; ++c) start[c + 1] = start[c] + ranks.count[c];
  std::vector<uint32_t>& gaps = scratch->gaps;
  gaps.resize(start[kMaxClasses]);
  uint64_t sum[kMaxClasses] = {};
  auto hist = std::make_unique<GapHistogram[]>(2 * static_cast<size_t>(spec.k));
  for (int c = 0; c < spec.k; ++c) {
    const uint32_t* r = ranks.rank[c];
    uint32_t* g = gaps.data() + start[c];
    GapHistogram& even = hist[2 * c];
    GapHistogram& odd = hist[2 * c + 1];
    uint64_t total = 0;
    const size_t count = ranks.count[c];
    for (size_t i = 0; i < count; ++i) {
      g[i] = r[i] - (i == 0 ? 0 : r[i - 1] + 1);
      total += g[i];
      ++(i % 2 ? odd : even).n[sparse::GapBin(g[i])];
    }
    for (int b = 0; b < sparse::kGapBins; ++b) even.n[b] += odd.n[b];
    sum[c] = total;
  }

  PendingStream& stream = scratch->positions;
  BitWriter& bits = stream.bits;
  bits.Clear();
  for (int c = 0; c < spec.k; ++c) bits.PutGamma(ranks.count[c]);
  int shift[kMaxClasses] = {};
  RansTable* tables = stream.tables;
  for (int c = 0; c < spec.k; ++c) {
    const size_t count = ranks.count[c];
    if (count == 0) continue;
    const uint32_t* g = gaps.data() + start[c];
    const sparse::ShiftChoice sc =
        sparse::ChooseShift(hist[2 * c].n, count, sum[c], [g](size_t j) { return g[j]; }, RansLog2());
    shift[c] = sc.shift;
    bits.Put(static_cast<uint64_t>(shift[c]), 5);
    tables[c] = ChooseRansTable(sc.counts, &bits);
  }
  // The refining bits in order, and each gap's rANS symbol with its table.
  std::vector<const RansEncSymbol*>& coded = scratch->gap_coded;
  coded.resize(gaps.size());
  // At most a gamma code (127 bits) and r <= 31 low bits per gap.
  BitWriter::Cursor fields = bits.Open(gaps.size() * 160);
  for (int c = 0; c < spec.k; ++c) {
    const int r = shift[c];
    const RansEncSymbol* enc = tables[c].enc.data();
    for (size_t i = start[c]; i < start[c + 1]; ++i) {
      const uint64_t g = gaps[i];
      const uint64_t q = g >> r;
      const uint8_t s = GapSymbol(q);
      coded[i] = enc + s;
      sparse::PutGapBits(g, r, s, fields);
    }
  }
  bits.Close(fields);
}

// Decodes the per-class ranks of a sparse chunk; positions follow from
// them alone when k == 1, else from the base (ResolveRanks).
Status DecodeSparseRanks(std::string_view coded, size_t n, uint64_t changed, ChunkPositions* out) {
  const ClassSpec& spec = out->spec;
  sparse::RansSpan span;
  if (!RansSpanOf(coded, &span)) return DataLossError("position stream: malformed word count");
  uint64_t counts[kMaxClasses] = {};
  out->ranks.resize(changed);
  // The same agent the device runs, with the host's slot lookup.
  auto tables = std::make_unique_for_overwrite<sparse::SlotTables>();  // filled where used
  const sparse::SparseResult r = sparse::DecodeSparseRanks(span, n, changed, spec.k, counts, out->ranks.data(), tables.get());
  switch (r.code) {
    case sparse::kSparseOk: break;
    case sparse::kBadClassCounts:
      if (r.cls < spec.k) {
        return DataLossError("position stream: class " + std::to_string(r.cls) + " count exceeds the " +
                             std::to_string(changed) + " changed elements");
      }
      return DataLossError("position stream: class counts sum to " + std::to_string(r.sum) + ", directory says " +
                           std::to_string(changed));
    case sparse::kBadTable:
      return DataLossError("position stream: class " + std::to_string(r.cls) + ": bad table");
    case sparse::kGapOverrun:
      return DataLossError("position stream: class " + std::to_string(r.cls) + " gap " + std::to_string(r.at) +
                           " overruns the chunk of " + std::to_string(n) + " elements");
    default: return DataLossError("position stream: truncated or corrupt");
  }
  if (spec.k == 1) {
    out->pos = std::move(out->ranks);
    out->ranks.clear();
    out->class_counts.clear();
    return Status::Ok();
  }
  out->class_counts.assign(counts, counts + spec.k);
  out->ranked = true;
  return Status::Ok();
}

template <typename T>
Status ResolveRanks(const T* base, size_t n, ChunkPositions* cp) {
  if (!cp->ranked) return Status::Ok();
  const ClassSpec& spec = cp->spec;
  // The ranks are stored class after class.
  std::vector<const uint32_t*> ranks(spec.k);
  const uint32_t* next = cp->ranks.data();
  for (int c = 0; c < spec.k; ++c) {
    ranks[c] = next;
    next += cp->class_counts[c];
  }
  std::vector<uint64_t> done(spec.k);
  cp->pos.resize(cp->ranks.size() + 2);
  const size_t found =
      ResolveRankSweep(base, n, spec, ranks.data(), cp->class_counts.data(), cp->pos.data(), done.data());
  cp->pos.resize(found);
  if (found != cp->ranks.size()) {
    for (int c = 0; c < spec.k; ++c) {
      if (done[c] < cp->class_counts[c]) {
        return DataLossError("position stream: class " + std::to_string(c) + " rank " +
                             std::to_string(ranks[c][done[c]]) + " beyond its " +
                             std::to_string(ClassSize(base, n, spec, c)) + " elements");
      }
    }
    return DataLossError("position stream: ranks beyond their classes");
  }
  cp->ranked = false;
  cp->ranks.clear();
  cp->class_counts.clear();
  return Status::Ok();
}

template <typename T>
void RanksByClass(const T* base, size_t n, const std::vector<uint32_t>& pos, const ClassSpec& spec,
                  std::vector<uint32_t>* rank) {
  rank->assign(pos.size(), 0);
  static_assert(kMaxClasses == 8);
  switch (spec.k) {
    case 1: std::copy(pos.begin(), pos.end(), rank->begin()); return;
    case 2: return RanksByClassK<2>(base, n, pos, spec, rank);
    case 3: return RanksByClassK<3>(base, n, pos, spec, rank);
    case 4: return RanksByClassK<4>(base, n, pos, spec, rank);
    case 5: return RanksByClassK<5>(base, n, pos, spec, rank);
    case 6: return RanksByClassK<6>(base, n, pos, spec, rank);
    case 7: return RanksByClassK<7>(base, n, pos, spec, rank);
    default: return RanksByClassK<8>(base, n, pos, spec, rank);
  }
}

Status LocateSparseStreams(std::string_view pos, std::string_view val, ExponentField exponent,
                           sparse::ChunkStreams* out) {
  ByteReader r(pos, "position stream");
  std::string_view coded;
  if (!ReadClassHeader(pos, exponent, &out->spec, &coded, &r)) return r.status();
  if (!RansSpanOf(coded, &out->pos)) return DataLossError("position stream: malformed word count");
  if (!RansSpanOf(val, &out->val)) return DataLossError("value stream: malformed word count");
  return Status::Ok();
}

#define WSYNC_INSTANTIATE(T) \
  template Status ResolveRanks<T>(const T*, size_t, ChunkPositions*); \
  template void RanksByClass<T>(const T*, size_t, const std::vector<uint32_t>&, const ClassSpec&, std::vector<uint32_t>*);

WSYNC_FOR_EACH_WIDTH(WSYNC_INSTANTIATE)
#undef WSYNC_INSTANTIATE

}  // namespace wsync::codec::internal
