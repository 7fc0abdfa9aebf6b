// A client of etcd's v3 API over the project's gRPC (proto/etcd/rpc.proto):
// the calls a coordinator replica makes. Calls go to one endpoint at a time
// and move to the next when it is unreachable or has no etcd leader; with a
// user name, the client authenticates and re-authenticates when its token
// expires.
//
// Thread safety: a client may be used from many threads.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "etcd/rpc.pb.h"
#include "wsync/util/status.h"

namespace wsync::control {

struct EtcdOptions {
  std::vector<std::string> endpoints;  // host:port (an http:// or https:// scheme is accepted)
  std::string ca_file;                 // set: TLS, verifying the members against this CA
  std::string cert_file;               // client certificate (etcd's --client-cert-auth)
  std::string key_file;
  std::string user;                    // set: etcd authentication as this user
  std::string password;
  int timeout_ms = 2000;               // per call
};

class Etcd {
 public:
  static StatusOr<std::unique_ptr<Etcd>> Connect(const EtcdOptions& options);
  virtual ~Etcd() = default;

  virtual StatusOr<etcdserverpb::RangeResponse> Range(const etcdserverpb::RangeRequest& req) = 0;
  virtual StatusOr<etcdserverpb::TxnResponse> Txn(const etcdserverpb::TxnRequest& req) = 0;
  // A lease of ttl_s seconds: its ID.
  virtual StatusOr<int64_t> Grant(int64_t ttl_s) = 0;
  virtual Status Revoke(int64_t id) = 0;
  // Renews lease `id`: its remaining TTL in seconds, 0 when it has expired.
  virtual StatusOr<int64_t> KeepAlive(int64_t id) = 0;
  // Watches `key` from revision after_revision + 1: true once it changed
  // (put or deleted), false when it did not within timeout_ms or the waits
  // were cancelled. The member must have an etcd leader (a member cut off
  // from the majority ends the watch with an error).
  virtual StatusOr<bool> WaitForChange(const std::string& key, int64_t after_revision, int timeout_ms) = 0;
  // Ends every WaitForChange in flight and every later one at once.
  virtual void CancelWaits() = 0;
};

// The end of the range of keys that start with `prefix` (etcd's convention).
std::string PrefixEnd(const std::string& prefix);

}  // namespace wsync::control
