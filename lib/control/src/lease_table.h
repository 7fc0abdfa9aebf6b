// The coordinator's leases (internal to wsync::control): a node's claim
// that a version stays available until the lease expires or is released.
//
// Thread safety: not thread-safe. REQUIRES for every method: the
// coordinator's mutex held (a test using it alone: one thread).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "record_log.h"
#include "wsync/control/clock.h"
#include "wsync/util/status.h"
#include "wsync/v1/coordinator.pb.h"
#include "wsync/v1/store.pb.h"

namespace wsync::control {

class LeaseTable {
 public:
  // REQUIRES: `clock` outlives this; `default_ttl_ms` serves a TTL of 0.
  LeaseTable(const Clock* clock, uint64_t default_ttl_ms) : clock_(clock), default_ttl_ms_(default_ttl_ms) {}

  // A new lease of `node` on `version` until now + `ttl_ms` (0: the
  // default), through `log` (a lease_granted record). A non-empty
  // `request_id` that granted a lease `node` still holds is a retry: that
  // lease, unchanged, and nothing logged. REQUIRES: the caller checked that
  // the node lives, the version exists and the TTL is allowed.
  StatusOr<wsync::v1::Lease> Acquire(const std::string& node, uint64_t version, uint64_t ttl_ms,
                                     const std::string& request_id, const RecordLog& log);
  // Lease `id` until now + `ttl_ms` (0: the default); NotFound when not held.
  StatusOr<wsync::v1::Lease> Renew(uint64_t id, uint64_t ttl_ms, const RecordLog& log);
  // Ends lease `id` through `log` (lease_released); NotFound when not held.
  Status Release(uint64_t id, const RecordLog& log);

  // Apply a lease_granted or lease_released record.
  void ApplyGranted(const wsync::v1::Lease& lease);
  void ApplyReleased(uint64_t id);
  // Applies a node_deregistered record: the node's leases end.
  void DropNode(const std::string& node);

  // The leases that end at `now` (unix ms), by id: past their expiry, or
  // `owner_dead(node)`.
  std::vector<uint64_t> Ended(int64_t now, const std::function<bool(const std::string& node)>& owner_dead) const;
  // The oldest version leased; 0 for none.
  uint64_t OldestLeased() const;
  // Every lease, by id, with OldestLeased().
  wsync::v1::ListLeasesResponse List() const;
  size_t size() const { return leases_.size(); }

  // Writes the leases and the next lease id into `snapshot`; LoadFrom
  // applies what SaveTo wrote.
  void SaveTo(wsync::store::v1::Snapshot* snapshot) const;
  void LoadFrom(const wsync::store::v1::Snapshot& snapshot);

 private:
  StatusOr<wsync::v1::Lease> Grant(uint64_t id, const std::string& node, uint64_t version, uint64_t ttl_ms,
                                   const std::string& request_id, const RecordLog& log);
  void Erase(std::map<uint64_t, wsync::v1::Lease>::iterator it);

  const Clock* clock_;
  const uint64_t default_ttl_ms_;
  std::map<uint64_t, wsync::v1::Lease> leases_;
  // Held leases granted with a request id: (node, request id) -> lease id.
  std::map<std::pair<std::string, std::string>, uint64_t> by_request_;
  uint64_t next_lease_id_ = 1;
};

}  // namespace wsync::control
