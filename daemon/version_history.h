// The source's memory of versions: what it needs to bring any leased or live
// sink to the head, and nothing older (DESIGN.md, "Versions, leases").
//
// It keeps the head's weights, the weights of the oldest version still needed
// and the chain of patches between them. A pull (from, to) is answered with
// the merged patch from `from` to `to` (encoded against `from`, whose weights
// are rebuilt from the oldest copy), or with a keyframe of `to` when `from`
// is 0, unknown or older than the oldest kept. Results are cached.
//
// Thread safety: thread-safe; Publish and Retain are serialized with pulls.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "wsync/exchange/exchange.h"
#include "wsync/buffers/safetensors.h"
#include "wsync/codec/codec.h"

namespace wsync::daemon {

using exchange::PatchProvider;
using exchange::PatchStream;

struct PublishedVersion {
  uint64_t version = 0;
  uint64_t base_version = 0;  // 0 for the first (a keyframe)
  uint64_t patch_bytes = 0;   // the patch from the previous version (keyframe bytes for the first)
  uint64_t dense_bytes = 0;
  uint64_t set_checksum = 0;  // of the version's tensors (patch-format.md)
};

class VersionHistory : public PatchProvider {
 public:
  struct Options {
    codec::EncodeOptions encode;          // its pool is used for encode, merge and apply
    uint32_t stream_chunk_bytes = 1u << 20;  // transport chunk size of served streams
    size_t cache_entries = 16;
  };
  explicit VersionHistory(Options options) : options_(std::move(options)) {}

  // Snapshots `weights` (copied: the trainer may continue at once) as
  // `version`, which must be above the head, with the head's names, dtypes
  // and shapes.
  StatusOr<PublishedVersion> Publish(uint64_t version, std::span<const codec::TensorView> weights);

  // Publishes a copy the caller took (`weights`): it becomes the head's copy
  // without another copy, and *weights receives the previous head's buffers
  // (the same layout; zeros after the first version) to take the next copy
  // into. On error *weights is unchanged.
  StatusOr<PublishedVersion> Publish(uint64_t version, std::vector<buffers::OwnedTensor>* weights);

  // Ok when Publish would take `version` with this layout (names, dtypes,
  // shapes): above the head, and the head's layout if there is one.
  Status Accepts(uint64_t version, std::span<const codec::TensorView> layout) const;

  // Where a new version comes from, for weights the history cannot read
  // directly (device memory: daemon/device_source.h).
  struct NewVersion {
    std::span<const codec::TensorView> layout;  // names, dtypes, shapes (data unused)
    // The patch from the head (host copy `head`) to the new weights; not
    // called for the first version.
    std::function<StatusOr<std::string>(std::span<const codec::TensorView> head, const codec::EncodeOptions&)>
        encode;
    // Overwrites the host copy of the head with the new weights (after
    // encode). Always called for the first version.
    std::function<Status(std::vector<buffers::OwnedTensor>& head)> fill;
    // When set, later versions skip `fill`: the host copy of the head is
    // loaded through load_head only when something needs it (a keyframe of
    // the head), so a publish moves only the patch across PCIe.
    std::function<Status(std::vector<buffers::OwnedTensor>& head)> load_head;
  };
  StatusOr<PublishedVersion> Publish(uint64_t version, const NewVersion& next);

  // Forgets what only versions older than `oldest_needed` need: the oldest
  // copy moves forward along the chain (never past the head).
  Status Retain(uint64_t oldest_needed);

  // Loads a lazily kept head copy now (before whatever load_head reads from
  // goes away).
  Status MaterializeHead();

  uint64_t head() const;
  uint64_t oldest() const;

  StatusOr<std::shared_ptr<PatchStream>> Open(uint64_t from, uint64_t to) override;

 private:
  Status AcceptsLocked(uint64_t version, std::span<const codec::TensorView> layout) const;  // REQUIRES: mu_ held
  // Weights of version v (oldest <= v <= head), rebuilt from the oldest copy.
  StatusOr<std::vector<buffers::OwnedTensor>> WeightsAt(uint64_t v);  // REQUIRES: mu_ held

  Options options_;
  mutable std::mutex mu_;
  uint64_t head_ = 0, oldest_ = 0;
  uint64_t head_set_checksum_ = 0;  // SetChecksum of the head version (valid once head_ != 0)
  std::vector<buffers::OwnedTensor> head_weights_, oldest_weights_;
  bool head_stale_ = false;  // head_weights_ is behind: load through head_loader_
  std::function<Status(std::vector<buffers::OwnedTensor>&)> head_loader_;
  Status LoadHeadLocked();  // REQUIRES: mu_ held
  std::map<uint64_t, std::string> patches_;  // version -> patch from the previous version
  std::map<std::pair<uint64_t, uint64_t>, std::shared_ptr<PatchStream>> cache_;
};

}  // namespace wsync::daemon
