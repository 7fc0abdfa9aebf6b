#include "store_mirror.h"

#include <spdlog/spdlog.h>

#include <algorithm>

namespace wsync::daemon {

StatusOr<std::unique_ptr<StoreMirror>> StoreMirror::Start(const StoreMirrorOptions& options, PatchProvider* history) {
  if (options.run.empty()) return InvalidArgumentError("--store-run: the run's key prefix is empty");
  if (options.keyframe_every == 0) return InvalidArgumentError("--store-keyframe-every must be at least 1");
  WSYNC_ASSIGN_OR_RETURN(auto s3, store::OpenS3Url(options.url));
  std::unique_ptr<store::Signer> signer;
  if (!options.signing_key.empty()) {
    WSYNC_ASSIGN_OR_RETURN(signer, store::Signer::FromPemFile(options.signing_key));
  }
  return std::unique_ptr<StoreMirror>(new StoreMirror(options, std::move(s3), std::move(signer), history));
}

StoreMirror::StoreMirror(const StoreMirrorOptions& options, std::unique_ptr<store::ObjectStore> store,
                         std::unique_ptr<store::Signer> signer, PatchProvider* history)
    : options_(options),
      store_(std::move(store)),
      signer_(std::move(signer)),
      writer_(*store_, options.run, signer_.get()),
      history_(history) {
  thread_ = std::thread([this] { Loop(); });
}

StoreMirror::~StoreMirror() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void StoreMirror::Published(const PublishedVersion& pub) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(pub);
  }
  cv_.notify_all();
}

StoreMirror::Stats StoreMirror::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

bool StoreMirror::WaitUploaded(uint64_t version, std::chrono::steady_clock::time_point deadline) const {
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_until(lock, deadline, [&] { return done_ >= version; });
}

StatusOr<std::string> StoreMirror::Bytes(uint64_t from, uint64_t to) {
  WSYNC_ASSIGN_OR_RETURN(auto stream, history_->Open(from, to));
  WSYNC_RETURN_IF_ERROR(stream->WaitComplete(std::chrono::steady_clock::now() + std::chrono::minutes(10)));
  return stream->Assemble();
}

Status StoreMirror::Upload(const PublishedVersion& pub, bool keyframe) {
  std::string patch, key, merged;
  std::vector<store::VersionWriter::Upload> uploads;
  if (pub.base_version > 0) {
    WSYNC_ASSIGN_OR_RETURN(patch, Bytes(pub.base_version, pub.version));
    uploads.push_back({store::StoredObject::Kind::kPatch, pub.base_version, patch});
  }
  // A merged patch for pullers merge_every behind, from a version the
  // store holds, while the history still serves it (it merges).
  const uint64_t from = pub.version > options_.merge_every ? pub.version - options_.merge_every : 0;
  if (options_.merge_every > 1 && pub.version % options_.merge_every == 0 && from > 0 &&
      from != pub.base_version && in_store_.count(from)) {
    auto bytes = Bytes(from, pub.version);
    if (bytes.ok()) {
      merged = std::move(*bytes);
      uploads.push_back({store::StoredObject::Kind::kPatch, from, merged});
    } else {
      spdlog::info("store: no merged patch {} -> {}: {}", from, pub.version, bytes.status().ToString());
    }
  }
  if (keyframe || pub.base_version == 0) {
    WSYNC_ASSIGN_OR_RETURN(key, Bytes(0, pub.version));
    uploads.push_back({store::StoredObject::Kind::kKeyframe, 0, key});
  }
  WSYNC_RETURN_IF_ERROR(writer_.Publish(pub.version, pub.set_checksum, uploads));
  in_store_.insert(pub.version);
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.bytes_uploaded += patch.size() + key.size() + merged.size();
    if (!key.empty()) ++stats_.keyframes_uploaded;
    if (!merged.empty()) ++stats_.merged_uploaded;
  }
  if (!key.empty()) last_keyframe_ = pub.version;
  if (options_.keep_versions > 0 && pub.version > options_.keep_versions) {
    auto removed = writer_.Collect(pub.version - options_.keep_versions);
    if (!removed.ok()) spdlog::warn("store: collecting old versions: {}", removed.status().ToString());
    // What Collect may have removed is no base for a merged patch any more.
    in_store_.erase(in_store_.begin(), in_store_.lower_bound(pub.version - options_.keep_versions));
  }
  return Status::Ok();
}

void StoreMirror::Loop() {
  std::chrono::milliseconds backoff{1000};
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
    if (stopping_) return;
    const PublishedVersion pub = queue_.front();
    const uint64_t uploaded = stats_.uploaded;
    lock.unlock();
    // A keyframe when the store lacks the base (nothing in it reaches this
    // version otherwise), at the first version and every keyframe_every.
    const bool keyframe = pub.base_version == 0 || pub.base_version != uploaded ||
                          pub.version - last_keyframe_ >= options_.keyframe_every;
    const Status s = Upload(pub, keyframe);
    lock.lock();
    if (s.ok()) {
      queue_.pop_front();
      stats_.uploaded = pub.version;
      ++stats_.versions_uploaded;
      done_ = std::max(done_, pub.version);
      backoff = std::chrono::milliseconds(1000);
      cv_.notify_all();
      continue;
    }
    ++stats_.failures;
    stats_.last_error = s;
    if (queue_.size() > 1) {
      spdlog::error("store: version {} not uploaded ({}); dropped for version {}, which goes up with a keyframe",
                    pub.version, s.ToString(), queue_[1].version);
      queue_.pop_front();
      ++stats_.dropped;
      done_ = std::max(done_, pub.version);
      cv_.notify_all();
      continue;
    }
    spdlog::warn("store: version {} not uploaded, retrying in {} ms: {}", pub.version, backoff.count(), s.ToString());
    cv_.wait_for(lock, backoff, [&] { return stopping_ || queue_.size() > 1; });
    backoff = std::min(backoff * 2, std::chrono::milliseconds(30'000));
  }
}

}  // namespace wsync::daemon
