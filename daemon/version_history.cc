#include "version_history.h"
#include "wsync/util/text.h"

#include <utility>

#include <spdlog/spdlog.h>

namespace wsync::daemon {
namespace {

Status ApplyInPlace(const std::string& patch, std::vector<buffers::OwnedTensor>& w, ThreadPool* pool) {
  auto views = buffers::MutableViews(w);
  codec::ApplyOptions ao;
  ao.pool = pool;
  return codec::ApplyPatch(patch, views, ao);
}

}  // namespace

StatusOr<PublishedVersion> VersionHistory::Publish(uint64_t version, std::span<const codec::TensorView> weights) {
  NewVersion next;
  next.layout = weights;
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
    return FailedPreconditionError("version " + std::to_string(version) + " is not above the head " +
                                   std::to_string(head_));
  }
  if (head_ != 0 && !buffers::SameLayout(head_weights_, layout)) {
    return InvalidArgumentError("version " + std::to_string(version) + ": " + LayoutDifference(head_weights_, layout) +
                                " (the previous version's layout)");
  }
  return Status::Ok();
}

StatusOr<PublishedVersion> VersionHistory::Publish(uint64_t version, const NewVersion& next) {
  std::lock_guard<std::mutex> lock(mu_);
  WSYNC_RETURN_IF_ERROR(AcceptsLocked(version, next.layout));
  PublishedVersion out;
  out.version = version;
  for (const auto& t : next.layout) out.dense_bytes += t.NumBytes();
  if (head_ == 0 || (head_stale_ && !next.load_head)) {
    // A first version, or a host publish after lazy device ones.
    WSYNC_RETURN_IF_ERROR(LoadHeadLocked());
  }
  if (head_ == 0) {
    std::vector<buffers::OwnedTensor> first;
    for (const auto& t : next.layout) first.push_back({t.name, t.dtype, t.shape, std::vector<uint8_t>(t.NumBytes())});
    WSYNC_RETURN_IF_ERROR(next.fill(first));
    codec::EncodeOptions eo = options_.encode;
    eo.target_version = version;
    WSYNC_ASSIGN_OR_RETURN(std::string kf, codec::EncodeKeyframe(buffers::Views(first), eo));
    WSYNC_ASSIGN_OR_RETURN(codec::PatchInfo info, codec::InspectPatch(kf));
    out.set_checksum = head_set_checksum_ = info.target_set_checksum;
    out.patch_bytes = kf.size();
    head_weights_ = std::move(first);
    oldest_weights_ = head_weights_;
    cache_[{0, version}] = PatchStream::FromBytes(codec::PatchKind::kKeyframe, 0, version, std::move(kf),
                                                  options_.stream_chunk_bytes);
    head_ = oldest_ = version;
    return out;
  }
  codec::EncodeOptions eo = options_.encode;
  eo.base_version = head_;
  eo.target_version = version;
  eo.base_set_checksum = head_set_checksum_;  // the head was the last target: no second hash of it
  WSYNC_ASSIGN_OR_RETURN(std::string patch, next.encode(buffers::Views(head_weights_), eo));
  WSYNC_ASSIGN_OR_RETURN(codec::PatchInfo info, codec::InspectPatch(patch));
  if (next.load_head) {
    head_stale_ = true;
    head_loader_ = next.load_head;
  } else if (Status filled = next.fill(head_weights_); !filled.ok()) {
    // The head copy may be torn: rebuild it from the oldest copy and the chain.
    std::vector<buffers::OwnedTensor> w = oldest_weights_;
    for (const auto& [v, p] : patches_) WSYNC_RETURN_IF_ERROR(ApplyInPlace(p, w, options_.encode.pool));
    head_weights_ = std::move(w);
    return filled.WithContext("version " + std::to_string(version));
  }
  out.base_version = head_;
  out.patch_bytes = patch.size();
  out.set_checksum = head_set_checksum_ = info.target_set_checksum;
  patches_[version] = std::move(patch);
  head_ = version;
  return out;
}

Status VersionHistory::Retain(uint64_t oldest_needed) {
  std::lock_guard<std::mutex> lock(mu_);
  while (!patches_.empty() && patches_.begin()->first <= std::min(oldest_needed, head_)) {
    auto it = patches_.begin();
    WSYNC_RETURN_IF_ERROR(ApplyInPlace(it->second, oldest_weights_, options_.encode.pool));
    oldest_ = it->first;
    patches_.erase(it);
  }
  for (auto it = cache_.begin(); it != cache_.end();) {
    const bool stale = (it->first.first != 0 && it->first.first < oldest_) || it->first.second < oldest_;
    it = stale ? cache_.erase(it) : std::next(it);
  }
  return Status::Ok();
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
  WSYNC_RETURN_IF_ERROR(head_loader_(head_weights_).WithContext("loading the head version"));
  head_stale_ = false;
  head_loader_ = nullptr;
  return Status::Ok();
}

Status VersionHistory::MaterializeHead() {
  std::lock_guard<std::mutex> lock(mu_);
  return LoadHeadLocked();
}

StatusOr<std::vector<buffers::OwnedTensor>> VersionHistory::WeightsAt(uint64_t v) {
  if (v == head_) {
    WSYNC_RETURN_IF_ERROR(LoadHeadLocked());
    return head_weights_;
  }
  std::vector<buffers::OwnedTensor> w = oldest_weights_;
  for (auto it = patches_.begin(); it != patches_.end() && it->first <= v; ++it) {
    WSYNC_RETURN_IF_ERROR(ApplyInPlace(it->second, w, options_.encode.pool));
  }
  return w;
}

StatusOr<std::shared_ptr<PatchStream>> VersionHistory::Open(uint64_t from, uint64_t to) {
  std::lock_guard<std::mutex> lock(mu_);
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
  if (auto it = cache_.find({from, to}); it != cache_.end()) return it->second;
  if (cache_.size() >= options_.cache_entries) cache_.erase(cache_.begin());

  std::shared_ptr<PatchStream> stream;
  if (from == 0) {
    WSYNC_ASSIGN_OR_RETURN(auto weights, WeightsAt(to));
    codec::EncodeOptions eo = options_.encode;
    eo.target_version = to;
    WSYNC_ASSIGN_OR_RETURN(std::string kf, codec::EncodeKeyframe(buffers::Views(weights), eo));
    stream = PatchStream::FromBytes(codec::PatchKind::kKeyframe, 0, to, std::move(kf), options_.stream_chunk_bytes);
  } else if (auto next = patches_.upper_bound(from); next != patches_.end() && next->first == to) {
    // One step: the patch as published, no weights needed.
    stream = PatchStream::FromBytes(codec::PatchKind::kPatch, from, to, next->second, options_.stream_chunk_bytes);
  } else {
    // Merge the chain from -> to against the weights of `from` (conditioned
    // patches decode only against their base).
    std::vector<buffers::OwnedTensor> rebuilt;
    if (from != oldest_) {
      WSYNC_ASSIGN_OR_RETURN(rebuilt, WeightsAt(from));
    }
    const auto base_views = buffers::Views(from == oldest_ ? oldest_weights_ : rebuilt);
    auto it = patches_.upper_bound(from);
    std::string merged = it->second;
    for (++it; it != patches_.end() && it->first <= to; ++it) {
      WSYNC_ASSIGN_OR_RETURN(merged, codec::MergePatches(merged, it->second, base_views, options_.encode));
    }
    stream = PatchStream::FromBytes(codec::PatchKind::kPatch, from, to, std::move(merged), options_.stream_chunk_bytes);
  }
  cache_[{from, to}] = stream;
  return stream;
}

}  // namespace wsync::daemon
