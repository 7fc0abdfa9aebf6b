// The coordinator's gRPC service: a thin adapter over CoordinatorState.
// Each RPC checks the bearer token (when one is configured), forwards to the
// state machine and maps its Status to the gRPC status with the same code.
// grpc.health.v1 (exempt from the token) and server reflection are served
// too, so grpcurl and grpc_health_probe work.
//
// Thread safety: Start/Shutdown from one thread; RPCs run on gRPC's threads.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "wsync/control/coordinator_state.h"
#include "wsync/util/status.h"

namespace wsync::control {

struct TlsOptions {
  std::string cert_file;       // server certificate chain (PEM); empty: no TLS
  std::string key_file;        // its private key (PEM)
  std::string client_ca_file;  // CA for client certificates (PEM); set: mTLS required
};

struct ServerOptions {
  std::vector<std::string> listen;  // "host:port" (port 0 picks one) or "unix:PATH"
  std::string token;                // required "authorization: Bearer <token>"; empty: none
  TlsOptions tls;
  std::string metrics_listen;       // Prometheus "host:port"; empty: off
  // With a token: /metrics asks for HTTP basic auth with the token as the
  // password (any user name; Prometheus: basic_auth.password_file). Off:
  // served to anyone who reaches metrics_listen (sink names, staleness).
  bool metrics_auth = true;
  // gRPC server reflection (grpcurl). Reflection is not behind the token:
  // it lists the services and messages to anyone who reaches the port.
  bool reflection = false;
  int tick_ms = 200;                // how often TTLs are checked
  // Tests only: honour a call's fault-injection metadata (a replica killing
  // itself between a commit and its answer).
  bool inject_faults = false;
};

// Where the state a server answers with lives: in the process, for the
// embedded coordinator; in a replica, only while it leads (replica.h).
class StateHolder {
 public:
  virtual ~StateHolder() = default;
  // The state to answer one call with (the pointer keeps it alive while the
  // call runs), or Unavailable with reason NOT_LEADER naming the leader.
  virtual StatusOr<std::shared_ptr<CoordinatorState>> Current() = 0;
  // What the Replica RPC answers (any replica, leading or not).
  virtual wsync::v1::ReplicaResponse Describe() const {
    wsync::v1::ReplicaResponse r;
    r.set_role(wsync::v1::ReplicaResponse::SINGLE);
    return r;
  }
};

class CoordinatorServer {
 public:
  // REQUIRES: state outlives the server.
  static StatusOr<std::unique_ptr<CoordinatorServer>> Start(const ServerOptions& options, CoordinatorState* state);
  // A replica's server: every call asks `holder` (REQUIRES: outlives the server).
  static StatusOr<std::unique_ptr<CoordinatorServer>> Start(const ServerOptions& options, StateHolder* holder);
  virtual ~CoordinatorServer() = default;

  // Ports actually bound for the TCP listen addresses, in order (port 0 resolved).
  virtual std::vector<int> ports() const = 0;
  // The metrics port (0 when off).
  virtual int metrics_port() const = 0;
  // Stops accepting, cancels streams, waits for handlers.
  virtual void Shutdown() = 0;
  // Blocks until Shutdown.
  virtual void Wait() = 0;
};

// Reads a token file: its content without surrounding white space.
StatusOr<std::string> ReadTokenFile(const std::string& path);

}  // namespace wsync::control
