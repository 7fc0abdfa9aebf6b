// The chunk codec: the diff, the class choice, the mode choice among the
// stream coders (chunk_coders.h) and the staged encode and decode of
// chunk_codec.h.
#include "chunk_codec.h"

#include <algorithm>
#include <memory>

#include "chunk_coders.h"
#include "sweep.h"

namespace wsync::codec::internal {

CoderScratch& ThreadCoderScratch() {
  static thread_local CoderScratch scratch;
  return scratch;
}

template <typename T>
void DiffChunk(const T* base, const T* target, size_t n, SparseDelta<T>* out) {
  const size_t full = n / kBlock * kBlock;
  for (size_t b = 0; b < full; b += kBlock) {
    if (BlockEqual(base + b, target + b)) continue;
    uint32_t m = NeMask(base + b, target + b);
    while (m != 0) {
      const size_t i = b + std::countr_zero(m);
      out->pos.push_back(static_cast<uint32_t>(i));
      out->delta.push_back(static_cast<T>(target[i] - base[i]));
      m &= m - 1;
    }
  }
  for (size_t i = full; i < n; ++i) {
    if (base[i] != target[i]) {
      out->pos.push_back(static_cast<uint32_t>(i));
      out->delta.push_back(static_cast<T>(target[i] - base[i]));
    }
  }
}

size_t SampledElements(size_t n) {
  const size_t blocks = n / kBlock;
  return (blocks + kSampleStride - 1) / kSampleStride * kBlock;
}

template <typename T>
void SampleHistogram(const T* base, size_t n, ExponentField exponent, uint32_t* hist) {
  std::fill(hist, hist + size_t{exponent.mask} + 1, 0u);
  if (exponent.mask == 0) return;
  ClassSpec spec;
  spec.shift = exponent.shift;
  spec.mask = exponent.mask;
  // Eight interleaved histograms, element j of a group of eight counting in
  // the j-th: runs of equal exponents (the common case) would otherwise
  // wait on each other's increments.
  constexpr int kParts = 8;
  static_assert(kBlock % kParts == 0);
  const size_t bins = size_t{exponent.mask} + 1;
  std::vector<uint32_t> part(kParts * bins, 0);
  const size_t blocks = n / kBlock;
  for (size_t b = 0; b < blocks; b += kSampleStride) {
    const T* x = base + b * kBlock;
    for (int j = 0; j < kBlock; j += kParts) {
#pragma GCC unroll 8
      for (int k = 0; k < kParts; ++k) ++part[k * bins + spec.Exponent(x[j + k])];
    }
  }
  for (size_t e = 0; e < bins; ++e) {
    uint32_t sum = 0;
    for (int k = 0; k < kParts; ++k) sum += part[k * bins + e];
    hist[e] = sum;
  }
}

bool NeedsRanks(size_t n, size_t m, const ClassSpec& spec) { return m > 0 && m * 2 <= n && spec.k > 1; }

// The smallest of the modes the change is weighed in, given its value
// stream and, when sparse mode is tried (m * 2 <= n), its sparse position
// stream: runs, a bitmap and byte planes are coded here as the change calls
// for them, and the first of the smallest wins.
template <typename T>
EncodedChunk ChooseMode(size_t n, const SparseDelta<T>& d, const ClassSpec& spec, int zstd_level, std::string sparse,
                        std::string val) {
  EncodedChunk best;
  const size_t m = d.pos.size();
  best.changed = m;
  if (m == 0) return best;
  const size_t runs = CountRuns(d.pos);
  const bool try_sparse = m * 2 <= n;
  const bool try_runs = runs * 4 <= m || !try_sparse;
  const bool try_bitmap = m * 32 > n;
  const bool try_dense = m * 4 > n;
  size_t best_size = 0;
  auto consider = [&](ChunkMode mode, std::string pos, size_t val_size) {
    if (best.mode == ChunkMode::kEmpty || pos.size() + val_size < best_size) {
      best.mode = mode;
      best.pos = std::move(pos);
      best_size = best.pos.size() + val_size;
    }
  };
  if (try_sparse) consider(ChunkMode::kSparse, std::move(sparse), val.size());
  if (try_runs) {
    std::string pos;
    EncodeRunPositions(d.pos, spec, &pos);
    consider(ChunkMode::kRuns, std::move(pos), val.size());
  }
  if (try_bitmap) {
    std::string pos;
    EncodeBitmapPositions(d.pos, n, spec, zstd_level, &pos);
    consider(ChunkMode::kBitmap, std::move(pos), val.size());
  }
  if (try_dense) {
    std::string pos;
    EncodeDense(d, n, zstd_level, &pos);
    consider(ChunkMode::kDense, std::move(pos), 0);
  }
  if (best.mode != ChunkMode::kDense) best.val = std::move(val);
  return best;
}

namespace {

// Codes the change in the smallest mode, from each change's class (in
// position order) and, when sparse mode is tried (m * 2 <= n), the ranks
// grouped by class.
template <typename T>
EncodedChunk EncodeChunkCoded(size_t n, const SparseDelta<T>& d, const std::vector<uint8_t>& cls,
                              const ClassRanks& ranks, const ClassSpec& spec, int zstd_level) {
  const size_t m = d.pos.size();
  if (m == 0) return EncodedChunk{};
  // Every mode but dense codes the values in the same stream.
  CoderScratch& scratch = ThreadCoderScratch();
  PrepareValues(d, cls, &scratch);
  PendingStream& values = scratch.values;
  const uint8_t* sym = scratch.value_sym.data();
  auto value_symbol = [&](size_t i) -> const RansEncSymbol& { return values.tables[cls[i]].enc[sym[i]]; };
  std::string val, sparse;
  if (m * 2 <= n) {
    // Both streams' rANS passes at once (their dependency chains overlap).
    PreparePositions(ranks, spec, &scratch, &sparse);
    const RansEncSymbol* const* gap = scratch.gap_coded.data();
    RansEncoder::EncodePair(&values.rans, m, value_symbol, &scratch.positions.rans, scratch.gap_coded.size(),
                            [&](size_t i) -> const RansEncSymbol& { return *gap[i]; });
    scratch.positions.AppendTo(&sparse);
  } else {
    values.rans.Encode(m, value_symbol);
  }
  values.AppendTo(&val);
  return ChooseMode(n, d, spec, zstd_level, std::move(sparse), std::move(val));
}

// One class: the positions are the ranks.
ClassRanks PositionsAsRanks(const std::vector<uint32_t>& pos) {
  ClassRanks g;
  g.rank[0] = pos.data();
  g.count[0] = pos.size();
  return g;
}

}  // namespace

template <typename T>
EncodedChunk EncodeChunkStaged(size_t n, const SparseDelta<T>& d, const T* old, const ClassSpec& spec,
                               const uint32_t* rank, int zstd_level) {
  const size_t m = d.pos.size();
  const std::vector<uint8_t> cls = ClassesOf(old, m, spec);
  std::vector<uint32_t> grouped;
  const ClassRanks ranks = !NeedsRanks(n, m, spec) ? PositionsAsRanks(d.pos) : GroupRanks(cls, rank, &grouped);
  return EncodeChunkCoded(n, d, cls, ranks, spec, zstd_level);
}

namespace {

// The base's values at the given positions.
template <typename T>
std::vector<T> GatherAt(const T* base, const std::vector<uint32_t>& pos) {
  std::vector<T> out(pos.size());
  for (size_t i = 0; i < pos.size(); ++i) out[i] = base[pos[i]];
  return out;
}

// ChooseClasses on the base's sampled histogram.
template <typename T>
ClassSpec ChooseClassesOnBase(const T* base, size_t n, const SparseDelta<T>& evidence, const T* old,
                              const ChunkCodecOptions& options) {
  std::vector<uint32_t> hist(size_t{options.exponent.mask} + 1);
  SampleHistogram(base, n, options.exponent, hist.data());
  return ChooseClasses(n, hist.data(), evidence, old, options);
}

}  // namespace

template <typename T>
EncodedChunk EncodeChunk(const T* base, size_t n, const SparseDelta<T>& d,
                         const ChunkCodecOptions& options) {
  if (d.pos.empty()) return EncodedChunk{};
  const bool conditioned = base != nullptr && options.condition && options.exponent.mask != 0;
  const std::vector<T> old = conditioned ? GatherAt(base, d.pos) : std::vector<T>();
  const ClassSpec spec = conditioned ? ChooseClassesOnBase(base, n, d, old.data(), options)
                                     : ChooseClasses<T>(n, nullptr, d, nullptr, options);
  std::vector<uint32_t> rank;
  if (NeedsRanks(n, d.pos.size(), spec)) RanksByClass(base, n, d.pos, spec, &rank);
  return EncodeChunkStaged(n, d, old.empty() ? nullptr : old.data(), spec, rank.data(), options.zstd_level);
}

template <typename T>
ClassSpec ChooseChunkClasses(const T* base, const T* target, size_t n, const ChunkCodecOptions& options) {
  if (!options.condition || options.exponent.mask == 0) {
    return ChooseClasses<T>(n, nullptr, SparseDelta<T>{}, nullptr, options);  // unconditioned
  }
  SparseDelta<T> evidence;
  std::vector<T> old;
  if (ClassesFromSampledChanges(n)) {
    SampleChanges(base, target, n, &evidence, &old);
  } else {
    // A small chunk (in cache): every change, then the sweep.
    DiffChunk(base, target, n, &evidence);
    old = GatherAt(base, evidence.pos);
  }
  return ChooseClassesOnBase(base, n, evidence, old.data(), options);
}

template <typename T>
EncodedChunk EncodeChunkPair(const T* base, const T* target, size_t n, const ChunkCodecOptions& options,
                             const ClassSpec* classes, const std::function<void(size_t, size_t)>& segment_done) {
  const ClassSpec spec = classes != nullptr ? *classes : ChooseChunkClasses(base, target, n, options);
  // The sweep's output, like the coder's scratch, is the thread's own and
  // keeps its capacity from chunk to chunk (see CoderScratch).
  static thread_local ChunkSweep<T> sweep;
  SweepChunk(base, target, n, spec, &sweep, segment_done);
  if (sweep.d.pos.empty()) return EncodedChunk{};
  if (spec.k == 1) {
    return EncodeChunkCoded(n, sweep.d, std::vector<uint8_t>(sweep.d.pos.size(), 0), PositionsAsRanks(sweep.d.pos),
                            spec, options.zstd_level);
  }
  ClassRanks ranks;
  for (int c = 0; c < spec.k; ++c) {
    ranks.rank[c] = sweep.rank[c].data();
    ranks.count[c] = sweep.rank[c].size();
  }
  return EncodeChunkCoded(n, sweep.d, sweep.cls, ranks, spec, options.zstd_level);
}

template <typename T>
Status DecodeChunkPositions(ChunkMode mode, uint64_t changed, std::string_view pos, std::string_view val,
                            size_t n, ExponentField exponent, ChunkPositions* cp, SparseDelta<T>* out) {
  cp->Clear();  // not replaced: a reused cp keeps its buffers' capacity
  out->Clear();
  if (changed > n) {
    return DataLossError(std::to_string(changed) + " changed elements in a chunk of " + std::to_string(n));
  }
  switch (mode) {
    case ChunkMode::kEmpty:
      if (changed != 0 || !pos.empty() || !val.empty()) {
        return DataLossError("empty chunk with changes or streams");
      }
      return Status::Ok();
    case ChunkMode::kDense:
      if (!val.empty()) return DataLossError("dense chunk with a value stream");
      return DecodeDense(pos, n, changed, out);
    case ChunkMode::kSparse:
    case ChunkMode::kRuns:
    case ChunkMode::kBitmap:
      break;
    default:
      return DataLossError("unknown chunk mode " + std::to_string(static_cast<int>(mode)));
  }
  if (changed == 0) return DataLossError("non-empty chunk mode with no change");
  ByteReader r(pos, "position stream");
  std::string_view coded;
  if (!ReadClassHeader(pos, exponent, &cp->spec, &coded, &r)) return r.status();
  cp->values_pending = true;
  if (mode == ChunkMode::kSparse) return DecodeSparseRanks(coded, n, changed, cp);
  if (mode == ChunkMode::kRuns) return DecodeRunPositions(coded, n, changed, &cp->pos);
  return DecodeBitmapPositions(coded, n, changed, &cp->pos);
}

template <typename T>
Status DecodeChunkValues(std::string_view val, const ChunkPositions& cp, const T* old, SparseDelta<T>* out) {
  if (!cp.values_pending) return Status::Ok();
  if (cp.ranked) return FailedPreconditionError("chunk positions are still ranks; resolve them first");
  if (cp.spec.k > 1 && old == nullptr) {
    return FailedPreconditionError("chunk is coded relative to the base's exponents; the base is needed");
  }
  out->pos = cp.pos;
  return DecodeValues(val, ClassesOf(old, cp.pos.size(), cp.spec), out);
}

template <typename T>
Status DecodeChunk(ChunkMode mode, uint64_t changed, std::string_view pos, std::string_view val,
                   const T* base, size_t n, ExponentField exponent, SparseDelta<T>* out) {
  // The thread's own, kept from chunk to chunk (like the encoder's
  // CoderScratch): the ranks' and classes' buffers keep their capacity.
  static thread_local ChunkPositions cp;
  static thread_local std::vector<uint8_t> cls;
  WSYNC_RETURN_IF_ERROR(DecodeChunkPositions(mode, changed, pos, val, n, exponent, &cp, out));
  if (!cp.values_pending) return Status::Ok();
  if (cp.spec.k > 1) {
    if (base == nullptr) {
      return FailedPreconditionError("chunk is coded relative to the base's exponents; the base is needed");
    }
    WSYNC_RETURN_IF_ERROR(ResolveRanks(base, n, &cp));
  }
  // The classes straight from the base (DecodeChunkValues's work without a
  // gathered copy of the old values, or of the positions).
  const uint32_t* at = cp.pos.data();
  ClassesInto(cp.pos.size(), cp.spec, [base, at](size_t i) { return base[at[i]]; }, &cls);
  out->pos = std::move(cp.pos);
  return DecodeValues(val, cls, out);
}

bool ChunkNeedsBase(ChunkMode mode, std::string_view pos) {
  if (mode != ChunkMode::kSparse && mode != ChunkMode::kRuns && mode != ChunkMode::kBitmap) return false;
  return !pos.empty() && static_cast<uint8_t>(pos[0]) > 1;
}

template <typename T>
void ScatterAdd(T* x, const SparseDelta<T>& d) {
  const size_t m = d.pos.size();
  for (size_t i = 0; i < m; ++i) x[d.pos[i]] = static_cast<T>(x[d.pos[i]] + d.delta[i]);
}

#define WSYNC_INSTANTIATE(T) \
   template void DiffChunk<T>(const T*, const T*, size_t, SparseDelta<T>*); \
   template void SampleHistogram<T>(const T*, size_t, ExponentField, uint32_t*); \
   template EncodedChunk EncodeChunkStaged<T>(size_t, const SparseDelta<T>&, const T*, const ClassSpec&, const uint32_t*, int); \
   template EncodedChunk ChooseMode<T>(size_t, const SparseDelta<T>&, const ClassSpec&, int, std::string, std::string); \
   template EncodedChunk EncodeChunk<T>(const T*, size_t, const SparseDelta<T>&, const ChunkCodecOptions&); \
   template ClassSpec ChooseChunkClasses<T>(const T*, const T*, size_t, const ChunkCodecOptions&); \
   template EncodedChunk EncodeChunkPair<T>(const T*, const T*, size_t, const ChunkCodecOptions&, const ClassSpec*, const std::function<void(size_t, size_t)>&); \
   template Status DecodeChunkPositions<T>(ChunkMode, uint64_t, std::string_view, std::string_view, size_t, ExponentField, ChunkPositions*, SparseDelta<T>*); \
   template Status DecodeChunkValues<T>(std::string_view, const ChunkPositions&, const T*, SparseDelta<T>*); \
   template Status DecodeChunk<T>(ChunkMode, uint64_t, std::string_view, std::string_view, const T*, size_t, ExponentField, SparseDelta<T>*); \
   template void ScatterAdd<T>(T*, const SparseDelta<T>&);

WSYNC_FOR_EACH_WIDTH(WSYNC_INSTANTIATE)
#undef WSYNC_INSTANTIATE

}  // namespace wsync::codec::internal
