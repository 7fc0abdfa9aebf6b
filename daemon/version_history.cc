#include "version_history.h"

#include "wsync/codec/codec.h"
#include "wsync/util/text.h"

#include <algorithm>
#include <utility>

#include <spdlog/spdlog.h>

namespace wsync::daemon {
namespace {

Status ApplyInPlace(const std::string& patch, std::vector<buffers::OwnedTensor>& w, ThreadPool* pool) {
  auto views = buffers::MutableViews(w);
  codec::ApplyOptions ao;
  ao.pool = pool;
  return codec::Apply(patch, views, ao);
}

}  // namespace

StatusOr<PublishedVersion> VersionHistory::Publish(uint64_t version, std::span<const codec::TensorView> weights) {
  NewVersion next;
  next.layout = weights;
  next.host = weights;
  next.encode = [&](std::span<const codec::TensorView> head, const codec::EncodeOptions& eo) {
    return codec::EncodePatch(head, weights, eo);
  };
  next.fill = [&](std::vector<buffers::OwnedTensor>& head) {
    return buffers::CopyInto(weights, head, options_.encode.pool);
  };
  return Publish(version, next);
}

StatusOr<PublishedVersion> VersionHistory::Publish(uint64_t version, std::vector<buffers::OwnedTensor>* weights) {
  const std::vector<codec::TensorView> views = buffers::Views(*weights);
  NewVersion next;
  next.layout = views;
  next.host = views;
  next.encode = [&](std::span<const codec::TensorView> head, const codec::EncodeOptions& eo) {
    return codec::EncodePatch(head, views, eo);
  };
  next.fill = [&](std::vector<buffers::OwnedTensor>& head) {
    std::swap(head, *weights);
    return Status::Ok();
  };
  return Publish(version, next);
}

Status VersionHistory::Accepts(uint64_t version, std::span<const codec::TensorView> layout) const {
  std::lock_guard<std::mutex> lock(mu_);
  return AcceptsLocked(version, layout);
}

namespace {

// The first difference between the head's layout and a new one, naming the tensor.
std::string LayoutDifference(const std::vector<buffers::OwnedTensor>& head, std::span<const codec::TensorView> next) {
  auto shape = [](const std::vector<uint64_t>& s) {
    std::string out = "[";
    for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
    return out + "]";
  };
  for (size_t i = 0; i < head.size() && i < next.size(); ++i) {
    const auto& a = head[i];
    const auto& b = next[i];
    if (a.name != b.name) return "tensor " + std::to_string(i) + " is " + Quoted(b.name) + ", was " + Quoted(a.name);
    if (a.dtype != b.dtype) {
      return "tensor " + Quoted(b.name) + " is " + std::string(codec::DTypeName(b.dtype)) + ", was " +
             std::string(codec::DTypeName(a.dtype));
    }
    if (a.shape != b.shape) return "tensor " + Quoted(b.name) + " has shape " + shape(b.shape) + ", was " + shape(a.shape);
  }
  return std::to_string(next.size()) + " tensors, was " + std::to_string(head.size());
}

}  // namespace

Status VersionHistory::AcceptsLocked(uint64_t version, std::span<const codec::TensorView> layout) const {
  if (version <= head_) {
    return StaleVersionError(version, head_);
  }
  if (head_ != 0 && !buffers::SameLayout(*head_weights_, layout)) {
    return InvalidArgumentError("version " + std::to_string(version) + ": " + LayoutDifference(*head_weights_, layout) +
                                " (the previous version's layout)");
  }
  return Status::Ok();
}

std::shared_ptr<VersionHistory::Weights> VersionHistory::Fresh(const Weights& like) {
  auto fresh = std::make_shared<Weights>();
  for (const auto& t : like) fresh->push_back({t.name, t.dtype, t.shape, std::vector<uint8_t>(t.bytes.size())});
  return fresh;
}

namespace {

// The tensor checksums a patch or keyframe records, in order.
std::vector<uint64_t> TargetSums(const codec::PatchInfo& info) {
  std::vector<uint64_t> out;
  for (const auto& t : info.tensors) out.push_back(t.target_checksum);
  return out;
}

}  // namespace

StatusOr<std::string> VersionHistory::EncodeStreamed(const Weights& head, const NewVersion& next,
                                                     const codec::EncodeOptions& eo, uint64_t dense_bytes) {
  auto live = PatchStream::Growing(codec::PatchKind::kPatch, eo.base_version, eo.target_version,
                                   options_.stream_chunk_bytes);
  {
    std::lock_guard<std::mutex> lock(mu_);
    live_ = Live{eo.base_version, eo.target_version, live};
  }
  StatusOr<std::string> encoded = codec::EncodeSegmented(
      buffers::Views(head), next.host, eo, options_.segment_bytes, head_sums_,
      [&](size_t k, std::string_view segment) -> Status {
        WSYNC_RETURN_IF_ERROR(live->Append(segment));
        if (k == 0 && options_.on_stream) {
          PublishedVersion early;
          early.version = eo.target_version;
          early.base_version = eo.base_version;
          early.dense_bytes = dense_bytes;
          options_.on_stream(early);
        }
        if (options_.after_segment) options_.after_segment(k);
        return Status::Ok();
      });
  if (encoded.ok()) {
    if (Status finished = live->Finish(); !finished.ok()) encoded = finished;
  }
  if (!encoded.ok()) live->Fail(encoded.status());
  return encoded;
}

// Publish holds publish_mu_ through its steps, so the head they read stays
// put; each step takes mu_ only where it says so.
StatusOr<PublishedVersion> VersionHistory::Publish(uint64_t version, const NewVersion& next) {
  std::lock_guard<std::mutex> publishing(publish_mu_);
  WSYNC_ASSIGN_OR_RETURN(HeadSnapshot head, SnapshotHead(version, next));
  PublishedVersion out;
  out.version = version;
  for (const auto& t : next.layout) out.dense_bytes += t.NumBytes();
  if (head.version == 0) return PublishFirst(next, out);
  StatusOr<PublishedVersion> published = PublishNext(next, std::move(head), out);
  // A version streamed while it was encoded stops being live when it is the
  // head (the commit) or failed (its pullers' streams fail with it).
  if (!published.ok()) EndLive();
  return published;
}

StatusOr<VersionHistory::HeadSnapshot> VersionHistory::SnapshotHead(uint64_t version, const NewVersion& next) {
  std::lock_guard<std::mutex> lock(mu_);
  WSYNC_RETURN_IF_ERROR(AcceptsLocked(version, next.layout));
  if (head_stale_ && !next.load_head) WSYNC_RETURN_IF_ERROR(LoadHeadLocked());  // a host publish after lazy ones
  return HeadSnapshot{head_weights_, head_, head_set_checksum_};
}

StatusOr<PublishedVersion> VersionHistory::PublishFirst(const NewVersion& next, PublishedVersion out) {
  auto first = std::make_shared<Weights>();
  for (const auto& t : next.layout) first->push_back({t.name, t.dtype, t.shape, std::vector<uint8_t>(t.NumBytes())});
  WSYNC_RETURN_IF_ERROR(next.fill(*first));
  codec::EncodeOptions eo = CurrentEncodeOptions();
  eo.target_version = out.version;
  WSYNC_ASSIGN_OR_RETURN(std::string kf, codec::EncodeKeyframe(buffers::Views(*first), eo));
  WSYNC_ASSIGN_OR_RETURN(codec::PatchInfo info, codec::InspectPatch(kf));
  out.set_checksum = info.target_set_checksum;
  std::vector<uint64_t> sums = TargetSums(info);
  out.patch_bytes = kf.size();
  auto stream =
      PatchStream::FromBytes(codec::PatchKind::kKeyframe, 0, out.version, std::move(kf), options_.stream_chunk_bytes);
  auto oldest = std::make_shared<Weights>(*first);
  std::lock_guard<std::mutex> lock(mu_);
  head_set_checksum_ = out.set_checksum;
  head_sums_ = std::move(sums);
  head_weights_ = std::move(first);
  oldest_weights_ = std::move(oldest);
  head_ = oldest_ = out.version;
  CacheLocked({0, out.version}, std::move(stream), 0);
  return out;
}

StatusOr<PublishedVersion> VersionHistory::PublishNext(const NewVersion& next, HeadSnapshot head,
                                                       PublishedVersion out) {
  // Only this thread changes the state; pulls read what they share, so the
  // encode runs without the lock.
  WSYNC_ASSIGN_OR_RETURN(std::string encoded, EncodeFromHead(next, head, out));
  WSYNC_ASSIGN_OR_RETURN(codec::PatchInfo info, codec::InspectPatch(encoded));
  auto patch = std::make_shared<const std::string>(std::move(encoded));
  head.weights.reset();  // only pulls may still hold the head's buffers now
  std::unique_lock<std::mutex> lock(mu_);
  WSYNC_RETURN_IF_ERROR(ReplaceHeadCopyLocked(next, out.version, lock));
  out.base_version = head_;
  out.patch_bytes = patch->size();
  out.set_checksum = head_set_checksum_ = info.target_set_checksum;
  head_sums_ = TargetSums(info);
  patches_[out.version] = std::move(patch);
  head_ = out.version;
  live_.reset();  // its pullers have their stream; later ones get the stored patch
  built_.notify_all();
  return out;
}

StatusOr<std::string> VersionHistory::EncodeFromHead(const NewVersion& next, const HeadSnapshot& head,
                                                     const PublishedVersion& out) {
  codec::EncodeOptions eo = CurrentEncodeOptions();
  eo.base_version = head.version;
  eo.target_version = out.version;
  eo.base_set_checksum = head.set_checksum;  // the head was the last target: no second hash of it
  const bool streamed = !next.host.empty() && codec::SegmentGroups(next.layout, options_.segment_bytes).size() > 1 &&
                        head_sums_.size() == head.weights->size();
  if (streamed) return EncodeStreamed(*head.weights, next, eo, out.dense_bytes);
  return next.encode(buffers::Views(*head.weights), eo);
}

Status VersionHistory::ReplaceHeadCopyLocked(const NewVersion& next, uint64_t version,
                                             std::unique_lock<std::mutex>& lock) {
  if (next.load_head) {
    head_stale_ = true;
    head_loader_ = next.load_head;
    return Status::Ok();
  }
  if (head_weights_.use_count() == 1) {
    // No pull reads the head's buffers: the new head goes into them (a pull
    // that comes meanwhile waits for this copy; a publish never waits for a
    // pull's build).
    Status filled = next.fill(*head_weights_);
    if (filled.ok()) return Status::Ok();
    // The head copy may be torn: rebuild it from the oldest copy and the chain.
    live_.reset();
    built_.notify_all();
    Weights w = *oldest_weights_;
    for (const auto& [v, p] : patches_) WSYNC_RETURN_IF_ERROR(ApplyInPlace(*p, w, options_.encode.pool));
    *head_weights_ = std::move(w);
    return filled.WithContext("version " + std::to_string(version));
  }
  // A pull reads them (a keyframe of the head being built): fresh buffers.
  lock.unlock();
  auto fresh = Fresh(*head_weights_);  // stable: only this thread replaces it (publish_mu_)
  if (Status filled = next.fill(*fresh); !filled.ok()) return filled.WithContext("version " + std::to_string(version));
  lock.lock();
  head_weights_ = std::move(fresh);
  return Status::Ok();
}

void VersionHistory::EndLive() {
  std::lock_guard<std::mutex> lock(mu_);
  live_.reset();
  built_.notify_all();
}

Status VersionHistory::Retain(uint64_t oldest_needed) {
  std::lock_guard<std::mutex> publishing(publish_mu_);
  std::vector<std::pair<uint64_t, std::shared_ptr<const std::string>>> chain;
  std::shared_ptr<const Weights> shared;
  std::shared_ptr<Weights> moving;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = patches_.begin(); it != patches_.end() && it->first <= std::min(oldest_needed, head_); ++it) {
      chain.push_back(*it);
    }
    if (chain.empty()) return Status::Ok();
    if (oldest_weights_.use_count() == 1) {
      // Nobody reads it: moved forward in place (ms); pulls that need it wait.
      moving = oldest_weights_;
      oldest_moving_ = true;
    } else {
      shared = oldest_weights_;  // a pull reads it: move a copy forward
    }
  }
  if (!moving) moving = std::make_shared<Weights>(*shared);
  // codec::Apply is all or nothing: on an error `moving` holds `reached`.
  Status applied = Status::Ok();
  uint64_t reached = 0;
  for (const auto& [v, p] : chain) {
    applied = ApplyInPlace(*p, *moving, options_.encode.pool);
    if (!applied.ok()) break;
    reached = v;
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (reached != 0) {
    oldest_weights_ = std::move(moving);
    oldest_ = reached;
    patches_.erase(patches_.begin(), patches_.upper_bound(reached));
    for (auto it = cache_.begin(); it != cache_.end();) {
      const bool stale = (it->first.first != 0 && it->first.first < oldest_) || it->first.second < oldest_;
      if (stale) stats_.bytes -= it->second.stream->total_bytes();
      it = stale ? cache_.erase(it) : std::next(it);
    }
  }
  oldest_moving_ = false;
  built_.notify_all();
  return applied;
}

Status VersionHistory::SetGrids(std::vector<codec::TileGrid> grids) {
  auto same = [](const codec::TileGrid& a, const codec::TileGrid& b) {
    return a.tensor == b.tensor && a.row_cuts == b.row_cuts && a.col_cuts == b.col_cuts;
  };
  std::lock_guard<std::mutex> publishing(publish_mu_);
  std::shared_ptr<const Weights> head;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (std::equal(grids.begin(), grids.end(), grids_.begin(), grids_.end(), same)) return Status::Ok();
    if (head_ == 0) {
      grids_ = std::move(grids);
      return Status::Ok();
    }
    if (head_stale_) WSYNC_RETURN_IF_ERROR(LoadHeadLocked());
    head = head_weights_;
  }
  // Patches merge only over one grid: the versions kept before the head go
  // (sinks behind it get keyframes); the next patch is coded from the head
  // on the new grids, against the head's checksum on them.
  WSYNC_ASSIGN_OR_RETURN(std::vector<uint64_t> sums,
                         codec::TensorChecksums(buffers::Views(*head), grids, options_.encode.pool));
  const uint64_t head_checksum = codec::SetChecksumOf(sums);
  std::lock_guard<std::mutex> lock(mu_);
  spdlog::info("tile grids changed at version {}: versions {}..{} are no longer kept", head_, oldest_, head_ - 1);
  grids_ = std::move(grids);
  head_set_checksum_ = head_checksum;
  head_sums_ = std::move(sums);
  oldest_weights_ = head_weights_;  // shared: a publish then fills fresh buffers for the next head
  oldest_ = head_;
  patches_.clear();
  cache_.clear();
  stats_.bytes = 0;
  selections_.clear();
  selection_order_.clear();
  building_.clear();  // builds under way finish for their pullers, uncached
  ++grid_epoch_;
  return Status::Ok();
}

void VersionHistory::SetServedLayouts(const std::vector<std::vector<codec::RuntimeTensor>>& layouts) {
  std::lock_guard<std::mutex> lock(mu_);
  served_.clear();
  for (const auto& l : layouts) served_[codec::LayoutFingerprint(l)] = l;
  selections_.clear();
  selection_order_.clear();
}

StatusOr<std::shared_ptr<PatchStream>> VersionHistory::OpenFor(uint64_t from, uint64_t to, uint64_t layout,
                                                              uint32_t /*part*/) {
  if (layout == 0) return Open(from, to);
  const auto key = std::make_tuple(from, to, layout);
  std::vector<codec::RuntimeTensor> pieces;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = selections_.find(key); it != selections_.end()) return it->second;
    if (auto it = served_.find(layout); it != served_.end()) pieces = it->second;
  }
  if (pieces.empty()) {
    static std::atomic<int> warned{0};
    if (warned++ < 8) spdlog::warn("a sink pulls for a layout not served (fingerprint {:#x}): the whole stream", layout);
    return Open(from, to);
  }
  WSYNC_ASSIGN_OR_RETURN(auto whole, Open(from, to));
  WSYNC_RETURN_IF_ERROR(whole->WaitComplete(std::chrono::steady_clock::now() + std::chrono::minutes(5)));
  // Segment by segment: a version streamed while it was encoded is several.
  const std::string bytes = whole->Assemble();
  WSYNC_ASSIGN_OR_RETURN(auto segments, codec::SplitSegments(bytes));
  std::string selected;
  for (std::string_view segment : segments) {
    WSYNC_ASSIGN_OR_RETURN(std::string part, codec::SelectForPieces(segment, pieces));
    selected += part;
  }
  auto stream = PatchStream::FromBytes(whole->kind(), whole->from(), whole->to(), std::move(selected),
                                       options_.stream_chunk_bytes);
  std::lock_guard<std::mutex> lock(mu_);
  if (selections_.emplace(key, stream).second) {
    selection_order_.push_back(key);
    if (selection_order_.size() > 2 * served_.size()) {
      selections_.erase(selection_order_.front());
      selection_order_.pop_front();
    }
  }
  return stream;
}

codec::EncodeOptions VersionHistory::CurrentEncodeOptions() const {
  codec::EncodeOptions eo = options_.encode;
  std::lock_guard<std::mutex> lock(mu_);
  eo.grids = grids_;
  return eo;
}

uint64_t VersionHistory::head() const {
  std::lock_guard<std::mutex> lock(mu_);
  return head_;
}

uint64_t VersionHistory::oldest() const {
  std::lock_guard<std::mutex> lock(mu_);
  return oldest_;
}

Status VersionHistory::LoadHeadLocked() {
  if (!head_stale_) return Status::Ok();
  // A pull may read the stale buffers still: load into fresh ones then.
  if (head_weights_.use_count() == 1) {
    WSYNC_RETURN_IF_ERROR(head_loader_(*head_weights_).WithContext("loading the head version"));
  } else {
    auto target = Fresh(*head_weights_);
    WSYNC_RETURN_IF_ERROR(head_loader_(*target).WithContext("loading the head version"));
    head_weights_ = std::move(target);
  }
  head_stale_ = false;
  head_loader_ = nullptr;
  return Status::Ok();
}

Status VersionHistory::MaterializeHead() {
  std::lock_guard<std::mutex> lock(mu_);
  return LoadHeadLocked();
}

VersionHistory::CacheStats VersionHistory::cache_stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  CacheStats s = stats_;
  s.entries = cache_.size();
  return s;
}

// Built outside the lock; two pulls of one stream wait for the same build.
struct VersionHistory::Build {
  bool done = false;
  StatusOr<std::shared_ptr<PatchStream>> result = UnavailableError("not built yet");
};

void VersionHistory::CacheLocked(std::pair<uint64_t, uint64_t> key, std::shared_ptr<PatchStream> stream, double cost_s) {
  const uint64_t bytes = stream->total_bytes();
  cache_[key] = Cached{std::move(stream), cost_s, ++accesses_};
  stats_.bytes += bytes;
  uint64_t dense = 0;
  if (head_weights_) {
    for (const auto& t : *head_weights_) dense += t.bytes.size();
  }
  const uint64_t max_bytes = options_.cache_bytes != 0 ? options_.cache_bytes : 2 * dense;
  // The entry that is cheapest to rebuild for how recently it was used goes
  // first: a stored patch (cost 0) before a merge, a merge before a keyframe,
  // and an entry not used for long before one in use. The newest stays.
  while (cache_.size() > 1 && (cache_.size() > options_.cache_entries || stats_.bytes > max_bytes)) {
    auto victim = cache_.end();
    double lowest = 0;
    for (auto it = cache_.begin(); it != cache_.end(); ++it) {
      if (it->first == key) continue;
      const double value = (it->second.cost_s + 1e-6) / static_cast<double>(1 + accesses_ - it->second.last_use);
      if (victim == cache_.end() || value < lowest) {
        victim = it;
        lowest = value;
      }
    }
    stats_.bytes -= victim->second.stream->total_bytes();
    ++stats_.evictions;
    cache_.erase(victim);
  }
}

StatusOr<std::shared_ptr<const VersionHistory::Weights>> VersionHistory::WeightsAt(
    uint64_t v, std::shared_ptr<const Weights> head_copy, uint64_t head_version,
    std::shared_ptr<const Weights> oldest_copy, const std::map<uint64_t, std::shared_ptr<const std::string>>& chain) {
  if (v == head_version && head_copy) return head_copy;
  if (chain.empty() || chain.begin()->first > v) return oldest_copy;  // v is the oldest
  auto w = std::make_shared<Weights>(*oldest_copy);
  for (auto it = chain.begin(); it != chain.end() && it->first <= v; ++it) {
    WSYNC_RETURN_IF_ERROR(ApplyInPlace(*it->second, *w, options_.encode.pool));
  }
  return std::shared_ptr<const Weights>(std::move(w));
}

StatusOr<std::shared_ptr<PatchStream>> VersionHistory::Open(uint64_t from, uint64_t to) {
  std::unique_lock<std::mutex> lock(mu_);
  if (live_ && live_->to == to) {
    // The version being encoded: its patch from the head as it grows;
    // anything else of it (a keyframe, a merge) once it is encoded.
    if (live_->from == from) return live_->stream;
    if (!built_.wait_for(lock, std::chrono::minutes(5), [&] { return !live_ || live_->to != to; })) {
      return UnavailableError("version " + std::to_string(to) + " is still being encoded");
    }
  }
  // NotFound, as for any version not held: the puller waits for a newer
  // version (a restarted source publishes its history anew).
  if (head_ == 0) return NotFoundError("version " + std::to_string(to) + " is not held: nothing published since "
                                       "this source started");
  if (to < oldest_ || to > head_ || (to != head_ && to != oldest_ && !patches_.count(to))) {
    return NotFoundError("version " + std::to_string(to) + " is not held (held: " + std::to_string(oldest_) +
                         ".." + std::to_string(head_) + ")");
  }
  const bool known = from >= oldest_ && from < to && (from == oldest_ || patches_.count(from));
  if (!known) from = 0;  // unknown or too old: a keyframe
  const auto key = std::make_pair(from, to);
  if (auto it = cache_.find(key); it != cache_.end()) {
    it->second.last_use = ++accesses_;
    ++stats_.hits;
    return it->second.stream;
  }
  if (auto next = patches_.upper_bound(from); from != 0 && next != patches_.end() && next->first == to) {
    // One step: the patch as published, no weights needed.
    auto stream = PatchStream::FromBytes(codec::PatchKind::kPatch, from, to, *next->second, options_.stream_chunk_bytes);
    CacheLocked(key, stream, 0);
    return stream;
  }
  if (auto it = building_.find(key); it != building_.end()) {
    auto build = it->second;
    built_.wait(lock, [&] { return build->done; });
    return build->result;
  }
  // A keyframe or a merge: built from shared, immutable inputs outside the
  // lock, so that a publish never waits for it (nor it for a publish).
  built_.wait(lock, [&] { return !oldest_moving_; });
  if (from == 0 && to == head_) WSYNC_RETURN_IF_ERROR(LoadHeadLocked());
  auto build = std::make_shared<Build>();
  building_[key] = build;
  const std::shared_ptr<const Weights> head = head_weights_, oldest = oldest_weights_;
  const uint64_t head_version = head_, oldest_version = oldest_, epoch = grid_epoch_;
  std::map<uint64_t, std::shared_ptr<const std::string>> chain(patches_.upper_bound(oldest_version),
                                                               patches_.upper_bound(to));
  lock.unlock();

  const auto t0 = std::chrono::steady_clock::now();
  if (options_.before_build) options_.before_build(from, to);
  auto built = [&]() -> StatusOr<std::shared_ptr<PatchStream>> {
    if (from == 0) {
      WSYNC_ASSIGN_OR_RETURN(auto weights, WeightsAt(to, head, head_version, oldest, chain));
      codec::EncodeOptions eo = CurrentEncodeOptions();
      eo.target_version = to;
      WSYNC_ASSIGN_OR_RETURN(std::string kf, codec::EncodeKeyframe(buffers::Views(*weights), eo));
      return PatchStream::FromBytes(codec::PatchKind::kKeyframe, 0, to, std::move(kf), options_.stream_chunk_bytes);
    }
    // Merge the chain from -> to against the weights of `from` (conditioned
    // patches decode only against their base).
    std::shared_ptr<const Weights> base = oldest;
    if (from != oldest_version) {
      WSYNC_ASSIGN_OR_RETURN(base, WeightsAt(from, nullptr, 0, oldest, chain));
    }
    const auto base_views = buffers::Views(*base);
    auto it = chain.upper_bound(from);
    std::string merged = *it->second;
    for (++it; it != chain.end() && it->first <= to; ++it) {
      WSYNC_ASSIGN_OR_RETURN(merged, codec::MergePatches(merged, *it->second, base_views, options_.encode));
    }
    return PatchStream::FromBytes(codec::PatchKind::kPatch, from, to, std::move(merged), options_.stream_chunk_bytes);
  }();
  const double cost_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  lock.lock();
  if (auto it = building_.find(key); it != building_.end() && it->second == build) building_.erase(it);
  ++stats_.builds;
  // Not cached when the versions went out of the history meanwhile, or the
  // grids changed (built on the old ones).
  if (built.ok() && epoch == grid_epoch_ && to >= oldest_ && (from == 0 || from >= oldest_)) {
    CacheLocked(key, *built, cost_s);
  }
  build->result = built;
  build->done = true;
  built_.notify_all();
  return built;
}

}  // namespace wsync::daemon
