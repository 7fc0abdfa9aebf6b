// Time source of the control plane, injectable so the state machine is tested
// with a fake clock (wsync/control/testing/fake_clock.h).
#pragma once

#include <cstdint>

namespace wsync::control {

class Clock {
 public:
  virtual ~Clock() = default;
  // Milliseconds since the Unix epoch.
  virtual int64_t NowMs() const = 0;
};

// The system clock.
Clock* SystemClock();

}  // namespace wsync::control
