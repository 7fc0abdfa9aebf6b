// Helpers of the set-level drivers (patch.cc, staged.cc): validation,
// chunk layout, parallel chunk loops, container assembly (private).
#pragma once

#include <algorithm>
#include <functional>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "block_hasher.h"
#include "format.h"
#include "wsync/codec/checksum.h"
#include "wsync/codec/codec.h"
#include "wsync/util/first_error.h"
#include "wsync/util/thread_pool.h"

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

using wsync::FirstError;


Status ValidateOptions(const EncodeOptions& o);
// need_data: a tensor of nonzero size must have a data pointer.
Status ValidateTensor(const TensorView& t, bool need_data = true);
Status ValidateSet(std::span<const TensorView> set, bool need_data = true);
TensorEntry EntryFor(const TensorView& t, uint32_t chunk_bytes);

struct Task {
  size_t tensor;
  size_t chunk;
};

std::vector<Task> TasksOf(const std::vector<TensorEntry>& tensors);

// Runs body(i, entry, chunk_index, n, T{}) for every task, in parallel when a
// pool is given, with n the chunk's elements and T its element type.
template <typename F>
void ForEachChunk(ThreadPool* pool, const Container& c, const std::vector<Task>& tasks, F&& body) {
  ParallelFor(pool, tasks.size(), [&](size_t i) {
    const TensorEntry& t = c.tensors[tasks[i].tensor];
    const size_t n = c.ChunkElements(t, tasks[i].chunk);
    WithWidth(DTypeWidth(t.dtype), [&](auto zero) { body(i, t, tasks[i].chunk, n, zero); });
  });
}

// Per-tensor arrays of checksum-block digests; chunks hold whole blocks.
struct Digests {
  std::vector<std::vector<uint64_t>> blocks;

  explicit Digests(const std::vector<TensorEntry>& tensors) {
    for (const auto& t : tensors) blocks.emplace_back(ChecksumBlockCount(t.nbytes));
  }
  // Digests the blocks of chunk c (chunk_bytes from `chunk_data`).
  void DigestChunk(size_t tensor, size_t c, const uint8_t* chunk_data, size_t chunk_len, uint32_t chunk_bytes);
  uint64_t Tensor(size_t t) const { return CombineBlockDigests(blocks[t]); }
};

// Digests the checksum blocks of one chunk from consecutive pieces of it
// (a sweep's segments), into Digests.
class ChunkDigester {
 public:
  ChunkDigester(Digests* digests, size_t tensor, size_t chunk, uint32_t chunk_bytes)
      : blocks_(&digests->blocks[tensor]), next_(chunk * (chunk_bytes / kChecksumBlockBytes)) {}
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

inline void Digests::DigestChunk(size_t tensor, size_t c, const uint8_t* chunk_data, size_t chunk_len,
                                 uint32_t chunk_bytes) {
  ChunkDigester digester(this, tensor, c, chunk_bytes);
  digester.Update(chunk_data, chunk_len);
  digester.Finish();
}

// Fills chunk entries from encoded chunks in task order and writes the file.
std::string Finish(Container& c, const std::vector<Task>& tasks, std::vector<EncodedChunk>& encoded);

// Matches the container's tensors to destination views by name.
StatusOr<std::vector<const MutableTensorView*>> MatchTensors(const Container& c,
                                                             std::span<const MutableTensorView> dst,
                                                             bool allow_extra);

std::string ChunkWhere(const TensorEntry& t, size_t c);

}  // namespace wsync::codec::internal
