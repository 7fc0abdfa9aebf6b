// The device codec's data flow run on the CPU: the kernels' per-block logic
// (wsync/cuda/logic.h) in plain loops and their jobs (the entropy stage's
// included), feeding the staged codec exactly as cuda/src/device_encode.cc
// does. The patch must be byte-identical to
// codec::EncodePatch and applying through the ranked-position path must
// equal codec::Apply. Runs without a GPU.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <random>

#include "../codec/test_tensors.h"
#include "../codec/tp_model.h"
#include "wsync/buffers/safetensors.h"
#include "wsync/codec/checksum.h"
#include "wsync/codec/staged.h"
#include "wsync/cuda/encode_plan.h"
#include "wsync/cuda/logic.h"
#include "wsync/cuda/placed.h"
#include "wsync/cuda/sparse_plan.h"
#include "wsync/util/first_error.h"

namespace wsync {
namespace {

using codec::ClassSpec;
using codec::kBlock;
using codec::kMaxClasses;
using testing::OwnedTensor;

// What DiffCounts + scan + DiffScatter + SampleHistogram compute for a tensor.
struct Compact {
  std::vector<uint32_t> chunk_off, pos;
  std::vector<uint8_t> delta, old;
  std::vector<uint32_t> hist;
};

template <typename T>
Compact Diff(const T* base, const T* target, cuda::logic::Layout l, size_t bins, codec::ExponentField ef) {
  Compact c;
  c.chunk_off.push_back(0);
  c.hist.assign(l.Chunks() * bins, 0);
  for (uint64_t b = 0; b < l.Blocks(); ++b) {
    const int len = l.BlockLen(b);
    uint32_t m = cuda::logic::DiffMask(base + b * kBlock, target + b * kBlock, len);
    while (m != 0) {
      const uint64_t i = b * kBlock + codec::CountrZero32(m);
      m &= m - 1;
      c.pos.push_back(static_cast<uint32_t>(i % l.chunk_elems));
      const T d = static_cast<T>(target[i] - base[i]);
      c.delta.insert(c.delta.end(), reinterpret_cast<const uint8_t*>(&d), reinterpret_cast<const uint8_t*>(&d) + sizeof(T));
      c.old.insert(c.old.end(), reinterpret_cast<const uint8_t*>(base + i), reinterpret_cast<const uint8_t*>(base + i) + sizeof(T));
    }
    if (bins > 0 && l.Sampled(b)) {
      for (int j = 0; j < kBlock; ++j) {
        ++c.hist[(b / l.ChunkBlocks()) * bins + ((static_cast<uint64_t>(base[b * kBlock + j]) >> ef.shift) & ef.mask)];
      }
    }
    if ((b + 1) % l.ChunkBlocks() == 0 || b + 1 == l.Blocks()) c.chunk_off.push_back(static_cast<uint32_t>(c.pos.size()));
  }
  return c;
}

// ClassCounts + exclusive scan: the class-major rank prefix.
template <typename T>
std::vector<uint32_t> Prefix(const T* base, cuda::logic::Layout l, const std::vector<ClassSpec>& specs) {
  const uint64_t blocks = l.Blocks();
  std::vector<uint32_t> counts(kMaxClasses * blocks + 1, 0), prefix(counts.size());
  for (uint64_t b = 0; b < blocks; ++b) {
    uint32_t c[kMaxClasses];
    cuda::logic::BlockClassCounts(specs[b / l.ChunkBlocks()], base + b * kBlock, l.BlockLen(b), c);
    for (int k = 0; k < kMaxClasses; ++k) counts[k * blocks + b] = c[k];
  }
  uint32_t sum = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    prefix[i] = sum;
    sum += counts[i];
  }
  return prefix;
}

// The element of a tensor that chunk ch's class-c rank r names, as the
// rank kernel (RankPositionsKernel) finds it from the class prefix.
template <typename T>
StatusOr<uint64_t> RankedElement(const T* x, cuda::logic::Layout l, const std::vector<uint32_t>& prefix,
                                 const ClassSpec& spec, uint64_t ch, int c, uint32_t r) {
  const uint64_t blocks = l.Blocks();
  const uint64_t first = ch * l.ChunkBlocks(), end = std::min(first + l.ChunkBlocks(), blocks);
  const uint32_t* row = prefix.data() + c * blocks;
  if (row[end] - row[first] <= r) return DataLossError("rank beyond its class");
  uint64_t lo = first, hi = end;
  while (hi - lo > 1) {
    const uint64_t mid = (lo + hi) / 2;
    (row[mid] - row[first] <= r ? lo : hi) = mid;
  }
  return lo * kBlock + cuda::logic::ClassSelect(spec, x + lo * kBlock, l.BlockLen(lo), c, r - (row[lo] - row[first]));
}

// A cell's elements in its row-major order, as PlaceCells finds them: the
// tensor's own bytes when contiguous, else a two-dimensional copy.
std::vector<uint8_t> CellImage(const OwnedTensor& t, const codec::staged::Cell& cell) {
  const size_t w = codec::DTypeWidth(t.dtype);
  std::vector<uint8_t> out(cell.elements() * w);
  for (uint64_t r = 0; r < cell.rows; ++r) {
    std::memcpy(out.data() + r * cell.cols * w, t.bytes.data() + ((cell.row0 + r) * cell.tensor_cols + cell.col0) * w,
                cell.cols * w);
  }
  return out;
}

// Changed chunks the device's coder coded, and those left to the host.
struct CoderStats {
  size_t device_coded = 0, host_coded = 0;
};

template <typename T>
std::string EncodeLikeTheDevice(const std::vector<OwnedTensor>& base, const std::vector<OwnedTensor>& target,
                                const codec::EncodeOptions& options, CoderStats* stats) {
  auto tv = buffers::Views(target);
  auto writer = codec::staged::PatchWriter::Create(tv, options);
  EXPECT_TRUE(writer.ok()) << writer.status().ToString();
  // Block digests of every tensor's cells in turn; classes by writer chunk.
  std::vector<std::vector<uint64_t>> tblocks(target.size()), bblocks(target.size());
  std::vector<ClassSpec> chosen(writer->chunks().size());
  for (const codec::staged::Cell& cell : writer->cells()) {
    const size_t t = cell.tensor;
    const std::vector<uint8_t> bimg = CellImage(base[t], cell), ximg = CellImage(target[t], cell);
    const T* b = reinterpret_cast<const T*>(bimg.data());
    const T* x = reinterpret_cast<const T*>(ximg.data());
    const cuda::logic::Layout l{.n = cell.elements(), .chunk_elems = options.chunk_bytes / sizeof(T)};
    EXPECT_EQ(l.Chunks(), cell.chunks);
    const size_t bins = options.condition_on_base ? codec::staged::HistogramBins(tv[t].dtype) : 0;
    const Compact c = Diff(b, x, l, bins, codec::ExponentFieldOf(tv[t].dtype));
    std::vector<ClassSpec> specs(l.Chunks());
    std::vector<codec::staged::ChunkChange> changes(l.Chunks());
    bool ranks = false;
    for (uint64_t k = 0; k < l.Chunks(); ++k) {
      const size_t id = cell.first_chunk + k;
      auto& ch = changes[k];
      ch.count = c.chunk_off[k + 1] - c.chunk_off[k];
      ch.pos = c.pos.data() + c.chunk_off[k];
      ch.delta = c.delta.data() + c.chunk_off[k] * sizeof(T);
      ch.old = bins > 0 ? c.old.data() + c.chunk_off[k] * sizeof(T) : nullptr;
      // Chunks take the classes of their run's first (ClassSourceChunk of
      // the tensor's chunks, across cells).
      if (writer->ClassSource(id) == id) {
        chosen[id] = writer->ChooseClasses(id, bins > 0 ? c.hist.data() + k * bins : nullptr, ch);
      }
      specs[k] = chosen[writer->ClassSource(id)];
      ranks = ranks || writer->NeedsRanks(id, ch.count, specs[k]);
    }
    std::vector<uint32_t> rank(c.pos.size());
    if (ranks) {
      const auto prefix = Prefix(b, l, specs);
      const uint64_t blocks = l.Blocks();
      for (uint64_t k = 0; k < l.Chunks(); ++k) {
        for (uint32_t i = c.chunk_off[k]; i < c.chunk_off[k + 1]; ++i) {
          const uint64_t first = k * l.ChunkBlocks(), blk = first + c.pos[i] / kBlock;
          const int cls = specs[k].ClassOf(reinterpret_cast<const T*>(c.old.data())[i]);
          rank[i] = prefix[cls * blocks + blk] - prefix[cls * blocks + first] +
                    cuda::logic::ClassCountBelow(specs[k], b + blk * kBlock, l.BlockLen(blk), cls, c.pos[i] % kBlock);
        }
      }
    }
    std::vector<uint64_t> xd;
    for (size_t off = 0; off < ximg.size(); off += codec::kChecksumBlockBytes) {
      const size_t len = std::min(codec::kChecksumBlockBytes, ximg.size() - off);
      xd.push_back(cuda::logic::Xxh3(ximg.data() + off, len));
      bblocks[t].push_back(cuda::logic::Xxh3(bimg.data() + off, len));
    }
    tblocks[t].insert(tblocks[t].end(), xd.begin(), xd.end());
    // The entropy stage: the device's coder takes what it can
    // (encode_plan.h, the jobs run here on the CPU), the host the rest.
    std::vector<cuda::EncodeInput> inputs;
    for (uint64_t k = 0; k < l.Chunks(); ++k) {
      const auto& ch = changes[k];
      cuda::EncodeInput in{cell.first_chunk + k, writer->chunks()[cell.first_chunk + k].elements, ch.count, ch.pos,
                           ch.delta, ch.old, rank.data() + c.chunk_off[k], specs[k], static_cast<int>(sizeof(T))};
      if (cuda::MaySparseEncode(in.elements, in.changed)) inputs.push_back(in);
    }
    constexpr size_t kArenaBytes = size_t{256} << 20;  // the device codec's
    std::vector<uint64_t> arena((cuda::PlanSparseEncode(inputs, nullptr, kArenaBytes).bytes + 7) / 8);
    const cuda::EncodePlan plan =
        cuda::PlanSparseEncode(inputs, reinterpret_cast<uint8_t*>(arena.data()), kArenaBytes);
    std::vector<codec::sparse::SparseEncodeResult> results;
    for (const cuda::SparseEncodeJob& job : plan.jobs) {
      results.push_back(cuda::RunSparseEncodeJob(job, codec::sparse::kLog2Table.data()));
    }
    const cuda::Packing packing = cuda::PackSparseEncoded(plan, results);
    std::vector<uint8_t> packed(packing.bytes);
    for (const cuda::PackSegment& seg : packing.segments) std::memcpy(packed.data() + seg.at, seg.src, seg.bytes);
    // The host reads a change only where the device fetches it: the class
    // sources' (above) and ChunksForTheHost.
    std::vector<size_t> changed;
    for (uint64_t k = 0; k < l.Chunks(); ++k) {
      if (changes[k].count > 0) changed.push_back(cell.first_chunk + k);
    }
    std::vector<uint8_t> fetched(writer->chunks().size(), 0);
    for (size_t id : cuda::ChunksForTheHost(plan, results, changed)) fetched[id] = 1;
    std::vector<uint8_t> coded(writer->chunks().size(), 0);
    auto change_of = [&](size_t chunk) {
      EXPECT_TRUE(fetched[chunk]) << "chunk " << chunk << "'s change read without being fetched";
      return changes[chunk - cell.first_chunk];
    };
    const Status set = cuda::SetSparseEncoded(plan, results, packed.data(), change_of, nullptr, *writer, &coded);
    EXPECT_TRUE(set.ok()) << set.ToString();
    for (uint64_t k = 0; k < l.Chunks(); ++k) {
      const size_t id = cell.first_chunk + k;
      if (coded[id]) {
        ++stats->device_coded;
      } else {
        EXPECT_TRUE(changes[k].count == 0 || fetched[id]) << "chunk " << id << " coded on the host without its change";
        const Status s = writer->SetChunk(id, changes[k], specs[k], rank.data() + c.chunk_off[k]);
        EXPECT_TRUE(s.ok()) << s.ToString();
        stats->host_coded += changes[k].count > 0 ? 1 : 0;
      }
      if (writer->gridded(id)) {
        EXPECT_TRUE(writer->SetTileDigest(id, xd[k]).ok());
      }
    }
  }
  std::vector<uint64_t> tsum, bsum;
  for (size_t t = 0; t < target.size(); ++t) {
    tsum.push_back(codec::CombineBlockDigests(tblocks[t]));
    bsum.push_back(codec::CombineBlockDigests(bblocks[t]));
  }
  EXPECT_TRUE(writer->SetChecksums(tsum, bsum).ok());
  auto out = writer->Finish();
  EXPECT_TRUE(out.ok()) << out.status().ToString();
  return out.ok() ? *out : std::string();
}

// A decoded chunk's old values as the device finds them: ranked chunks'
// positions from their ranks (RankPositionsKernel's search and select in
// chunk `k` of x), merged by position; other conditioned chunks' gathered at
// first + pos. Empty when the values need no base.
template <typename T>
StatusOr<std::vector<uint8_t>> OldValues(const T* x, cuda::logic::Layout l, const std::vector<uint32_t>& prefix,
                                         uint64_t k, uint64_t first, codec::staged::DecodedChunk* d) {
  std::vector<uint8_t> old;
  if (!d->values_pending || d->spec.k == 1) return old;
  if (!d->ranked) {
    for (uint32_t p : d->pos) {
      const T v = x[first + p];
      old.insert(old.end(), reinterpret_cast<const uint8_t*>(&v), reinterpret_cast<const uint8_t*>(&v) + sizeof(T));
    }
    return old;
  }
  std::vector<uint32_t> pos;
  std::vector<T> o;
  size_t at = 0;
  for (int c = 0; c < d->spec.k; ++c) {
    for (uint64_t j = 0; j < d->class_counts[c]; ++j, ++at) {
      WSYNC_ASSIGN_OR_RETURN(const uint64_t e, RankedElement(x, l, prefix, d->spec, k, c, d->ranks[at]));
      pos.push_back(static_cast<uint32_t>(e - k * l.chunk_elems));
      o.push_back(x[e]);
    }
  }
  WSYNC_RETURN_IF_ERROR(codec::staged::MergeRankedPositions(pos.data(), o.data(), sizeof(T), d, &old));
  return old;
}

// Applies with positions found from ranks by the kernels' search + select.
template <typename T>
Status ApplyLikeTheDevice(const std::string& patch, std::vector<OwnedTensor>* dst) {
  WSYNC_ASSIGN_OR_RETURN(auto r, codec::staged::PatchReader::Open(patch));
  const auto& chunks = r.chunks();
  for (size_t t = 0; t < dst->size(); ++t) {
    T* x = reinterpret_cast<T*>((*dst)[t].bytes.data());
    const cuda::logic::Layout l{.n = (*dst)[t].bytes.size() / sizeof(T), .chunk_elems = r.chunk_bytes() / sizeof(T)};
    std::vector<size_t> ids;
    for (size_t i = 0; i < chunks.size(); ++i) {
      if (chunks[i].tensor == t) ids.push_back(i);
    }
    std::vector<codec::staged::DecodedChunk> dec(ids.size());
    std::vector<ClassSpec> specs(ids.size());
    for (size_t k = 0; k < ids.size(); ++k) {
      WSYNC_RETURN_IF_ERROR(r.DecodePositions(ids[k], &dec[k]));
      specs[k] = dec[k].spec;
    }
    const auto prefix = Prefix(x, l, specs);
    for (size_t k = 0; k < ids.size(); ++k) {
      auto& d = dec[k];
      WSYNC_ASSIGN_OR_RETURN(auto old, OldValues(x, l, prefix, k, chunks[ids[k]].first_element, &d));
      WSYNC_RETURN_IF_ERROR(r.DecodeValues(ids[k], old.empty() ? nullptr : old.data(), &d));
    }
    for (size_t k = 0; k < ids.size(); ++k) {
      for (size_t j = 0; j < dec[k].pos.size(); ++j) {
        T& v = x[chunks[ids[k]].first_element + dec[k].pos[j]];
        v = static_cast<T>(v + reinterpret_cast<const T*>(dec[k].delta.data())[j]);
      }
    }
  }
  return Status::Ok();
}

// The device's decoding path (device_apply.cc, ApplySparse) on the CPU: the
// host's plan, the jobs of sparse_jobs.h over the set-wide arrays, the rank
// kernel's resolution, the chunks of other modes decoded by the host with
// old values gathered from the base, the scatter.
struct SparsePath {
  bool taken = false;      // false: the device takes the host-entropy path
  size_t host_chunks = 0;  // chunks in other modes, decoded on the host
};
template <typename T>
StatusOr<SparsePath> ApplySparseLikeTheDevice(const std::string& patch, std::vector<OwnedTensor>* dst) {
  WSYNC_ASSIGN_OR_RETURN(auto r, codec::staged::PatchReader::Open(patch));
  const std::vector<size_t> widths(dst->size(), sizeof(T));
  cuda::SparsePlan p;
  FirstError error;
  cuda::PlanSparse(patch, r, widths, &p, &error);
  if (p.host_changes * 8 > p.entries + p.host_changes) return SparsePath{};
  WSYNC_RETURN_IF_ERROR(error.status());
  const auto& chunks = r.chunks();
  std::vector<codec::staged::DecodedChunk> hdec(p.host_chunks.size());
  for (size_t k = 0; k < hdec.size(); ++k) {
    const size_t i = p.host_chunks[k];
    WSYNC_RETURN_IF_ERROR(r.DecodePositions(i, &hdec[k]));
    std::vector<T> old;
    const T* x = reinterpret_cast<const T*>((*dst)[chunks[i].tensor].bytes.data());
    if (hdec[k].values_pending && hdec[k].spec.k > 1) {
      for (uint32_t pos : hdec[k].pos) old.push_back(x[chunks[i].first_element + pos]);
    }
    WSYNC_RETURN_IF_ERROR(r.DecodeValues(i, old.empty() ? nullptr : old.data(), &hdec[k]));
  }
  const size_t m = p.entries;
  std::vector<uint32_t> rank(m), chunk(m), pos(m), mpos(m);
  std::vector<uint8_t> cls(m), old(p.bytes), mold(p.bytes), delta(p.bytes);
  std::vector<uint64_t> counts(p.jobs.size() * kMaxClasses), index(m);
  const auto* bytes = reinterpret_cast<const uint8_t*>(patch.data());
  for (size_t j = 0; j < p.jobs.size(); ++j) {
    if (cuda::SparseRanksJob(p.jobs[j], bytes, rank.data(), cls.data(), chunk.data(), counts.data() + j * kMaxClasses)) {
      return DataLossError("position stream");
    }
  }
  for (size_t t = 0; t < dst->size(); ++t) {
    const cuda::SparsePlan::Tensor& tp = p.tensors[t];
    if (!tp.conditioned) continue;
    const T* x = reinterpret_cast<const T*>((*dst)[t].bytes.data());
    const cuda::logic::Layout l{.n = (*dst)[t].bytes.size() / sizeof(T), .chunk_elems = r.chunk_bytes() / sizeof(T)};
    const auto prefix = Prefix(x, l, tp.specs);
    for (size_t e = tp.entry; e < tp.entry + tp.m; ++e) {
      WSYNC_ASSIGN_OR_RETURN(const uint64_t at, RankedElement(x, l, prefix, tp.specs[chunk[e]], chunk[e], cls[e], rank[e]));
      pos[e] = static_cast<uint32_t>(at - chunk[e] * l.chunk_elems);
      std::memcpy(old.data() + tp.byte + (e - tp.entry) * sizeof(T), &x[at], sizeof(T));
    }
  }
  for (size_t j = 0; j < p.jobs.size(); ++j) {
    if (cuda::SparseValuesJob(p.jobs[j], bytes, rank.data(), counts.data() + j * kMaxClasses, pos.data(), old.data(),
                              mpos.data(), mold.data(), index.data(), delta.data())) {
      return DataLossError("value stream");
    }
  }
  for (size_t t = 0; t < dst->size(); ++t) {
    const cuda::SparsePlan::Tensor& tp = p.tensors[t];
    T* x = reinterpret_cast<T*>((*dst)[t].bytes.data());
    for (size_t e = tp.entry; e < tp.entry + tp.m; ++e) {
      T d;
      std::memcpy(&d, delta.data() + tp.byte + (e - tp.entry) * sizeof(T), sizeof(T));
      x[index[e]] = static_cast<T>(x[index[e]] + d);
    }
  }
  for (size_t k = 0; k < hdec.size(); ++k) {
    const codec::staged::Chunk& c = chunks[p.host_chunks[k]];
    T* x = reinterpret_cast<T*>((*dst)[c.tensor].bytes.data());
    const T* delta = reinterpret_cast<const T*>(hdec[k].delta.data());
    for (size_t j = 0; j < hdec[k].pos.size(); ++j) {
      x[c.first_element + hdec[k].pos[j]] = static_cast<T>(x[c.first_element + hdec[k].pos[j]] + delta[j]);
    }
  }
  return SparsePath{true, hdec.size()};
}

// The device's apply into pieces, tile grids and parts
// (DeviceCodec::Apply, Impl::ApplyPlaced) run on the CPU: its plan, its
// batches, each chunk gathered into its image slot by the kernel's body,
// ranks resolved in the image by the kernels' search and select, the values,
// the results' digests, the verdict, and only then the changes at their
// placements. `budget`: image bytes per batch (small here, for several).
template <typename T>
Status ApplyPlacedLikeTheDevice(std::span<const std::string_view> parts, const codec::Destination& destination,
                                bool as_parts, size_t budget) {
  std::vector<codec::staged::PatchReader> readers;
  for (std::string_view p : parts) {
    WSYNC_ASSIGN_OR_RETURN(auto r, codec::staged::PatchReader::Open(p));
    readers.push_back(std::move(r));
  }
  std::vector<const codec::staged::PatchReader*> refs;
  for (const auto& r : readers) refs.push_back(&r);
  WSYNC_ASSIGN_OR_RETURN(auto all_plans, codec::staged::PlanApply(refs, destination, {}, as_parts));
  std::vector<void*> dst;
  if (destination.pieces()) {
    for (const auto& rt : destination.runtime()) dst.push_back(rt.view.data);
  } else {
    for (const auto& t : destination.tensors()) dst.push_back(t.data);
  }
  // Keyframes decoded and verified first, written last; patches between.
  std::vector<const codec::staged::PatchReader*> key_refs;
  std::vector<codec::staged::ApplyPlan> plans, key_plans;
  std::vector<size_t> patch_parts;
  for (size_t i = 0; i < refs.size(); ++i) {
    if (refs[i]->kind() == codec::PatchKind::kKeyframe) {
      key_refs.push_back(refs[i]);
      key_plans.push_back(all_plans[i]);
    } else {
      patch_parts.push_back(i);
      plans.push_back(all_plans[i]);
    }
  }
  std::vector<cuda::placed::DecodedWorks> keyframes;
  std::vector<std::vector<std::vector<uint64_t>>> key_digests;
  for (size_t i = 0; i < key_refs.size(); ++i) {
    WSYNC_ASSIGN_OR_RETURN(auto d, cuda::placed::DecodeKeyframeWorks(*key_refs[i], key_plans[i], nullptr));
    key_digests.push_back(d.digests);
    keyframes.push_back(std::move(d));
  }
  if (auto bad = cuda::placed::Mismatch(key_refs, key_plans, key_digests)) return DataLossError(*bad + ": keyframe");
  refs.clear();
  for (size_t i : patch_parts) refs.push_back(&readers[i]);
  std::vector<std::vector<codec::staged::DecodedChunk>> dec(plans.size());
  std::vector<std::vector<std::vector<uint64_t>>> digests(plans.size());
  for (size_t p = 0; p < plans.size(); ++p) {
    dec[p].resize(plans[p].works.size());
    digests[p].resize(plans[p].works.size());
    for (size_t w = 0; w < plans[p].works.size(); ++w) {
      WSYNC_RETURN_IF_ERROR(refs[p]->DecodePositions(plans[p].works[w].chunk, &dec[p][w]));
    }
  }
  std::vector<std::vector<uint64_t>> index(dst.size());
  std::vector<std::vector<uint8_t>> delta(dst.size());
  for (const cuda::placed::Batch& b : cuda::placed::Batches(refs, plans, budget)) {
    EXPECT_EQ(b.width, sizeof(T));
    const size_t n = b.works.size();
    std::vector<T> image(n * b.slot, T{1});  // the kernel writes every element, padding included
    std::vector<ClassSpec> specs(n);
    for (size_t j = 0; j < n; ++j) {
      const auto& work = plans[b.works[j].part].works[b.works[j].work];
      const cuda::TileJob job{dst[work.dst], work.map};
      for (uint64_t k = 0; k < b.slot; ++k) cuda::GatherTileElement(job, j, b.slot, k, image.data());
      specs[j] = dec[b.works[j].part][b.works[j].work].spec;
    }
    const cuda::logic::Layout l{.n = n * b.slot, .chunk_elems = b.slot};
    const auto prefix = Prefix(image.data(), l, specs);
    for (size_t j = 0; j < n; ++j) {
      const auto& ref = b.works[j];
      const auto& work = plans[ref.part].works[ref.work];
      auto& d = dec[ref.part][ref.work];
      const bool ranked = d.ranked && d.values_pending && d.spec.k > 1;
      WSYNC_ASSIGN_OR_RETURN(auto old, OldValues(image.data(), l, prefix, j, j * b.slot, &d));
      if (ranked && !d.pos.empty() && d.pos.back() >= work.map.n) return DataLossError("a rank beyond its elements");
      WSYNC_RETURN_IF_ERROR(refs[ref.part]->DecodeValues(work.chunk, old.empty() ? nullptr : old.data(), &d));
      const T* dl = reinterpret_cast<const T*>(d.delta.data());
      for (size_t i = 0; i < d.pos.size(); ++i) image[j * b.slot + d.pos[i]] += dl[i];
      const uint8_t* bytes = reinterpret_cast<const uint8_t*>(image.data() + j * b.slot);
      const size_t len = work.map.n * sizeof(T);
      if (refs[ref.part]->gridded(refs[ref.part]->chunks()[work.chunk].tensor) && len > codec::kChecksumBlockBytes) {
        digests[ref.part][ref.work] = cuda::placed::ResultDigests(true, bytes, len);  // hashed whole on the host
      } else {
        for (size_t off = 0; off < len; off += codec::kChecksumBlockBytes) {  // the device's block digests
          digests[ref.part][ref.work].push_back(
              cuda::logic::Xxh3(bytes + off, std::min(codec::kChecksumBlockBytes, len - off)));
        }
      }
      cuda::placed::AppendChange(work, d, &index[work.dst], &delta[work.dst]);
    }
  }
  if (auto bad = cuda::placed::Mismatch(refs, plans, digests)) return DataLossError(*bad + ": mismatch");
  for (size_t k = 0; k < dst.size(); ++k) {
    T* x = static_cast<T*>(dst[k]);
    const T* dl = reinterpret_cast<const T*>(delta[k].data());
    for (size_t i = 0; i < index[k].size(); ++i) x[index[k][i]] += dl[i];
  }
  for (size_t i = 0; i < key_refs.size(); ++i) {
    const codec::staged::PatchReader* one[] = {key_refs[i]};
    for (const cuda::placed::Batch& b : cuda::placed::Batches(one, std::span(&key_plans[i], 1), budget)) {
      std::vector<T> image(b.works.size() * b.slot);
      for (size_t j = 0; j < b.works.size(); ++j) {
        const auto& v = keyframes[i].values[b.works[j].work];
        std::memcpy(image.data() + j * b.slot, v.data(), v.size());
      }
      for (size_t j = 0; j < b.works.size(); ++j) {
        const auto& work = key_plans[i].works[b.works[j].work];
        const cuda::TileJob job{dst[work.dst], work.map};
        for (uint64_t k = 0; k < b.slot; ++k) cuda::ScatterTileElement(job, j, b.slot, k, image.data());
      }
    }
  }
  return Status::Ok();
}

// Every rank of TP 1, 2 and 4 (replicated kv heads at 4, padded vocabulary,
// column-parallel cells of several chunks) from the whole patch, from its
// selection, from the parts of two sources, from a keyframe and from the
// parts of a version one of which is a keyframe; whole tensors from a
// gridded patch; each to codec::Apply's bits. A base the pieces do not hold
// is refused and nothing is written.
TEST(HostPlacedPath, PiecesGridsAndPartsApplyLikeTheHostCodec) {
  using testing::Rank;
  for (uint64_t tp : {1, 2, 4}) {
    SCOPED_TRACE("TP " + std::to_string(tp));
    std::mt19937_64 rng(40 + tp);
    const auto v0 = testing::CanonicalModel(rng);
    std::vector<OwnedTensor> v1;
    for (const auto& t : v0) v1.push_back(testing::PerturbByExponent(t, 0.05, 118, rng));
    std::vector<Rank> ranks = testing::MakeRanks(4);
    codec::EncodeOptions o;
    o.grids = codec::GridsFor(testing::Layouts(ranks), buffers::Views(v0));
    auto patch = codec::EncodePatch(buffers::Views(v0), buffers::Views(v1), o);
    ASSERT_TRUE(patch.ok()) << patch.status().ToString();
    codec::EncodeOptions unconditioned = o;
    unconditioned.condition_on_base = false;
    auto plain = codec::EncodePatch(buffers::Views(v0), buffers::Views(v1), unconditioned);
    ASSERT_TRUE(plain.ok());
    auto keyframe = codec::EncodeKeyframe(buffers::Views(v1), o);
    ASSERT_TRUE(keyframe.ok());
    // The parts of two sources (as patches, and as keyframes).
    const auto [parts, key_parts] = testing::TwoSourceParts(v0, v1, o.grids);
    const std::vector<std::string_view> part_views(parts.begin(), parts.end());
    for (uint64_t r = 0; r < tp; ++r) {
      const auto want = testing::Expected(tp, r, v1);
      auto selection = codec::SelectForPieces(*patch, testing::MakeRank(tp, r).layout);
      ASSERT_TRUE(selection.ok());
      for (int form = 0; form < 5; ++form) {
        Rank rank = testing::MakeRank(tp, r);
        testing::Fill(&rank, v0);
        std::string_view one = form == 1 ? std::string_view(*selection)
                               : form == 3 ? std::string_view(*keyframe)
                                           : std::string_view(*patch);
        const std::vector<std::string_view> key_and_patch = {key_parts[0], parts[1]};
        const Status s =
            form == 2   ? ApplyPlacedLikeTheDevice<uint16_t>(part_views, rank.layout, true, 3 << 19)
            : form == 4 ? ApplyPlacedLikeTheDevice<uint16_t>(key_and_patch, rank.layout, true, 3 << 19)
                        : ApplyPlacedLikeTheDevice<uint16_t>(std::span(&one, 1), rank.layout, false, 3 << 19);
        ASSERT_TRUE(s.ok()) << "rank " << r << " form " << form << ": " << s.ToString();
        EXPECT_TRUE(testing::SameBits(rank.tensors, want)) << "rank " << r << " form " << form;
      }
      // Pieces whose gridded tensor "down" holds another version than the
      // base: refused, nothing written; coded without conditioning on the
      // base, only its tiles' digests can tell.
      auto mixed = v0;
      mixed.back() = v1.back();
      ASSERT_EQ(mixed.back().name, "down");
      for (const std::string& p : {*patch, *plain}) {
        Rank stale = testing::MakeRank(tp, r);
        testing::Fill(&stale, mixed);
        const std::string_view one(p);
        const Status s = ApplyPlacedLikeTheDevice<uint16_t>(std::span(&one, 1), stale.layout, false, 3 << 19);
        EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.ToString();
        EXPECT_TRUE(testing::SameBits(stale.tensors, testing::Expected(tp, r, mixed))) << "a refused apply wrote";
      }
    }
    auto whole = v0;
    const std::string_view one(*patch);
    ASSERT_TRUE(
        ApplyPlacedLikeTheDevice<uint16_t>(std::span(&one, 1), buffers::MutableViews(whole), false, 3 << 19).ok());
    EXPECT_TRUE(testing::SameBits(whole, v1));
  }
  // Tiles of more than one checksum block (2 MiB chunks): their digests are
  // of the whole tile.
  std::mt19937_64 rng(49);
  std::vector<OwnedTensor> b = {testing::RandomTensor("big", codec::DType::kBF16, {2048, 1024}, rng)};
  std::vector<OwnedTensor> t = {testing::PerturbByExponent(b[0], 0.05, 118, rng)};
  codec::EncodeOptions o;
  o.chunk_bytes = 2u << 20;
  o.grids = {{"big", {1024}, {}}};
  auto patch = codec::EncodePatch(buffers::Views(b), buffers::Views(t), o);
  ASSERT_TRUE(patch.ok());
  const std::string_view one(*patch);
  auto whole = b;
  ASSERT_TRUE(
      ApplyPlacedLikeTheDevice<uint16_t>(std::span(&one, 1), buffers::MutableViews(whole), false, 8 << 20).ok());
  EXPECT_TRUE(testing::SameBits(whole, t));
  auto stale = t;
  EXPECT_EQ(ApplyPlacedLikeTheDevice<uint16_t>(std::span(&one, 1), buffers::MutableViews(stale), false, 8 << 20).code(),
            StatusCode::kDataLoss);
}

struct Case {
  codec::DType dtype;
  double density;
};

class HostPipelineTest : public ::testing::TestWithParam<Case> {};

template <typename T>
void RunCase(const Case& c, bool condition) {
  std::mt19937_64 rng(static_cast<uint64_t>(c.density * 1e6) + static_cast<int>(c.dtype) + condition);
  std::vector<OwnedTensor> base, target;
  const std::vector<std::vector<uint64_t>> shapes = {{3, 700001}, {1}, {0}, {33}, {1 << 19}};
  for (size_t i = 0; i < shapes.size(); ++i) {
    base.push_back(testing::RandomTensor("t" + std::to_string(i), c.dtype, shapes[i], rng));
    target.push_back(c.dtype == codec::DType::kBF16 ? testing::PerturbByExponent(base.back(), c.density, 118, rng)
                                                    : testing::Perturb(base.back(), c.density, rng));
  }
  codec::EncodeOptions o;
  o.condition_on_base = condition;
  auto host = codec::EncodePatch(buffers::Views(base), buffers::Views(target), o);
  ASSERT_TRUE(host.ok()) << host.status().ToString();
  CoderStats stats;
  EXPECT_TRUE(EncodeLikeTheDevice<T>(base, target, o, &stats) == *host) << "the device data flow gives other bytes";
  // At RL change rates the device's coder codes the chunks.
  if (c.density > 0 && c.density <= 1e-2) {
    EXPECT_GT(stats.device_coded, 0u) << "the device's coder coded no chunk";
  }
  // Gridded as a source serving tensor-parallel layouts codes them: cells
  // gathered out of their tensors, classes chosen across cells.
  codec::EncodeOptions gridded = o;
  gridded.grids = {{"t0", {1}, {100, 350000, 350001}}, {"t4", {100000, 300000}, {}}};
  auto host_gridded = codec::EncodePatch(buffers::Views(base), buffers::Views(target), gridded);
  ASSERT_TRUE(host_gridded.ok()) << host_gridded.status().ToString();
  EXPECT_TRUE(EncodeLikeTheDevice<T>(base, target, gridded, &stats) == *host_gridded)
      << "the device data flow gives other bytes with tile grids";
  std::vector<OwnedTensor> out = base;
  ASSERT_TRUE(ApplyLikeTheDevice<T>(*host, &out).ok());
  EXPECT_TRUE(testing::SameBits(out, target));
  // RL change rates: every chunk sparse-coded, so the whole patch is
  // decoded on the device.
  out = base;
  auto path = ApplySparseLikeTheDevice<T>(*host, &out);
  ASSERT_TRUE(path.ok()) << path.status().ToString();
  if (c.density > 0 && c.density <= 1e-2) {
    EXPECT_TRUE(path->taken && path->host_chunks == 0) << "not every chunk sparse-coded";
  }
  if (path->taken) {
    EXPECT_TRUE(testing::SameBits(out, target)) << "the device's decoding path gives other bits";
  }
}

TEST_P(HostPipelineTest, SameBytesAndSameResultAsTheHostCodec) {
  const Case c = GetParam();
  for (bool condition : {true, false}) {
    switch (codec::DTypeWidth(c.dtype)) {
      case 1: RunCase<uint8_t>(c, condition); break;
      case 2: RunCase<uint16_t>(c, condition); break;
      case 4: RunCase<uint32_t>(c, condition); break;
      default: RunCase<uint64_t>(c, condition); break;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    WidthsAndDensities, HostPipelineTest,
    ::testing::Values(Case{codec::DType::kBF16, 0}, Case{codec::DType::kBF16, 1e-4}, Case{codec::DType::kBF16, 1e-2},
                      Case{codec::DType::kBF16, 0.5}, Case{codec::DType::kBF16, 1}, Case{codec::DType::kF32, 1e-2},
                      Case{codec::DType::kF8E4M3, 1e-2}, Case{codec::DType::kF16, 0.1},
                      Case{codec::DType::kI32, 1e-3}, Case{codec::DType::kF64, 1e-2}));

// The real RL snapshots (BF16): at lr 1e-6 consecutive versions' patches are
// sparse-coded throughout, so a GPU sink decodes them on the device, to the
// target's bits; at lr 1e-5 (11-12% changed) a few small chunks are coded
// in other modes and decode on the host beside them.
void CheckRealSnapshots(const std::string& run, bool all_sparse) {
  const std::filesystem::path dir = std::string(WSYNC_SHARED_DATA_DIR) + "/" + run;
  std::string error;
  const bool found = testing::ForEachSnapshotPair(
      dir,
      [&](const std::vector<OwnedTensor>& base, const std::vector<OwnedTensor>& target, const std::string& name) {
        auto patch = codec::EncodePatch(buffers::Views(base), buffers::Views(target), {});
        ASSERT_TRUE(patch.ok());
        CoderStats stats;
        EXPECT_TRUE(EncodeLikeTheDevice<uint16_t>(base, target, {}, &stats) == *patch)
            << name << ": the device data flow gives other bytes";
        // The device's coder takes every changed chunk the host would weigh
        // sparse mode for: all at lr 1e-6, all but a bias or two at 1e-5.
        EXPECT_GE(stats.device_coded, 10 * stats.host_coded) << name;
        // What the patch codes in modes other than sparse (zstd-coded bitmaps
        // and planes, runs) is negligible: the device needs no coder for it.
        auto reader = codec::staged::PatchReader::Open(*patch);
        ASSERT_TRUE(reader.ok());
        uint64_t changed = 0, other = 0;
        for (size_t i = 0; i < reader->chunks().size(); ++i) {
          codec::sparse::ChunkStreams streams;
          auto sparse = reader->LocateSparse(i, &streams);
          ASSERT_TRUE(sparse.ok());
          changed += reader->changed(i);
          other += *sparse ? 0 : reader->changed(i);
        }
        EXPECT_LE(other * 1000, changed) << name << ": more than 0.1% of the changes in other modes than sparse";
        auto out = base;
        auto path = ApplySparseLikeTheDevice<uint16_t>(*patch, &out);
        ASSERT_TRUE(path.ok()) << path.status().ToString();
        ASSERT_TRUE(path->taken) << name;
        if (all_sparse) {
          EXPECT_EQ(path->host_chunks, 0u) << name << ": a chunk in another mode than sparse";
        }
        EXPECT_TRUE(testing::SameBits(out, target)) << name;
      },
      &error);
  EXPECT_EQ(error, "");
  if (!found) GTEST_SKIP() << "no snapshots in " << dir;
}

TEST(HostSparsePath, RealSnapshotsTakeTheDevicePathToTheTargetBits) {
  CheckRealSnapshots("rl-small-lr1e-6", true);
  CheckRealSnapshots("rl-small-lr1e-5", false);
}

}  // namespace
}  // namespace wsync
