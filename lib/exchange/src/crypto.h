// The data plane's cryptography (private), all of it OpenSSL's libcrypto:
// HKDF-SHA256 for keys, HMAC-SHA256 for the handshake's proofs, AES-256-GCM
// for sealed messages. docs/security.md says what each protects.
#pragma once

#include <array>
#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>

#include "wire.h"
#include "wsync/util/status.h"

namespace wsync::exchange::crypto {

using Key = std::array<uint8_t, 32>;

// The cluster key: HKDF-SHA256 of the cluster token (the coordinator's
// bearer token), so that the token itself never crosses the data plane.
Key ClusterKey(std::string_view token);

// Fresh random bytes (RAND_bytes).
wire::Nonce RandomNonce();

// The proof that the side `label` ("client" or "server") holds the cluster
// key, bound to both nonces and the security mode.
wire::Mac Prove(const Key& key, std::string_view label, const wire::Nonce& client, const wire::Nonce& server,
                uint8_t mode);

// Constant-time equality.
bool SameMac(const wire::Mac& a, const wire::Mac& b);

// The key for one direction ("client->server", "server->client") of one
// session, from the cluster key and both nonces.
Key SessionKey(const Key& key, std::string_view direction, const wire::Nonce& client, const wire::Nonce& server);

// AES-256-GCM for one direction of one session. The nonce is a counter
// (never reused under a key); the channel and seq the transport carries
// are authenticated with the payload, so a sealed message cannot be moved
// to another pull or position.
class Sealer {
 public:
  explicit Sealer(const Key& key) : key_(key) {}
  // A SEALED message carrying `plain`.
  std::string Seal(uint32_t channel, uint64_t seq, std::string_view plain);

 private:
  const Key key_;
  std::mutex mu_;
  uint64_t counter_ = 0;
};

class Opener {
 public:
  explicit Opener(const Key& key) : key_(key) {}
  // The plaintext of a SEALED message; DataLoss when it fails to
  // authenticate or replays a counter (counters only increase).
  StatusOr<std::string> Open(uint32_t channel, uint64_t seq, std::string_view sealed);

 private:
  const Key key_;
  std::mutex mu_;
  uint64_t last_ = 0;
};

}  // namespace wsync::exchange::crypto
