#include "wsync/control/testing/in_process_client.h"

namespace wsync::control {

namespace v1 = wsync::v1;

Status InProcessClient::Reach() {
  ++calls_;
  if (unreachable_) return UnavailableError("coordinator unreachable (in-process client)");
  if (cancelled_) return CancelledError("coordinator client cancelled");
  return Status::Ok();
}

StatusOr<v1::RegisterResponse> InProcessClient::Register(const v1::RegisterRequest& req) {
  WSYNC_RETURN_IF_ERROR(Reach());
  return state_->Register(req);
}

StatusOr<v1::HeartbeatResponse> InProcessClient::Heartbeat(const v1::HeartbeatRequest& req) {
  WSYNC_RETURN_IF_ERROR(Reach());
  return state_->Heartbeat(req);
}

Status InProcessClient::Deregister(const std::string& name) {
  WSYNC_RETURN_IF_ERROR(Reach());
  return state_->Deregister(name);
}

StatusOr<uint64_t> InProcessClient::Publish(const v1::VersionSummary& version) {
  WSYNC_RETURN_IF_ERROR(Reach());
  if (failing_publishes_.fetch_sub(1) > 0) return UnavailableError("publish answer lost (in-process client)");
  failing_publishes_ = std::max(0, failing_publishes_.load());
  return state_->Publish(version);
}

StatusOr<v1::ListVersionsResponse> InProcessClient::ListVersions(uint64_t after) {
  WSYNC_RETURN_IF_ERROR(Reach());
  return state_->ListVersions(after);
}

Status InProcessClient::Watch(const v1::WatchRequest& req,
                              const std::function<bool(const v1::VersionSummary&)>& on_version) {
  WSYNC_RETURN_IF_ERROR(Reach());
  bool cut = false;  // nothing reaches the watcher once unreachable
  const bool watcher_left = state_->WatchVersions(
      req.after(),
      [&](const v1::VersionSummary& v) {
        cut = unreachable_.load() || cancelled_.load();
        return !cut && on_version(v);
      },
      [&] { return unreachable_.load() || cancelled_.load(); });
  if (cancelled_) return CancelledError("coordinator client cancelled");
  if (watcher_left && !cut) return Status::Ok();
  // The stream broke (unreachable): the coordinator sees the node go.
  if (!req.node().empty()) state_->WatchBroken(req.node(), req.incarnation());
  return UnavailableError("watch stream broken (in-process client)");
}

StatusOr<v1::Node> InProcessClient::ReportApplied(const std::string& name, uint64_t version) {
  WSYNC_RETURN_IF_ERROR(Reach());
  ++report_calls_;
  return state_->ReportApplied(name, version);
}

StatusOr<v1::Lease> InProcessClient::AcquireLease(const std::string& node, uint64_t version, uint64_t ttl_ms) {
  WSYNC_RETURN_IF_ERROR(Reach());
  return state_->AcquireLease(node, version, ttl_ms);
}

StatusOr<v1::Lease> InProcessClient::RenewLease(uint64_t id, uint64_t ttl_ms) {
  WSYNC_RETURN_IF_ERROR(Reach());
  return state_->RenewLease(id, ttl_ms);
}

Status InProcessClient::ReleaseLease(uint64_t id) {
  WSYNC_RETURN_IF_ERROR(Reach());
  return state_->ReleaseLease(id);
}

StatusOr<v1::ListLeasesResponse> InProcessClient::ListLeases() {
  WSYNC_RETURN_IF_ERROR(Reach());
  return state_->ListLeases();
}

StatusOr<v1::MayPublishResponse> InProcessClient::MayPublish(uint64_t version, int64_t wait_ms) {
  WSYNC_RETURN_IF_ERROR(Reach());
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(std::max<int64_t>(0, wait_ms));
  return state_->MayPublishWaiting(version, deadline, [&] { return unreachable_.load() || cancelled_.load(); });
}

StatusOr<v1::StatusResponse> InProcessClient::GetStatus() {
  WSYNC_RETURN_IF_ERROR(Reach());
  return state_->GetStatus();
}

StatusOr<v1::ReplicaResponse> InProcessClient::DescribeReplica() {
  v1::ReplicaResponse r;
  r.set_role(v1::ReplicaResponse::SINGLE);
  return r;
}

StatusOr<v1::GetLayoutResponse> InProcessClient::GetLayout() {
  WSYNC_RETURN_IF_ERROR(Reach());
  return state_->GetLayout();
}

StatusOr<uint32_t> InProcessClient::OfferLayout(const std::string& node, const v1::ServedLayout& layout) {
  WSYNC_RETURN_IF_ERROR(Reach());
  return state_->offers().Offer(node, layout);
}

StatusOr<std::vector<v1::ServedLayout>> InProcessClient::ListOfferedLayouts() {
  WSYNC_RETURN_IF_ERROR(Reach());
  return state_->offers().List();
}

Status InProcessClient::SetLayout(const v1::Layout& layout) {
  WSYNC_RETURN_IF_ERROR(Reach());
  return state_->SetLayout(layout);
}

}  // namespace wsync::control
