// A daemon's membership at the coordinator: it registers, heartbeats every
// quarter of its TTL (or at the period the coordinator's last answer asked
// for: a large fleet is paced), registers again when the coordinator has forgotten it
// (NotFound / Aborted: marked dead, or the coordinator restarted without
// it), and heartbeats on demand. The role plugs in through hooks: what a
// heartbeat carries, what its answer means, what follows a registration.
//
// Thread safety: thread-safe; Start/Stop from one thread.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>

#include "wsync/control/client.h"
#include "wsync/v1/coordinator.pb.h"

namespace wsync::daemon {

class Membership {
 public:
  struct Hooks {
    std::function<void(wsync::v1::HeartbeatRequest*)> fill;
    std::function<void(const wsync::v1::HeartbeatResponse&)> on_heartbeat;
    std::function<void(const wsync::v1::Node&)> after_register;
  };
  // REQUIRES: coordinator outlives this. `registration` is sent as is.
  Membership(control::CoordinatorClient* coordinator, wsync::v1::RegisterRequest registration, Hooks hooks)
      : coordinator_(coordinator), registration_(std::move(registration)), hooks_(std::move(hooks)) {}
  ~Membership() { Stop(); }

  Status Register();
  // The heartbeat thread (after a first Register()).
  void Start();
  void Stop();
  // Heartbeats now (registering again if needed) and waits up to `timeout`
  // for that round to finish.
  void HeartbeatNow(std::chrono::milliseconds timeout);
  uint64_t incarnation() const { return incarnation_.load(); }
  const std::string& name() const { return registration_.name(); }
  // The period of the next heartbeats.
  std::chrono::milliseconds period() const;

 private:
  void Loop();

  control::CoordinatorClient* coordinator_;
  const wsync::v1::RegisterRequest registration_;
  const Hooks hooks_;
  std::atomic<uint64_t> incarnation_{0};
  std::atomic<uint64_t> period_ms_{0};  // as the last heartbeat's answer asked (0: a quarter of the TTL)
  std::mutex mu_;
  std::condition_variable wake_;
  bool stopping_ = false;
  uint64_t rounds_ = 0;        // under mu_
  bool now_ = false;           // under mu_
  bool in_flight_ = false;     // under mu_
  std::thread thread_;
};

}  // namespace wsync::daemon
