// The control plane's clock for tests (a test double; link wsync::control_testing).
#pragma once

#include <atomic>
#include <cstdint>

#include "wsync/control/clock.h"

namespace wsync::control {

// A clock that moves only when told. Thread-safe.
class FakeClock : public Clock {
 public:
  explicit FakeClock(int64_t start_ms = 1'700'000'000'000) : now_(start_ms) {}
  int64_t NowMs() const override { return now_.load(); }
  void Advance(int64_t ms) { now_ += ms; }

 private:
  std::atomic<int64_t> now_;
};

}  // namespace wsync::control
