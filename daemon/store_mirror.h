// A source's versions mirrored into an object store (docs/object-store.md),
// for pullers that reach no daemon of the cluster. After each version is
// announced, a background thread uploads its patch from the previous
// version (and a keyframe: the first version, every `keyframe_every`, and
// whenever the previous version did not reach the store, so that the store
// never holds a version nothing in it reaches; every `merge_every`, a merged
// patch from that many versions back), then its manifest and the head
// (store::VersionWriter). Versions older than `keep_versions` behind
// the newest are collected (0: all kept).
//
// The trainer never waits for the store: Published only queues. A failed
// upload is retried (1 s, doubling to 30 s) while its version is the newest
// waiting; once a newer one waits, the failed one is dropped (logged) and
// the newer goes up with a keyframe. With a signing key, every manifest is
// signed (pullers given the public key accept nothing else).
//
// Thread safety: thread-safe.
#pragma once

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include "version_history.h"
#include "wsync/store/object_store.h"
#include "wsync/store/versions.h"

namespace wsync::daemon {

struct StoreMirrorOptions {
  std::string url;  // s3://BUCKET?endpoint=... (credentials: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)
  std::string run;  // the key prefix of this run's versions
  uint64_t keyframe_every = 16;
  // Every N versions also a merged patch from N versions back (when the
  // store holds that version and the history still serves it), so that a
  // puller N behind fetches one patch, not N; 0: none.
  uint64_t merge_every = 4;
  uint64_t keep_versions = 0;
  std::string signing_key;  // Ed25519 private key (PEM) every manifest is signed with; empty: unsigned
};

class StoreMirror {
 public:
  // InvalidArgument for a bad URL; the store itself is first reached by
  // the first upload. REQUIRES: history outlives the mirror.
  static StatusOr<std::unique_ptr<StoreMirror>> Start(const StoreMirrorOptions& options, PatchProvider* history);
  ~StoreMirror();

  // Queues an announced version for upload.
  void Published(const PublishedVersion& pub);

  struct Stats {
    uint64_t uploaded = 0;  // the newest version in the store
    uint64_t versions_uploaded = 0, keyframes_uploaded = 0, merged_uploaded = 0, failures = 0, dropped = 0;
    uint64_t bytes_uploaded = 0;
    Status last_error;
  };
  Stats stats() const;
  // Blocks until `version` is in the store or was dropped, or the deadline
  // (tests, shutdown).
  bool WaitUploaded(uint64_t version, std::chrono::steady_clock::time_point deadline) const;

 private:
  StoreMirror(const StoreMirrorOptions& options, std::unique_ptr<store::ObjectStore> store,
              std::unique_ptr<store::Signer> signer, PatchProvider* history);
  void Loop();
  Status Upload(const PublishedVersion& pub, bool keyframe);
  StatusOr<std::string> Bytes(uint64_t from, uint64_t to);

  const StoreMirrorOptions options_;
  std::unique_ptr<store::ObjectStore> store_;
  std::unique_ptr<store::Signer> signer_;
  store::VersionWriter writer_;
  PatchProvider* history_;
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  std::deque<PublishedVersion> queue_;
  Stats stats_;
  uint64_t last_keyframe_ = 0;
  std::set<uint64_t> in_store_;  // versions uploaded (the bases a merged patch may start from)
  uint64_t done_ = 0;  // the newest version uploaded or dropped
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace wsync::daemon
