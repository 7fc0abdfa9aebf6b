// The host's half of the device's entropy stage of encoding: which changed
// chunks go to the device's coder (encode_jobs.h), where each job's scratch
// and streams lie in one arena, how the coded streams are packed for the
// copy to the host, and their hand-over to the patch writer. Host code
// only; runs without a GPU (the tests run the whole stage on the CPU).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "wsync/codec/staged.h"
#include "wsync/cuda/encode_jobs.h"
#include "wsync/util/status.h"
#include "wsync/util/thread_pool.h"

namespace wsync::cuda {

// A changed chunk of the writer's and its compact change (in the memory
// the jobs run in); old and rank are needed when spec.k > 1.
struct EncodeInput {
  size_t chunk = 0;
  uint64_t elements = 0, changed = 0;
  const uint32_t* pos = nullptr;
  const void* delta = nullptr;
  const void* old = nullptr;
  const uint32_t* rank = nullptr;
  codec::ClassSpec spec;
  int width = 2;
};

// Whether a chunk goes to the device's coder: whether the host's coder
// weighs sparse mode for it (codec::sparse::SparseTried).
bool MaySparseEncode(uint64_t elements, uint64_t changed);

// Room for a job's streams. A chunk that does not fit (deltas far larger
// than an optimizer step's) is reported full and coded on the host.
uint64_t SparsePosRoom(uint64_t changed);
uint64_t SparseValRoom(uint64_t changed);

struct EncodePlan {
  std::vector<SparseEncodeJob> jobs;
  std::vector<size_t> job_chunk;  // the writer's chunk of each job
  size_t o_jobs = 0, o_results = 0;  // the job list and the results, in the arena
  size_t bytes = 0;                  // of the arena
};

// A job per input that MaySparseEncode, its scratch and streams carved out
// of an arena of plan.bytes at `arena` (null: the sizes alone, no jobs),
// in order while the arena stays within about max_bytes (the rest are left
// to the host).
EncodePlan PlanSparseEncode(std::span<const EncodeInput> inputs, uint8_t* arena, size_t max_bytes);

// The coded streams of the jobs that coded their chunk (results: one per
// job), each job's position stream then its value stream, back to back.
struct Packing {
  std::vector<PackSegment> segments;
  uint64_t bytes = 0;
};
Packing PackSparseEncoded(const EncodePlan& plan, std::span<const codec::sparse::SparseEncodeResult> results);

// The changed chunks (of `changed`, writer indices) whose change the host
// needs once the jobs ran: all but those the device coded in sparse mode
// alone (the host weighs other modes for the rest, or codes them).
std::vector<size_t> ChunksForTheHost(const EncodePlan& plan,
                                     std::span<const codec::sparse::SparseEncodeResult> results,
                                     std::span<const size_t> changed);

// Hands the packed streams (Packing's bytes, on the host) to the writer,
// chunks in parallel on pool: PatchWriter::SetSparseCoded where the device
// coded a chunk in sparse mode alone, else SetSparseChunk, which weighs
// the other modes from change_of(chunk) (the change in host memory; asked
// only for ChunksForTheHost). (*coded)[chunk] is set for each chunk coded.
// InvalidArgument if a stream's framing is malformed (a fault of the
// device's coder).
Status SetSparseEncoded(const EncodePlan& plan, std::span<const codec::sparse::SparseEncodeResult> results,
                        const uint8_t* packed, const std::function<codec::staged::ChunkChange(size_t)>& change_of,
                        ThreadPool* pool, codec::staged::PatchWriter& writer, std::vector<uint8_t>* coded);

}  // namespace wsync::cuda
