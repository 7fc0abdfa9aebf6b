// A UCX peer process killed with SIGKILL is detected (error handling mode
// PEER) and reported once; sends to it then fail instead of hanging.
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>

#include <condition_variable>
#include <mutex>

#include "wsync/transport/transport.h"

extern char** environ;

namespace wsync::transport {
namespace {

class Events : public Handler {
 public:
  void OnMessage(Message m) override {
    std::lock_guard<std::mutex> lock(mu);
    from = m.peer;
    cv.notify_all();
  }
  void OnCorrupt(PeerId, uint32_t, uint64_t) override {}
  void OnPeerFailed(PeerId peer, const Status& why) override {
    std::lock_guard<std::mutex> lock(mu);
    failed = peer;
    ++failures;
    cv.notify_all();
  }
  std::mutex mu;
  std::condition_variable cv;
  PeerId from = 0, failed = 0;
  int failures = 0;
};

TEST(UcxPeerFailure, KilledPeerProcessIsDetected) {
  Events events;
  TransportOptions o;
  auto t = CreateUcxTransport(o, &events);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  std::string info = (*t)->LocalConnInfo();
  std::vector<char*> argv = {const_cast<char*>(PEER_BINARY), info.data(), nullptr};
  pid_t pid = 0;
  ASSERT_EQ(posix_spawn(&pid, PEER_BINARY, nullptr, nullptr, argv.data(), environ), 0);
  {
    std::unique_lock<std::mutex> lock(events.mu);
    ASSERT_TRUE(events.cv.wait_for(lock, std::chrono::seconds(20), [&] { return events.from != 0; }));
  }
  ::kill(pid, SIGKILL);
  int status;
  ::waitpid(pid, &status, 0);
  // The failure shows up at once (connection reset) or on the next send.
  for (int i = 0; i < 200; ++i) {
    {
      std::lock_guard<std::mutex> lock(events.mu);
      if (events.failures > 0) break;
    }
    (void)(*t)->Send(events.from, 0, i, std::string(4096, 'x'));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  std::lock_guard<std::mutex> lock(events.mu);
  EXPECT_EQ(events.failures, 1);
  EXPECT_EQ(events.failed, events.from);
}

}  // namespace
}  // namespace wsync::transport
