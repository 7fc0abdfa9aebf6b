#include "version_log.h"

#include <algorithm>
#include <iterator>

#include <spdlog/spdlog.h>

namespace wsync::control {

using wsync::store::v1::Record;
using wsync::v1::VersionSummary;

StatusOr<uint64_t> VersionLog::Publish(const VersionSummary& version, uint32_t layout_parts, const RecordLog& log) {
  if (version.parts() > 1 || layout_parts > 1) return PublishPart(version, layout_parts, log);
  // Above the head, and above every version ever acknowledged (the store's
  // high-water mark: higher than the head after a salvage lost records).
  const uint64_t head = acknowledged_head();
  if (auto it = versions_.find(version.version()); it != versions_.end() &&
      it->second.source() == version.source() && it->second.base_version() == version.base_version()) {
    const VersionSummary& had = it->second;
    if (had.incomplete() && !version.incomplete() && it == std::prev(versions_.end())) {
      // The version announced while it was encoded, now complete.
      Record r;
      *r.mutable_version_published() = version;
      r.mutable_version_published()->set_published_unix_ms(had.published_unix_ms());
      WSYNC_RETURN_IF_ERROR(log(r));
      spdlog::info("version {} complete ({} patch bytes)", version.version(), version.patch_bytes());
      return version.version();
    }
    if ((had.set_checksum() == version.set_checksum() && had.incomplete() == version.incomplete()) ||
        (!had.incomplete() && version.incomplete())) {
      // A retry of a publish that was stored but whose answer was lost (or
      // of the early announce of a version since completed).
      return version.version();
    }
  }
  if (version.version() <= head) {
    return StaleVersionError(version.version(), head).WithContext("versions only grow");
  }
  if (!version.keyframe() && version.base_version() >= version.version()) {
    return InvalidArgumentError("base version " + std::to_string(version.base_version()) +
                                " of a patch must be below its version " + std::to_string(version.version()));
  }
  Record r;
  *r.mutable_version_published() = version;
  if (version.published_unix_ms() == 0) r.mutable_version_published()->set_published_unix_ms(clock_->NowMs());
  WSYNC_RETURN_IF_ERROR(log(r));
  NoteSourceHolds(version.source(), version.version());
  spdlog::info("version {} published by {} (base {}, {} patch bytes, {} dense bytes{}{})", version.version(),
               version.source(), version.base_version(), version.patch_bytes(), version.dense_bytes(),
               version.keyframe() ? ", keyframe" : "", version.incomplete() ? ", still being encoded: streamed as it is" : "");
  return version.version();
}

// A part of a version published by several sources: recorded; the version
// is published (visible, the head) once every part is in. A part announced
// again for a version not yet whole replaces the earlier one (its source
// restarted: nobody has applied it). Versions below a whole one that are
// still partial are dropped: their missing sources have moved past them.
StatusOr<uint64_t> VersionLog::PublishPart(const VersionSummary& part, uint32_t layout_parts, const RecordLog& log) {
  const uint64_t v = part.version();
  if (layout_parts == 0 || layout_parts != part.parts() || part.parts() <= 1) {
    return FailedPreconditionError("version " + std::to_string(v) + " part " + std::to_string(part.part()) + " of " +
                                   std::to_string(part.parts()) + ": the layout is set for " +
                                   std::to_string(layout_parts) + " part(s)");
  }
  if (part.part() >= part.parts()) {
    return InvalidArgumentError("part " + std::to_string(part.part()) + " of " + std::to_string(part.parts()));
  }
  if (part.incomplete()) {
    return InvalidArgumentError("version " + std::to_string(v) + " part " + std::to_string(part.part()) +
                                ": a part is announced once encoded (no incomplete announce)");
  }
  if (auto it = versions_.find(v); it != versions_.end() && static_cast<int>(part.part()) < it->second.part_summaries_size()) {
    const VersionSummary& had = it->second.part_summaries(static_cast<int>(part.part()));
    if (had.set_checksum() == part.set_checksum() && had.source() == part.source() &&
        had.base_version() == part.base_version()) {
      return v;  // a retry of a part stored with its version
    }
  }
  const uint64_t head = acknowledged_head();
  if (v <= head) {
    return StaleVersionError(v, head).WithContext("versions only grow");
  }
  if (!part.keyframe() && part.base_version() >= v) {
    return InvalidArgumentError("base version " + std::to_string(part.base_version()) +
                                " of a patch must be below its version " + std::to_string(v));
  }
  Record r;
  *r.mutable_version_part() = part;
  if (part.published_unix_ms() == 0) r.mutable_version_part()->set_published_unix_ms(clock_->NowMs());
  WSYNC_RETURN_IF_ERROR(log(r));
  NoteSourceHolds(part.source(), v);
  const auto& have = parts_[v];
  spdlog::info("version {} part {} of {} published by {} ({} of {} parts in)", v, part.part(), part.parts(),
               part.source(), have.size(), part.parts());
  if (have.size() < part.parts()) return v;
  // Whole: the version as sinks see it.
  Record whole;
  VersionSummary* s = whole.mutable_version_published();
  s->set_version(v);
  s->set_parts(part.parts());
  s->set_keyframe(true);
  std::string sources;
  for (const auto& [index, p] : have) {
    *s->add_part_summaries() = p;
    s->set_patch_bytes(s->patch_bytes() + p.patch_bytes());
    s->set_dense_bytes(s->dense_bytes() + p.dense_bytes());
    s->set_keyframe(s->keyframe() && p.keyframe());
    if (!p.keyframe()) s->set_base_version(std::max(s->base_version(), p.base_version()));
    sources += (sources.empty() ? "" : "+") + p.source();
  }
  s->set_source(sources);
  s->set_published_unix_ms(clock_->NowMs());
  WSYNC_RETURN_IF_ERROR(log(whole));
  spdlog::info("version {} published: all {} parts in ({})", v, part.parts(), sources);
  return v;
}

void VersionLog::ApplyPublished(const VersionSummary& version) {
  const uint64_t v = version.version();
  // Above the head, or the head's summary completed.
  if (versions_.empty() || v > versions_.rbegin()->first ||
      (v == versions_.rbegin()->first && versions_.rbegin()->second.incomplete())) {
    versions_[v] = version;
  }
  // Parts of this version and of older ones: whole now, or never.
  parts_.erase(parts_.begin(), parts_.upper_bound(v));
}

void VersionLog::ApplyPart(const VersionSummary& part) {
  if (versions_.empty() || part.version() > versions_.rbegin()->first) parts_[part.version()][part.part()] = part;
}

void VersionLog::ApplyFloor(uint64_t floor) { version_floor_ = std::max(version_floor_, floor); }

uint64_t VersionLog::acknowledged_head() const { return std::max(head(), version_floor_); }

wsync::v1::ListVersionsResponse VersionLog::List(uint64_t after) const {
  wsync::v1::ListVersionsResponse resp;
  for (auto it = versions_.upper_bound(after); it != versions_.end(); ++it) *resp.add_versions() = it->second;
  for (const auto& [v, parts] : parts_) {
    VersionSummary* partial = resp.add_partial();
    partial->set_version(v);
    for (const auto& [index, p] : parts) {
      *partial->add_part_summaries() = p;
      partial->set_parts(p.parts());
    }
  }
  // Publishers read the next valid version from it: the floor counts.
  resp.set_head_version(acknowledged_head());
  return resp;
}

void VersionLog::NoteSourceHolds(const std::string& source, uint64_t version) {
  auto [it, added] = source_heads_.emplace(source, version);
  if (!added) it->second = std::max(it->second, version);
}

void VersionLog::SetSourceHead(const std::string& source, uint64_t version) { source_heads_[source] = version; }

void VersionLog::ForgetSource(const std::string& source) { source_heads_.erase(source); }

bool VersionLog::SourceHolds(const std::string& source, uint64_t version) const {
  auto held = source_heads_.find(source);
  return held == source_heads_.end() || held->second >= version;
}

void VersionLog::SaveTo(wsync::store::v1::Snapshot* snapshot) const {
  for (const auto& [v, vs] : versions_) *snapshot->add_versions() = vs;
  snapshot->set_version_floor(version_floor_);
  for (const auto& [v, parts] : parts_) {
    for (const auto& [p, summary] : parts) *snapshot->add_version_parts() = summary;
  }
}

void VersionLog::LoadFrom(const wsync::store::v1::Snapshot& snapshot) {
  for (const auto& v : snapshot.versions()) ApplyPublished(v);
  for (const auto& p : snapshot.version_parts()) ApplyPart(p);
  ApplyFloor(snapshot.version_floor());
}

}  // namespace wsync::control
