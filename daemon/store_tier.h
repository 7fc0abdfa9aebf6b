// A sink's second tier (docs/object-store.md, "Sinks that read the store"):
// the versions a source mirrors into an object store, read when no daemon
// serves the sink a version (its parent unreachable, none assigned, or
// lacking the version past a wait). Objects are checked as `wsync store
// pull` checks them: each against its manifest's size and SHA-256, the
// manifest against the run's public key when one is given, and the version
// reached against the set checksum the coordinator holds for it, so that a
// store of another run is never applied.
//
// Thread safety: one caller at a time (the sink's sync thread).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "wsync/store/object_store.h"
#include "wsync/store/signing.h"
#include "wsync/store/versions.h"
#include "wsync/util/status.h"

namespace wsync::daemon {

struct StoreTierOptions {
  std::string url;         // s3://BUCKET?endpoint=... (empty: no store tier); credentials from AWS_* or none
  std::string run;         // the run's key prefix
  std::string verify_key;  // the run's Ed25519 public key (PEM): only manifests it verifies; empty: any
  int parallel = 8;        // ranged GETs in flight per object
  uint64_t range_bytes = uint64_t{8} << 20;
  // How long a parent that lacks the version (a relay still receiving it)
  // is waited for before the store is read. An unreachable parent, or none,
  // sends the sink to the store at once.
  uint64_t wait_ms = 2000;
};

class StoreTier {
 public:
  // InvalidArgument for a bad URL or run, the key's error when it does not
  // load; the store itself is first reached by the first Plan.
  static StatusOr<std::unique_ptr<StoreTier>> Open(const StoreTierOptions& options);

  struct Plan {
    uint64_t version = 0;        // the version the steps reach
    uint64_t set_checksum = 0;   // its manifest's
    std::vector<store::VersionReader::Step> steps;
  };
  // The fewest bytes from `from` (0: nothing held) to the newest version in
  // the store at or below `head`. NotFound when the store holds no version
  // above `from` yet (the source mirrors a version after announcing it).
  StatusOr<Plan> PlanTo(uint64_t from, uint64_t head);
  // An object's bytes, verified against its manifest.
  StatusOr<std::string> Fetch(const store::StoredObject& object) { return reader_.Fetch(object); }

  // "the store at s3://... (run R)", for logs and errors.
  const std::string& where() const { return where_; }
  const StoreTierOptions& options() const { return options_; }

 private:
  StoreTier(const StoreTierOptions& options, std::unique_ptr<store::ObjectStore> store,
            std::unique_ptr<store::Verifier> verifier);

  const StoreTierOptions options_;
  const std::string where_;
  std::unique_ptr<store::ObjectStore> store_;
  std::unique_ptr<store::Verifier> verifier_;
  store::VersionReader reader_;
};

}  // namespace wsync::daemon
