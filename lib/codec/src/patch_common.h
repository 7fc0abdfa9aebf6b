// What the set-level files share, whichever way they run (encode.cc,
// merge.cc, apply*.cc, staged.cc; defined in patch.cc): element widths,
// tensor sets validated and laid out in entries, the placements of chunks
// in memory, and the digests a patch is checked by (private). The encode
// side's own helpers are in patch_encode.h, the apply side's in apply_plan.h
// and apply_chunks.h.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "block_hasher.h"
#include "format.h"
#include "wsync/codec/checksum.h"
#include "wsync/codec/codec.h"
#include "wsync/codec/tile_map.h"
#include "wsync/util/status.h"

namespace wsync::codec::internal {

// Calls f(T{}) with T the unsigned integer type of `width` bytes.
template <typename F>
decltype(auto) WithWidth(size_t width, F&& f) {
  switch (width) {
    case 1: return f(uint8_t{});
    case 2: return f(uint16_t{});
    case 4: return f(uint32_t{});
    default: return f(uint64_t{});
  }
}

uint64_t SaturatingProduct(const std::vector<uint64_t>& shape);
uint64_t SaturatingBytes(uint64_t numel, DType dtype);

// need_data: a tensor of nonzero size must have a data pointer.
Status ValidateTensor(const TensorView& t, bool need_data = true);
Status ValidateSet(std::span<const TensorView> set, bool need_data = true);
// The entry of a tensor with no grid, or with `grid` (InvalidArgument when
// its cuts do not fit the tensor).
TensorEntry EntryFor(const TensorView& t, uint32_t chunk_bytes);
StatusOr<TensorEntry> EntryFor(const TensorView& t, uint32_t chunk_bytes, const TileGrid* grid);

// Where a tensor's canonical elements lie in memory: the tensor itself
// (drow = dcol = 0, cols = its width) or a runtime tensor holding a piece of
// it: canonical (r, c) is at element (r + drow) * cols + c + dcol.
struct Placement {
  uint8_t* data = nullptr;
  uint64_t cols = 0;
  int64_t drow = 0;
  int64_t dcol = 0;
};

inline Placement Identity(const TensorEntry& e, const uint8_t* data) {
  return Placement{const_cast<uint8_t*>(data), e.cols, 0, 0};
}

// The chunk at the placement as tile_map.h has it: PlacedElement says where
// each of its elements lies.
inline TileMap MapOf(const Tile& t, const Placement& p) {
  return TileMap{t.row0, t.col0, t.cell_cols, t.first, t.n, p.cols, p.drow, p.dcol};
}

// Calls f(element, chunk_offset, len) for each maximal run of the chunk's
// elements that is contiguous at the placement, in chunk order.
template <typename F>
void ForEachRun(const Tile& t, const Placement& p, F&& f) {
  const TileMap m = MapOf(t, p);
  if (p.cols == t.cell_cols && static_cast<int64_t>(t.col0) + p.dcol == 0) {
    // The cell's rows are whole rows at the placement (every ungridded
    // tensor, 1-D ones included, and every row band): one run, found in
    // O(1) rather than a row at a time.
    f(PlacedElement(m, 0), 0, t.n);
    return;
  }
  uint64_t run_at = 0, run_k = 0, run_len = 0;
  for (uint64_t k = 0; k < t.n;) {
    const uint64_t len = std::min(t.cell_cols - (t.first + k) % t.cell_cols, t.n - k);
    const uint64_t at = PlacedElement(m, k);
    if (run_len > 0 && run_at + run_len == at) {
      run_len += len;
    } else {
      if (run_len > 0) f(run_at, run_k, run_len);
      run_at = at;
      run_k = k;
      run_len = len;
    }
    k += len;
  }
  if (run_len > 0) f(run_at, run_k, run_len);
}

// The chunk's first byte at the placement when its elements are contiguous
// there, else null (then Gather / Scatter move them).
inline uint8_t* ContiguousAt(const Tile& t, const Placement& p, size_t width) {
  uint8_t* at = nullptr;
  int runs = 0;
  ForEachRun(t, p, [&](uint64_t element, uint64_t, uint64_t) {
    if (runs++ == 0) at = p.data + element * width;
  });
  return runs == 1 ? at : nullptr;
}

inline void Gather(const Tile& t, const Placement& p, size_t width, uint8_t* out) {
  ForEachRun(t, p, [&](uint64_t element, uint64_t k, uint64_t len) {
    std::memcpy(out + k * width, p.data + element * width, len * width);
  });
}

inline void Scatter(const Tile& t, const Placement& p, size_t width, const uint8_t* in) {
  ForEachRun(t, p, [&](uint64_t element, uint64_t k, uint64_t len) {
    std::memcpy(p.data + element * width, in + k * width, len * width);
  });
}

// A chunk's bytes in chunk order: at the placement when contiguous there,
// else gathered into `scratch`.
inline uint8_t* ChunkBytes(const Tile& t, const Placement& p, size_t width, std::vector<uint8_t>* scratch) {
  if (uint8_t* at = ContiguousAt(t, p, width)) return at;
  scratch->resize(t.n * width);
  Gather(t, p, width, scratch->data());
  return scratch->data();
}

struct Task {
  size_t tensor;
  size_t chunk;
};

std::vector<Task> TasksOf(const std::vector<TensorEntry>& tensors);

// Per-tensor arrays of checksum-block digests; chunks hold whole blocks.
struct Digests {
  std::vector<std::vector<uint64_t>> blocks;

  explicit Digests(const std::vector<TensorEntry>& tensors) {
    for (const auto& t : tensors) blocks.emplace_back(t.checksum_blocks);
  }
  // Digests of tensors of these sizes.
  explicit Digests(const std::vector<uint64_t>& nbytes) {
    for (uint64_t n : nbytes) blocks.emplace_back(ChecksumBlockCount(n));
  }
  // Digests the blocks of a chunk whose bytes start at block first_block.
  void DigestChunk(size_t tensor, size_t first_block, const uint8_t* chunk_data, size_t chunk_len);
  uint64_t Tensor(size_t t) const { return CombineBlockDigests(blocks[t]); }
};

// The first checksum block of chunk c (format.h's cell blocks: a chunk
// covers whole blocks of its cell, the last one possibly short).
inline size_t FirstBlock(const TensorEntry& e, size_t c) { return static_cast<size_t>(e.tiles[c].block); }

// The format's checksum of tensor e's bytes at `data` (contiguous, e's
// shape): its cells' blocks, gathered where a cell is narrower than the
// tensor. Parallel over blocks when a pool is given.
uint64_t EntryChecksum(const TensorEntry& e, const uint8_t* data, ThreadPool* pool);

// The set checksum of tensors laid out as `entries`, entry t's bytes at
// data(t).
template <typename F>
uint64_t EntriesSetChecksum(const std::vector<TensorEntry>& entries, F&& data, ThreadPool* pool) {
  std::vector<uint64_t> sums;
  for (size_t t = 0; t < entries.size(); ++t) sums.push_back(EntryChecksum(entries[t], data(t), pool));
  return SetChecksumOf(sums);
}

// Digests the checksum blocks of one chunk from consecutive pieces of it
// (a sweep's segments), into Digests.
class ChunkDigester {
 public:
  ChunkDigester(Digests* digests, size_t tensor, size_t first_block)
      : blocks_(&digests->blocks[tensor]), next_(first_block) {}
  void Update(const uint8_t* data, size_t len) {
    while (len > 0) {
      const size_t take = std::min(len, kChecksumBlockBytes - filled_);
      hasher_.Update(data, take);
      data += take;
      len -= take;
      filled_ += take;
      if (filled_ == kChecksumBlockBytes) Flush();
    }
  }
  // Digests the last (short) block. REQUIRES: every byte of the chunk fed.
  void Finish() {
    if (filled_ > 0) Flush();
  }

 private:
  void Flush() {
    (*blocks_)[next_++] = hasher_.Digest();
    hasher_.Reset();
    filled_ = 0;
  }
  std::vector<uint64_t>* blocks_;
  size_t next_;
  size_t filled_ = 0;
  BlockHasher hasher_;
};

inline void Digests::DigestChunk(size_t tensor, size_t first_block, const uint8_t* chunk_data, size_t chunk_len) {
  ChunkDigester digester(this, tensor, first_block);
  digester.Update(chunk_data, chunk_len);
  digester.Finish();
}

std::string ChunkWhere(const TensorEntry& t, size_t c);

// The entries of a set with the options' grids (InvalidArgument for two
// grids of a tensor, or one of a tensor the set lacks).
StatusOr<std::vector<TensorEntry>> EntriesFor(std::span<const TensorView> set, const EncodeOptions& options);

// FailedPrecondition: chunk `chunk` of t is not in this patch (a selection for other pieces).
Status AbsentChunk(const TensorEntry& t, size_t chunk);

}  // namespace wsync::codec::internal
