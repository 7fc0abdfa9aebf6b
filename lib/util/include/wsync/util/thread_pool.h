// A fixed-size pool of worker threads for data-parallel loops.
//
// Thread safety: ParallelFor may be called from one thread at a time per pool
// (calls are serialized internally); the body runs concurrently on the workers
// and on the calling thread.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>

namespace wsync {

class ThreadPool {
 public:
  // `threads` is the total parallelism including the calling thread; 0 means
  // std::thread::hardware_concurrency(). A pool of 1 runs everything inline.
  explicit ThreadPool(size_t threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  size_t size() const;

  // Runs body(i) for every i in [0, n) and returns when all have finished.
  // Indices are handed out dynamically, so uneven work balances itself.
  // REQUIRES: body does not throw and does not call ParallelFor on this pool.
  void ParallelFor(size_t n, const std::function<void(size_t)>& body);

 private:
  struct Rep;
  std::unique_ptr<Rep> rep_;
};

// pool->ParallelFor(n, body), or body(0..n-1) in order on this thread when
// pool is null.
void ParallelFor(ThreadPool* pool, size_t n, const std::function<void(size_t)>& body);

}  // namespace wsync
