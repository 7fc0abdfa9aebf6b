#include "wsync/cuda/sparse_plan.h"

#include <algorithm>

namespace wsync::cuda {

size_t SparsePlan::JobOfEntry(size_t t, uint64_t entry) const {
  const uint64_t at = tensors[t].entry + entry;
  const auto it =
      std::upper_bound(jobs.begin(), jobs.end(), at, [](uint64_t x, const SparseJob& job) { return x < job.entry; });
  return static_cast<size_t>(it - jobs.begin()) - 1;
}

std::vector<std::vector<size_t>> ChunksByTensor(const std::vector<codec::staged::Chunk>& chunks, size_t tensors) {
  std::vector<std::vector<size_t>> out(tensors);
  for (size_t i = 0; i < chunks.size(); ++i) out[chunks[i].tensor].push_back(i);
  return out;
}

void PlanSparse(std::string_view patch, const codec::staged::PatchReader& r, std::span<const size_t> widths,
                SparsePlan* plan, FirstError* error) {
  const auto& chunks = r.chunks();
  const auto by_tensor = ChunksByTensor(chunks, widths.size());
  const auto* bytes = reinterpret_cast<const uint8_t*>(patch.data());
  auto offset = [&](const uint8_t* p) { return static_cast<uint64_t>(p - bytes); };
  *plan = SparsePlan{};
  plan->tensors.resize(widths.size());
  for (size_t t = 0; t < widths.size(); ++t) {
    SparsePlan::Tensor& tp = plan->tensors[t];
    plan->bytes = (plan->bytes + 7) / 8 * 8;
    tp.entry = plan->entries;
    tp.byte = plan->bytes;
    tp.specs.resize(by_tensor[t].size());
    for (size_t c = 0; c < by_tensor[t].size(); ++c) {
      const size_t i = by_tensor[t][c];
      if (r.changed(i) == 0) {  // empty: checked here, nothing to decode
        codec::staged::DecodedChunk dc;
        error->Record(i, r.DecodePositions(i, &dc));
        continue;
      }
      codec::sparse::ChunkStreams cs;
      auto sparse = r.LocateSparse(i, &cs);
      if (!sparse.ok()) {
        error->Record(i, sparse.status());
        continue;
      }
      if (!*sparse) {
        plan->host_chunks.push_back(i);
        plan->host_changes += r.changed(i);
        continue;
      }
      SparseJob job{};
      job.pos_words = offset(cs.pos.words);
      job.pos_word_count = cs.pos.word_count;
      job.pos_bits = offset(cs.pos.bits);
      job.pos_bit_bytes = cs.pos.bit_bytes;
      job.val_words = offset(cs.val.words);
      job.val_word_count = cs.val.word_count;
      job.val_bits = offset(cs.val.bits);
      job.val_bit_bytes = cs.val.bit_bytes;
      job.spec = cs.spec;
      job.elements = chunks[i].elements;
      job.changed = r.changed(i);
      job.first_element = chunks[i].first_element;
      job.entry = plan->entries;
      job.byte = plan->bytes;
      job.chunk_in_tensor = static_cast<uint32_t>(c);
      job.width = static_cast<int32_t>(widths[t]);
      plan->jobs.push_back(job);
      plan->job_chunk.push_back(i);
      tp.specs[c] = cs.spec;
      tp.conditioned = tp.conditioned || cs.spec.k > 1;
      plan->entries += job.changed;
      plan->bytes += job.changed * widths[t];
    }
    tp.m = plan->entries - tp.entry;
  }
}

}  // namespace wsync::cuda
