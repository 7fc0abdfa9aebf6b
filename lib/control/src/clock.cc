#include <chrono>

#include "wsync/control/clock.h"

namespace wsync::control {
namespace {

class System : public Clock {
 public:
  int64_t NowMs() const override {
    return std::chrono::duration_cast<std::chrono::milliseconds>(
               std::chrono::system_clock::now().time_since_epoch())
        .count();
  }
};

}  // namespace

Clock* SystemClock() {
  static System clock;
  return &clock;
}

}  // namespace wsync::control
