// The device codec's data flow run on the CPU: the kernels' per-block logic
// (wsync/cuda/logic.h) in plain loops and their jobs (the entropy stage's
// included), feeding the staged codec exactly as cuda/src/device_encode.cc
// does, and its apply (staged, committed, confirmed) as
// cuda/src/device_apply.cc runs it. The patch must be byte-identical to
// codec::EncodePatch and the apply's result must equal codec::Apply's, its
// refusals included. Runs without a GPU.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <functional>
#include <random>
#include <set>

#include "../codec/test_tensors.h"
#include "../codec/tp_model.h"
#include "wsync/buffers/safetensors.h"
#include "wsync/codec/checksum.h"
#include "wsync/codec/staged.h"
#include "wsync/cuda/commit_jobs.h"
#include "wsync/cuda/encode_plan.h"
#include "wsync/cuda/logic.h"
#include "wsync/cuda/placed.h"
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

// The device's apply (DeviceCodec::Stage, Commit and Confirm; whole
// tensors, pieces, tile grids and parts alike) run on the CPU: its plan, its
// batches, each chunk gathered into its image slot by the kernel's body,
// ranks resolved in the image by the kernels' search and select, the values,
// the results' digests and the verdict, the writes kept (element, old and
// new value read in the image), then `between` (another writer, say), then
// the commit by the kernels' bodies: every change checked, then every change
// written, then the keyframes' tiles. `budget`: image bytes per batch
// (small here, for several).
using WorkDigests = std::vector<std::vector<std::vector<uint64_t>>>;  // [part][work]

// A batch's image: each work's chunk gathered into its slot by the kernel's
// body (which writes every element, padding included).
template <typename T>
std::vector<T> GatherSlots(std::span<const codec::staged::ApplyPlan> plans, const cuda::placed::Batch& b,
                           std::span<void* const> dst) {
  std::vector<T> image(b.works.size() * b.slot, T{1});
  for (size_t j = 0; j < b.works.size(); ++j) {
    const auto& work = plans[b.works[j].part].works[b.works[j].work];
    const cuda::TileJob job{dst[work.dst], work.map};
    for (uint64_t k = 0; k < b.slot; ++k) cuda::GatherTileElement(job, j, b.slot, k, image.data());
  }
  return image;
}

// The digests of a batch's slots, as the device takes them.
template <typename T>
void DigestSlots(std::span<const codec::staged::PatchReader* const> refs,
                 std::span<const codec::staged::ApplyPlan> plans, const cuda::placed::Batch& b,
                 const std::vector<T>& image, WorkDigests* digests) {
  for (size_t j = 0; j < b.works.size(); ++j) {
    const auto& ref = b.works[j];
    const auto& work = plans[ref.part].works[ref.work];
    const uint8_t* bytes = reinterpret_cast<const uint8_t*>(image.data() + j * b.slot);
    const size_t len = work.map.n * sizeof(T);
    auto& out = (*digests)[ref.part][ref.work];
    if (refs[ref.part]->gridded(refs[ref.part]->chunks()[work.chunk].tensor) && len > codec::kChecksumBlockBytes) {
      out = cuda::placed::ResultDigests(true, bytes, len);  // hashed whole on the host
      continue;
    }
    out.clear();
    for (size_t off = 0; off < len; off += codec::kChecksumBlockBytes) {  // the device's block digests
      out.push_back(cuda::logic::Xxh3(bytes + off, std::min(codec::kChecksumBlockBytes, len - off)));
    }
  }
}

WorkDigests EmptyDigests(std::span<const codec::staged::ApplyPlan> plans) {
  WorkDigests d(plans.size());
  for (size_t p = 0; p < plans.size(); ++p) d[p].resize(plans[p].works.size());
  return d;
}

using Between = std::function<void(const std::vector<cuda::placed::Writes>& writes, std::span<void* const> dst)>;

// Changed chunks the device's sparse decoder decoded, and those decoded on
// the host (other modes).
struct DecodeStats {
  size_t device = 0, host = 0;
};

// The sparse-coded works ApplyPlacedLikeTheDevice decoded with the
// device's jobs, all calls together.
size_t placed_sparse_jobs = 0;

template <typename T>
Status ApplyPlacedLikeTheDevice(std::span<const std::string_view> parts, const codec::Destination& destination,
                                bool as_parts, size_t budget, const Between& between = {},
                                Status* confirmed = nullptr, DecodeStats* stats = nullptr) {
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
  std::vector<std::string_view> patch_bytes;
  for (size_t i : patch_parts) {
    refs.push_back(&readers[i]);
    patch_bytes.push_back(parts[i]);
  }
  // Sparse-coded chunks decoded by the device's jobs, against the parts
  // back to back; the host decodes the others' positions.
  FirstError located;
  const cuda::placed::SparseWorks sparse = cuda::placed::LocateSparseWorks(refs, plans, &located);
  WSYNC_RETURN_IF_ERROR(located.status());
  std::vector<uint64_t> offsets;
  std::string device_parts;
  for (std::string_view p : patch_bytes) {
    offsets.push_back(device_parts.size());
    device_parts.append(p);
    device_parts.resize((device_parts.size() + 255) / 256 * 256);
  }
  const auto* patch_dev = reinterpret_cast<const uint8_t*>(device_parts.data());
  std::vector<std::vector<codec::staged::DecodedChunk>> dec(plans.size());
  WorkDigests digests = EmptyDigests(plans);
  for (size_t p = 0; p < plans.size(); ++p) {
    dec[p].resize(plans[p].works.size());
    for (size_t w = 0; w < plans[p].works.size(); ++w) {
      if (sparse[p][w]) continue;
      WSYNC_RETURN_IF_ERROR(refs[p]->DecodePositions(plans[p].works[w].chunk, &dec[p][w]));
    }
  }
  std::vector<cuda::placed::Writes> writes(dst.size());
  for (const cuda::placed::Batch& b : cuda::placed::Batches(refs, plans, budget)) {
    EXPECT_EQ(b.width, sizeof(T));
    const size_t n = b.works.size();
    std::vector<T> image = GatherSlots<T>(plans, b, dst);
    std::vector<ClassSpec> specs(n);
    for (size_t j = 0; j < n; ++j) specs[j] = dec[b.works[j].part][b.works[j].work].spec;
    const auto sb = cuda::placed::PlanSparseBatch(refs, plans, b, sparse, patch_bytes, offsets);
    const size_t nj = sb.jobs.size(), sm = sb.entries;
    placed_sparse_jobs += nj;
    for (size_t k = 0; k < nj; ++k) specs[sb.slot[k]] = sb.jobs[k].spec;
    const cuda::logic::Layout l{.n = n * b.slot, .chunk_elems = b.slot};
    const auto prefix = Prefix(image.data(), l, specs);
    // The device's jobs, against the image before any change is added:
    // ranks, their positions and old values (the rank kernel's search and
    // select), then the values.
    std::vector<uint32_t> rank(sm), slot_of(sm), spos(sm), mpos(sm);
    std::vector<uint8_t> cls(sm), sold(sb.bytes), mold(sb.bytes), sdelta(sb.bytes);
    std::vector<uint64_t> counts(nj * kMaxClasses), sindex(sm);
    for (size_t k = 0; k < nj; ++k) {
      if (cuda::SparseRanksJob(sb.jobs[k], patch_dev, rank.data(), cls.data(), slot_of.data(),
                               counts.data() + k * kMaxClasses) != codec::sparse::kSparseOk) {
        return DataLossError("position stream");
      }
    }
    if (sb.conditioned) {
      for (size_t e = 0; e < sm; ++e) {
        WSYNC_ASSIGN_OR_RETURN(const uint64_t at, RankedElement(image.data(), l, prefix, specs[slot_of[e]],
                                                                slot_of[e], cls[e], rank[e]));
        spos[e] = static_cast<uint32_t>(at - slot_of[e] * l.chunk_elems);
        std::memcpy(sold.data() + e * sizeof(T), &image[at], sizeof(T));
      }
    }
    for (size_t k = 0; k < nj; ++k) {
      if (cuda::SparseValuesJob(sb.jobs[k], patch_dev, rank.data(), counts.data() + k * kMaxClasses, spos.data(),
                                sold.data(), mpos.data(), mold.data(), sindex.data(),
                                sdelta.data()) != codec::sparse::kSparseOk) {
        return DataLossError("value stream");
      }
    }
    if (stats != nullptr) {
      stats->device += nj;
      for (size_t j = 0; j < n; ++j) {
        const auto& ref = b.works[j];
        const uint64_t changed = refs[ref.part]->changed(plans[ref.part].works[ref.work].chunk);
        stats->host += !sparse[ref.part][ref.work] && changed > 0;
      }
    }
    for (size_t k = 0; k < nj; ++k) {
      const auto& job = sb.jobs[k];
      const auto& ref = b.works[sb.slot[k]];
      const auto& work = plans[ref.part].works[ref.work];
      std::vector<uint32_t> pos(job.changed);
      std::vector<T> before(job.changed), after(job.changed);
      for (size_t i = 0; i < job.changed; ++i) {
        if (sindex[job.entry + i] - job.first_element >= work.map.n) return DataLossError("a rank beyond its elements");
        pos[i] = static_cast<uint32_t>(sindex[job.entry + i] - job.first_element);
        T& x = image[sindex[job.entry + i]];
        before[i] = x;
        x = static_cast<T>(x + reinterpret_cast<const T*>(sdelta.data() + job.byte)[i]);
        after[i] = x;
      }
      writes[work.dst].width = sizeof(T);
      cuda::placed::AppendWrites(work, pos, reinterpret_cast<const uint8_t*>(before.data()),
                                 reinterpret_cast<const uint8_t*>(after.data()), &writes[work.dst]);
    }
    for (size_t j = 0; j < n; ++j) {
      const auto& ref = b.works[j];
      if (sparse[ref.part][ref.work]) continue;
      const auto& work = plans[ref.part].works[ref.work];
      auto& d = dec[ref.part][ref.work];
      const bool ranked = d.ranked && d.values_pending && d.spec.k > 1;
      WSYNC_ASSIGN_OR_RETURN(auto old, OldValues(image.data(), l, prefix, j, j * b.slot, &d));
      if (ranked && !d.pos.empty() && d.pos.back() >= work.map.n) return DataLossError("a rank beyond its elements");
      WSYNC_RETURN_IF_ERROR(refs[ref.part]->DecodeValues(work.chunk, old.empty() ? nullptr : old.data(), &d));
      // The values replaced and the results, gathered in the image around
      // the scatter-add.
      const T* dl = reinterpret_cast<const T*>(d.delta.data());
      std::vector<T> before(d.pos.size()), after(d.pos.size());
      for (size_t i = 0; i < d.pos.size(); ++i) {
        T& x = image[j * b.slot + d.pos[i]];
        before[i] = x;
        x = static_cast<T>(x + dl[i]);
        after[i] = x;
      }
      writes[work.dst].width = sizeof(T);
      cuda::placed::AppendWrites(work, d.pos, reinterpret_cast<const uint8_t*>(before.data()),
                                 reinterpret_cast<const uint8_t*>(after.data()), &writes[work.dst]);
    }
    DigestSlots(refs, plans, b, image, &digests);
  }
  if (auto bad = cuda::placed::Mismatch(refs, plans, digests)) return DataLossError(*bad + ": mismatch");
  if (between) between(writes, dst);
  // The commit: the job list, one pass checking every change, one writing.
  std::vector<cuda::CommitJob> jobs;
  uint64_t total = 0;
  for (size_t k = 0; k < dst.size(); ++k) {
    if (writes[k].index.empty()) continue;
    jobs.push_back({dst[k], writes[k].index.data(), writes[k].old.data(), writes[k].value.data(), total,
                    writes[k].index.size(), static_cast<int32_t>(sizeof(T))});
    total += writes[k].index.size();
  }
  for (uint64_t k = 0; k < total; ++k) {
    const cuda::CommitJob& job = jobs[cuda::CommitJobOf(jobs.data(), jobs.size(), k)];
    if (!cuda::HoldsStaged(job, k - job.first)) return FailedPreconditionError("another writer changed an element");
  }
  for (uint64_t k = 0; k < total; ++k) {
    const cuda::CommitJob& job = jobs[cuda::CommitJobOf(jobs.data(), jobs.size(), k)];
    cuda::WriteStaged(job, k - job.first);
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
  // The confirm: every work's chunk gathered and digested again.
  if (confirmed != nullptr) {
    *confirmed = Status::Ok();
    for (const bool key : {false, true}) {
      const auto& r = key ? key_refs : refs;
      const auto& pl = key ? key_plans : plans;
      WorkDigests now = EmptyDigests(pl);
      for (const cuda::placed::Batch& b : cuda::placed::Batches(r, pl, budget)) {
        DigestSlots(r, pl, b, GatherSlots<T>(pl, b, dst), &now);
      }
      if (auto bad = cuda::placed::Mismatch(r, pl, now)) {
        *confirmed = DataLossError(*bad + " is not the version's");
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
  // 5% changed: chunks the host decodes; 0.2%: sparse-coded chunks, the
  // device's jobs.
  for (const auto& [tp, rate] : std::vector<std::pair<uint64_t, double>>{{1, 0.05}, {2, 0.05}, {4, 0.05},
                                                                         {2, 0.002}, {4, 0.002}}) {
    SCOPED_TRACE("TP " + std::to_string(tp) + ", " + std::to_string(rate) + " changed");
    std::mt19937_64 rng(40 + tp);
    const auto v0 = testing::CanonicalModel(rng);
    std::vector<OwnedTensor> v1;
    for (const auto& t : v0) v1.push_back(testing::PerturbByExponent(t, rate, 118, rng));
    placed_sparse_jobs = 0;
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
    EXPECT_GT(placed_sparse_jobs, 0u) << "no chunk took the device's sparse decoding";
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

// Staged, then another writer, then the commit: an element the version
// changes, written by someone else since staging, is found by the commit's
// check and nothing is written (the other writer's value stays); an element
// it does not change is found by the confirm, after the writes. A patch
// that is corrupt, or whose base the destination does not hold, is refused
// by the staging with the destination untouched.
TEST(HostPlacedPath, AnotherWriterBeforeTheCommitIsRefusedOrFoundAfter) {
  std::mt19937_64 rng(61);
  const auto v0 = testing::CanonicalModel(rng);
  std::vector<OwnedTensor> v1;
  for (const auto& t : v0) v1.push_back(testing::PerturbByExponent(t, 0.05, 118, rng));
  auto patch = codec::EncodePatch(buffers::Views(v0), buffers::Views(v1), {});
  ASSERT_TRUE(patch.ok()) << patch.status().ToString();
  const std::string_view one(*patch);
  constexpr size_t kBudget = 3 << 19;
  // Flips element e of destination k, in the destination and in `mirror`.
  auto flip = [](std::span<void* const> dst, size_t k, uint64_t e, std::vector<OwnedTensor>* mirror) {
    static_cast<uint16_t*>(dst[k])[e] ^= 1;
    reinterpret_cast<uint16_t*>((*mirror)[k].bytes.data())[e] ^= 1;
  };
  {
    SCOPED_TRACE("a changed element");
    auto w = v0, mirror = v0;
    const Status s = ApplyPlacedLikeTheDevice<uint16_t>(
        std::span(&one, 1), buffers::MutableViews(w), false, kBudget,
        [&](const std::vector<cuda::placed::Writes>& writes, std::span<void* const> dst) {
          const size_t k = writes.size() - 1;  // the last tensor's last change: after many checks that pass
          ASSERT_FALSE(writes[k].index.empty());
          flip(dst, k, writes[k].index.back(), &mirror);
        });
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
    EXPECT_TRUE(testing::SameBits(w, mirror)) << "the refused commit wrote";
  }
  {
    SCOPED_TRACE("an unchanged element");
    auto w = v0, mirror = v1;
    Status confirmed;
    const Status s = ApplyPlacedLikeTheDevice<uint16_t>(
        std::span(&one, 1), buffers::MutableViews(w), false, kBudget,
        [&](const std::vector<cuda::placed::Writes>& writes, std::span<void* const> dst) {
          const std::set<uint64_t> changed(writes[0].index.begin(), writes[0].index.end());
          uint64_t e = 0;
          while (changed.count(e) != 0) ++e;
          flip(dst, 0, e, &mirror);
        },
        &confirmed);
    ASSERT_TRUE(s.ok()) << s.ToString();
    EXPECT_TRUE(testing::SameBits(w, mirror));
    EXPECT_EQ(confirmed.code(), StatusCode::kDataLoss) << confirmed.ToString();
  }
  {
    SCOPED_TRACE("no other writer");
    auto w = v0;
    Status confirmed;
    ASSERT_TRUE(ApplyPlacedLikeTheDevice<uint16_t>(std::span(&one, 1), buffers::MutableViews(w), false, kBudget, {},
                                                   &confirmed)
                    .ok());
    EXPECT_TRUE(testing::SameBits(w, v1));
    EXPECT_TRUE(confirmed.ok()) << confirmed.ToString();
  }
  {
    SCOPED_TRACE("the pieces of TP 2");
    codec::EncodeOptions o;
    std::vector<testing::Rank> ranks = testing::MakeRanks(2);
    o.grids = codec::GridsFor(testing::Layouts(ranks), buffers::Views(v0));
    auto gridded = codec::EncodePatch(buffers::Views(v0), buffers::Views(v1), o);
    ASSERT_TRUE(gridded.ok()) << gridded.status().ToString();
    const std::string_view g(*gridded);
    testing::Rank rank = testing::MakeRank(2, 1);
    testing::Fill(&rank, v0);
    const auto before = rank.tensors;
    bool called = false;
    const Status s = ApplyPlacedLikeTheDevice<uint16_t>(
        std::span(&g, 1), rank.layout, false, kBudget,
        [&](const std::vector<cuda::placed::Writes>& writes, std::span<void* const> dst) {
          called = true;
          for (size_t k = 0; k < writes.size(); ++k) {
            if (writes[k].index.empty()) continue;
            static_cast<uint16_t*>(dst[k])[writes[k].index[0]] ^= 1;
            return;
          }
        });
    EXPECT_TRUE(called);
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
    size_t differing = 0;
    for (size_t k = 0; k < before.size(); ++k) {
      for (size_t i = 0; i < before[k].bytes.size(); ++i) differing += before[k].bytes[i] != rank.tensors[k].bytes[i];
    }
    EXPECT_EQ(differing, 1u) << "only the other writer's element may differ";
  }
  {
    SCOPED_TRACE("refused by the staging");
    std::string corrupt = *patch;
    corrupt[corrupt.size() / 2] ^= 0x10;
    for (const std::string_view p : {std::string_view(corrupt), one}) {
      auto w = p == one ? v1 : v0;  // corrupt, then a base the tensors do not hold
      const auto untouched = w;
      bool reached = false;
      const Status s = ApplyPlacedLikeTheDevice<uint16_t>(
          std::span(&p, 1), buffers::MutableViews(w), false, kBudget,
          [&](const std::vector<cuda::placed::Writes>&, std::span<void* const>) { reached = true; });
      EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.ToString();
      EXPECT_FALSE(reached) << "the staging let it through to the commit";
      EXPECT_TRUE(testing::SameBits(w, untouched));
    }
  }
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
  // Applied as the device applies it (whole tensors as identity
  // placements), the patch and the gridded one alike; at RL change rates
  // every changed chunk of the patch is sparse-coded and decoded by the
  // device's jobs.
  for (const std::string* p : {&*host, &*host_gridded}) {
    std::vector<OwnedTensor> out = base;
    const std::string_view one(*p);
    DecodeStats decoded;
    const Status s =
        ApplyPlacedLikeTheDevice<T>(std::span(&one, 1), buffers::MutableViews(out), false, 3 << 19, {}, nullptr,
                                    &decoded);
    ASSERT_TRUE(s.ok()) << s.ToString();
    EXPECT_TRUE(testing::SameBits(out, target)) << "the device's apply gives other bits";
    if (p == &*host && c.density > 0 && c.density <= 1e-2) {
      EXPECT_GT(decoded.device, 0u);
      EXPECT_EQ(decoded.host, 0u) << "a changed chunk not sparse-coded";
    }
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
        const std::string_view one(*patch);
        DecodeStats decoded;
        const Status s = ApplyPlacedLikeTheDevice<uint16_t>(std::span(&one, 1), buffers::MutableViews(out), false,
                                                            64 << 20, {}, nullptr, &decoded);
        ASSERT_TRUE(s.ok()) << name << ": " << s.ToString();
        EXPECT_GT(decoded.device, 0u) << name;
        if (all_sparse) {
          EXPECT_EQ(decoded.host, 0u) << name << ": a chunk in another mode than sparse";
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
