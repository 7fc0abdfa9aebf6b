// The host's half of decoding a patch on the device: the jobs of its
// sparse-coded chunks (sparse_jobs.h) and where their changes go in the
// set-wide arrays the kernels fill. Host code only; runs without a GPU.
#pragma once

#include <cstddef>
#include <span>
#include <string_view>
#include <vector>

#include "wsync/codec/staged.h"
#include "wsync/cuda/sparse_jobs.h"
#include "wsync/util/first_error.h"

namespace wsync::cuda {

struct SparsePlan {
  // A destination tensor's changes: entries [entry, entry + m), bytes from
  // `byte` (aligned to 8) in the old-value and delta arrays.
  struct Tensor {
    size_t entry = 0, m = 0, byte = 0;
    bool conditioned = false;             // some chunk's classes need the base (ranks to resolve)
    std::vector<codec::ClassSpec> specs;  // per chunk of the tensor, in its order
  };
  std::vector<SparseJob> jobs;
  std::vector<size_t> job_chunk;  // the reader's chunk of each job
  std::vector<Tensor> tensors;    // in the patch's tensor order
  size_t entries = 0, bytes = 0;
  // Changed chunks coded in other modes (runs, bitmap, dense bytes), for the
  // host to decode, and their changes.
  std::vector<size_t> host_chunks;
  uint64_t host_changes = 0;

  // The job holding entry `entry` of tensor t.
  size_t JobOfEntry(size_t t, uint64_t entry) const;
};

// The indices of a patch's (or writer's) chunks per tensor, in chunk order.
std::vector<std::vector<size_t>> ChunksByTensor(const std::vector<codec::staged::Chunk>& chunks, size_t tensors);

// Plans every chunk of a patch (widths: the element width of each of its
// tensors): a job per sparse-coded chunk, the others in host_chunks. A
// malformed chunk is recorded in *error under its index, as
// PatchReader::DecodePositions reports it.
void PlanSparse(std::string_view patch, const codec::staged::PatchReader& r, std::span<const size_t> widths,
                SparsePlan* plan, FirstError* error);

}  // namespace wsync::cuda
