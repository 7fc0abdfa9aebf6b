// The first error of parallel tasks, by task index.
#pragma once

#include <cstddef>
#include <mutex>

#include "wsync/util/status.h"

namespace wsync {

// Keeps the error of the lowest task index, so errors are deterministic
// whatever the thread interleaving. Thread-safe.
class FirstError {
 public:
  void Record(size_t task, Status s) {
    if (s.ok()) return;
    std::lock_guard<std::mutex> lock(mu_);
    if (status_.ok() || task < task_) {
      status_ = std::move(s);
      task_ = task;
    }
  }
  bool failed() const {
    std::lock_guard<std::mutex> lock(mu_);
    return !status_.ok();
  }
  Status status() const {
    std::lock_guard<std::mutex> lock(mu_);
    return status_;
  }

 private:
  mutable std::mutex mu_;
  Status status_;
  size_t task_ = 0;
};

}  // namespace wsync
