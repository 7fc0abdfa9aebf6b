#include "wsync/store/signing.h"

#include <openssl/evp.h>
#include <openssl/pem.h>

#include <cstdio>

#include "wsync/util/text.h"

namespace wsync::store {
namespace {

struct PkeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
using Pkey = std::unique_ptr<EVP_PKEY, PkeyFree>;

StatusOr<Pkey> ReadKey(const std::string& path, bool is_private) {
  FILE* f = std::fopen(path.c_str(), "r");
  if (f == nullptr) return InvalidArgumentError("cannot open key file " + path);
  EVP_PKEY* k =
      is_private ? PEM_read_PrivateKey(f, nullptr, nullptr, nullptr) : PEM_read_PUBKEY(f, nullptr, nullptr, nullptr);
  std::fclose(f);
  if (k == nullptr || EVP_PKEY_id(k) != EVP_PKEY_ED25519) {
    EVP_PKEY_free(k);
    return InvalidArgumentError(path + " is not an Ed25519 " + (is_private ? "private" : "public") +
                                " key in PEM (openssl genpkey -algorithm ed25519; openssl pkey -pubout)");
  }
  return Pkey(k);
}

}  // namespace

struct Signer::Key {
  Pkey pkey;
};
struct Verifier::Key {
  Pkey pkey;
};

Signer::Signer(std::unique_ptr<Key> key) : key_(std::move(key)) {}
Signer::~Signer() = default;
Verifier::Verifier(std::unique_ptr<Key> key) : key_(std::move(key)) {}
Verifier::~Verifier() = default;

StatusOr<std::unique_ptr<Signer>> Signer::FromPemFile(const std::string& path) {
  WSYNC_ASSIGN_OR_RETURN(Pkey k, ReadKey(path, true));
  return std::unique_ptr<Signer>(new Signer(std::make_unique<Key>(Key{std::move(k)})));
}

StatusOr<std::unique_ptr<Verifier>> Verifier::FromPemFileIfAny(const std::string& path) {
  if (path.empty()) return std::unique_ptr<Verifier>();
  return FromPemFile(path);
}

StatusOr<std::unique_ptr<Verifier>> Verifier::FromPemFile(const std::string& path) {
  WSYNC_ASSIGN_OR_RETURN(Pkey k, ReadKey(path, false));
  return std::unique_ptr<Verifier>(new Verifier(std::make_unique<Key>(Key{std::move(k)})));
}

std::string Signer::Sign(std::string_view bytes) const {
  unsigned char sig[64];
  size_t len = sizeof(sig);
  EVP_MD_CTX* ctx = EVP_MD_CTX_new();
  EVP_DigestSignInit(ctx, nullptr, nullptr, nullptr, key_->pkey.get());
  EVP_DigestSign(ctx, sig, &len, reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size());
  EVP_MD_CTX_free(ctx);
  return Hex(std::string_view(reinterpret_cast<const char*>(sig), len));
}

bool Verifier::Verify(std::string_view bytes, std::string_view signature_hex) const {
  const std::optional<std::string> sig = FromHex(signature_hex);
  if (!sig || sig->size() != 64) return false;
  EVP_MD_CTX* ctx = EVP_MD_CTX_new();
  const auto* s = reinterpret_cast<const unsigned char*>(sig->data());
  const auto* b = reinterpret_cast<const unsigned char*>(bytes.data());
  const bool ok = EVP_DigestVerifyInit(ctx, nullptr, nullptr, nullptr, key_->pkey.get()) == 1 &&
                  EVP_DigestVerify(ctx, s, sig->size(), b, bytes.size()) == 1;
  EVP_MD_CTX_free(ctx);
  return ok;
}

}  // namespace wsync::store
