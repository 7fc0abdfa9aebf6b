// A coordinator replica: one of several `wsyncd coordinator --etcd`
// processes over one etcd cluster. One leads at a time, elected through etcd
// (a lease and a key created only while absent); the leader answers every
// RPC from the state it recovered from etcd, and every mutation it
// acknowledges is first committed to etcd in a transaction that only its
// own election can pass, so a replica deposed, paused or cut off can never
// write. The others answer Unavailable with reason NOT_LEADER and the
// leader's address; clients follow it (client.h). Key layout, what a
// failover loses and recovers: docs/control-plane.md.
//
// Thread safety: all methods are thread-safe.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "wsync/control/clock.h"
#include "wsync/control/coordinator_state.h"
#include "wsync/control/server.h"
#include "wsync/util/status.h"

namespace wsync::control {

struct ReplicaOptions {
  std::vector<std::string> etcd_endpoints;  // host:port of the etcd members
  std::string etcd_ca_file;                 // TLS to etcd (its client CA); client certificate below
  std::string etcd_cert_file;
  std::string etcd_key_file;
  std::string etcd_user;                    // etcd authentication
  std::string etcd_password;
  std::string prefix = "/wsync";            // every key of this coordinator starts with it
  std::string advertise;                    // the address clients reach this replica at
  int lease_ttl_s = 2;                      // the leader's lease: a dead leader is replaced after about this
  int poll_ms = 100;                        // how often a follower reads the leadership when etcd fails it
  int watch_ms = 1000;                      // a follower watches the leader key this long, then reads it again
  CoordinatorOptions coordinator;
};

class Replica : public StateHolder {
 public:
  // Connects and starts campaigning (in the background). REQUIRES: clock
  // outlives the replica.
  static StatusOr<std::unique_ptr<Replica>> Start(const ReplicaOptions& options, const Clock* clock);
  // Resigns (revokes the lease, so another replica leads at once).
  ~Replica() override;

  // Not leading: NOT_LEADER, or ETCD_UNREACHABLE once etcd has failed
  // this replica for its lease TTL plus 3 s.
  StatusOr<std::shared_ptr<CoordinatorState>> Current() override;
  wsync::v1::ReplicaResponse Describe() const override;
  bool leading() const;
  // The leader's address as etcd names it ("" when none is known).
  std::string leader() const;
  // Transactions this replica committed to etcd as leader (records and snapshots).
  uint64_t etcd_writes() const;

 private:
  struct Impl;
  explicit Replica(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace wsync::control
