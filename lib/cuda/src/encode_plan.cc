#include "wsync/cuda/encode_plan.h"

#include <string_view>

#include "wsync/cuda/carver.h"
#include "wsync/util/first_error.h"

namespace wsync::cuda {
namespace sparse = codec::sparse;

bool MaySparseEncode(uint64_t elements, uint64_t changed) { return sparse::SparseTried(elements, changed); }

// A gap costs its rANS word (2 bytes at most, well under 1 at RL rates)
// and its bits (a few: its quotient's offset and the shift's low bits); a
// delta one word and, past a magnitude of 9, a few bits. The fixed parts:
// the class header, word counts and states, 8 tables of at most 44 bytes.
uint64_t SparsePosRoom(uint64_t changed) { return 512 + 6 * changed; }
uint64_t SparseValRoom(uint64_t changed) { return 512 + 4 * changed; }

namespace {

// Where a job's work area, scratch and streams lie in the arena.
struct JobPieces {
  size_t work, grouped, words, pos, val;
};

JobPieces CarveJob(const EncodeInput& in, Carver& carve) {
  JobPieces p;
  p.work = carve.Add<sparse::SparseEncodeWork>(1);
  p.grouped = carve.Add<uint32_t>(in.spec.k > 1 ? in.changed : 0);
  p.words = carve.Add<uint16_t>(in.changed + 1);
  p.pos = carve.Add<uint8_t>(SparsePosRoom(in.changed));
  p.val = carve.Add<uint8_t>(SparseValRoom(in.changed));
  return p;
}

}  // namespace

EncodePlan PlanSparseEncode(std::span<const EncodeInput> inputs, uint8_t* arena, size_t max_bytes) {
  EncodePlan plan;
  // The jobs that fit: the arena holds the job list and results, then each
  // job's pieces (CarveJob).
  std::vector<uint8_t> take(inputs.size(), 0);
  size_t njobs = 0;
  {
    size_t bytes = 0;
    for (size_t i = 0; i < inputs.size(); ++i) {
      const EncodeInput& in = inputs[i];
      if (!MaySparseEncode(in.elements, in.changed)) continue;
      Carver alone;
      CarveJob(in, alone);
      const size_t job = sizeof(SparseEncodeJob) + sizeof(sparse::SparseEncodeResult) + alone.bytes();
      if (bytes + job > max_bytes) continue;
      bytes += job;
      take[i] = 1;
      ++njobs;
    }
  }
  Carver carve;
  plan.o_jobs = carve.Add<SparseEncodeJob>(njobs);
  plan.o_results = carve.Add<sparse::SparseEncodeResult>(njobs);
  if (arena != nullptr) {
    plan.jobs.reserve(njobs);
    plan.job_chunk.reserve(njobs);
  }
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!take[i]) continue;
    const EncodeInput& in = inputs[i];
    const JobPieces p = CarveJob(in, carve);
    if (arena == nullptr) continue;
    SparseEncodeJob job;
    job.pos = in.pos;
    job.delta = in.delta;
    job.old = in.spec.k > 1 ? in.old : nullptr;
    job.rank = in.spec.k > 1 ? in.rank : nullptr;
    job.work = At<sparse::SparseEncodeWork>(arena, p.work);
    job.grouped = At<uint32_t>(arena, p.grouped);
    job.words = At<uint16_t>(arena, p.words);
    job.pos_room = SparsePosRoom(in.changed);
    job.val_room = SparseValRoom(in.changed);
    job.pos_out = At<uint8_t>(arena, p.pos);
    job.val_out = At<uint8_t>(arena, p.val);
    job.elements = in.elements;
    job.changed = in.changed;
    job.spec = in.spec;
    job.width = in.width;
    plan.jobs.push_back(job);
    plan.job_chunk.push_back(in.chunk);
  }
  plan.bytes = carve.bytes();
  return plan;
}

Packing PackSparseEncoded(const EncodePlan& plan, std::span<const sparse::SparseEncodeResult> results) {
  Packing p;
  for (size_t j = 0; j < plan.jobs.size(); ++j) {
    const sparse::SparseEncodeResult& r = results[j];
    if (r.code != sparse::kSparseEncoded) continue;
    p.segments.push_back({plan.jobs[j].pos_out, r.pos_bytes, p.bytes});
    p.bytes += r.pos_bytes;
    p.segments.push_back({plan.jobs[j].val_out, r.val_bytes, p.bytes});
    p.bytes += r.val_bytes;
  }
  return p;
}

std::vector<size_t> ChunksForTheHost(const EncodePlan& plan, std::span<const sparse::SparseEncodeResult> results,
                                     std::span<const size_t> changed) {
  std::vector<uint8_t> alone;
  for (size_t j = 0; j < plan.jobs.size(); ++j) {
    if (results[j].code != sparse::kSparseEncoded || !results[j].sparse_only) continue;
    const size_t chunk = plan.job_chunk[j];
    if (chunk >= alone.size()) alone.resize(chunk + 1, 0);
    alone[chunk] = 1;
  }
  std::vector<size_t> out;
  for (size_t chunk : changed) {
    if (chunk >= alone.size() || !alone[chunk]) out.push_back(chunk);
  }
  return out;
}

Status SetSparseEncoded(const EncodePlan& plan, std::span<const sparse::SparseEncodeResult> results,
                        const uint8_t* packed, const std::function<codec::staged::ChunkChange(size_t)>& change_of,
                        ThreadPool* pool, codec::staged::PatchWriter& writer, std::vector<uint8_t>* coded) {
  std::vector<size_t> jobs;
  std::vector<uint64_t> at;
  uint64_t next = 0;
  for (size_t j = 0; j < plan.jobs.size(); ++j) {
    if (results[j].code != sparse::kSparseEncoded) continue;
    jobs.push_back(j);
    at.push_back(next);
    next += results[j].pos_bytes + results[j].val_bytes;
  }
  FirstError error;
  ParallelFor(pool, jobs.size(), [&](size_t i) {
    const size_t j = jobs[i];
    const sparse::SparseEncodeResult& r = results[j];
    const char* p = reinterpret_cast<const char*>(packed + at[i]);
    const size_t chunk = plan.job_chunk[j];
    const std::string_view pos(p, r.pos_bytes), val(p + r.pos_bytes, r.val_bytes);
    const Status s = r.sparse_only ? writer.SetSparseCoded(chunk, plan.jobs[j].changed, plan.jobs[j].spec, pos, val)
                                   : writer.SetSparseChunk(chunk, change_of(chunk), plan.jobs[j].spec, pos, val);
    if (s.ok()) (*coded)[chunk] = 1;
    error.Record(i, s);
  });
  return error.status();
}

}  // namespace wsync::cuda
