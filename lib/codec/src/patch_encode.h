// The encode side's helpers (private), for the files that write a patch or
// keyframe: encode.cc (which defines them), merge.cc and staged.cc's
// PatchWriter.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "chunk_codec.h"
#include "format.h"
#include "patch_common.h"
#include "wsync/codec/codec.h"
#include "wsync/util/status.h"
#include "wsync/util/thread_pool.h"

namespace wsync::codec::internal {

// InvalidArgument naming the option out of range.
Status ValidateOptions(const EncodeOptions& o);

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

// Fills chunk entries from encoded chunks in task order and writes the file.
std::string Finish(Container& c, const std::vector<Task>& tasks, std::vector<EncodedChunk>& encoded);

}  // namespace wsync::codec::internal
