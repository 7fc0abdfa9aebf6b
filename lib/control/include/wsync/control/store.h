// The coordinator's durable store: an append-only log of mutations with a
// periodic snapshot, in a directory. Format: docs/control-plane.md.
//
//   DIR/snapshot.pb  a wsync.store.v1.Snapshot (written to a temporary file,
//                    fsynced, renamed)
//   DIR/wal.log      records after the snapshot: u32 length, u32 CRC-32C of
//                    the payload, payload (a wsync.store.v1.Record)
//
// Every Append is fsynced before it returns: a mutation acknowledged to a
// client survives SIGKILL and power loss. On open, a torn or corrupt tail
// (short length, short payload, CRC mismatch) is cut off at the last
// complete record and reported.
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
  // Replaces snapshot + log by `snapshot` (the whole state).
  virtual Status Compact(const wsync::store::v1::Snapshot& snapshot) = 0;
  // Records appended since the last compaction.
  virtual size_t LogRecords() const = 0;
};

struct Recovered {
  wsync::store::v1::Snapshot snapshot;
  std::vector<wsync::store::v1::Record> records;  // to replay after the snapshot
  size_t torn_bytes = 0;                          // cut from the log's tail
};

// Opens (creating if needed) the store in `dir` and recovers its content.
StatusOr<std::unique_ptr<Store>> OpenLogStore(const std::string& dir, Recovered* recovered);

// A store that keeps nothing (a coordinator without --store-dir).
std::unique_ptr<Store> NewNullStore();

}  // namespace wsync::control
