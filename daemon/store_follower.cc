#include "store_follower.h"

#include <spdlog/spdlog.h>

#include <algorithm>

#include "wsync/util/text.h"

namespace wsync::daemon {

StatusOr<std::unique_ptr<StoreFollower>> StoreFollower::Start(const StoreFollowOptions& options,
                                                              control::CoordinatorState* state) {
  if (options.run.empty()) return InvalidArgumentError("--store-run: the run's key prefix is empty");
  if (options.poll_ms == 0) return InvalidArgumentError("--store-poll-ms must be above 0");
  WSYNC_ASSIGN_OR_RETURN(auto s3, store::OpenS3Url(options.url));
  WSYNC_ASSIGN_OR_RETURN(auto verifier, store::Verifier::FromPemFileIfAny(options.verify_key));
  return std::unique_ptr<StoreFollower>(new StoreFollower(options, std::move(s3), std::move(verifier), state));
}

StoreFollower::StoreFollower(const StoreFollowOptions& options, std::unique_ptr<store::ObjectStore> store,
                             std::unique_ptr<store::Verifier> verifier, control::CoordinatorState* state)
    : options_(options),
      store_(std::move(store)),
      verifier_(std::move(verifier)),
      reader_(*store_, options.run, 8, uint64_t{8} << 20, verifier_.get()),
      state_(state) {
  spdlog::info("following run {} in {}: its versions are announced here", Quoted(options_.run),
               options_.url.substr(0, options_.url.find('?')));
  thread_ = std::thread([this] { Loop(); });
}

StoreFollower::~StoreFollower() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void StoreFollower::Loop() {
  std::string last_error;
  uint64_t failures = 0;
  for (;;) {
    StatusOr<uint64_t> announced = Round();
    if (announced.ok()) {
      if (failures > 0) spdlog::info("the store answers again");
      failures = 0;
      last_error.clear();
    } else {
      ++failures;
      // Said once per distinct error, not at every poll.
      if (announced.status().ToString() != last_error) {
        last_error = announced.status().ToString();
        spdlog::warn("following run {}: {}", Quoted(options_.run), last_error);
      }
    }
    // While the store fails, polls back off (x2 per failure, to 30 s).
    const uint64_t shift = std::min<uint64_t>(failures, 5);
    const auto delay = std::chrono::milliseconds(std::min<uint64_t>(options_.poll_ms << shift, 30'000));
    std::unique_lock<std::mutex> lock(mu_);
    // (A poll period above 30 s is kept as given.)
    if (cv_.wait_for(lock, std::max(delay, std::chrono::milliseconds(options_.poll_ms)), [&] { return stopping_; })) {
      return;
    }
  }
}

StatusOr<uint64_t> StoreFollower::Round() {
  StatusOr<uint64_t> newest = reader_.Newest();
  if (newest.status().code() == StatusCode::kNotFound) return uint64_t{0};  // nothing published yet
  WSYNC_RETURN_IF_ERROR(newest.status());
  const uint64_t head = state_->head();
  if (*newest <= head) return uint64_t{0};
  WSYNC_ASSIGN_OR_RETURN(store::Manifest m, reader_.ManifestOf(*newest));
  wsync::v1::VersionSummary v;
  v.set_version(m.version);
  v.set_set_checksum(m.set_checksum);
  v.set_source("store");
  v.set_keyframe(true);
  for (const auto& o : m.objects) {
    if (o.kind == store::StoredObject::Kind::kPatch && o.base == head && head != 0) {
      v.set_keyframe(false);
      v.set_base_version(o.base);
      v.set_patch_bytes(o.bytes);
    } else if (o.kind == store::StoredObject::Kind::kKeyframe) {
      v.set_dense_bytes(o.bytes);
      if (v.keyframe()) v.set_patch_bytes(o.bytes);
    }
  }
  StatusOr<uint64_t> published = state_->Publish(v);
  // Another announcement got there first: nothing to do.
  if (published.status().code() == StatusCode::kFailedPrecondition) return uint64_t{0};
  WSYNC_RETURN_IF_ERROR(published.status());
  spdlog::info("version {} of run {} announced from the store", m.version, Quoted(options_.run));
  return m.version;
}

}  // namespace wsync::daemon
