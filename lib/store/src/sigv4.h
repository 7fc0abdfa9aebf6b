// AWS Signature Version 4 for S3 requests (private): the canonical request,
// the string to sign, the signing key and the Authorization header, with
// OpenSSL's SHA-256 and HMAC-SHA256.
#pragma once

#include <map>
#include <string>
#include <string_view>

namespace wsync::store::sigv4 {

// Hex of SHA-256 of bytes (a payload's x-amz-content-sha256).
std::string Sha256Hex(std::string_view bytes);

// RFC 3986 percent-encoding as SigV4 wants it: unreserved characters kept,
// every other byte %XX (upper case); '/' kept when keep_slash.
std::string UriEncode(std::string_view s, bool keep_slash);

struct Request {
  std::string method;                          // "GET", "PUT", ...
  std::string host;                            // the Host header: "127.0.0.1:8333"
  std::string path;                            // encoded: "/bucket/key" (UriEncode with keep_slash)
  std::map<std::string, std::string> query;    // unencoded names and values
  std::map<std::string, std::string> headers;  // lower-case names, signed besides host and x-amz-*
  std::string payload_sha256;                  // Sha256Hex of the body, or "UNSIGNED-PAYLOAD"
  std::string amz_date;                        // "20130524T000000Z"
};

// The canonical query string of a request (sorted, encoded).
std::string CanonicalQuery(const std::map<std::string, std::string>& query);

// The Authorization header's value for the request.
std::string Authorization(const Request& r, std::string_view region, std::string_view access_key,
                          std::string_view secret_key);

}  // namespace wsync::store::sigv4
