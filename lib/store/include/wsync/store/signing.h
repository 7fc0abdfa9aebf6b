// Signed manifests (docs/object-store.md, "Failures and trust"): the source
// signs each version's manifest with an Ed25519 private key; a puller given
// the public key accepts only manifests it signed. Keys are PEM files, as
// `openssl genpkey -algorithm ed25519` and `openssl pkey -pubout` write
// them. OpenSSL's libcrypto.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "wsync/util/status.h"

namespace wsync::store {

class Signer {
 public:
  // InvalidArgument naming the file when it is not an Ed25519 private key.
  static StatusOr<std::unique_ptr<Signer>> FromPemFile(const std::string& path);
  ~Signer();
  // The signature of `bytes`, 128 hex digits.
  std::string Sign(std::string_view bytes) const;

 private:
  struct Key;
  explicit Signer(std::unique_ptr<Key> key);
  std::unique_ptr<Key> key_;
};

class Verifier {
 public:
  // InvalidArgument naming the file when it is not an Ed25519 public key.
  static StatusOr<std::unique_ptr<Verifier>> FromPemFile(const std::string& path);
  // FromPemFile, or none (null) for an empty path: every manifest accepted.
  static StatusOr<std::unique_ptr<Verifier>> FromPemFileIfAny(const std::string& path);
  ~Verifier();
  bool Verify(std::string_view bytes, std::string_view signature_hex) const;

 private:
  struct Key;
  explicit Verifier(std::unique_ptr<Key> key);
  std::unique_ptr<Key> key_;
};

}  // namespace wsync::store
