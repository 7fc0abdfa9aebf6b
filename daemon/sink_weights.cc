#include "sink_weights.h"

#include <spdlog/spdlog.h>

namespace wsync::daemon {

SinkWeights::SinkWeights(std::unique_ptr<WeightStore> store, codec::ApplyOptions options, uint64_t applied_version)
    : store_(std::move(store)), options_(options), applied_(applied_version) {}

SinkWeights::~SinkWeights() = default;

uint64_t SinkWeights::applied() const {
  std::lock_guard<std::mutex> lock(mu_);
  return applied_;
}

Status SinkWeights::Apply(const PatchStream& stream) {
  const PatchStream* one[] = {&stream};
  return ApplyParts(one);
}

Status SinkWeights::ApplyParts(std::span<const PatchStream* const> parts) {
  // The parts as one stream of segments: staged as one.
  std::string stream;
  for (const PatchStream* p : parts) {
    WSYNC_RETURN_IF_ERROR(p->WaitComplete(std::chrono::steady_clock::now()).WithContext("apply"));
    stream += p->Assemble();
  }
  std::unique_ptr<StagedApply> staged = BeginStaged();
  return ApplyStaged(parts, *staged, stream);
}

std::unique_ptr<StagedApply> SinkWeights::BeginStaged() const {
  return store_->BeginStaged(options_);
}

Status SinkWeights::Apply(const PatchStream& stream, StagedApply& ahead, std::string_view bytes) {
  const PatchStream* one[] = {&stream};
  return ApplyStaged(one, ahead, bytes);
}

Status SinkWeights::ApplyStaged(std::span<const PatchStream* const> parts, StagedApply& ahead,
                                std::string_view bytes) {
  using Ms = std::chrono::duration<double, std::milli>;
  // Staged while the engine may still hold (read) the weights: the wait for
  // its holds, then only the writes.
  const auto t0 = std::chrono::steady_clock::now();
  WSYNC_RETURN_IF_ERROR(ahead.Prepare(bytes));
  {
    std::lock_guard<std::mutex> lock(mu_);
    timings_.staging_ms = Ms(std::chrono::steady_clock::now() - t0).count();
    timings_.staged_version = parts.empty() ? 0 : parts[0]->to();
  }
  bool ran = false, wrote = false;
  double apply_ms = 0;
  Status s = ApplyWith(
      parts,
      [&] {
        const auto t1 = std::chrono::steady_clock::now();
        Status applied = ahead.Apply(bytes);
        apply_ms = Ms(std::chrono::steady_clock::now() - t1).count();
        ran = true;
        wrote = applied.ok();
        return applied;
      },
      bytes.size());
  std::unique_lock<std::mutex> lock(mu_);
  timings_.staged_version = 0;
  if (ran) timings_.apply_ms = apply_ms;
  if (!wrote) {
    // Staged and applied but refused: the only cause is a value changed
    // since staging. The apply undid itself, unless it had written changes
    // past the staging budget.
    if (ran && s.code() == StatusCode::kFailedPrecondition) ForeignWriteLocked(s, /*undone=*/true);
    if (ran && s.code() == StatusCode::kDataLoss) {
      applied_ = 0;  // no version: a keyframe repairs them
      ForeignWriteLocked(s, /*undone=*/false);
      cv_.notify_all();
    }
    return s;
  }
  if (const size_t again = ahead.decoded_again()) {
    spdlog::info("version {}: {} chunks' changes past the staging budget (--stage-mib) were decoded again while "
                 "the engine waited",
                 parts.empty() ? 0 : parts[0]->to(), again);
  }
  if (closed_) return s;
  // Read back with the holders reading again: values changed by someone
  // else between staging and the writes.
  confirming_ = true;
  lock.unlock();
  Status confirmed = ahead.Confirm();
  lock.lock();
  confirming_ = false;
  if (!confirmed.ok()) {
    applied_ = 0;  // no version: a keyframe repairs them
    ForeignWriteLocked(confirmed, /*undone=*/false);
  }
  cv_.notify_all();
  return confirmed;
}

void SinkWeights::ForeignWriteLocked(const Status& why, bool undone) {
  ++timings_.foreign_writes;
  spdlog::error("another writer changed the weights between staging a version and applying it: {}; {}",
                why.ToString(),
                undone ? "the apply was undone" : "they hold no version until a keyframe repairs them");
}

SinkWeights::Timings SinkWeights::timings() const {
  std::lock_guard<std::mutex> lock(mu_);
  return timings_;
}

Status SinkWeights::ApplyWith(std::span<const PatchStream* const> parts, const std::function<Status()>& apply,
                              uint64_t bytes) {
  if (parts.empty()) return InvalidArgumentError("no parts to apply");
  const PatchStream& stream = *parts[0];
  for (const PatchStream* p : parts) {
    if (p->to() != stream.to()) {
      return InvalidArgumentError("parts of versions " + std::to_string(stream.to()) + " and " + std::to_string(p->to()));
    }
  }
  std::unique_lock<std::mutex> lock(mu_);
  ++applies_waiting_;
  cv_.wait(lock, [&] { return (holds_ == 0 && !applying_) || closed_; });
  --applies_waiting_;
  if (closed_) {
    cv_.notify_all();
    return AbortedError("the tensors were registered again or unregistered");
  }
  for (const PatchStream* p : parts) {
    if (p->kind() == codec::PatchKind::kPatch && p->from() != applied_) {
      cv_.notify_all();
      return FailedPreconditionError("patch " + std::to_string(p->from()) + "->" + std::to_string(p->to()) +
                                     " does not start at the applied version " + std::to_string(applied_));
    }
  }
  applying_ = true;
  lock.unlock();
  const auto t0 = std::chrono::steady_clock::now();
  Status s = apply();
  lock.lock();
  applying_ = false;
  if (s.ok()) {
    spdlog::info("applied {} {}->{} ({} bytes{}) in {:.1f} ms",
                 stream.kind() == codec::PatchKind::kKeyframe ? "keyframe" : "patch", stream.from(), stream.to(), bytes,
                 parts.size() > 1 ? ", " + std::to_string(parts.size()) + " parts" : "",
                 std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    applied_ = stream.to();
  }
  cv_.notify_all();
  return s;
}

uint64_t SinkWeights::Hold() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return !applying_ && applies_waiting_ == 0; });
  ++holds_;
  return applied_;
}

void SinkWeights::Release() {
  std::lock_guard<std::mutex> lock(mu_);
  if (holds_ > 0) --holds_;
  cv_.notify_all();
}

void SinkWeights::Close() {
  std::unique_lock<std::mutex> lock(mu_);
  closed_ = true;
  cv_.notify_all();
  cv_.wait(lock, [&] { return !applying_ && !confirming_; });
}

void SinkWeights::SetSyncError(const Status& why, bool permanent) {
  std::lock_guard<std::mutex> lock(mu_);
  sync_error_ = why;
  sync_error_permanent_ = permanent && !why.ok();
  cv_.notify_all();
}

Status SinkWeights::sync_error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return sync_error_;
}

Status SinkWeights::WaitForVersion(uint64_t v, std::chrono::steady_clock::time_point deadline) const {
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_until(lock, deadline, [&] { return applied_ >= v || sync_error_permanent_ || closed_; })) {
    std::string why = "version " + std::to_string(v) + " not applied in time (applied: " + std::to_string(applied_) + ")";
    if (!sync_error_.ok()) why += "; last sync error: " + sync_error_.ToString();
    return DeadlineExceededError(why);
  }
  if (applied_ >= v) return Status::Ok();
  if (closed_) return AbortedError("the tensors were registered again or unregistered while waiting");
  return sync_error_;
}

bool SinkWeights::closed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return closed_;
}

}  // namespace wsync::daemon
