#include "source_core.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdio>
#include <set>
#include <limits>

#include "tensor_layout.h"
#include "wsync/control/layout.h"
#include "wsync/util/text.h"

namespace wsync::daemon {

namespace v1 = wsync::v1;
using Clock = std::chrono::steady_clock;

namespace {

double MillisecondsSince(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// Names, published dtypes and shapes of `views` (data unused), for
// VersionHistory::Accepts.
std::vector<codec::TensorView> LayoutViews(std::span<const codec::TensorView> views) {
  std::vector<codec::TensorView> out(views.begin(), views.end());
  for (auto& t : out) t.dtype = buffers::PublishedDType(t.dtype);
  return out;
}

// A served layout's pieces of this source's tensors (with several sources,
// each serves the pieces of its own part).
std::vector<codec::RuntimeTensor> OwnPieces(std::vector<codec::RuntimeTensor> layout, const std::set<std::string>& mine,
                                            uint32_t parts) {
  for (auto& rt : layout) {
    std::erase_if(rt.pieces, [&](const codec::Piece& p) { return parts > 1 && !mine.count(p.canonical); });
  }
  return layout;
}

// The layouts sinks offered to the coordinator that `canonical` can serve
// (pieces of its tensors within their bounds); the others are left out,
// with a warning naming why.
StatusOr<std::vector<std::vector<codec::RuntimeTensor>>> OfferedLayouts(control::CoordinatorClient* coordinator,
                                                                        std::span<const codec::TensorView> canonical,
                                                                        const std::string& name) {
  WSYNC_ASSIGN_OR_RETURN(auto offered, coordinator->ListOfferedLayouts());
  std::vector<std::vector<codec::RuntimeTensor>> out;
  for (size_t i = 0; i < offered.size(); ++i) {
    auto layout = RuntimeLayoutOf(offered[i]);
    Status s = layout.status();
    if (s.ok()) {
      const std::vector<std::vector<codec::RuntimeTensor>> alone = {*layout};
      s = codec::ValidatePieces(*layout, canonical, codec::GridsFor(alone, canonical));
    }
    if (!s.ok()) {
      spdlog::warn("source {}: a layout offered by a sink is not served: {}", name, s.ToString());
      continue;
    }
    out.push_back(std::move(*layout));
  }
  return out;
}

// The tile grids that hold every served layout, each checked against this
// source's tensors: InvalidArgument naming the first layout they cannot serve.
StatusOr<std::vector<codec::TileGrid>> ServingGrids(std::span<const std::vector<codec::RuntimeTensor>> served,
                                                    std::span<const codec::TensorView> canonical, uint32_t parts) {
  std::set<std::string> mine;
  for (const auto& t : canonical) mine.insert(t.name);
  std::vector<codec::TileGrid> grids = codec::GridsFor(served, canonical);
  for (size_t i = 0; i < served.size(); ++i) {
    if (Status s = codec::ValidatePieces(OwnPieces(served[i], mine, parts), canonical, grids); !s.ok()) {
      return s.WithContext("served layout " + std::to_string(i));
    }
  }
  return grids;
}

// The layout a source publishes for `views` on `grids`: with several
// sources, its tensors marked as its part.
v1::Layout PublishedLayoutOf(std::span<const codec::TensorView> views, std::span<const codec::TileGrid> grids,
                             uint32_t part, uint32_t parts) {
  v1::Layout layout = LayoutOf(views, /*published=*/true, grids);
  if (parts > 1) {
    layout.set_parts(parts);
    for (auto& t : *layout.mutable_tensors()) t.set_part(part);
  }
  return layout;
}

std::set<uint64_t> Fingerprints(std::span<const std::vector<codec::RuntimeTensor>> layouts) {
  std::set<uint64_t> out;
  for (const auto& l : layouts) out.insert(codec::LayoutFingerprint(l));
  return out;
}

}  // namespace

SourceCore::SourceCore(DataDaemonConfig config, control::CoordinatorClient* coordinator, ThreadPool* pool)
    : config_(std::move(config)),
      coordinator_(coordinator),
      pool_(pool),
      history_([this, pool] {
        VersionHistory::Options o;
        o.encode.pool = pool;
        o.segment_bytes = config_.segment_bytes;
        o.on_stream = [this](const PublishedVersion& early) { AnnounceEarly(early); };
        return o;
      }()),
      copy_pool_(config_.threads) {}

SourceCore::~SourceCore() { Stop(); }

void SourceCore::Stop() {
  {
    std::lock_guard<std::mutex> lock(stop_mu_);
    stopping_ = true;
    stop_cv_.notify_all();
  }
  std::lock_guard<std::mutex> publishing(publish_mu_);
  (void)JoinBackground();
}

Status SourceCore::StartMirror() {
  if (config_.store.url.empty()) return Status::Ok();
  WSYNC_ASSIGN_OR_RETURN(mirror_, StoreMirror::Start(config_.store, &history_));
  spdlog::info("source {}: mirroring versions to {} under {}", config_.name, config_.store.url, config_.store.run);
  return Status::Ok();
}

std::optional<StoreMirror::Stats> SourceCore::mirror_stats() const {
  if (!mirror_) return std::nullopt;
  return mirror_->stats();
}

bool SourceCore::SleepFor(std::chrono::milliseconds d) {
  std::unique_lock<std::mutex> lock(stop_mu_);
  return !stop_cv_.wait_for(lock, d, [&] { return stopping_.load(); });
}

StatusOr<SourceRegistration> SourceCore::RegisterTensors(buffers::MappedTensors reg,
                                                         const std::vector<std::vector<codec::RuntimeTensor>>& named,
                                                         uint32_t part, uint32_t parts, bool serve_offered) {
  parts = std::max<uint32_t>(parts, 1);
  if (part >= parts) {
    return InvalidArgumentError("part " + std::to_string(part) + " of " + std::to_string(parts) + " sources");
  }
  const auto views = reg.Views();
  const auto canonical = LayoutViews(views);
  std::vector<std::vector<codec::RuntimeTensor>> served = named;
  if (serve_offered) {
    auto offered = OfferedLayouts(coordinator_, canonical, config_.name);
    if (!offered.ok()) return offered.status().WithContext("the layouts sinks offered (serve_offered_layouts)");
    served.insert(served.end(), offered->begin(), offered->end());
  }
  WSYNC_ASSIGN_OR_RETURN(std::vector<codec::TileGrid> grids, ServingGrids(served, canonical, parts));
  v1::Layout layout = PublishedLayoutOf(views, grids, part, parts);
  // The layout is the coordinator's, also across restarts of this source.
  auto published = coordinator_->GetLayout();
  bool mine_published = false, regrid = false;
  if (published.ok() && published->layout().tensors_size() > 0) {
    const v1::Layout& p = published->layout();
    if (std::max<uint32_t>(p.parts(), 1) != parts) {
      return FailedPreconditionError("the layout published is of " + std::to_string(std::max<uint32_t>(p.parts(), 1)) +
                                     " part(s) (sources); this source registers part " + std::to_string(part) + " of " +
                                     std::to_string(parts));
    }
    const v1::Layout expected = parts > 1 ? control::PartOf(p, part) : p;
    mine_published = expected.tensors_size() > 0;
    if (mine_published) {
      if (auto s = control::CheckLayout(expected, layout, "the registered tensors"); !s.ok()) return s;
      regrid = !control::SameGrids(expected, layout);
    }
  } else if (!published.ok()) {
    spdlog::warn("source {}: layout not checked at registration (checked at the first publish): {}", config_.name,
                 published.status().ToString());
  }
  // Wait for a background publish (it reads the source's copy, not the
  // registered memory, but uses the table); its outcome is the next
  // Publish's to report.
  std::lock_guard<std::mutex> publishing(publish_mu_);
  WaitBackground();
  std::lock_guard<std::mutex> lock(state_mu_);
  WSYNC_RETURN_IF_ERROR(history_.SetGrids(grids));
  history_.SetServedLayouts(served);
  serve_offered_ = serve_offered;
  served_fingerprints_ = Fingerprints(served);
  served_layouts_ = std::move(served);
  const bool keep = reg.on_device() && device_ && device_->Matches(views, reg.device());
  if (device_ && !keep) {
    // The device state goes: the history's head copy must not depend on it.
    WSYNC_RETURN_IF_ERROR(history_.MaterializeHead());
    device_.reset();
  }
  if (reg.on_device() && !device_) {
    WSYNC_ASSIGN_OR_RETURN(device_, DeviceSource::Create(views, reg.device(), config_.device_base, config_.entropy_stage));
  }
  SourceRegistration out;
  for (const auto& t : views) {
    if (buffers::PublishedDType(t.dtype) != t.dtype) out.cast_to_bf16.push_back(t.name);
  }
  cast_ = !out.cast_to_bf16.empty();
  tensors_ = std::make_unique<buffers::MappedTensors>(std::move(reg));
  layout_ = layout;
  grids_ = grids;
  layout_set_ = mine_published;
  part_ = part;
  parts_ = parts;
  if (regrid) {
    // The layouts served changed: recorded now (the history codes on the new
    // grids already), so that sinks of the new layouts may register at once.
    spdlog::info("source {}: the layouts served changed the tile grids: versions from the next one are coded on "
                 "them (sinks behind the head get keyframes)",
                 config_.name);
    v1::Layout l = layout;
    l.set_source(config_.name);
    if (Status s = coordinator_->SetLayout(l); !s.ok()) {
      spdlog::warn("source {}: the new tile grids are recorded at the next publish: {}", config_.name, s.ToString());
      layout_set_ = false;
    }
  }
  // A restarted source learns the head now, so that it names the next valid version.
  if (auto versions = coordinator_->ListVersions(std::numeric_limits<uint64_t>::max()); versions.ok()) {
    coordinator_head_ = std::max(coordinator_head_.load(), versions->head_version());
  }
  out.head = std::max(history_.head(), coordinator_head_.load());
  spdlog::info("source {}: {} registered{}", config_.name, tensors_->description(),
               cast_ ? " (" + std::to_string(out.cast_to_bf16.size()) + " F32 tensors published as BF16)" : "");
  return out;
}

void SourceCore::ServeNewOffers() {
  if (!serve_offered_) return;
  std::lock_guard<std::mutex> lock(state_mu_);
  if (!tensors_) return;
  const auto views = tensors_->Views();
  const auto canonical = LayoutViews(views);
  auto offered = OfferedLayouts(coordinator_, canonical, config_.name);
  if (!offered.ok()) {
    spdlog::warn("source {}: layouts offered since registration not read (served from a later version): {}",
                 config_.name, offered.status().ToString());
    return;
  }
  // Layouts served stay served (their sinks may still run, also when the
  // coordinator that kept their offers restarted); new ones join them.
  std::vector<std::vector<codec::RuntimeTensor>> served = served_layouts_;
  std::set<uint64_t> fingerprints = served_fingerprints_;
  size_t added = 0;
  for (auto& l : *offered) {
    if (fingerprints.insert(codec::LayoutFingerprint(l)).second) {
      served.push_back(std::move(l));
      ++added;
    }
  }
  if (added == 0) return;
  auto grids = ServingGrids(served, canonical, parts_);
  Status s = grids.ok() ? history_.SetGrids(*grids) : grids.status();
  if (!s.ok()) {
    spdlog::warn("source {}: the layouts offered since registration are not served: {}", config_.name, s.ToString());
    return;
  }
  history_.SetServedLayouts(served);
  spdlog::info("source {}: {} new layout(s) offered by sinks: versions from the next one are coded on new tile grids "
               "(sinks behind the head get keyframes)",
               config_.name, added);
  layout_ = PublishedLayoutOf(views, *grids, part_, parts_);
  grids_ = std::move(*grids);
  served_layouts_ = std::move(served);
  served_fingerprints_ = std::move(fingerprints);
  layout_set_ = false;  // this publish records the new grids
}

Status SourceCore::Unregister() {
  std::lock_guard<std::mutex> publishing(publish_mu_);
  WaitBackground();
  std::lock_guard<std::mutex> lock(state_mu_);
  if (!tensors_) return NotRegisteredError();
  if (device_) {
    WSYNC_RETURN_IF_ERROR(history_.MaterializeHead());
    device_.reset();
  }
  tensors_.reset();
  spdlog::info("source {}: tensors unregistered", config_.name);
  return Status::Ok();
}

StatusOr<PublishResult> SourceCore::Publish(const PublishRequest& req) {
  // Publishes are serialized; the registration lock is taken only for the
  // snapshot, so waiting on the staleness policy blocks nothing else.
  std::lock_guard<std::mutex> publishing(publish_mu_);
  // Once StopRole has joined the background publisher, none may start.
  if (stopping_) return UnavailableError("the source is shutting down");
  // A version copied by an earlier Publish is announced first.
  WSYNC_RETURN_IF_ERROR(JoinBackground());
  ServeNewOffers();
  v1::Layout layout;
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    if (!tensors_) return NotRegisteredError();
    layout = layout_;
  }
  if (head_pub_.version != 0 && req.version == head_pub_.version && !head_announced_) {
    // The version is encoded, but the coordinator did not confirm it. The
    // same weights again are a retry: announce it now. Other weights (the
    // trainer stepped on) must not pass as this version.
    WSYNC_ASSIGN_OR_RETURN(bool same, HeadHoldsTheRegisteredWeights());
    if (!same) {
      return FailedPreconditionError("version " + std::to_string(req.version) +
                                     " was encoded from other weights and its announce failed; "
                                     "it cannot be published again with these: the next valid version is " +
                                     std::to_string(req.version + 1))
          .WithReason(reasons::kVersionTaken, {{"version", std::to_string(req.version)},
                                               {"next_version", std::to_string(req.version + 1)}});
    }
    WSYNC_RETURN_IF_ERROR(Announce(head_pub_, 0));
    head_announced_ = true;
    return PublishResult{head_pub_};
  }
  WSYNC_RETURN_IF_ERROR(CheckVersion(req.version));
  if (!layout_set_) {
    // The first publish of this registration fixes (or checks) the layout.
    layout.set_source(config_.name);
    WSYNC_RETURN_IF_ERROR(coordinator_->SetLayout(layout));
    layout_set_ = true;
  }
  WSYNC_ASSIGN_OR_RETURN(auto may, coordinator_->MayPublish(req.version, req.wait_ms));
  if (!may.allowed()) {
    return AbortedError("version " + std::to_string(req.version) + " is held back by the staleness bound" +
                        (req.wait_ms > 0 ? " after waiting " + std::to_string(req.wait_ms) + " ms" : "") +
                        "; lagging sinks: " + DescribeLagging(may));
  }
  const auto t0 = Clock::now();
  StatusOr<PublishedVersion> pub = UnavailableError("not published");
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    const auto views = tensors_->Views();
    if ((req.return_after_copy || cast_) && !device_) {
      // The source's own copy: taken (and cast) now, encoded from it.
      WSYNC_RETURN_IF_ERROR(history_.Accepts(req.version, LayoutViews(views)));
      WSYNC_RETURN_IF_ERROR(CopyToSnapshot(views));
      if (req.return_after_copy) {
        PublishResult pending;
        pending.published.version = req.version;
        pending.published.base_version = history_.head();
        for (const auto& t : snapshot_) pending.published.dense_bytes += t.bytes.size();
        pending.pending = true;
        pending.copy_ms = MillisecondsSince(t0);
        publisher_ = std::thread([this, version = req.version, t0] {
          auto published = history_.Publish(version, &snapshot_);
          if (published.ok()) {
            head_pub_ = *published;
            head_announced_ = false;
          }
          wsync::Status s = published.ok() ? Announce(*published, MillisecondsSince(t0)) : published.status();
          if (published.ok() && s.ok()) head_announced_ = true;
          if (!s.ok()) {
            s = s.WithContext("version " + std::to_string(version) + ", copied and published in the background");
            spdlog::error("source {}: {}", config_.name, s.ToString());
          }
          background_status_ = std::move(s);
        });
        return pending;
      }
      pub = history_.Publish(req.version, &snapshot_);
    } else {
      pub = device_ ? history_.Publish(req.version, device_->Next(views)) : history_.Publish(req.version, views);
    }
  }
  WSYNC_RETURN_IF_ERROR(pub.status());
  head_pub_ = *pub;
  head_announced_ = false;
  const double ms = MillisecondsSince(t0);
  WSYNC_RETURN_IF_ERROR(Announce(*pub, ms));
  head_announced_ = true;
  PublishResult out{*pub};
  out.encode_ms = ms;
  return out;
}

SourceStatus SourceCore::status() {
  std::lock_guard<std::mutex> lock(state_mu_);
  SourceStatus s;
  s.version = history_.head();
  s.head = std::max(history_.head(), coordinator_head_.load());
  s.tensors = tensors_ ? tensors_->table().size() : 0;
  return s;
}

void SourceCore::OnHeartbeat(const v1::HeartbeatResponse& hb) {
  coordinator_head_ = std::max(coordinator_head_.load(), hb.head_version());
  // Keep what leased or live sinks need, and at least the last
  // retain_versions versions: a sink that restarts reports nothing until
  // its server registers its buffers again, and should still catch up
  // with one merged patch rather than a keyframe.
  auto status = coordinator_->GetStatus();
  if (!status.ok()) return;
  const uint64_t head = history_.head();
  const uint64_t window = head > config_.retain_versions ? head - config_.retain_versions : 0;
  uint64_t needed = status->oldest_needed_version() ? status->oldest_needed_version() : head;
  needed = std::max<uint64_t>(std::min(needed, window), 1);
  wsync::Status s = history_.Retain(needed);
  if (!s.ok()) spdlog::warn("source {}: retain: {}", config_.name, s.ToString());
}

// Whether the registered weights, as they would be published now (F32
// cast), are the encoded head's (its set checksum). REQUIRES: publish_mu_.
StatusOr<bool> SourceCore::HeadHoldsTheRegisteredWeights() {
  std::lock_guard<std::mutex> lock(state_mu_);
  const auto views = tensors_->Views();
  if (device_) {
    if (cast_) return false;  // no device checksum of the cast: treated as other weights
    WSYNC_ASSIGN_OR_RETURN(uint64_t sum, TensorsSetChecksum(*tensors_, grids_, pool_));
    return sum == head_pub_.set_checksum;
  }
  if (!cast_) {
    WSYNC_ASSIGN_OR_RETURN(uint64_t sum, codec::SetChecksum(views, grids_, pool_));
    return sum == head_pub_.set_checksum;
  }
  // snapshot_ is scratch between publishes (the previous head's buffers).
  WSYNC_RETURN_IF_ERROR(CopyToSnapshot(views));
  WSYNC_ASSIGN_OR_RETURN(uint64_t sum, codec::SetChecksum(buffers::Views(snapshot_), grids_, pool_));
  return sum == head_pub_.set_checksum;
}

// Copies (and casts) `views` into snapshot_, reallocating it when its
// layout is not theirs. REQUIRES: publish_mu_ and state_mu_ held.
Status SourceCore::CopyToSnapshot(std::span<const codec::TensorView> views) {
  if (buffers::CopyInto(views, snapshot_, &copy_pool_).ok()) return wsync::Status::Ok();
  snapshot_ = buffers::PublishedCopy(views);
  return buffers::CopyInto(views, snapshot_, &copy_pool_);
}

// A version must be above every version the coordinator acknowledged,
// also those published before this source restarted.
Status SourceCore::CheckVersion(uint64_t version) {
  auto versions = coordinator_->ListVersions(std::numeric_limits<uint64_t>::max());
  if (!versions.ok()) return versions.status().WithContext("reading the head version");
  coordinator_head_ = std::max(coordinator_head_.load(), versions->head_version());
  const uint64_t head = std::max(history_.head(), coordinator_head_.load());
  if (version > head) return wsync::Status::Ok();
  return StaleVersionError(version, head);
}

// "rollout-1 at version 3 of 9: 1 hold active for 42.0 s, ..." for the
// sinks a MayPublish named.
std::string SourceCore::DescribeLagging(const v1::MayPublishResponse& may) {
  auto status = coordinator_->GetStatus();
  std::string out;
  for (const auto& name : may.blocking()) {
    if (!out.empty()) out += "; ";
    out += Quoted(name);
    if (!status.ok()) continue;
    for (const auto& n : status->nodes()) {
      if (n.name() != name) continue;
      out += " at version " + std::to_string(n.applied_version()) + " of " + std::to_string(status->head_version());
      if (n.active_holds() > 0) {
        char held[64];
        std::snprintf(held, sizeof(held), "%.1f", static_cast<double>(n.oldest_hold_ms()) / 1000.0);
        out += ": " + std::to_string(n.active_holds()) + " hold(s) active, the oldest for " + held +
               " s (a sink applies only when no hold is active)";
      }
      if (!n.sync_error().empty()) out += ": cannot sync: " + n.sync_error();
      if (n.active_holds() == 0 && n.sync_error().empty()) out += ": syncing";
    }
  }
  return out;
}

// Tells the coordinator of a version the history holds (`ms`: since the
// publish began, for the log).
Status SourceCore::Announce(const PublishedVersion& pub, double ms) {
  if (pub.version == config_.fail_announce) {
    return UnavailableError("announcing version " + std::to_string(pub.version) + ": injected failure");
  }
  const v1::VersionSummary v = SummaryOf(pub);
  // A lost answer is retried (the coordinator takes the same summary
  // again as a success), a bounded number of times; not when etcd has no
  // majority (the replicas have waited for it already: say so now).
  StatusOr<uint64_t> head = UnavailableError("not announced");
  for (int attempt = 0; attempt < 4; ++attempt) {
    if (attempt > 0 && !SleepFor(std::chrono::milliseconds(250 << attempt))) break;
    head = coordinator_->Publish(v);
    if (head.ok() || head.status().HasReason(reasons::kEtcdUnreachable) ||
        (head.status().code() != StatusCode::kUnavailable && head.status().code() != StatusCode::kDeadlineExceeded)) {
      break;
    }
    spdlog::warn("source {}: announcing version {}: {} (attempt {} of 4)", config_.name, pub.version,
                 head.status().ToString(), attempt + 1);
  }
  if (!head.ok()) {
    return head.status().WithContext("version " + std::to_string(pub.version) +
                                     " is encoded, but the coordinator did not confirm it (it may have stored it: "
                                     "`wsync versions` shows it if so)");
  }
  coordinator_head_ = std::max(coordinator_head_.load(), *head);
  if (mirror_) mirror_->Published(pub);
  spdlog::info("source {}: version {} published: {} patch bytes for {} dense ({:.1f}x), encoded in {:.1f} ms",
               config_.name, pub.version, pub.patch_bytes, pub.dense_bytes,
               pub.patch_bytes ? static_cast<double>(pub.dense_bytes) / pub.patch_bytes : 0.0, ms);
  return wsync::Status::Ok();
}

// What the coordinator is told of a version this source publishes.
v1::VersionSummary SourceCore::SummaryOf(const PublishedVersion& pub) const {
  v1::VersionSummary v;
  v.set_version(pub.version);
  v.set_base_version(pub.base_version);
  v.set_patch_bytes(pub.patch_bytes);
  v.set_dense_bytes(pub.dense_bytes);
  v.set_set_checksum(pub.set_checksum);
  v.set_keyframe(pub.base_version == 0);
  v.set_source(config_.name);
  if (parts_ > 1) {  // set at registration, which waits for every publish
    v.set_part(part_);
    v.set_parts(parts_);
  }
  return v;
}

// Tells the coordinator of a version whose patch is streamed while it is
// encoded (the history calls this once its first segment is out), so that
// sinks pull it at once. One attempt, no retries (this runs between
// segments of the encode): if it fails, the complete announce after the
// encode publishes the version as usual. Versions of several sources are
// announced once encoded (the coordinator takes parts whole).
void SourceCore::AnnounceEarly(const PublishedVersion& early) {
  if (parts_ > 1 || early.version == config_.fail_announce) return;
  v1::VersionSummary v = SummaryOf(early);  // no patch bytes or checksum yet
  v.set_incomplete(true);
  StatusOr<uint64_t> head = coordinator_->Publish(v);
  if (!head.ok()) {
    spdlog::warn("source {}: announcing version {} while it is encoded: {} (announced once encoded)", config_.name,
                 early.version, head.status().ToString());
    return;
  }
  spdlog::debug("source {}: version {} announced while it is encoded", config_.name, early.version);
}

// Waits for a version being published in the background; returns (once)
// what became of it. REQUIRES: publish_mu_ held.
Status SourceCore::JoinBackground() {
  WaitBackground();
  return std::exchange(background_status_, wsync::Status::Ok());
}
// Waits for it, leaving its outcome to JoinBackground. REQUIRES: publish_mu_ held.
void SourceCore::WaitBackground() {
  if (publisher_.joinable()) publisher_.join();
}

}  // namespace wsync::daemon
