// wsync::Status and wsync::StatusOr<T>: the one error model of the code base.
//
// Codes follow gRPC's canonical codes one to one so the gRPC adapter maps them
// without a table of special cases. A Status is cheap to copy when OK (no
// allocation); an error carries a message naming what was wrong, and may carry
// a machine-readable reason with details (ErrorReason; on the wire, gRPC's
// google.rpc.ErrorInfo), on which callers decide instead of on the message.
//
// Thread safety: values; no shared state.
#pragma once

#include <cassert>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace wsync {

enum class StatusCode : int {
  kOk = 0,
  kCancelled = 1,
  kUnknown = 2,
  kInvalidArgument = 3,
  kDeadlineExceeded = 4,
  kNotFound = 5,
  kAlreadyExists = 6,
  kPermissionDenied = 7,
  kResourceExhausted = 8,
  kFailedPrecondition = 9,
  kAborted = 10,
  kOutOfRange = 11,
  kUnimplemented = 12,
  kInternal = 13,
  kUnavailable = 14,
  kDataLoss = 15,
  kUnauthenticated = 16,
};

std::string_view StatusCodeName(StatusCode code);

// A machine-readable cause of an error: a reason in UPPER_SNAKE_CASE, stable
// across releases (docs/local-api.md lists them), and details by name.
struct ErrorReason {
  std::string reason;
  std::map<std::string, std::string> metadata;
};

// The reasons callers act on.
namespace reasons {
inline constexpr char kStaleVersion[] = "STALE_VERSION";    // version, head_version, next_version
inline constexpr char kVersionTaken[] = "VERSION_TAKEN";    // version, next_version
inline constexpr char kNotRegistered[] = "NOT_REGISTERED";  // a daemon (restarted) holds no tensors
inline constexpr char kNotLeader[] = "NOT_LEADER";          // leader: the address to ask instead ("" unknown)
inline constexpr char kEtcdUnreachable[] = "ETCD_UNREACHABLE";  // replica, failing_ms: a replica cannot reach etcd's majority
}  // namespace reasons

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message)
      : code_(code), message_(code == StatusCode::kOk ? std::string() : std::move(message)) {}

  static Status Ok() { return Status(); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

  // "DataLoss: tensor 'x': checksum mismatch"
  std::string ToString() const;

  // Returns a copy whose message is "context: message" (no-op when OK).
  Status WithContext(std::string_view context) const;

  // Marks an intentionally ignored status.
  void IgnoreError() const {}

  // A copy carrying `reason` (no-op when OK); WithContext keeps it.
  Status WithReason(std::string reason, std::map<std::string, std::string> metadata = {}) const;
  // The reason, or nullptr.
  const ErrorReason* reason() const { return reason_.get(); }
  bool HasReason(std::string_view reason) const { return reason_ && reason_->reason == reason; }

  friend bool operator==(const Status& a, const Status& b) {
    return a.code_ == b.code_ && a.message_ == b.message_;
  }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
  std::shared_ptr<const ErrorReason> reason_;
};

Status InvalidArgumentError(std::string message);
Status NotFoundError(std::string message);
Status AlreadyExistsError(std::string message);
Status FailedPreconditionError(std::string message);
Status OutOfRangeError(std::string message);
Status UnimplementedError(std::string message);
Status InternalError(std::string message);
Status UnavailableError(std::string message);
Status DataLossError(std::string message);
Status ResourceExhaustedError(std::string message);
Status AbortedError(std::string message);
Status DeadlineExceededError(std::string message);
Status UnauthenticatedError(std::string message);
Status PermissionDeniedError(std::string message);
Status CancelledError(std::string message);

// "version 3 is not above the head version 5; the next valid version is 6"
// (FailedPrecondition, STALE_VERSION).
Status StaleVersionError(uint64_t version, uint64_t head);
// FailedPrecondition, NOT_REGISTERED.
Status NotRegisteredError();
// "this coordinator replica is not the leader; the leader is at ADDRESS"
// (Unavailable, NOT_LEADER; `leader` empty while none is known), then
// `why` when given.
Status NotLeaderError(const std::string& leader, const std::string& why = "");
// "coordinator replica R has not reached a majority of etcd for N s (ERROR);
// check ..." (Unavailable, ETCD_UNREACHABLE): not worth retrying at once.
Status EtcdUnreachableError(const std::string& replica, int64_t failing_ms, const std::string& error);

// Converts an errno value at the edge: "open /x: No such file or directory".
Status ErrnoToStatus(int err, std::string_view what);

template <typename T>
class [[nodiscard]] StatusOr {
 public:
  StatusOr(Status status) : rep_(std::move(status)) {  // NOLINT: implicit by design
    assert(!std::get<Status>(rep_).ok() && "StatusOr built from an OK Status");
    if (std::get<Status>(rep_).ok()) rep_ = Status(StatusCode::kInternal, "StatusOr built from OK");
  }
  StatusOr(T value) : rep_(std::move(value)) {}  // NOLINT: implicit by design

  bool ok() const { return std::holds_alternative<T>(rep_); }
  Status status() const { return ok() ? Status() : std::get<Status>(rep_); }

  // REQUIRES: ok().
  T& value() & { assert(ok()); return std::get<T>(rep_); }
  const T& value() const& { assert(ok()); return std::get<T>(rep_); }
  T&& value() && { assert(ok()); return std::get<T>(std::move(rep_)); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  std::variant<Status, T> rep_;
};

}  // namespace wsync

#define WSYNC_CONCAT_INNER_(a, b) a##b
#define WSYNC_CONCAT_(a, b) WSYNC_CONCAT_INNER_(a, b)

// Returns from the enclosing function if `expr` (a Status) is not OK.
#define WSYNC_RETURN_IF_ERROR(expr)                        \
  do {                                                     \
    ::wsync::Status wsync_status_ = (expr);                \
    if (!wsync_status_.ok()) return wsync_status_;         \
  } while (0)

// `lhs = value of expr` (a StatusOr), or returns its error.
#define WSYNC_ASSIGN_OR_RETURN(lhs, expr) \
  WSYNC_ASSIGN_OR_RETURN_IMPL_(WSYNC_CONCAT_(wsync_statusor_, __LINE__), lhs, expr)
#define WSYNC_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                 \
  if (!tmp.ok()) return tmp.status();                \
  lhs = std::move(tmp).value()
