#include "sink_core.h"

#include <spdlog/spdlog.h>

#include "tensor_layout.h"
#include "wsync/control/layout.h"
#include "wsync/util/text.h"

namespace wsync::daemon {

namespace v1 = wsync::v1;
using Clock = std::chrono::steady_clock;
using exchange::PatchStream;

namespace {

// How the sink applies versions: its pool, and what staging keeps.
codec::ApplyOptions ApplyOptionsOf(const DataDaemonConfig& config, ThreadPool* pool) {
  codec::ApplyOptions options;
  options.pool = pool;
  options.keyframe_keep_bytes = config.keyframe_keep_bytes;
  options.stage_keep_bytes = config.stage_keep_bytes;
  return options;
}

}  // namespace

SinkCore::SinkCore(DataDaemonConfig config, SinkEnvironment env)
    : config_(std::move(config)), env_(env), rng_(std::random_device{}()) {}

SinkCore::~SinkCore() { Stop(); }

void SinkCore::Start() {
  watcher_ = std::thread([this] { WatchLoop(); });
  syncer_ = std::thread([this] { SyncLoop(); });
  leaser_ = std::thread([this] { LeaseLoop(); });
}

void SinkCore::Stop() {
  if (stopping_.exchange(true)) return;
  // An apply in progress completes; none starts after this.
  if (auto w = weights()) w->Close();
  {
    std::lock_guard<std::mutex> lock(holds_mu_);
    holds_cv_.notify_all();
  }
  {
    std::lock_guard<std::mutex> lock(stop_mu_);
    stop_cv_.notify_all();
  }
  ResetBackoff();
  Kick();
  if (watcher_.joinable()) watcher_.join();
  if (syncer_.joinable()) syncer_.join();
  if (leaser_.joinable()) leaser_.join();
}

std::shared_ptr<SinkWeights> SinkCore::weights() {
  std::lock_guard<std::mutex> lock(state_mu_);
  return weights_;
}

void SinkCore::ReportApplied(uint64_t version) {
  if (auto n = env_.coordinator->ReportApplied(config_.name, version); !n.ok() && !stopping_) {
    spdlog::warn("sink {}: report: {}", config_.name, n.status().ToString());
  }
}

void SinkCore::ReportAppliedAfterApply(uint64_t version) {
  if (!reports_on_heartbeats_) ReportApplied(version);
}

// ------------------------------------------------------------ registration

StatusOr<uint64_t> SinkCore::RegisterTensors(buffers::MappedTensors reg, uint64_t claimed) {
  // Refused at once when the tensors cannot take the versions published.
  const PublishedLayout published = env_.coordinator->GetLayout();
  Status unserved = Status::Ok();
  if (Status s = CheckPublishedLayout(reg, published); !s.ok()) {
    if (!AwaitsServing(reg, published)) {
      spdlog::warn("sink {}: registration refused: {}", config_.name, s.ToString());
      return s;
    }
    // Pieces of the published tensors that the published tile grids do not
    // hold yet: the layout is offered, and a source serving offered layouts
    // codes its next version for it.
    unserved = s;
    spdlog::warn("sink {}: the published tile grids do not hold this layout yet; waiting for a source to serve it",
                 config_.name);
  }
  const std::string description = reg.description();
  const bool reg_has_pieces = reg.has_pieces();
  WSYNC_ASSIGN_OR_RETURN(auto store, WeightStore::Open(std::move(reg), config_.entropy_stage));
  // Trust a claimed version only if the tensors' checksum is that version's
  // (a sink that died mid-apply leaves torn weights: those get a keyframe).
  uint64_t applied = claimed;
  if (applied != 0 && reg_has_pieces) {
    // The coordinator records whole-tensor checksums only: a claim over
    // pieces cannot be checked.
    spdlog::info("sink {}: pieces registered as version {}: not verifiable, starting from a keyframe", config_.name,
                 applied);
    applied = 0;
  }
  if (applied != 0) {
    auto versions = env_.coordinator->ListVersions(applied - 1);
    // The versions' checksums follow their tile grids (patch-format.md).
    auto sum = [&]() -> StatusOr<uint64_t> {
      if (!published.ok()) return published.status();
      WSYNC_ASSIGN_OR_RETURN(CanonicalLayout canonical, CanonicalOf(published->layout()));
      return store->SetChecksum(canonical.grids, env_.pool);
    }();
    // A version announced while it was encoded and not completed has no
    // checksum to check a claim against: not trusted.
    const bool known = versions.ok() && versions->versions_size() > 0 &&
                       versions->versions(0).version() == applied && !versions->versions(0).incomplete();
    const bool match = known && sum.ok() && versions->versions(0).set_checksum() == *sum;
    if (!match) {
      spdlog::warn("sink {}: the registered tensors are not version {} ({}): starting from a keyframe", config_.name,
                   applied, known ? "checksum differs" : "no checksum of it is known");
      applied = 0;
    }
  }
  std::shared_ptr<SinkWeights> old;
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    old = std::exchange(weights_,
                        std::make_shared<SinkWeights>(std::move(store), ApplyOptionsOf(config_, env_.pool), applied));
  }
  // The caller may reuse or free the old memory from now on.
  if (old) Retire(old, "the tensors were registered again");
  if (reg_has_pieces != (old && old->store().tensors().has_pieces())) {
    // Parents are assigned by what a sink holds (a sink holding pieces is
    // never one): say it now, not at the next heartbeat.
    env_.membership->HeartbeatNow(std::chrono::seconds(1));
  }
  ResetBackoff();
  // What the coordinator shows is what these tensors hold.
  ReportApplied(applied);
  spdlog::info("sink {}: {} registered (holding version {})", config_.name, description, applied);
  if (!unserved.ok()) weights()->SetSyncError(unserved, /*permanent=*/false);
  Kick();
  return head_.load();
}

Status SinkCore::Unregister() {
  std::shared_ptr<SinkWeights> old;
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    old = std::exchange(weights_, nullptr);
  }
  if (!old) return NotRegisteredError();
  Retire(old, "the tensors were unregistered");
  ReportApplied(0);
  spdlog::info("sink {}: tensors unregistered", config_.name);
  return Status::Ok();
}

SinkStatus SinkCore::status() {
  auto w = weights();
  SinkStatus s;
  s.applied = w ? w->applied() : 0;
  s.head = head_.load();
  s.tensors = w ? w->Views().size() : 0;
  s.pulls_made = pulls_made_.load();
  s.bytes_received = bytes_received_.load();
  s.chunks_staged_ahead = staged_ahead_.load();
  s.sync_failures = failures_.load();
  if (w) {
    s.sync_error = w->sync_error();
    s.timings = w->timings();
  }
  std::tie(s.active_holds, s.oldest_hold_ms) = HoldSummary();
  s.reports_on_heartbeats = reports_on_heartbeats_.load();
  return s;
}

// -------------------------------------------------------------- membership

void SinkCore::OnHeartbeat(const v1::HeartbeatResponse& hb) {
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    if (parent_ != hb.node().parent()) ResetBackoffSoon();
    parent_ = hb.node().parent();
    resync_ = hb.node().resync_keyframe();
  }
  head_ = std::max(head_.load(), hb.head_version());
  reports_on_heartbeats_ = hb.reports_on_heartbeats();
  // The coordinator shows another applied version than this sink holds: a
  // report it acknowledged was lost in a failover before it was durable.
  if (const auto w = weights(); w && hb.node().applied_version() != w->applied()) ReportApplied(w->applied());
  Kick();
}

// The coordinator remembers the applied version of an earlier process of
// this name: what it shows must be what this one holds.
void SinkCore::AfterRegister(const v1::Node& node) {
  const auto w = weights();
  const uint64_t applied = w ? w->applied() : 0;
  if (node.applied_version() != applied) ReportApplied(applied);
}

void SinkCore::FillHeartbeat(v1::HeartbeatRequest* h) {
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    h->set_unreachable_parent(std::exchange(unreachable_parent_, std::string()));
  }
  const auto w = weights();  // one registration for every field
  if (w && !w->sync_error().ok()) h->set_sync_error(w->sync_error().ToString());
  const auto [holds, oldest_ms] = HoldSummary();
  h->set_active_holds(holds);
  if (w) h->set_holds_pieces(w->store().tensors().has_pieces());
  h->set_reads_store(env_.store != nullptr);
  h->set_applied_version(w ? w->applied() : 0);
  h->set_oldest_hold_ms(oldest_ms);
}

// ------------------------------------------------------------------ relay

void SinkCore::KeepStreamLocked(StreamKey key, std::shared_ptr<PatchStream> stream) {
  streams_[key] = Kept{std::move(stream), ++stream_uses_};
  while (streams_.size() > kKeptStreams) {
    auto victim = streams_.end();
    for (auto it = streams_.begin(); it != streams_.end(); ++it) {
      if (it->first == key) continue;
      const bool arriving = !it->second.stream->WaitComplete(Clock::now()).ok();
      const bool victim_arriving =
          victim != streams_.end() && !victim->second.stream->WaitComplete(Clock::now()).ok();
      if (victim == streams_.end() || (victim_arriving && !arriving) ||
          (arriving == victim_arriving && it->second.last_use < victim->second.last_use)) {
        victim = it;
      }
    }
    streams_.erase(victim);
  }
}

StatusOr<std::shared_ptr<PatchStream>> SinkCore::Open(uint64_t from, uint64_t to) { return OpenFor(from, to, 0, 0); }

StatusOr<std::shared_ptr<PatchStream>> SinkCore::OpenFor(uint64_t from, uint64_t to, uint64_t, uint32_t part) {
  std::shared_ptr<SinkWeights> weights;
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    if (auto it = streams_.find({from, to, part}); it != streams_.end()) {
      it->second.last_use = ++stream_uses_;
      return it->second.stream;
    }
    weights = weights_;
  }
  if (!weights || weights->applied() != to || to == 0) {
    return NotFoundError("sink " + config_.name + " holds no patch " + std::to_string(from) + "->" +
                         std::to_string(to));
  }
  if (weights->store().tensors().has_pieces()) {
    return UnavailableError("sink " + config_.name + " holds pieces and makes no keyframes; it relays no sink");
  }
  // A keyframe of what it holds (the child had another base): with several
  // sources, of the part's tensors; coded on the published grids, so that
  // children holding pieces apply it too (without the coordinator, flat:
  // whole children only).
  std::vector<std::string> names;
  codec::EncodeOptions eo;
  const PublishedLayout published = env_.coordinator->GetLayout();
  if (published.ok()) {
    v1::Layout mine = published->layout();
    if (mine.parts() > 1) {
      mine = control::PartOf(mine, part);
      for (const auto& t : mine.tensors()) names.push_back(t.name());
      if (names.empty()) return NotFoundError("the published layout has no part " + std::to_string(part));
    } else if (part != 0) {
      return NotFoundError("the versions have no part " + std::to_string(part));
    }
    WSYNC_ASSIGN_OR_RETURN(CanonicalLayout canonical, CanonicalOf(mine));
    eo.grids = std::move(canonical.grids);
  } else if (part != 0) {
    return published.status().WithContext("keyframe of part " + std::to_string(part));
  } else {
    spdlog::warn("sink {}: keyframe for a child without the published layout (flat): {}", config_.name,
                 published.status().ToString());
  }
  const uint64_t v = weights->Hold();
  eo.pool = env_.pool;
  eo.target_version = v;
  StatusOr<std::string> kf = weights->store().EncodeKeyframe(eo, names);
  weights->Release();
  if (!kf.ok()) return kf.status();
  auto stream = PatchStream::FromBytes(codec::PatchKind::kKeyframe, 0, v, std::move(*kf), 1u << 20);
  std::lock_guard<std::mutex> lock(state_mu_);
  KeepStreamLocked({0, v, part}, stream);
  return stream;
}

// ---------------------------------------------------------- watch and sync

void SinkCore::Kick() {
  std::lock_guard<std::mutex> lock(sync_mu_);
  kicked_ = true;
  sync_cv_.notify_all();
}

void SinkCore::WatchLoop() {
  while (!stopping_) {
    v1::WatchRequest req;
    req.set_after(head_.load());
    req.set_node(config_.name);
    req.set_incarnation(env_.membership->incarnation());
    wsync::Status s = env_.coordinator->Watch(req, [this](const v1::VersionSummary& v) {
      head_ = std::max(head_.load(), v.version());
      Kick();
      return !stopping_.load();
    });
    if (stopping_) return;
    if (!s.ok()) spdlog::debug("sink {}: watch: {}", config_.name, s.ToString());
    // A broken stream marks this node dead at the coordinator: register
    // again (a heartbeat does) before watching under the new incarnation.
    env_.membership->HeartbeatNow(std::chrono::seconds(2));
    std::unique_lock<std::mutex> lock(stop_mu_);
    stop_cv_.wait_for(lock, std::chrono::milliseconds(200), [&] { return stopping_.load(); });
  }
}

// Parent's peer id on the data plane, connecting when needed.
StatusOr<transport::PeerId> SinkCore::ParentPeer(const std::string& parent) {
  if (auto it = peers_.find(parent); it != peers_.end()) return it->second;
  WSYNC_ASSIGN_OR_RETURN(auto status, env_.coordinator->GetStatus());
  for (const auto& n : status.nodes()) {
    if (n.name() != parent) continue;
    WSYNC_ASSIGN_OR_RETURN(transport::PeerId peer, env_.transport->Connect(n.data_address()));
    peers_[parent] = peer;
    return peer;
  }
  return NotFoundError("parent " + Quoted(parent) + " is not registered");
}

// Closes and forgets the connection to `parent` (the next attempt
// connects again, to the address the coordinator has then): endpoints are
// released, not leaked, when a parent fails or restarts.
void SinkCore::DropPeer(const std::string& parent) {
  auto it = peers_.find(parent);
  if (it == peers_.end()) return;
  env_.transport->Disconnect(it->second);
  peers_.erase(it);
}

// The next attempt after a failure comes at once (new tensors registered,
// a new parent, shutdown).
void SinkCore::ResetBackoff() {
  std::lock_guard<std::mutex> lock(sync_mu_);
  backoff_reset_ = true;
  failures_ = 0;
  sync_cv_.notify_all();
}
void SinkCore::ResetBackoffSoon() {
  std::lock_guard<std::mutex> lock(sync_mu_);
  backoff_reset_ = true;
  sync_cv_.notify_all();
}

// Exponential backoff with jitter: the n-th consecutive failure waits a
// uniform draw in [d/2, d], d = min(first * 2^(n-1), max).
std::chrono::milliseconds SinkCore::RetryDelay(uint64_t failures) {
  const uint64_t shift = std::min<uint64_t>(failures - 1, 30);
  const uint64_t d = std::min<uint64_t>(config_.retry_first_ms << shift, config_.retry_max_ms);
  std::uniform_int_distribution<uint64_t> jitter(d / 2, d);
  return std::chrono::milliseconds(jitter(rng_));
}

void SinkCore::SyncLoop() {
  next_attempt_ = Clock::now();
  while (!stopping_) {
    if (!AwaitAttempt()) continue;
    std::optional<SyncTarget> target = NextTarget();
    if (!target) continue;
    const PublishedLayout published = env_.coordinator->GetLayout();
    if (!TakesPublishedLayout(*target, published)) continue;
    const std::string& parent = target->parent;
    std::vector<PartPull> pulls;
    std::string from_where = "no daemon (the coordinator assigned no parent)";
    Status s = UnavailableError("no parent is assigned");
    if (!parent.empty()) {
      pulls = PullsFrom(parent, published);
      from_where =
          Quoted(parent) + (pulls.size() > 1 && pulls[0].node != parent ? " (each part from its source)" : "");
      s = SyncTo(*target, pulls, from_where);
    }
    if (stopping_) return;
    if (!s.ok() && ReadsStoreAfter(s)) {
      Status from_store = SyncFromStore(*target, published);
      if (stopping_) return;
      if (from_store.ok()) {
        if (s.code() == StatusCode::kUnavailable || s.code() == StatusCode::kDeadlineExceeded) {
          LeaveUnreachable(*target, pulls);
        }
        s = Status::Ok();
      } else if (parent.empty()) {
        s = from_store;
      } else {
        s = s.WithContext("then " + env_.store->where() + ": " + from_store.ToString());
      }
      from_where += " or " + env_.store->where();
    }
    if (s.ok()) {
      OnSynced(*target);
    } else {
      OnSyncFailed(*target, pulls, from_where, std::move(s));
    }
  }
}

bool SinkCore::AwaitAttempt() {
  std::unique_lock<std::mutex> lock(sync_mu_);
  sync_cv_.wait_for(lock, std::chrono::milliseconds(500), [&] { return kicked_ || stopping_.load(); });
  kicked_ = false;
  // After a failure, wait out the delay: new versions do not shorten it,
  // unless the parent lacked the version (then a newer one may be what it
  // has: a restarted source starts its history again).
  auto new_head = [&] { return retry_on_new_head_ > 0 && head_.load() > retry_on_new_head_; };
  sync_cv_.wait_until(lock, next_attempt_, [&] { return stopping_.load() || backoff_reset_ || new_head(); });
  if (backoff_reset_ || new_head()) next_attempt_ = Clock::now();
  retry_on_new_head_ = 0;
  backoff_reset_ = false;
  return Clock::now() >= next_attempt_ && !stopping_;
}

std::optional<SinkCore::SyncTarget> SinkCore::NextTarget() {
  SyncTarget t;
  t.weights = weights();
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    t.parent = parent_;
    t.resync = resync_;
  }
  t.head = head_.load();
  const auto& w = t.weights;
  if (!w || w.get() == mismatched_ || (t.parent.empty() && env_.store == nullptr) || w->applied() >= t.head) {
    return std::nullopt;
  }
  return t;
}

bool SinkCore::TakesPublishedLayout(const SyncTarget& t, const PublishedLayout& published) {
  const Status s = CheckPublishedLayout(t.weights->store().tensors(), published);
  if (s.ok()) return true;
  if (AwaitsServing(t.weights->store().tensors(), published)) {
    // Not served yet: checked again at the next version (a source serving
    // offered layouts re-grids for it then), or in half a minute.
    t.weights->SetSyncError(s, /*permanent=*/false);
    std::lock_guard<std::mutex> lock(sync_mu_);
    retry_on_new_head_ = t.head;
    next_attempt_ = Clock::now() + std::chrono::seconds(30);
    return false;
  }
  // Tensors that cannot take the published versions never will: no pull
  // until they are registered again.
  spdlog::error("sink {}: {}", config_.name, s.ToString());
  t.weights->SetSyncError(s, /*permanent=*/true);
  mismatched_ = t.weights.get();
  return false;
}

Status SinkCore::SyncTo(const SyncTarget& t, const std::vector<PartPull>& pulls, const std::string& from_where) {
  const auto& w = t.weights;
  Status s = SyncOnce(w, pulls, t.resync || w->applied() == 0 ? 0 : w->applied(), t.head);
  if (!s.ok() && !stopping_ && (s.code() == StatusCode::kFailedPrecondition || s.code() == StatusCode::kDataLoss)) {
    // The patch does not fit what we hold: a keyframe in the same attempt.
    spdlog::warn("sink {}: sync {}->{} from {}: {}; pulling a keyframe", config_.name, w->applied(), t.head,
                 from_where, s.ToString());
    s = SyncOnce(w, pulls, 0, t.head);
  }
  return s;
}

void SinkCore::OnSynced(const SyncTarget& t) {
  failures_ = 0;
  not_yet_ = 0;
  t.weights->SetSyncError(wsync::Status::Ok(), false);
  Kick();  // a version may have come meanwhile
}

void SinkCore::OnSyncFailed(const SyncTarget& t, const std::vector<PartPull>& pulls, const std::string& from_where,
                            Status s) {
  auto delay = RetryDelay(++failures_);
  // A parent that lacks the version yet (a relay still receiving it) has it
  // soon: asked again after at most kNotYetMs, kNotYetTries times in a row
  // (with a store, for as long as the store's wait), before the backoff
  // applies.
  if (s.code() == StatusCode::kNotFound && not_yet_++ == 0) lacking_since_ = Clock::now();
  if (s.code() != StatusCode::kNotFound) not_yet_ = 0;
  if (not_yet_ > 0 && (not_yet_ <= kNotYetTries || (env_.store != nullptr && !LackedPastStoreWait()))) {
    delay = std::min(delay, std::chrono::milliseconds(kNotYetMs));
  }
  next_attempt_ = Clock::now() + delay;
  if (s.code() == StatusCode::kUnavailable || s.code() == StatusCode::kDeadlineExceeded) LeaveUnreachable(t, pulls);
  if (s.code() == StatusCode::kNotFound) {
    std::lock_guard<std::mutex> lock(sync_mu_);
    retry_on_new_head_ = t.head;
  }
  s = s.WithContext("sync " + std::to_string(t.weights->applied()) + "->" + std::to_string(t.head) + " from " +
                    from_where);
  t.weights->SetSyncError(s, /*permanent=*/false);
  spdlog::warn("sink {}: {} (failure {}; next attempt in {} ms)", config_.name, s.ToString(), failures_.load(),
               delay.count());
}

void SinkCore::LeaveUnreachable(const SyncTarget& t, const std::vector<PartPull>& pulls) {
  // The peer is gone or unreachable: not the same parent again. The
  // coordinator assigns another holder of the version at once; a new
  // parent ends the backoff (OnHeartbeat).
  for (const auto& p : pulls) DropPeer(p.node);
  if (env_.membership == nullptr || t.parent.empty()) return;
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    unreachable_parent_ = t.parent;
  }
  env_.membership->HeartbeatNow(std::chrono::seconds(1));
}

// ------------------------------------------------------------ store tier

bool SinkCore::ReadsStoreAfter(const Status& s) const {
  if (env_.store == nullptr || s.code() == StatusCode::kAborted) return false;
  if (s.code() != StatusCode::kNotFound || env_.store->options().wait_ms == 0) return true;
  // This failure is not counted yet: the first NotFound of a row starts now.
  return not_yet_ > 0 && LackedPastStoreWait();
}

bool SinkCore::LackedPastStoreWait() const {
  return Clock::now() - lacking_since_ >= std::chrono::milliseconds(env_.store->options().wait_ms);
}

Status SinkCore::SyncFromStore(const SyncTarget& t, const PublishedLayout& published) {
  if (published.ok() && published->set() && published->layout().parts() > 1) {
    return FailedPreconditionError("versions published in parts by several sources are not read from the store");
  }
  const auto& w = t.weights;
  const uint64_t from = t.resync ? 0 : w->applied();
  bool applying = false;
  Status s = SyncFromStoreOnce(w, from, t.head, &applying);
  if (!s.ok() && applying && from != 0 && !stopping_ &&
      (s.code() == StatusCode::kFailedPrecondition || s.code() == StatusCode::kDataLoss)) {
    spdlog::warn("sink {}: from {}: {}; reading from a keyframe", config_.name, env_.store->where(), s.ToString());
    s = SyncFromStoreOnce(w, 0, t.head, &applying);
  }
  return s;
}

Status SinkCore::SyncFromStoreOnce(const std::shared_ptr<SinkWeights>& w, uint64_t from, uint64_t head,
                                   bool* applying) {
  const auto t0 = Clock::now();
  WSYNC_ASSIGN_OR_RETURN(StoreTier::Plan plan, env_.store->PlanTo(from, head));
  // The version reached must be the one this cluster published: a store of
  // another run (a wrong --store-run) holds other weights under the same
  // version numbers, and a keyframe of them would apply over anything.
  auto known = env_.coordinator->ListVersions(plan.version - 1);
  if (known.ok() && known->versions_size() > 0 && known->versions(0).version() == plan.version &&
      !known->versions(0).incomplete() && known->versions(0).set_checksum() != plan.set_checksum) {
    return FailedPreconditionError("version " + std::to_string(plan.version) + " in " + env_.store->where() +
                                   " is not the version the coordinator published (their set checksums differ): "
                                   "is --store-run this cluster's run?");
  }
  uint64_t bytes = 0;
  for (const auto& step : plan.steps) {
    if (stopping_) return AbortedError("the sink is stopping");
    WSYNC_ASSIGN_OR_RETURN(std::string object, env_.store->Fetch(step.object));
    bytes += object.size();
    const bool keyframe = step.object.kind == store::StoredObject::Kind::kKeyframe;
    auto stream = PatchStream::FromBytes(keyframe ? codec::PatchKind::kKeyframe : codec::PatchKind::kPatch,
                                         step.object.base, step.version, std::move(object), 1u << 20);
    if (w->layout() == 0) {
      // Children pull it from this sink as from any relay.
      std::lock_guard<std::mutex> lock(state_mu_);
      KeepStreamLocked({stream->from(), stream->to(), 0}, stream);
    }
    if (Status s = w->Apply(*stream); !s.ok()) {
      *applying = true;
      return s.WithContext(step.object.key);
    }
    ReportAppliedAfterApply(w->applied());
  }
  bytes_received_ += bytes;
  const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  spdlog::info("sink {}: version {} applied from {} ({} object{}{}, {} bytes, {:.1f} ms)", config_.name,
               w->applied(), env_.store->where(), plan.steps.size(), plan.steps.size() == 1 ? "" : "s",
               plan.steps.front().object.kind == store::StoredObject::Kind::kKeyframe ? " from a keyframe" : "",
               bytes, ms);
  return wsync::Status::Ok();
}

// Whether the tensors hold pieces of the published tensors that a tile grid
// cut for them would hold: they fail the published layout only because no
// source serves their layout yet.
bool SinkCore::AwaitsServing(const buffers::MappedTensors& tensors, const PublishedLayout& published) {
  if (!tensors.has_pieces() || !published.ok() || !published->set()) return false;
  auto canonical = CanonicalOf(published->layout());
  if (!canonical.ok()) return false;
  const std::vector<std::vector<codec::RuntimeTensor>> own = {tensors.Runtime()};
  return codec::ValidatePieces(own[0], canonical->tensors, codec::GridsFor(own, canonical->tensors)).ok();
}

// Ok unless a layout is published and the tensors do not match it: the
// published tensors themselves, or runtime tensors whose pieces the
// published tensors and their tile grids hold.
Status SinkCore::CheckPublishedLayout(const buffers::MappedTensors& tensors, const PublishedLayout& published) {
  if (!published.ok() || !published->set()) return wsync::Status::Ok();  // checked again next time
  if (tensors.has_pieces()) {
    WSYNC_ASSIGN_OR_RETURN(CanonicalLayout canonical, CanonicalOf(published->layout()));
    return codec::ValidatePieces(tensors.Runtime(), canonical.tensors, canonical.grids)
        .WithContext("the registered pieces cannot take the published versions (a source serves the layouts "
                     "named in its serve_layouts, and with serve_offered_layouts those sinks offer, from its next "
                     "version)");
  }
  // Whole tensors take patches of any grid (CheckLayout compares no grids).
  return control::CheckLayout(published->layout(), LayoutOf(tensors.Views(), false), "the registered tensors")
      .WithContext("the registered tensors cannot take the published versions; register tensors of the "
                   "published layout");
}


std::vector<SinkCore::PartPull> SinkCore::PullsFrom(const std::string& parent, const PublishedLayout& published) {
  if (!published.ok() || !published->set() || published->layout().parts() <= 1) return {{parent, 0}};
  const auto& sources = published->layout().part_sources();
  const bool relay = std::find(sources.begin(), sources.end(), parent) == sources.end();
  std::vector<PartPull> out;
  for (int p = 0; p < sources.size(); ++p) out.push_back({relay ? parent : sources[p], static_cast<uint32_t>(p)});
  return out;
}

Status SinkCore::SyncOnce(const std::shared_ptr<SinkWeights>& w, const std::vector<PartPull>& pulls, uint64_t from,
                          uint64_t to) {
  const auto t0 = Clock::now();
  std::vector<std::shared_ptr<PatchStream>> streams;
  for (const auto& p : pulls) {
    WSYNC_ASSIGN_OR_RETURN(transport::PeerId peer, ParentPeer(p.node));
    ++pulls_made_;
    WSYNC_ASSIGN_OR_RETURN(auto stream,
                           env_.fetcher->Pull(peer, from, to, w->layout(), p.part, std::chrono::seconds(30)));
    streams.push_back(std::move(stream));
  }
  if (w->layout() == 0) {
    // Children may pull the same ranges (each part) from us while they
    // arrive (not selections for pieces: not the streams they would pull).
    std::lock_guard<std::mutex> lock(state_mu_);
    for (size_t i = 0; i < streams.size(); ++i) {
      const auto& stream = streams[i];
      KeepStreamLocked({stream->from(), stream->to(), pulls[i].part}, stream);
      if (stream->from() != from) KeepStreamLocked({from, to, pulls[i].part}, stream);
    }
  }
  uint64_t bytes = 0;
  std::vector<const PatchStream*> parts;
  // One stream: decoded chunk by chunk as it arrives (codec::ApplyAhead),
  // so that at the end only the adds and the checks remain.
  std::unique_ptr<StagedApply> ahead =
      streams.size() == 1 && config_.decode_ahead ? w->BeginStaged() : nullptr;
  std::string assembled;
  for (const auto& stream : streams) {
    const auto deadline = Clock::now() + std::chrono::minutes(5);
    if (ahead) {
      // Each round takes every chunk in by then and decodes what they
      // complete; once the last chunk is in, the apply decodes the rest
      // (in parallel) rather than this loop.
      // (A stream still being encoded at its source has no known length
      // until its last chunk: chunks are taken until there is no next.)
      assembled.reserve(stream->total_bytes());
      for (size_t i = 0;;) {
        StatusOr<std::string> chunk = stream->Wait(i, deadline);
        if (chunk.status().code() == StatusCode::kOutOfRange) break;
        WSYNC_RETURN_IF_ERROR(chunk.status());
        assembled += *chunk;
        for (++i;; ++i) {
          StatusOr<std::string> more = stream->Wait(i, Clock::now());
          if (!more.ok()) break;
          assembled += *more;
        }
        if (!stream->WaitComplete(Clock::now()).ok()) ahead->Advance(assembled);
      }
    } else {
      WSYNC_RETURN_IF_ERROR(stream->WaitComplete(deadline));
    }
    bytes += stream->total_bytes();
    parts.push_back(stream.get());
  }
  bytes_received_ += bytes;
  // When the last byte was in (decoding ahead may still have been busy).
  auto received = t0;
  for (const auto& stream : streams) received = std::max(received, stream->completed_at());
  WSYNC_RETURN_IF_ERROR(ahead ? w->Apply(*streams[0], *ahead, assembled) : w->ApplyParts(parts));
  if (ahead) staged_ahead_ += ahead->staged_ahead();
  ReportAppliedAfterApply(w->applied());
  using Ms = std::chrono::duration<double, std::milli>;
  const auto done = Clock::now();
  spdlog::info("sink {}: version {} applied from {} ({} {} bytes, {:.1f} ms: transfer {:.1f} ms, apply {:.1f} ms){}",
               config_.name, w->applied(), pulls.size() == 1 ? pulls[0].node : std::to_string(pulls.size()) + " parts",
               streams[0]->kind() == codec::PatchKind::kKeyframe ? "keyframe" : "patch", bytes, Ms(done - t0).count(),
               Ms(received - t0).count(), Ms(done - received).count(),
               ahead ? "; " + std::to_string(ahead->staged_ahead()) + " chunks staged while arriving" : "");
  return wsync::Status::Ok();
}

}  // namespace wsync::daemon
