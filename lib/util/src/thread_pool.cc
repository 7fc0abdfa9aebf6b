#include "wsync/util/thread_pool.h"

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

namespace wsync {

struct ThreadPool::Rep {
  std::mutex call_mu;  // serializes ParallelFor calls

  std::mutex mu;
  std::condition_variable work_cv;
  std::condition_variable done_cv;
  const std::function<void(size_t)>* body = nullptr;
  size_t n = 0;
  std::atomic<size_t> next{0};
  uint64_t generation = 0;
  size_t busy = 0;  // workers still inside the current generation
  bool stop = false;
  std::vector<std::thread> workers;

  void Drain() {
    for (;;) {
      size_t i = next.fetch_add(1, std::memory_order_relaxed);
      if (i >= n) return;
      (*body)(i);
    }
  }

  void WorkerLoop() {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(mu);
    for (;;) {
      work_cv.wait(lock, [&] { return stop || generation != seen; });
      if (stop) return;
      seen = generation;
      lock.unlock();
      Drain();
      lock.lock();
      if (--busy == 0) done_cv.notify_all();
    }
  }
};

ThreadPool::ThreadPool(size_t threads) : rep_(std::make_unique<Rep>()) {
  if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
  for (size_t i = 1; i < threads; ++i) {
    rep_->workers.emplace_back([r = rep_.get()] { r->WorkerLoop(); });
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(rep_->mu);
    rep_->stop = true;
  }
  rep_->work_cv.notify_all();
  for (auto& t : rep_->workers) t.join();
}

size_t ThreadPool::size() const { return rep_->workers.size() + 1; }

void ThreadPool::ParallelFor(size_t n, const std::function<void(size_t)>& body) {
  if (n == 0) return;
  if (rep_->workers.empty() || n == 1) {
    for (size_t i = 0; i < n; ++i) body(i);
    return;
  }
  std::lock_guard<std::mutex> call_lock(rep_->call_mu);
  {
    std::lock_guard<std::mutex> lock(rep_->mu);
    rep_->body = &body;
    rep_->n = n;
    rep_->next.store(0, std::memory_order_relaxed);
    rep_->busy = rep_->workers.size();
    ++rep_->generation;
  }
  rep_->work_cv.notify_all();
  rep_->Drain();
  std::unique_lock<std::mutex> lock(rep_->mu);
  rep_->done_cv.wait(lock, [&] { return rep_->busy == 0; });
  rep_->body = nullptr;
}

void ParallelFor(ThreadPool* pool, size_t n, const std::function<void(size_t)>& body) {
  if (pool != nullptr) {
    pool->ParallelFor(n, body);
  } else {
    for (size_t i = 0; i < n; ++i) body(i);
  }
}

}  // namespace wsync
