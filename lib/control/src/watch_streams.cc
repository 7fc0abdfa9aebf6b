#include "watch_streams.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <vector>

#include <spdlog/spdlog.h>

namespace wsync::control {

namespace v1 = wsync::v1;

// ---- WatchReactor

WatchReactor::WatchReactor(WatchHub* hub, std::shared_ptr<CoordinatorState> state, const v1::WatchRequest& req)
    : hub_(hub), state_(std::move(state)), after_(req.after()), node_(req.node()), incarnation_(req.incarnation()) {}

void WatchReactor::Unref() {
  if (refs_.fetch_sub(1) == 1) delete this;
}

bool WatchReactor::Pump(const v1::ListVersionsResponse* listed, uint64_t listed_after) {
  std::unique_lock<std::mutex> lock(mu_);
  if (ended_ || writing_) return false;
  if (pending_.empty()) {
    if (listed != nullptr && after_ >= listed_after) {
      for (const auto& v : listed->versions()) {
        if (v.version() > after_) pending_.push_back(v);
      }
    } else {
      v1::ListVersionsResponse own = state_->ListVersions(after_);
      for (auto& v : *own.mutable_versions()) pending_.push_back(std::move(v));
    }
  }
  if (pending_.empty()) return false;
  out_ = std::move(pending_.front());
  pending_.pop_front();
  writing_ = true;
  lock.unlock();
  hub_->WriteStarted();
  StartWrite(&out_);
  return true;
}

void WatchReactor::End() {
  bool finish;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ended_ = true;
    finish = TakeFinishLocked();
  }
  if (finish) Finish(grpc::Status::OK);
}

void WatchReactor::OnWriteDone(bool ok) {
  hub_->WriteDone();
  Ref();
  bool finish = false, more = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    writing_ = false;
    if (ok) {
      after_ = out_.version();
    } else {
      BrokenLocked();
    }
    finish = TakeFinishLocked();
    more = !ended_;
  }
  if (finish) Finish(grpc::Status::OK);
  if (more) Pump();
  Unref();
}

void WatchReactor::OnCancel() {
  Ref();
  bool finish;
  {
    std::lock_guard<std::mutex> lock(mu_);
    BrokenLocked();
    finish = TakeFinishLocked();
  }
  if (finish) Finish(grpc::Status::OK);
  Unref();
}

void WatchReactor::OnDone() {
  hub_->Remove(this);
  Unref();
}

void WatchReactor::BrokenLocked() {
  if (ended_) return;
  ended_ = true;
  // The caller's process is gone (or its connection): the coordinator sees the node go now.
  if (!node_.empty() && !hub_->stopping() && hub_->Holds(state_.get())) state_->WatchBroken(node_, incarnation_);
}

bool WatchReactor::TakeFinishLocked() {
  if (!ended_ || writing_ || finished_) return false;
  finished_ = true;
  return true;
}

// ---- WatchHub

WatchHub::WatchHub(StateHolder* holder) : holder_(holder), thread_([this] { Run(); }) {}

WatchHub::~WatchHub() { Stop(); }

void WatchHub::Stop() {
  if (stopping_.exchange(true)) return;
  if (thread_.joinable()) thread_.join();
  ForEach([](WatchReactor* r) { r->End(); });
}

bool WatchHub::Holds(const CoordinatorState* state) const {
  auto now = holder_->Current();
  return now.ok() && now->get() == state;
}

void WatchHub::Add(WatchReactor* r) {
  r->Ref();
  {
    std::lock_guard<std::mutex> lock(mu_);
    reactors_.insert(r);
  }
  if (stopping_) {
    r->End();
  } else {
    r->Pump();
  }
  r->Unref();
}

void WatchHub::Remove(WatchReactor* r) {
  std::lock_guard<std::mutex> lock(mu_);
  reactors_.erase(r);
}

void WatchHub::WriteStarted() {
  std::lock_guard<std::mutex> lock(writes_mu_);
  ++writes_in_flight_;
}

void WatchHub::WriteDone() {
  std::lock_guard<std::mutex> lock(writes_mu_);
  if (writes_in_flight_ > 0) --writes_in_flight_;
  if (writes_in_flight_ <= kSlice / 2) writes_cv_.notify_all();
}

void WatchHub::AwaitSlice() {
  std::unique_lock<std::mutex> lock(writes_mu_);
  // Writes stuck under callers that stopped reading cost at most the wait.
  writes_cv_.wait_for(lock, kSliceWait, [this] { return writes_in_flight_ <= kSlice / 2 || stopping_; });
}

void WatchHub::ForEach(const std::function<void(WatchReactor*)>& f) {
  std::vector<WatchReactor*> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    all.assign(reactors_.begin(), reactors_.end());
    for (WatchReactor* r : all) r->Ref();
  }
  for (WatchReactor* r : all) {
    f(r);
    r->Unref();
  }
}

void WatchHub::Run() {
  // Below the threads that answer calls: while a version goes out to a
  // large fleet, heartbeats are still answered (Linux: a thread's own nice).
  if (setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), kNice) != 0) {
    spdlog::debug("watch streams: the writing thread keeps its priority: {}", std::strerror(errno));
  }
  const CoordinatorState* served = nullptr;
  uint64_t seen = 0;
  uint64_t listed_after = 0;  // the newest version the streams were given
  while (!stopping_) {
    auto state = holder_->Current();
    const CoordinatorState* now = state.ok() ? state->get() : nullptr;
    if (now != served) {  // streams of a state no longer served end; their watchers find the leader
      served = now;
      seen = now ? now->versions_generation() : 0;
      listed_after = now ? now->head() : 0;
      ForEach([&](WatchReactor* r) {
        if (r->state() != served) r->End();
      });
    }
    if (now == nullptr) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      continue;
    }
    const uint64_t gen = now->WaitForVersions(seen, std::chrono::steady_clock::now() + std::chrono::milliseconds(100));
    if (gen == seen) continue;
    seen = gen;
    // One listing for every stream: a fleet's streams do not each take the state's lock.
    const v1::ListVersionsResponse listed = now->ListVersions(listed_after);
    size_t started = 0;
    ForEach([&](WatchReactor* r) {
      if (r->state() != served || !r->Pump(&listed, listed_after)) return;
      if (++started % kSlice == 0) AwaitSlice();
    });
    for (const auto& v : listed.versions()) listed_after = std::max(listed_after, v.version());
  }
}

}  // namespace wsync::control
