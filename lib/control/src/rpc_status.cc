#include "wsync/control/rpc_status.h"

#include "wsync/v1/errors.pb.h"

namespace wsync::control {
namespace {

constexpr char kErrorInfoType[] = "type.googleapis.com/google.rpc.ErrorInfo";
constexpr char kDomain[] = "wsync";

}  // namespace

grpc::Status ToGrpc(const Status& s) {
  if (s.ok()) return grpc::Status::OK;
  const auto code = static_cast<grpc::StatusCode>(s.code());
  const ErrorReason* reason = s.reason();
  if (reason == nullptr) return grpc::Status(code, s.message());
  v1::ErrorInfo info;
  info.set_reason(reason->reason);
  info.set_domain(kDomain);
  for (const auto& [k, v] : reason->metadata) (*info.mutable_metadata())[k] = v;
  v1::RpcStatus status;
  status.set_code(static_cast<int>(s.code()));
  status.set_message(s.message());
  auto* any = status.add_details();
  any->set_type_url(kErrorInfoType);
  any->set_value(info.SerializeAsString());
  return grpc::Status(code, s.message(), status.SerializeAsString());
}

Status FromGrpc(const grpc::Status& s, const std::string& what) {
  if (s.ok()) return Status::Ok();
  Status out(static_cast<StatusCode>(s.error_code()), what + ": " + s.error_message());
  v1::RpcStatus status;
  if (s.error_details().empty() || !status.ParseFromString(s.error_details())) return out;
  for (const auto& any : status.details()) {
    v1::ErrorInfo info;
    if (any.type_url() != kErrorInfoType || !info.ParseFromString(any.value()) || info.domain() != kDomain) continue;
    return out.WithReason(info.reason(), {info.metadata().begin(), info.metadata().end()});
  }
  return out;
}

}  // namespace wsync::control
