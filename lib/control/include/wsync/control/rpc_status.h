// wsync::Status at the gRPC edge, both ways, for every server and client of
// the project's gRPC services: the code and message as gRPC's, and a reason
// (ErrorReason) as gRPC's rich error model carries it (google.rpc.ErrorInfo
// in the trailer grpc-status-details-bin; proto/wsync/v1/errors.proto).
#pragma once

#include <grpcpp/grpcpp.h>

#include <string>

#include "wsync/util/status.h"

namespace wsync::control {

grpc::Status ToGrpc(const Status& s);

// The call's failure as a Status whose message is "what: <message>",
// keeping its reason.
Status FromGrpc(const grpc::Status& s, const std::string& what);

}  // namespace wsync::control
