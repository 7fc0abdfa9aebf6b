#include "wsync/cuda/placed.h"

#include <algorithm>
#include <map>
#include <tuple>

#include "wsync/codec/checksum.h"
#include "wsync/util/first_error.h"
#include "wsync/util/text.h"

namespace wsync::cuda::placed {

std::vector<Batch> Batches(std::span<const codec::staged::PatchReader* const> readers,
                           std::span<const codec::staged::ApplyPlan> plans, size_t budget) {
  std::map<std::pair<size_t, uint64_t>, std::vector<Batch>> by_kind;  // (width, slot)
  for (size_t p = 0; p < plans.size(); ++p) {
    const auto& chunks = readers[p]->chunks();
    for (size_t w = 0; w < plans[p].works.size(); ++w) {
      const codec::staged::Chunk& c = chunks[plans[p].works[w].chunk];
      const uint64_t slot = readers[p]->chunk_bytes() / c.width;
      auto& batches = by_kind[{c.width, slot}];
      if (batches.empty() || (batches.back().works.size() + 1) * slot * c.width > budget) {
        batches.push_back(Batch{c.width, slot, {}});
      }
      batches.back().works.push_back({p, w});
    }
  }
  std::vector<Batch> out;
  for (auto& [kind, batches] : by_kind) {
    for (auto& b : batches) out.push_back(std::move(b));
  }
  return out;
}

std::vector<uint64_t> ResultDigests(bool gridded, const uint8_t* bytes, size_t nbytes) {
  if (gridded) return {codec::BlockDigest(bytes, nbytes)};
  std::vector<uint64_t> out;
  for (size_t off = 0; off < nbytes; off += codec::kChecksumBlockBytes) {
    out.push_back(codec::BlockDigest(bytes + off, std::min(codec::kChecksumBlockBytes, nbytes - off)));
  }
  return out;
}

StatusOr<DecodedWorks> DecodeKeyframeWorks(const codec::staged::PatchReader& r, const codec::staged::ApplyPlan& plan,
                                           ThreadPool* pool) {
  DecodedWorks out;
  out.values.resize(plan.works.size());
  out.digests.resize(plan.works.size());
  FirstError error;
  ParallelFor(pool, plan.works.size(), [&](size_t w) {
    const codec::staged::Chunk& c = r.chunks()[plan.works[w].chunk];
    out.values[w].resize(c.elements * c.width);
    Status s = r.DecodeKeyframe(plan.works[w].chunk, out.values[w].data());
    if (!s.ok()) return error.Record(w, s);
    out.digests[w] = ResultDigests(r.gridded(c.tensor), out.values[w].data(), out.values[w].size());
  });
  WSYNC_RETURN_IF_ERROR(error.status());
  return out;
}

std::optional<std::string> Mismatch(std::span<const codec::staged::PatchReader* const> readers,
                                    std::span<const codec::staged::ApplyPlan> plans,
                                    const std::vector<std::vector<std::vector<uint64_t>>>& digests) {
  for (size_t p = 0; p < plans.size(); ++p) {
    const codec::staged::PatchReader& r = *readers[p];
    const codec::staged::ApplyPlan& plan = plans[p];
    std::vector<std::vector<uint64_t>> groups(plan.group_tensor.size());
    for (size_t w = 0; w < plan.works.size(); ++w) {
      const codec::staged::Work& work = plan.works[w];
      const codec::staged::Chunk& c = r.chunks()[work.chunk];
      if (!r.gridded(c.tensor)) {
        auto& g = groups[work.group];
        g.insert(g.end(), digests[p][w].begin(), digests[p][w].end());
        continue;
      }
      if (digests[p][w].size() != 1 || digests[p][w][0] != r.tile_digest(work.chunk)) {
        return "tensor " + Quoted(r.tensor_name(c.tensor)) + " chunk " + std::to_string(c.index) +
               (plan.whole ? "" : " in " + plan.group_where[work.group]);
      }
    }
    for (size_t g = 0; g < groups.size(); ++g) {
      const size_t t = plan.group_tensor[g];
      if (!r.gridded(t) && codec::CombineBlockDigests(groups[g]) != r.target_checksum(t)) return plan.group_where[g];
    }
  }
  return std::nullopt;
}

void AppendWrites(const codec::staged::Work& w, std::span<const uint32_t> pos, const uint8_t* old,
                  const uint8_t* value, Writes* out) {
  for (uint32_t p : pos) out->index.push_back(codec::PlacedElement(w.map, p));
  const size_t bytes = pos.size() * out->width;
  out->old.insert(out->old.end(), old, old + bytes);
  out->value.insert(out->value.end(), value, value + bytes);
}

SparseWorks LocateSparseWorks(std::span<const codec::staged::PatchReader* const> readers,
                              std::span<const codec::staged::ApplyPlan> plans, FirstError* error) {
  SparseWorks out(plans.size());
  size_t first = 0;
  for (size_t p = 0; p < plans.size(); ++p) {
    const codec::staged::PatchReader& r = *readers[p];
    out[p].resize(plans[p].works.size());
    for (size_t w = 0; w < plans[p].works.size(); ++w) {
      const size_t i = plans[p].works[w].chunk;
      if (r.kind() != codec::PatchKind::kPatch || r.changed(i) == 0) continue;
      codec::sparse::ChunkStreams cs;
      auto sparse = r.LocateSparse(i, &cs);
      if (!sparse.ok()) {
        error->Record(first + w, sparse.status());
      } else if (*sparse) {
        out[p][w] = cs;
      }
    }
    first += plans[p].works.size();
  }
  return out;
}

SparseBatch PlanSparseBatch(std::span<const codec::staged::PatchReader* const> readers,
                            std::span<const codec::staged::ApplyPlan> plans, const Batch& b, const SparseWorks& sparse,
                            std::span<const std::string_view> bytes, std::span<const uint64_t> offsets) {
  SparseBatch out;
  for (size_t j = 0; j < b.works.size(); ++j) {
    const Ref& ref = b.works[j];
    const auto& cs = sparse[ref.part][ref.work];
    if (!cs) continue;
    const auto* begin = reinterpret_cast<const uint8_t*>(bytes[ref.part].data());
    auto offset = [&](const uint8_t* at) { return offsets[ref.part] + static_cast<uint64_t>(at - begin); };
    const codec::staged::Work& work = plans[ref.part].works[ref.work];
    SparseJob job{};
    job.pos_words = offset(cs->pos.words);
    job.pos_word_count = cs->pos.word_count;
    job.pos_bits = offset(cs->pos.bits);
    job.pos_bit_bytes = cs->pos.bit_bytes;
    job.val_words = offset(cs->val.words);
    job.val_word_count = cs->val.word_count;
    job.val_bits = offset(cs->val.bits);
    job.val_bit_bytes = cs->val.bit_bytes;
    job.spec = cs->spec;
    job.elements = readers[ref.part]->chunks()[work.chunk].elements;
    job.changed = readers[ref.part]->changed(work.chunk);
    job.first_element = j * b.slot;
    job.entry = out.entries;
    job.byte = out.bytes;
    job.chunk_in_tensor = static_cast<uint32_t>(j);
    job.width = static_cast<int32_t>(b.width);
    out.jobs.push_back(job);
    out.slot.push_back(j);
    out.entries += job.changed;
    out.bytes += job.changed * b.width;
    out.conditioned = out.conditioned || cs->spec.k > 1;
  }
  return out;
}

}  // namespace wsync::cuda::placed
