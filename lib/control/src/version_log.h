// The coordinator's published versions (internal to wsync::control): the
// history sinks watch, the parts of versions published by several sources
// that are not whole yet, the floor a salvage left, and what each source's
// history holds.
//
// Thread safety: not thread-safe. REQUIRES for every method: the
// coordinator's mutex held (a test using it alone: one thread).
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "record_log.h"
#include "wsync/control/clock.h"
#include "wsync/util/status.h"
#include "wsync/v1/coordinator.pb.h"
#include "wsync/v1/store.pb.h"

namespace wsync::control {

class VersionLog {
 public:
  // REQUIRES: `clock` (stamps versions published without a time) outlives this.
  explicit VersionLog(const Clock* clock) : clock_(clock) {}

  // CoordinatorState::Publish's contract, for a version other than 0.
  // `layout_parts`: the parts (sources) the layout is set for, 0 before any
  // (LayoutRegistry::parts()); a part of a version of several is recorded
  // and the version is published once every part is in. Mutations go
  // through `log` (version_published, version_part records).
  StatusOr<uint64_t> Publish(const wsync::v1::VersionSummary& version, uint32_t layout_parts, const RecordLog& log);

  // Apply a version_published, version_part or version_floor record.
  void ApplyPublished(const wsync::v1::VersionSummary& version);
  void ApplyPart(const wsync::v1::VersionSummary& part);
  void ApplyFloor(uint64_t floor);

  // The newest version published; 0 for none.
  uint64_t head() const { return versions_.empty() ? 0 : versions_.rbegin()->first; }
  // The highest version ever acknowledged: the head, or the store's floor
  // after a salvage that lost versions.
  uint64_t acknowledged_head() const;
  bool empty() const { return versions_.empty(); }
  bool contains(uint64_t version) const { return versions_.count(version) != 0; }
  // The versions after `after`, every partial one, and acknowledged_head().
  wsync::v1::ListVersionsResponse List(uint64_t after) const;

  // What sources' histories hold (soft state, not durable). A source not
  // heard from (since this coordinator started or it registered) counts as
  // holding every version.
  // `source` announced `version`: its history holds it.
  void NoteSourceHolds(const std::string& source, uint64_t version);
  // `source`'s heartbeat says the newest version its history holds.
  void SetSourceHead(const std::string& source, uint64_t version);
  // `source` (re)registered: its next heartbeat says what it holds.
  void ForgetSource(const std::string& source);
  bool SourceHolds(const std::string& source, uint64_t version) const;

  // Writes the versions, the partial ones and the floor into `snapshot`;
  // LoadFrom applies what SaveTo wrote.
  void SaveTo(wsync::store::v1::Snapshot* snapshot) const;
  void LoadFrom(const wsync::store::v1::Snapshot& snapshot);

 private:
  StatusOr<uint64_t> PublishPart(const wsync::v1::VersionSummary& part, uint32_t layout_parts, const RecordLog& log);

  const Clock* clock_;
  std::map<uint64_t, wsync::v1::VersionSummary> versions_;
  // Versions published by several sources, not yet whole: version -> part -> summary.
  std::map<uint64_t, std::map<uint32_t, wsync::v1::VersionSummary>> parts_;
  uint64_t version_floor_ = 0;  // no version at or below it is published (Recovered::version_floor)
  // Sources: the newest version each one's history holds (absent: not known).
  std::map<std::string, uint64_t> source_heads_;
};

}  // namespace wsync::control
