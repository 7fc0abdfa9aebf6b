// What the project's gRPC clients (the coordinator's, etcd's) set up alike
// for a channel (private).
#pragma once

#include <grpcpp/grpcpp.h>

#include <functional>
#include <memory>
#include <string>

#include "wsync/util/status.h"

namespace wsync::control {

// Insecure without a CA; with one, TLS verifying the server against it, and
// with a certificate and key, presenting them (mTLS). The files' read errors.
StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ClientCredentials(const std::string& ca_file,
                                                                      const std::string& cert_file,
                                                                      const std::string& key_file);

// Reconnects after a server restart within 100 ms (gRPC's default starts at
// 1 s), backing off to at most `max_backoff_ms`.
void ReconnectQuickly(grpc::ChannelArguments* args, int max_backoff_ms);

// NewCoordinatorClient's client over the channels `channels` makes for each
// address (`options.address` names them): tests pass channels with
// interceptors that lose answers.
using ChannelFactory = std::function<std::shared_ptr<grpc::Channel>(const std::string& address)>;
struct ClientOptions;
class CoordinatorClient;
StatusOr<std::unique_ptr<CoordinatorClient>> NewCoordinatorClient(const ClientOptions& options,
                                                                  ChannelFactory channels);

}  // namespace wsync::control
