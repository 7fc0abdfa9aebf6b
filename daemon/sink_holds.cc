// SinkCore's holds: the inference server's side of keeping the weights
// stable (BeginHold .. ReleaseHold), their retirement with the tensors, and
// the lease loop that mirrors them at the coordinator (sink_core.h).
#include "sink_core.h"

#include <spdlog/spdlog.h>

#include "wsync/util/text.h"

namespace wsync::daemon {

using Clock = std::chrono::steady_clock;

StatusOr<SinkCore::HoldGrant> SinkCore::BeginHold(const std::string& holder, int64_t ttl_ms) {
  auto w = weights();
  if (!w) return NotRegisteredError();
  if (ttl_ms <= 0) ttl_ms = static_cast<int64_t>(config_.hold_ttl_ms);
  if (ttl_ms > 600'000) return InvalidArgumentError("hold TTL above 600000 ms");
  const uint64_t version = w->Hold();  // waits for an apply in progress
  std::lock_guard<std::mutex> lock(holds_mu_);
  const uint64_t id = next_hold_++;
  HoldState& h = holds_[id];
  h.weights = w;
  h.version = version;
  h.holder = holder.substr(0, 200);
  h.since = Clock::now();
  h.expires = h.since + std::chrono::milliseconds(ttl_ms);
  h.ttl_ms = ttl_ms;
  holds_cv_.notify_all();  // the lease loop mirrors it
  return HoldGrant{id, version, ttl_ms};
}

std::string SinkCore::AwaitHold(uint64_t id, const std::function<bool()>& cancelled) {
  std::string why;
  {
    std::unique_lock<std::mutex> lock(holds_mu_);
    for (;;) {
      auto it = holds_.find(id);
      if (it == holds_.end()) return "released";  // released by id or retired
      if (cancelled()) {
        why = "the holder cancelled the call or its connection closed";
        break;
      }
      if (Clock::now() >= it->second.expires) {
        why = "not renewed within its TTL of " + std::to_string(it->second.ttl_ms) + " ms";
        break;
      }
      if (stopping_) {
        why = "the sink is shutting down";
        break;
      }
      holds_cv_.wait_for(lock, std::chrono::milliseconds(20));
    }
  }
  EndHold(id, why);
  return why;
}

namespace {

std::string HoldGone(uint64_t id) {
  return "hold " + std::to_string(id) + " is not held (released, not renewed within its TTL, its connection "
         "closed, or the tensors were registered again)";
}

}  // namespace

Status SinkCore::RenewHold(uint64_t id) {
  std::lock_guard<std::mutex> lock(holds_mu_);
  auto it = holds_.find(id);
  if (it == holds_.end()) return NotFoundError(HoldGone(id));
  it->second.expires = Clock::now() + std::chrono::milliseconds(it->second.ttl_ms);
  return Status::Ok();
}

Status SinkCore::ReleaseHold(uint64_t id) {
  return EndHold(id, "released") ? Status::Ok() : NotFoundError(HoldGone(id));
}

// Ends hold `id` (releasing the weights); false if it is not held.
bool SinkCore::EndHold(uint64_t id, const std::string& why) {
  std::lock_guard<std::mutex> lock(holds_mu_);
  auto it = holds_.find(id);
  if (it == holds_.end()) return false;
  it->second.weights->Release();
  if (it->second.lease_id != 0) leases_to_release_.push_back(it->second.lease_id);
  const double held_s = std::chrono::duration<double>(Clock::now() - it->second.since).count();
  if (why == "released") {
    spdlog::debug("sink {}: hold {} released after {:.3f} s", config_.name, id, held_s);
  } else {
    spdlog::warn("sink {}: hold {} of {} ended after {:.1f} s: {}", config_.name, id,
                 it->second.holder.empty() ? "a holder" : Quoted(it->second.holder), held_s, why);
  }
  holds_.erase(it);
  holds_cv_.notify_all();
  return true;
}

// Ends every hold on `old`, then closes it (an apply into it completes).
void SinkCore::Retire(const std::shared_ptr<SinkWeights>& old, const std::string& why) {
  std::vector<uint64_t> ids;
  {
    std::lock_guard<std::mutex> lock(holds_mu_);
    for (const auto& [id, h] : holds_) {
      if (h.weights == old) ids.push_back(id);
    }
  }
  for (uint64_t id : ids) EndHold(id, why);
  old->Close();
}

std::pair<uint32_t, int64_t> SinkCore::HoldSummary() {
  std::lock_guard<std::mutex> lock(holds_mu_);
  int64_t oldest = 0;
  for (const auto& [id, h] : holds_) {
    oldest = std::max<int64_t>(oldest, std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - h.since).count());
  }
  return {static_cast<uint32_t>(holds_.size()), oldest};
}

// Mirrors the active holds as coordinator leases (`wsync leases`; the
// source keeps what leased versions need), renewed at a third of their TTL.
void SinkCore::LeaseLoop() {
  std::unique_lock<std::mutex> lock(holds_mu_);
  while (!stopping_) {
    holds_cv_.wait_for(lock, std::chrono::milliseconds(500));
    std::vector<uint64_t> release = std::move(leases_to_release_);
    leases_to_release_.clear();
    struct Renewal {
      uint64_t hold, lease, version;
      int64_t ttl_ms;
    };
    std::vector<Renewal> due;
    const auto now = Clock::now();
    for (const auto& [id, h] : holds_) {
      if (h.lease_id == 0 || now - h.lease_renewed >= std::chrono::milliseconds(h.ttl_ms / 3)) {
        due.push_back({id, h.lease_id, h.version, h.ttl_ms});
      }
    }
    if (release.empty() && due.empty()) continue;
    lock.unlock();
    for (uint64_t lease : release) (void)env_.coordinator->ReleaseLease(lease);
    std::vector<std::pair<uint64_t, uint64_t>> granted;  // hold, lease
    for (const auto& d : due) {
      auto l = d.lease ? env_.coordinator->RenewLease(d.lease, d.ttl_ms)
                       : env_.coordinator->AcquireLease(config_.name, d.version, d.ttl_ms);
      if (l.ok()) {
        granted.push_back({d.hold, l->id()});
      } else if (d.lease != 0 && l.status().code() == StatusCode::kNotFound) {
        granted.push_back({d.hold, 0});  // the lease ended (the node was marked dead): acquire anew
      } else if (!stopping_) {
        spdlog::debug("sink {}: lease for hold {}: {}", config_.name, d.hold, l.status().ToString());
      }
    }
    lock.lock();
    for (const auto& [hold, lease] : granted) {
      auto it = holds_.find(hold);
      if (it == holds_.end()) {
        if (lease != 0) leases_to_release_.push_back(lease);  // ended meanwhile
        continue;
      }
      it->second.lease_id = lease;
      it->second.lease_renewed = Clock::now();
      if (lease == 0) holds_cv_.notify_all();
    }
  }
}

}  // namespace wsync::daemon
