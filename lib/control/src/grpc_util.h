// Conversions at the gRPC edge (private): one helper each way.
#pragma once

#include <grpcpp/grpcpp.h>

#include "wsync/util/status.h"

namespace wsync::control {

inline grpc::Status ToGrpc(const Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), s.message());
}

inline Status FromGrpc(const grpc::Status& s, const std::string& what) {
  if (s.ok()) return Status::Ok();
  return Status(static_cast<StatusCode>(s.error_code()), what + ": " + s.error_message());
}

}  // namespace wsync::control
