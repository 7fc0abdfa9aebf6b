// The coordinator's durable store: an append-only log of mutations with a
// periodic snapshot, in a directory (mode 0700, files 0600). Format:
// docs/control-plane.md.
//
//   DIR/snapshot.pb    "WSYNCSN1", u64 length, u32 CRC-32C, a wsync.store.v1.Snapshot
//                      (written to a temporary file, fsynced, renamed)
//   DIR/wal.log        records after the snapshot: u32 length, u32 CRC-32C of
//                      the payload, payload (a wsync.store.v1.Record)
//   DIR/versions.hwm   the highest version ever appended (u64, CRC-32C),
//                      kept apart from the log
//
// Every Append is fsynced before it returns: a mutation acknowledged to a
// client survives SIGKILL and power loss. On open, only a torn last write is
// cut off (a bad record with no valid record after it); anything else that
// fails its checks (a corrupt record followed by valid ones, a corrupt, empty
// or truncated snapshot, versions below the high-water mark) is DataLoss
// naming the file and offset, and nothing is changed, unless the store is
// opened to salvage it.
//
// Thread safety: not thread-safe; the coordinator serializes calls.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "wsync/util/status.h"
#include "wsync/v1/store.pb.h"

namespace wsync::control {

class Store {
 public:
  virtual ~Store() = default;
  virtual Status Append(const wsync::store::v1::Record& record) = 0;
  // Appends `records` in order, as few writes as the store allows (one
  // fsync, or as few etcd transactions as etcd's limits allow); on an error
  // a prefix of them may be durable, never a record without those before it.
  virtual Status AppendBatch(const std::vector<wsync::store::v1::Record>& records) {
    for (const auto& r : records) WSYNC_RETURN_IF_ERROR(Append(r));
    return Status::Ok();
  }
  // Replaces snapshot + log by `snapshot` (the whole state).
  virtual Status Compact(const wsync::store::v1::Snapshot& snapshot) = 0;
  // Records appended since the last compaction.
  virtual size_t LogRecords() const = 0;
};

struct Recovered {
  wsync::store::v1::Snapshot snapshot;
  std::vector<wsync::store::v1::Record> records;  // to replay after the snapshot
  size_t torn_bytes = 0;                          // cut from the log's tail
  // No version at or below this may be published again (the high-water
  // mark: above what the records hold when they lost some, salvaged).
  uint64_t version_floor = 0;
  std::vector<std::string> salvage_report;        // what a salvage dropped, one line each
};

struct StoreOptions {
  // Start from what verifies instead of refusing: a corrupt snapshot is set
  // aside, the log is cut before its first bad record (the original kept as
  // wal.log.corrupt.TIME), and versions stay above the high-water mark.
  // Every drop is logged and listed in Recovered::salvage_report.
  bool salvage = false;
};

// Opens (creating if needed) the store in `dir` and recovers its content.
StatusOr<std::unique_ptr<Store>> OpenLogStore(const std::string& dir, Recovered* recovered,
                                              const StoreOptions& options = {});

// A store that keeps nothing (a coordinator without --store-dir).
std::unique_ptr<Store> NewNullStore();

}  // namespace wsync::control
