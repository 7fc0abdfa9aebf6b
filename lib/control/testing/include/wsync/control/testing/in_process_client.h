// A CoordinatorClient over a CoordinatorState in this process: the gRPC
// adapter's semantics (Watch and MayPublish wait as the server does, a broken
// Watch marks the node disconnected) without gRPC, so that the data plane's
// logic runs in-process in tests against the real state machine. It can be
// made unreachable, to test what the daemons do when the coordinator is.
//
// Thread safety: thread-safe. REQUIRES: the state outlives the client.
#pragma once

#include <atomic>
#include <memory>

#include "wsync/control/client.h"
#include "wsync/control/coordinator_state.h"

namespace wsync::control {

class InProcessClient : public CoordinatorClient {
 public:
  explicit InProcessClient(CoordinatorState* state) : state_(state) {}

  // While unreachable every call fails with Unavailable and a Watch ends
  // (as a broken stream does).
  void SetUnreachable(bool unreachable) { unreachable_ = unreachable; }
  // The next n Publish calls fail with Unavailable (a lost answer).
  void FailNextPublishes(int n) { failing_publishes_ = n; }
  uint64_t calls() const { return calls_.load(); }
  uint64_t report_calls() const { return report_calls_.load(); }  // ReportApplied's

  StatusOr<wsync::v1::RegisterResponse> Register(const wsync::v1::RegisterRequest& req) override;
  StatusOr<wsync::v1::HeartbeatResponse> Heartbeat(const wsync::v1::HeartbeatRequest& req) override;
  Status Deregister(const std::string& name) override;
  StatusOr<uint64_t> Publish(const wsync::v1::VersionSummary& version) override;
  StatusOr<wsync::v1::ListVersionsResponse> ListVersions(uint64_t after) override;
  Status Watch(const wsync::v1::WatchRequest& req,
               const std::function<bool(const wsync::v1::VersionSummary&)>& on_version) override;
  StatusOr<wsync::v1::Node> ReportApplied(const std::string& name, uint64_t version) override;
  StatusOr<wsync::v1::Lease> AcquireLease(const std::string& node, uint64_t version, uint64_t ttl_ms) override;
  StatusOr<wsync::v1::Lease> RenewLease(uint64_t id, uint64_t ttl_ms) override;
  Status ReleaseLease(uint64_t id) override;
  StatusOr<wsync::v1::ListLeasesResponse> ListLeases() override;
  StatusOr<wsync::v1::MayPublishResponse> MayPublish(uint64_t version, int64_t wait_ms) override;
  StatusOr<wsync::v1::StatusResponse> GetStatus() override;
  StatusOr<wsync::v1::ReplicaResponse> DescribeReplica() override;
  StatusOr<wsync::v1::GetLayoutResponse> GetLayout() override;
  Status SetLayout(const wsync::v1::Layout& layout) override;
  StatusOr<uint32_t> OfferLayout(const std::string& node, const wsync::v1::ServedLayout& layout) override;
  StatusOr<std::vector<wsync::v1::ServedLayout>> ListOfferedLayouts() override;
  void Cancel() override { cancelled_ = true; }

 private:
  // Unavailable when unreachable or cancelled; counts the call.
  Status Reach();

  CoordinatorState* state_;
  std::atomic<bool> unreachable_{false};
  std::atomic<bool> cancelled_{false};
  std::atomic<uint64_t> calls_{0};
  std::atomic<uint64_t> report_calls_{0};
  std::atomic<int> failing_publishes_{0};
};

}  // namespace wsync::control
