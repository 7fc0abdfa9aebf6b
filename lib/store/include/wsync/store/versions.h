// The versions of a run in an object store (docs/object-store.md): where
// each version's objects go, the manifest that announces a version, and
// the two sides: a writer that uploads a version's objects, then its
// manifest (only if absent), then the head; and a reader that finds the
// cheapest way from the version it holds to another and fetches each object
// with parallel ranged GETs, verified against the manifest before it is
// returned.
//
// Keys under the run's prefix RUN:
//   RUN/versions/<v, 20 digits>/patch-<base, 20 digits>  the patch base -> v
//   RUN/versions/<v, 20 digits>/keyframe                 a keyframe of v
//   RUN/versions/<v, 20 digits>/manifest.json            written last
//   RUN/head                                             {"version": v}
// A version exists for readers once its manifest does: every object it
// lists was uploaded before it. The head is a hint (the newest version
// published); readers that find it stale or missing list the manifests.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "wsync/store/object_store.h"
#include "wsync/store/signing.h"
#include "wsync/util/status.h"

namespace wsync::store {

struct StoredObject {
  enum class Kind { kPatch, kKeyframe };
  Kind kind = Kind::kPatch;
  uint64_t base = 0;  // a patch's base version (0 for a keyframe)
  std::string key;
  uint64_t bytes = 0;
  std::string sha256;  // hex of the object's SHA-256
};

struct Manifest {
  static constexpr std::string_view kFormat = "wsync-store-v1";
  uint64_t version = 0;
  uint64_t set_checksum = 0;  // codec::SetChecksum of the version's tensors
  std::vector<StoredObject> objects;
  std::string signature;  // Ed25519 of SignedBytes(), 128 hex digits (signing.h); empty: unsigned

  std::string ToJson() const;
  // What the signature covers: the manifest without it.
  std::string SignedBytes() const;
  // DataLoss naming what is malformed (an untrusted store's bytes).
  static StatusOr<Manifest> Parse(std::string_view json, std::string_view where);
};

std::string VersionPrefix(std::string_view run, uint64_t version);
std::string PatchKey(std::string_view run, uint64_t version, uint64_t base);
std::string KeyframeKey(std::string_view run, uint64_t version);
std::string ManifestKey(std::string_view run, uint64_t version);
std::string HeadKey(std::string_view run);

// The versions of a run that have a manifest, ascending.
StatusOr<std::vector<uint64_t>> ListVersions(ObjectStore& store, std::string_view run);

class VersionWriter {
 public:
  // signer: signs every manifest (null: unsigned).
  VersionWriter(ObjectStore& store, std::string run, const Signer* signer = nullptr)
      : store_(store), run_(std::move(run)), signer_(signer) {}

  // What Publish uploads of a version: a patch from `base`, or a keyframe.
  struct Upload {
    StoredObject::Kind kind = StoredObject::Kind::kPatch;
    uint64_t base = 0;
    std::string_view bytes;
  };
  // Uploads the objects, then the manifest if no manifest of `version`
  // exists, then the head. A manifest already there that lists the same
  // objects (another uploader of the same bytes) is success; one that
  // differs is FailedPrecondition naming the version, and this call's
  // objects are left for Collect.
  Status Publish(uint64_t version, uint64_t set_checksum, const std::vector<Upload>& uploads);
  // Removes the versions a reader no longer needs to reach `oldest` or any
  // later version: every version below the newest keyframe at or below
  // `oldest` (manifests first, then their objects). Returns how many
  // versions were removed.
  StatusOr<size_t> Collect(uint64_t oldest);

 private:
  ObjectStore& store_;
  const std::string run_;
  const Signer* signer_;
};

class VersionReader {
 public:
  // parallel: ranged GETs in flight per object; range_bytes: their size.
  // verifier: only manifests it verifies are accepted (PermissionDenied
  // otherwise, naming the version); null: any.
  VersionReader(ObjectStore& store, std::string run, int parallel = 8, uint64_t range_bytes = uint64_t{8} << 20,
                const Verifier* verifier = nullptr)
      : store_(store), run_(std::move(run)), parallel_(parallel), range_bytes_(range_bytes), verifier_(verifier) {}

  // The newest version published: the head, or the newest manifest when
  // the head is missing or behind one. NotFound when the run has none.
  StatusOr<uint64_t> Newest();
  StatusOr<Manifest> ManifestOf(uint64_t version);

  // One step of a catch-up: the object to apply to reach `version`.
  struct Step {
    uint64_t version = 0;
    StoredObject object;
  };
  // The fewest bytes from `from` (0: holding nothing) to `to`: a chain of
  // patches, or a keyframe and the patches after it. NotFound when the
  // store holds no way there (say, patches from `from` collected and no
  // keyframe since).
  StatusOr<std::vector<Step>> Plan(uint64_t from, uint64_t to);
  // An object's bytes, fetched in ranges in parallel and verified against
  // its size and SHA-256 (DataLoss naming the key otherwise).
  StatusOr<std::string> Fetch(const StoredObject& object);

 private:
  ObjectStore& store_;
  const std::string run_;
  const int parallel_;
  const uint64_t range_bytes_;
  const Verifier* verifier_;
};

}  // namespace wsync::store
