#include "wsync/util/status.h"

#include <cstdio>
#include <cstring>

namespace wsync {

std::string_view StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "OK";
    case StatusCode::kCancelled: return "Cancelled";
    case StatusCode::kUnknown: return "Unknown";
    case StatusCode::kInvalidArgument: return "InvalidArgument";
    case StatusCode::kDeadlineExceeded: return "DeadlineExceeded";
    case StatusCode::kNotFound: return "NotFound";
    case StatusCode::kAlreadyExists: return "AlreadyExists";
    case StatusCode::kPermissionDenied: return "PermissionDenied";
    case StatusCode::kResourceExhausted: return "ResourceExhausted";
    case StatusCode::kFailedPrecondition: return "FailedPrecondition";
    case StatusCode::kAborted: return "Aborted";
    case StatusCode::kOutOfRange: return "OutOfRange";
    case StatusCode::kUnimplemented: return "Unimplemented";
    case StatusCode::kInternal: return "Internal";
    case StatusCode::kUnavailable: return "Unavailable";
    case StatusCode::kDataLoss: return "DataLoss";
    case StatusCode::kUnauthenticated: return "Unauthenticated";
  }
  return "Unknown";
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  std::string out(StatusCodeName(code_));
  out += ": ";
  out += message_;
  return out;
}

Status Status::WithContext(std::string_view context) const {
  if (ok()) return *this;
  std::string msg(context);
  msg += ": ";
  msg += message_;
  Status out(code_, std::move(msg));
  out.reason_ = reason_;
  return out;
}

Status Status::WithReason(std::string reason, std::map<std::string, std::string> metadata) const {
  if (ok()) return *this;
  Status out = *this;
  out.reason_ = std::make_shared<const ErrorReason>(ErrorReason{std::move(reason), std::move(metadata)});
  return out;
}

Status StaleVersionError(uint64_t version, uint64_t head) {
  return FailedPreconditionError("version " + std::to_string(version) + " is not above the head version " +
                                 std::to_string(head) + "; the next valid version is " + std::to_string(head + 1))
      .WithReason(reasons::kStaleVersion, {{"version", std::to_string(version)},
                                           {"head_version", std::to_string(head)},
                                           {"next_version", std::to_string(head + 1)}});
}

Status NotRegisteredError() {
  return FailedPreconditionError("no tensors registered").WithReason(reasons::kNotRegistered);
}

Status NotLeaderError(const std::string& leader, const std::string& why) {
  return UnavailableError((leader.empty() ? "this coordinator replica is not the leader, and no leader is known yet"
                                          : "this coordinator replica is not the leader; the leader is at " + leader) +
                          (why.empty() ? "" : " (" + why + ")"))
      .WithReason(reasons::kNotLeader, {{"leader", leader}});
}

Status EtcdUnreachableError(const std::string& replica, int64_t failing_ms, const std::string& error) {
  char seconds[32];
  std::snprintf(seconds, sizeof seconds, "%.1f", failing_ms / 1000.0);
  return UnavailableError("coordinator replica " + replica + " has not reached a majority of etcd for " + seconds +
                          " s (" + error + "), so no replica can lead: check that most etcd members run and answer "
                          "(etcdctl endpoint health) and that the replicas' --etcd endpoints reach them")
      .WithReason(reasons::kEtcdUnreachable, {{"replica", replica}, {"failing_ms", std::to_string(failing_ms)}});
}

Status InvalidArgumentError(std::string m) { return Status(StatusCode::kInvalidArgument, std::move(m)); }
Status NotFoundError(std::string m) { return Status(StatusCode::kNotFound, std::move(m)); }
Status AlreadyExistsError(std::string m) { return Status(StatusCode::kAlreadyExists, std::move(m)); }
Status FailedPreconditionError(std::string m) { return Status(StatusCode::kFailedPrecondition, std::move(m)); }
Status OutOfRangeError(std::string m) { return Status(StatusCode::kOutOfRange, std::move(m)); }
Status UnimplementedError(std::string m) { return Status(StatusCode::kUnimplemented, std::move(m)); }
Status InternalError(std::string m) { return Status(StatusCode::kInternal, std::move(m)); }
Status UnavailableError(std::string m) { return Status(StatusCode::kUnavailable, std::move(m)); }
Status DataLossError(std::string m) { return Status(StatusCode::kDataLoss, std::move(m)); }
Status ResourceExhaustedError(std::string m) { return Status(StatusCode::kResourceExhausted, std::move(m)); }
Status AbortedError(std::string m) { return Status(StatusCode::kAborted, std::move(m)); }
Status DeadlineExceededError(std::string m) { return Status(StatusCode::kDeadlineExceeded, std::move(m)); }
Status UnauthenticatedError(std::string m) { return Status(StatusCode::kUnauthenticated, std::move(m)); }
Status PermissionDeniedError(std::string m) { return Status(StatusCode::kPermissionDenied, std::move(m)); }
Status CancelledError(std::string m) { return Status(StatusCode::kCancelled, std::move(m)); }

Status ErrnoToStatus(int err, std::string_view what) {
  std::string msg(what);
  msg += ": ";
  msg += std::strerror(err);
  switch (err) {
    case ENOENT: return NotFoundError(std::move(msg));
    case EACCES:
    case EPERM: return PermissionDeniedError(std::move(msg));
    case EEXIST: return AlreadyExistsError(std::move(msg));
    case ENOSPC:
    case ENOMEM: return ResourceExhaustedError(std::move(msg));
    case EINVAL: return InvalidArgumentError(std::move(msg));
    case EAGAIN:
    case ECONNREFUSED:
    case ECONNRESET: return UnavailableError(std::move(msg));
    default: return InternalError(std::move(msg));
  }
}

}  // namespace wsync
