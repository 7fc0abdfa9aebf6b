// The source's logic, without gRPC: the trainer's registered tensors, the
// publish sequence (version checks, the layout, the staleness policy,
// snapshot and encode into the version history, announce with bounded
// retries, the background publish of a copy), and what it keeps for
// pullers. Constructed with the interfaces it uses, so that it runs
// in-process against control::InProcessClient in tests; the daemon's local
// API (data_daemon.cc) is a thin adapter over it.
//
// Thread safety: thread-safe; publishes are serialized.
#pragma once

#include <atomic>
#include <optional>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "data_daemon.h"
#include "device_weights.h"
#include "store_mirror.h"
#include "version_history.h"
#include "wsync/buffers/region.h"
#include "wsync/control/client.h"
#include "wsync/util/thread_pool.h"

namespace wsync::daemon {

struct SourceRegistration {
  uint64_t head = 0;                      // the newest version published (here or before a restart)
  std::vector<std::string> cast_to_bf16;  // F32 tensors, published as BF16
};

struct PublishRequest {
  uint64_t version = 0;
  int64_t wait_ms = 0;             // how long the staleness policy may hold it back
  bool return_after_copy = false;  // return once copied; encode and announce in the background
};

struct PublishResult {
  PublishedVersion published;  // version, base, dense bytes (and patch bytes unless pending)
  bool pending = false;        // return_after_copy: encoded and announced in the background
  double copy_ms = 0, encode_ms = 0;
};

struct SourceStatus {
  uint64_t version = 0;  // the history's head
  uint64_t head = 0;     // the newest version the coordinator acknowledged, or that
  size_t tensors = 0;
};

class SourceCore {
 public:
  // Uses config.name, threads, retain_versions, fail_announce. REQUIRES:
  // coordinator and pool outlive this.
  SourceCore(DataDaemonConfig config, control::CoordinatorClient* coordinator, ThreadPool* pool);
  ~SourceCore();

  // What pullers are served from.
  exchange::PatchProvider* provider() { return &history_; }

  // Checks the tensors against the published layout (also across restarts
  // of this source) and takes them.
  // `served`: the runtime layouts of the sinks holding pieces (tensor-parallel
  // ranks); versions are coded with the tile grid that holds them all
  // (codec::GridsFor), published with the layout.
  // `part` of `parts` (> 1): this source publishes these tensors as one part
  // of versions that other sources publish the rest of.
  // `serve_offered`: also the layouts sinks offered to the coordinator, read
  // now and again before every publish (a layout offered since is served
  // from that version on: the tile grids change, sinks behind get keyframes).
  StatusOr<SourceRegistration> RegisterTensors(buffers::MappedTensors tensors,
                                               const std::vector<std::vector<codec::RuntimeTensor>>& served = {},
                                               uint32_t part = 0, uint32_t parts = 1, bool serve_offered = false);
  Status Unregister();
  StatusOr<PublishResult> Publish(const PublishRequest& req);
  // A background publish ends; later publishes are refused.
  void Stop();
  // Mirrors every version announced from now on into the object store of
  // config.store (store_mirror.h); InvalidArgument for a bad store URL.
  Status StartMirror();
  // The mirror's progress; nothing without a store.
  std::optional<StoreMirror::Stats> mirror_stats() const;

  SourceStatus status();

  // Membership hook: keeps what leased or live sinks need.
  void OnHeartbeat(const wsync::v1::HeartbeatResponse& hb);
  // What the heartbeat says of this source: the newest version it holds.
  void FillHeartbeat(wsync::v1::HeartbeatRequest* h) { h->set_source_head(history_.head()); }

 private:
  StatusOr<bool> HeadHoldsTheRegisteredWeights();
  Status CopyToSnapshot(std::span<const codec::TensorView> views);
  Status CheckVersion(uint64_t version);
  std::string DescribeLagging(const wsync::v1::MayPublishResponse& may);
  Status Announce(const PublishedVersion& pub, double ms);
  void AnnounceEarly(const PublishedVersion& early);
  wsync::v1::VersionSummary SummaryOf(const PublishedVersion& pub) const;
  Status JoinBackground();
  // With serve_offered_: re-grids when sinks offered layouts not served yet.
  // REQUIRES: publish_mu_ held, no background publish.
  void ServeNewOffers();
  void WaitBackground();
  bool SleepFor(std::chrono::milliseconds d);  // false once stopping

  const DataDaemonConfig config_;
  control::CoordinatorClient* coordinator_;
  ThreadPool* pool_;
  VersionHistory history_;
  std::atomic<bool> stopping_{false};
  std::mutex stop_mu_;
  std::condition_variable stop_cv_;
  std::mutex publish_mu_;  // one Publish at a time
  // Copies the source takes itself (return-after-copy publishes, and F32
  // tensors cast to BF16): the copy of the version being published (in the
  // background, or now), afterwards the previous head's buffers for the
  // next copy; the thread publishing it and its outcome (all under
  // publish_mu_).
  std::vector<buffers::OwnedTensor> snapshot_;
  std::thread publisher_;
  Status background_status_;
  bool layout_set_ = false;  // the coordinator holds layout_ (under publish_mu_)
  // This source's part of the versions: written by RegisterTensors under
  // publish_mu_ with no publish in flight, read by publishes.
  uint32_t part_ = 0, parts_ = 1;
  // The layouts served (named at registration, and offered), their
  // fingerprints, and whether to serve layouts offered later (under
  // publish_mu_).
  std::vector<std::vector<codec::RuntimeTensor>> served_layouts_;
  std::set<uint64_t> served_fingerprints_;
  bool serve_offered_ = false;
  // The last version this source encoded, and whether the coordinator
  // confirmed it (under publish_mu_; written by the background publisher
  // before JoinBackground returns).
  PublishedVersion head_pub_;
  bool head_announced_ = false;
  // The copy's own threads: the codec's pool may be busy serving a merge.
  ThreadPool copy_pool_;
  // The object store the versions are mirrored to (null: none). Declared
  // after history_: it reads from it until it is destroyed.
  std::unique_ptr<StoreMirror> mirror_;
  std::mutex state_mu_;  // tensors_, layout_, grids_, cast_, device_
  std::unique_ptr<buffers::MappedTensors> tensors_;
  wsync::v1::Layout layout_;  // published layout of tensors_
  std::vector<codec::TileGrid> grids_;  // tensors_'s tile grids (their checksums follow them)
  bool cast_ = false;         // some of tensors_ are F32, published as BF16
  std::unique_ptr<DeviceSource> device_;  // set for device memory
  std::atomic<uint64_t> coordinator_head_{0};
};

}  // namespace wsync::daemon
