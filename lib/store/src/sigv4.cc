#include "sigv4.h"

#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/sha.h>

#include <array>
#include <cstdio>

#include "wsync/util/text.h"

namespace wsync::store::sigv4 {
namespace {

std::string Hmac(std::string_view key, std::string_view data) {
  std::array<unsigned char, EVP_MAX_MD_SIZE> out{};
  unsigned int len = 0;
  HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()), reinterpret_cast<const unsigned char*>(data.data()),
       data.size(), out.data(), &len);
  return std::string(reinterpret_cast<const char*>(out.data()), len);
}

}  // namespace

std::string Sha256Hex(std::string_view bytes) {
  std::array<unsigned char, SHA256_DIGEST_LENGTH> d{};
  SHA256(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(), d.data());
  return Hex(std::string_view(reinterpret_cast<const char*>(d.data()), d.size()));
}

std::string UriEncode(std::string_view s, bool keep_slash) {
  std::string out;
  out.reserve(s.size());
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if ((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' || c == '_' ||
        c == '.' || c == '~' || (keep_slash && c == '/')) {
      out += static_cast<char>(c);
    } else {
      char buf[4];
      std::snprintf(buf, sizeof(buf), "%%%02X", c);
      out += buf;
    }
  }
  return out;
}

std::string CanonicalQuery(const std::map<std::string, std::string>& query) {
  std::map<std::string, std::string> encoded;
  for (const auto& [k, v] : query) encoded[UriEncode(k, false)] = UriEncode(v, false);
  std::string out;
  for (const auto& [k, v] : encoded) {
    if (!out.empty()) out += '&';
    out += k + "=" + v;
  }
  return out;
}

std::string Authorization(const Request& r, std::string_view region, std::string_view access_key,
                          std::string_view secret_key) {
  std::map<std::string, std::string> headers = r.headers;
  headers["host"] = r.host;
  headers["x-amz-content-sha256"] = r.payload_sha256;
  headers["x-amz-date"] = r.amz_date;
  std::string canonical_headers, signed_headers;
  for (const auto& [k, v] : headers) {
    canonical_headers += k + ":" + v + "\n";
    signed_headers += (signed_headers.empty() ? "" : ";") + k;
  }
  const std::string canonical = r.method + "\n" + r.path + "\n" + CanonicalQuery(r.query) + "\n" + canonical_headers +
                                "\n" + signed_headers + "\n" + r.payload_sha256;
  const std::string date = r.amz_date.substr(0, 8);
  const std::string scope = date + "/" + std::string(region) + "/s3/aws4_request";
  const std::string to_sign = "AWS4-HMAC-SHA256\n" + r.amz_date + "\n" + scope + "\n" + Sha256Hex(canonical);
  std::string key = Hmac("AWS4" + std::string(secret_key), date);
  key = Hmac(key, region);
  key = Hmac(key, "s3");
  key = Hmac(key, "aws4_request");
  const std::string sig = Hmac(key, to_sign);
  return "AWS4-HMAC-SHA256 Credential=" + std::string(access_key) + "/" + scope + ", SignedHeaders=" + signed_headers +
         ", Signature=" + Hex(sig);
}

}  // namespace wsync::store::sigv4
