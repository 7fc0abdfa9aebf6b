// A coordinator that follows a run in an object store (docs/object-store.md,
// "A region that reads the store"): it announces the newest version a
// source mirrored there, as that source announced it to its own cluster's
// coordinator, so that sinks given the store (wsyncd sink --store) follow
// the run with no source and no connection to the trainer's cluster. The
// sink that reads the store relays to the others over the region's tree.
//
// Each round (every poll_ms, backing off to 30 s while the store fails):
// the store's newest version; if above the head, its manifest (checked
// against the run's public key when one is given) and the announcement:
// the version, its set checksum, and its patch from the head when the
// store holds one. A version whose manifest fails is not announced, and
// said once.
//
// Thread safety: thread-safe.
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "wsync/control/coordinator_state.h"
#include "wsync/store/object_store.h"
#include "wsync/store/signing.h"
#include "wsync/store/versions.h"

namespace wsync::daemon {

struct StoreFollowOptions {
  std::string url;         // s3://BUCKET?endpoint=... (empty: none); credentials from AWS_* or none
  std::string run;         // the run's key prefix
  std::string verify_key;  // the run's Ed25519 public key (PEM): only manifests it verifies; empty: any
  uint64_t poll_ms = 1000;
};

class StoreFollower {
 public:
  // InvalidArgument for a bad URL or run, the key's error when it does not
  // load. REQUIRES: state outlives the follower.
  static StatusOr<std::unique_ptr<StoreFollower>> Start(const StoreFollowOptions& options,
                                                        control::CoordinatorState* state);
  ~StoreFollower();

 private:
  StoreFollower(const StoreFollowOptions& options, std::unique_ptr<store::ObjectStore> store,
                std::unique_ptr<store::Verifier> verifier, control::CoordinatorState* state);
  void Loop();
  // One round; the version announced, or 0.
  StatusOr<uint64_t> Round();

  const StoreFollowOptions options_;
  std::unique_ptr<store::ObjectStore> store_;
  std::unique_ptr<store::Verifier> verifier_;
  store::VersionReader reader_;
  control::CoordinatorState* state_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace wsync::daemon
