#include "membership.h"

#include <spdlog/spdlog.h>

namespace wsync::daemon {

Status Membership::Register() {
  WSYNC_ASSIGN_OR_RETURN(auto resp, coordinator_->Register(registration_));
  incarnation_ = resp.node().incarnation();
  period_ms_ = 0;  // a new incarnation heartbeats every quarter of its TTL until told otherwise
  if (hooks_.after_register) hooks_.after_register(resp.node());
  return Status::Ok();
}

void Membership::Start() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!thread_.joinable() && !stopping_) thread_ = std::thread([this] { Loop(); });
}

void Membership::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    wake_.notify_all();
  }
  if (thread_.joinable()) thread_.join();
}

void Membership::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    in_flight_ = true;
    lock.unlock();
    wsync::v1::HeartbeatRequest h;
    h.set_name(registration_.name());
    h.set_incarnation(incarnation_);
    if (hooks_.fill) hooks_.fill(&h);
    auto resp = coordinator_->Heartbeat(h);
    if (resp.ok()) {
      period_ms_ = resp->heartbeat_interval_ms();
      if (hooks_.on_heartbeat) hooks_.on_heartbeat(*resp);
    } else if (resp.status().code() == StatusCode::kNotFound || resp.status().code() == StatusCode::kAborted) {
      spdlog::warn("{}: {}; registering again", registration_.name(), resp.status().ToString());
      if (Status s = Register(); !s.ok()) spdlog::warn("{}: register: {}", registration_.name(), s.ToString());
    } else {
      std::lock_guard<std::mutex> stopping(mu_);
      if (!stopping_) spdlog::warn("{}: heartbeat: {}", registration_.name(), resp.status().ToString());
    }
    lock.lock();
    ++rounds_;
    in_flight_ = false;
    wake_.notify_all();
    wake_.wait_for(lock, period(), [&] { return stopping_ || now_; });
    now_ = false;
  }
}

std::chrono::milliseconds Membership::period() const {
  const uint64_t asked = period_ms_.load();
  return std::chrono::milliseconds(asked > 0 ? asked : registration_.ttl_ms() / 4);
}

void Membership::HeartbeatNow(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  // A round in flight may have been sent before the request: wait for the next.
  const uint64_t done = rounds_ + (in_flight_ ? 2 : 1);
  now_ = true;
  wake_.notify_all();
  wake_.wait_for(lock, timeout, [&] { return stopping_ || rounds_ >= done; });
}

}  // namespace wsync::daemon
