// A client of the coordinator service, for daemons and the CLI. The interface
// allows fakes in tests; NewCoordinatorClient talks gRPC.
//
// Thread safety: a client may be used from many threads.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "wsync/util/status.h"
#include "wsync/v1/coordinator.pb.h"

namespace wsync::control {

// The largest message a coordinator, its clients and a daemon's local API
// take (gRPC's default is 4 MiB; a layout of a large model's rank is more).
inline constexpr int kMaxMessageBytes = 256 << 20;

struct ClientOptions {
  // "host:port" or "unix:PATH"; replicas (wsyncd coordinator --etcd): a
  // comma-separated list of them, calls follow the leader.
  std::string address;
  std::string token;           // sent as "authorization: Bearer <token>"
  std::string tls_ca_file;     // set: TLS, verifying the server against this CA
  std::string tls_cert_file;   // client certificate for mTLS
  std::string tls_key_file;
  std::string tls_server_name; // override of the name checked in the server's certificate
  int timeout_ms = 5000;       // per unary call
  // Wait (up to the call's deadline) for the coordinator to become reachable
  // instead of failing at once: for daemons starting next to it.
  bool wait_for_ready = false;
  // Tests only: metadata sent with every call (fault injection, honoured
  // by a coordinator started with --inject-faults).
  std::vector<std::pair<std::string, std::string>> test_metadata;
};

class CoordinatorClient {
 public:
  virtual ~CoordinatorClient() = default;
  virtual StatusOr<wsync::v1::RegisterResponse> Register(const wsync::v1::RegisterRequest& req) = 0;
  virtual StatusOr<wsync::v1::HeartbeatResponse> Heartbeat(const wsync::v1::HeartbeatRequest& req) = 0;
  virtual Status Deregister(const std::string& name) = 0;
  virtual StatusOr<uint64_t> Publish(const wsync::v1::VersionSummary& version) = 0;
  virtual StatusOr<wsync::v1::ListVersionsResponse> ListVersions(uint64_t after) = 0;
  // Calls on_version for every version > req.after, then for new ones,
  // until on_version returns false, the stream breaks (Unavailable) or
  // Cancel(). req.node / req.incarnation: see WatchRequest.
  virtual Status Watch(const wsync::v1::WatchRequest& req,
                       const std::function<bool(const wsync::v1::VersionSummary&)>& on_version) = 0;
  virtual StatusOr<wsync::v1::Node> ReportApplied(const std::string& name, uint64_t version) = 0;
  virtual StatusOr<wsync::v1::Lease> AcquireLease(const std::string& node, uint64_t version, uint64_t ttl_ms) = 0;
  virtual StatusOr<wsync::v1::Lease> RenewLease(uint64_t id, uint64_t ttl_ms) = 0;
  virtual Status ReleaseLease(uint64_t id) = 0;
  virtual StatusOr<wsync::v1::ListLeasesResponse> ListLeases() = 0;
  virtual StatusOr<wsync::v1::MayPublishResponse> MayPublish(uint64_t version, int64_t wait_ms) = 0;
  virtual StatusOr<wsync::v1::StatusResponse> GetStatus() = 0;
  // What the replica at the client's first address knows of the
  // replication (any replica answers; a coordinator without replicas says SINGLE).
  virtual StatusOr<wsync::v1::ReplicaResponse> DescribeReplica() = 0;
  virtual StatusOr<wsync::v1::GetLayoutResponse> GetLayout() = 0;
  virtual Status SetLayout(const wsync::v1::Layout& layout) = 0;
  // A sink's runtime layout, for sources to serve (LayoutOffers); returns the
  // number of distinct layouts offered.
  virtual StatusOr<uint32_t> OfferLayout(const std::string& node, const wsync::v1::ServedLayout& layout) = 0;
  virtual StatusOr<std::vector<wsync::v1::ServedLayout>> ListOfferedLayouts() = 0;
  // For shutdown: ends every call in flight (a Watch, a MayPublish that
  // waits) and every later Watch at once; later unary calls still run but
  // fail at once instead of waiting for an unreachable coordinator.
  virtual void Cancel() = 0;
};

StatusOr<std::unique_ptr<CoordinatorClient>> NewCoordinatorClient(const ClientOptions& options);

}  // namespace wsync::control
