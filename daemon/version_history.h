// The source's memory of versions: what it needs to bring any leased or live
// sink to the head, and nothing older (docs/data-plane.md, docs/control-plane.md: versions, leases).
//
// It keeps the head's weights, the weights of the oldest version still needed
// and the chain of patches between them. A pull (from, to) is answered with
// the merged patch from `from` to `to` (encoded against `from`, whose weights
// are rebuilt from the oldest copy), or with a keyframe of `to` when `from`
// is 0, unknown or older than the oldest kept. Results are cached.
//
// Thread safety: thread-safe. Publish and Retain are serialized with each
// other; pulls never wait for them to encode, nor they for a pull's keyframe
// or merge: those are built outside the lock, from weights shared
// immutably (a buffer a pull still reads is never written: Publish and
// Retain write the head's and the oldest copy's buffers in place when no
// pull holds them, fresh ones otherwise). Two pulls of the same stream
// build it once.
#pragma once

#include <condition_variable>
#include <deque>
#include <tuple>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
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
    // Built streams kept: at most this many, and this many bytes (0: twice
    // the model's dense size). Past either, the entry that is cheapest to
    // rebuild for its use goes first (docs/data-plane.md).
    size_t cache_entries = 16;
    uint64_t cache_bytes = 0;
    // Test seam: called outside the lock before a keyframe or merge is built.
    std::function<void(uint64_t from, uint64_t to)> before_build;
    // Streaming (docs/data-plane.md, "Streaming versions"): a version of
    // host weights larger than this (dense bytes) is encoded in segments of
    // whole tensors of about this size, and its patch from the head is
    // served while it is encoded (0: versions are encoded whole).
    uint64_t segment_bytes = 0;
    // Called (on the publishing thread) once the first segment of a version
    // is encoded: its patch is served from then on. patch_bytes and
    // set_checksum are 0 (not known yet).
    std::function<void(const PublishedVersion& early)> on_stream;
    // Test seam: called after each segment is encoded (its index).
    std::function<void(size_t segment)> after_segment;
  };
  explicit VersionHistory(Options options) : options_(std::move(options)) {}

  // The tile grids (codec.h) versions are coded with from the next publish
  // on. Patches merge only over one grid: new grids drop the versions kept
  // below the head (pulls from them get keyframes). InvalidArgument for a
  // grid that does not fit the head's tensors.
  Status SetGrids(std::vector<codec::TileGrid> grids);
  // The layouts of the sinks holding pieces that pull from this history:
  // OpenFor serves each its selection (codec::SelectForPieces).
  void SetServedLayouts(const std::vector<std::vector<codec::RuntimeTensor>>& layouts);

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
    // The new weights in host memory, when they are (data readable): then
    // the version may be encoded in segments and streamed (encode is not
    // called).
    std::span<const codec::TensorView> host;
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

  struct CacheStats {
    uint64_t hits = 0;
    uint64_t builds = 0;     // keyframes and merges built
    uint64_t evictions = 0;
    size_t entries = 0;
    uint64_t bytes = 0;
  };
  CacheStats cache_stats() const;

  StatusOr<std::shared_ptr<PatchStream>> Open(uint64_t from, uint64_t to) override;
  // The selection for a served layout (built from Open's stream; the last
  // two per layout served are kept: a rank's patch and its keyframe, about
  // one model's size in all); Open's whole stream for a layout not served.
  // (A source holds one part: `part` is not looked at.)
  StatusOr<std::shared_ptr<PatchStream>> OpenFor(uint64_t from, uint64_t to, uint64_t layout, uint32_t part) override;

 private:
  using Weights = std::vector<buffers::OwnedTensor>;
  struct Cached {
    std::shared_ptr<PatchStream> stream;
    double cost_s = 0;       // what it took to build (0: a stored patch)
    uint64_t last_use = 0;   // cache access count at its last use
  };
  struct Build;  // a stream being built outside the lock

  Status AcceptsLocked(uint64_t version, std::span<const codec::TensorView> layout) const;  // REQUIRES: mu_ held
  Status LoadHeadLocked();  // REQUIRES: mu_ held
  codec::EncodeOptions CurrentEncodeOptions() const;  // options_.encode with the grids; takes mu_
  // Weights of version v (oldest <= v <= head): the head's copy itself, or
  // the oldest copy with the chain applied (a new buffer). Outside mu_.
  StatusOr<std::shared_ptr<const Weights>> WeightsAt(uint64_t v, std::shared_ptr<const Weights> head_copy,
                                                     uint64_t head_version, std::shared_ptr<const Weights> oldest_copy,
                                                     const std::map<uint64_t, std::shared_ptr<const std::string>>& chain);
  void CacheLocked(std::pair<uint64_t, uint64_t> key, std::shared_ptr<PatchStream> stream, double cost_s);
  // New zeroed buffers of `like`'s layout (for when a pull reads the old ones).
  static std::shared_ptr<Weights> Fresh(const Weights& like);

  // Publish's steps. REQUIRES: publish_mu_ held (only the publishing thread
  // changes the state, so the head they read stays put); each takes mu_
  // only where it says so.
  struct HeadSnapshot {
    std::shared_ptr<const Weights> weights;  // null before the first version
    uint64_t version = 0, set_checksum = 0;
  };
  // Under mu_: checks that `version` may follow the head (AcceptsLocked),
  // loads a lazily kept head copy when `next` fills one, and returns the head.
  StatusOr<HeadSnapshot> SnapshotHead(uint64_t version, const NewVersion& next);
  // The first version (head_ == 0): `out` (version and dense_bytes set)
  // completed. Fills and keyframes new buffers outside mu_, then under it
  // makes them the head and the oldest copy and caches the keyframe.
  StatusOr<PublishedVersion> PublishFirst(const NewVersion& next, PublishedVersion out);
  // A later version: `out` (version and dense_bytes set) completed. Encodes
  // the patch from `head` outside mu_ (EncodeFromHead), then under mu_
  // replaces the head copy (ReplaceHeadCopyLocked) and commits the patch as
  // the new head, ending live_. On error live_ may still be set: the caller
  // ends it (EndLive).
  StatusOr<PublishedVersion> PublishNext(const NewVersion& next, HeadSnapshot head, PublishedVersion out);
  // The patch from `head` to the new version, outside mu_: streamed
  // (EncodeStreamed) when next.host is set, makes several segments and the
  // head's tensor checksums are known; next.encode otherwise.
  StatusOr<std::string> EncodeFromHead(const NewVersion& next, const HeadSnapshot& head, const PublishedVersion& out);
  // The patch from `head` to next.host in segments (codec::EncodeSegmented
  // of about options_.segment_bytes), served while it is encoded: live_ (set
  // under mu_) is its growing stream, finished when all are encoded, failed
  // on an error (live_ stays set either way). Returns the segments joined
  // into one container. Otherwise outside mu_.
  StatusOr<std::string> EncodeStreamed(const Weights& head, const NewVersion& next, const codec::EncodeOptions& eo,
                                       uint64_t dense_bytes);
  // Makes the head copy the new version's: lazily (next.load_head), in the
  // head's buffers when no pull reads them (a failed fill rebuilds them from
  // the oldest copy and the chain, and ends live_), or in fresh buffers,
  // filled with `lock` released. REQUIRES: `lock` holds mu_; it does again
  // on success (on error it may not).
  Status ReplaceHeadCopyLocked(const NewVersion& next, uint64_t version, std::unique_lock<std::mutex>& lock);
  // Takes mu_: no version is live any more; wakes the pulls waiting on it.
  void EndLive();

  Options options_;
  std::mutex publish_mu_;  // serializes Publish and Retain; never held by pulls
  mutable std::mutex mu_;  // the state below; held briefly
  std::vector<codec::TileGrid> grids_;
  std::map<uint64_t, std::vector<codec::RuntimeTensor>> served_;                 // by fingerprint
  std::map<std::tuple<uint64_t, uint64_t, uint64_t>, std::shared_ptr<PatchStream>> selections_;
  std::deque<std::tuple<uint64_t, uint64_t, uint64_t>> selection_order_;        // oldest first
  std::condition_variable built_;
  uint64_t head_ = 0, oldest_ = 0;
  uint64_t head_set_checksum_ = 0;  // SetChecksum of the head version (valid once head_ != 0)
  std::vector<uint64_t> head_sums_;  // its tensor checksums (segments' base checksums)
  // The version being encoded in segments: its patch from the head, served
  // while it grows.
  struct Live {
    uint64_t from = 0, to = 0;
    std::shared_ptr<PatchStream> stream;
  };
  std::optional<Live> live_;
  std::shared_ptr<Weights> head_weights_, oldest_weights_;  // shared with pulls reading them
  bool head_stale_ = false;  // head_weights_ is behind: load through head_loader_
  bool oldest_moving_ = false;  // Retain moves the oldest copy forward in place
  std::function<Status(std::vector<buffers::OwnedTensor>&)> head_loader_;
  std::map<uint64_t, std::shared_ptr<const std::string>> patches_;  // version -> patch from the previous version
  std::map<std::pair<uint64_t, uint64_t>, Cached> cache_;
  std::map<std::pair<uint64_t, uint64_t>, std::shared_ptr<Build>> building_;
  uint64_t grid_epoch_ = 0;  // SetGrids changes so far: builds from before are not cached
  uint64_t accesses_ = 0;
  CacheStats stats_;
};

}  // namespace wsync::daemon
