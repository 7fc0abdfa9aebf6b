#include "crypto.h"

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/kdf.h>
#include <openssl/rand.h>

#include <memory>
#include <stdexcept>

#include "wsync/util/bytes.h"

namespace wsync::exchange::crypto {
namespace {

constexpr size_t kTag = 16;

// libcrypto failing to compute a hash or a cipher over valid inputs is a
// broken installation, not bad input: there is no way to go on securely.
[[noreturn]] void Broken(const char* what) {
  throw std::runtime_error(std::string("libcrypto: ") + what + " failed");
}

Key Hkdf(std::string_view ikm, std::string_view salt, std::string_view info) {
  std::unique_ptr<EVP_KDF, decltype(&EVP_KDF_free)> kdf(EVP_KDF_fetch(nullptr, "HKDF", nullptr), EVP_KDF_free);
  if (!kdf) Broken("EVP_KDF_fetch(HKDF)");
  std::unique_ptr<EVP_KDF_CTX, decltype(&EVP_KDF_CTX_free)> ctx(EVP_KDF_CTX_new(kdf.get()), EVP_KDF_CTX_free);
  if (!ctx) Broken("EVP_KDF_CTX_new");
  char digest[] = "SHA256";
  OSSL_PARAM params[] = {
      OSSL_PARAM_construct_utf8_string(OSSL_KDF_PARAM_DIGEST, digest, 0),
      OSSL_PARAM_construct_octet_string(OSSL_KDF_PARAM_KEY, const_cast<char*>(ikm.data()), ikm.size()),
      OSSL_PARAM_construct_octet_string(OSSL_KDF_PARAM_SALT, const_cast<char*>(salt.data()), salt.size()),
      OSSL_PARAM_construct_octet_string(OSSL_KDF_PARAM_INFO, const_cast<char*>(info.data()), info.size()),
      OSSL_PARAM_construct_end(),
  };
  Key out{};
  if (EVP_KDF_derive(ctx.get(), out.data(), out.size(), params) != 1) Broken("HKDF-SHA256");
  return out;
}

std::string_view View(const uint8_t* p, size_t n) { return std::string_view(reinterpret_cast<const char*>(p), n); }

std::string BothNonces(const wire::Nonce& client, const wire::Nonce& server) {
  std::string s(View(client.data(), client.size()));
  s.append(View(server.data(), server.size()));
  return s;
}

// The nonce of message `counter`: 4 zero bytes, then the counter.
std::array<uint8_t, 12> GcmNonce(uint64_t counter) {
  std::array<uint8_t, 12> iv{};
  StoreLE(reinterpret_cast<char*>(iv.data()) + 4, counter);
  return iv;
}

// What is authenticated besides the plaintext: where the message goes.
std::array<uint8_t, 20> Aad(uint32_t channel, uint64_t seq, uint64_t counter) {
  std::array<uint8_t, 20> aad{};
  char* p = reinterpret_cast<char*>(aad.data());
  StoreLE(p, channel);
  StoreLE(p + 4, seq);
  StoreLE(p + 12, counter);
  return aad;
}

using CipherCtx = std::unique_ptr<EVP_CIPHER_CTX, decltype(&EVP_CIPHER_CTX_free)>;

CipherCtx NewCipher() {
  CipherCtx ctx(EVP_CIPHER_CTX_new(), EVP_CIPHER_CTX_free);
  if (!ctx) Broken("EVP_CIPHER_CTX_new");
  return ctx;
}

}  // namespace

Key ClusterKey(std::string_view token) { return Hkdf(token, "wsync cluster key", "wsync data plane v1"); }

wire::Nonce RandomNonce() {
  wire::Nonce n{};
  if (RAND_bytes(n.data(), static_cast<int>(n.size())) != 1) Broken("RAND_bytes");
  return n;
}

wire::Mac Prove(const Key& key, std::string_view label, const wire::Nonce& client, const wire::Nonce& server,
                uint8_t mode) {
  std::string msg = "wsync handshake v1 ";
  msg.append(label);
  msg.push_back('\0');
  msg += BothNonces(client, server);
  msg.push_back(static_cast<char>(mode));
  wire::Mac mac{};
  unsigned int len = 0;
  if (HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()), reinterpret_cast<const unsigned char*>(msg.data()),
           msg.size(), mac.data(), &len) == nullptr ||
      len != mac.size()) {
    Broken("HMAC-SHA256");
  }
  return mac;
}

bool SameMac(const wire::Mac& a, const wire::Mac& b) { return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0; }

Key SessionKey(const Key& key, std::string_view direction, const wire::Nonce& client, const wire::Nonce& server) {
  return Hkdf(View(key.data(), key.size()), BothNonces(client, server), std::string("wsync session ") + std::string(direction));
}

std::string Sealer::Seal(uint32_t channel, uint64_t seq, std::string_view plain) {
  uint64_t counter;
  {
    std::lock_guard<std::mutex> lock(mu_);
    counter = ++counter_;
  }
  std::string out(1 + 8 + plain.size() + kTag, '\0');
  out[0] = static_cast<char>(ExchangeMessage::kSealed);
  StoreLE(out.data() + 1, counter);
  const auto iv = GcmNonce(counter);
  const auto aad = Aad(channel, seq, counter);
  auto ctx = NewCipher();
  int len = 0;
  auto* dst = reinterpret_cast<unsigned char*>(out.data() + 9);
  if (EVP_EncryptInit_ex(ctx.get(), EVP_aes_256_gcm(), nullptr, key_.data(), iv.data()) != 1 ||
      EVP_EncryptUpdate(ctx.get(), nullptr, &len, aad.data(), static_cast<int>(aad.size())) != 1 ||
      EVP_EncryptUpdate(ctx.get(), dst, &len, reinterpret_cast<const unsigned char*>(plain.data()),
                        static_cast<int>(plain.size())) != 1 ||
      EVP_EncryptFinal_ex(ctx.get(), dst + len, &len) != 1 ||
      EVP_CIPHER_CTX_ctrl(ctx.get(), EVP_CTRL_GCM_GET_TAG, kTag, out.data() + 9 + plain.size()) != 1) {
    Broken("AES-256-GCM encrypt");
  }
  return out;
}

StatusOr<std::string> Opener::Open(uint32_t channel, uint64_t seq, std::string_view sealed) {
  WSYNC_ASSIGN_OR_RETURN(wire::Sealed s, wire::ParseSealed(sealed));
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (s.counter <= last_) {
      return DataLossError("SEALED: counter " + std::to_string(s.counter) + " replays or reorders (last " +
                           std::to_string(last_) + ")");
    }
  }
  const auto iv = GcmNonce(s.counter);
  const auto aad = Aad(channel, seq, s.counter);
  std::string plain(s.ciphertext.size(), '\0');
  auto ctx = NewCipher();
  int len = 0;
  auto* dst = reinterpret_cast<unsigned char*>(plain.data());
  std::string tag(s.tag);
  if (EVP_DecryptInit_ex(ctx.get(), EVP_aes_256_gcm(), nullptr, key_.data(), iv.data()) != 1 ||
      EVP_DecryptUpdate(ctx.get(), nullptr, &len, aad.data(), static_cast<int>(aad.size())) != 1 ||
      EVP_DecryptUpdate(ctx.get(), dst, &len, reinterpret_cast<const unsigned char*>(s.ciphertext.data()),
                        static_cast<int>(s.ciphertext.size())) != 1 ||
      EVP_CIPHER_CTX_ctrl(ctx.get(), EVP_CTRL_GCM_SET_TAG, kTag, tag.data()) != 1) {
    Broken("AES-256-GCM decrypt");
  }
  if (EVP_DecryptFinal_ex(ctx.get(), dst + len, &len) != 1) {
    return DataLossError("SEALED: message " + std::to_string(s.counter) + " fails authentication");
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (s.counter <= last_) return DataLossError("SEALED: counter " + std::to_string(s.counter) + " replays");
  last_ = s.counter;
  return plain;
}

}  // namespace wsync::exchange::crypto
