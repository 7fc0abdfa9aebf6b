// Objects in an S3-compatible store (AWS S3, Ceph's radosgw, SeaweedFS,
// MinIO, or any HTTP cache in front of one for reads): what wsync needs of
// one, behind one interface. Requests are signed with AWS Signature V4
// (path-style addressing) when a key is given; without one they are
// anonymous (a public bucket, or a cache in front of it).
//
// Every request is retried on what a store or network does transiently (a
// failed connection, a timeout, HTTP 5xx or 429, a body shorter than its
// Content-Length) up to `attempts` times with exponential backoff, and no
// more: the last failure is returned, naming the key, the HTTP status and
// the store's error code. Errors map as: 404 NotFound, 403 PermissionDenied,
// 401 Unauthenticated, 412 FailedPrecondition, other 4xx InvalidArgument,
// the transient ones Unavailable.
//
// Thread-safe: calls may run concurrently (each its own connection).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "wsync/util/status.h"

namespace wsync::store {

struct S3Options {
  std::string endpoint;  // scheme, host and port: "http://127.0.0.1:8333"
  std::string bucket;
  std::string region = "us-east-1";
  // Credentials; both empty: anonymous requests.
  std::string access_key;
  std::string secret_key;
  int attempts = 5;                                     // per request, the first included
  std::chrono::milliseconds backoff{100};               // before the second attempt, doubling
  std::chrono::milliseconds max_backoff{2000};          // the most between two attempts
  std::chrono::milliseconds connect_timeout{3000};
  std::chrono::milliseconds timeout{60000};             // a whole request
  uint64_t part_bytes = uint64_t{16} << 20;             // Put of more than this: a multipart upload
};

// Reads the options from a URL "s3://BUCKET?endpoint=http://HOST:PORT" with
// optional &region=R, &attempts=N and &timeout_ms=MS (a request's), and
// the credentials from the environment (AWS_ACCESS_KEY_ID,
// AWS_SECRET_ACCESS_KEY; both absent: anonymous). InvalidArgument naming
// what is wrong.
StatusOr<S3Options> S3OptionsFromUrl(std::string_view url);

class ObjectStore {
 public:
  virtual ~ObjectStore() = default;

  // Writes the object (a multipart upload past part_bytes, aborted on
  // failure). if_absent: only when no object has the key (If-None-Match:
  // *), else FailedPrecondition; a store that ignores the condition
  // overwrites.
  virtual Status Put(const std::string& key, std::string_view bytes, bool if_absent = false) = 0;
  // The whole object; NotFound when there is none.
  virtual StatusOr<std::string> Get(const std::string& key) = 0;
  // Bytes [offset, offset + length) of the object (a ranged GET): exactly
  // that many, or OutOfRange when the object ends before.
  virtual StatusOr<std::string> GetRange(const std::string& key, uint64_t offset, uint64_t length) = 0;
  // The object's size; NotFound when there is none.
  virtual StatusOr<uint64_t> Size(const std::string& key) = 0;
  // The keys under a prefix, in the store's (lexicographic) order.
  virtual StatusOr<std::vector<std::string>> List(const std::string& prefix) = 0;
  // Removes the object (no error when there is none).
  virtual Status Delete(const std::string& key) = 0;
  // Creates the bucket (no error when it exists and is ours).
  virtual Status CreateBucket() = 0;

  // Requests made since creation, first attempts and retries together, and
  // the bytes of object bodies read: what a store bills.
  virtual uint64_t requests() const = 0;
  virtual uint64_t bytes_read() const = 0;
};

StatusOr<std::unique_ptr<ObjectStore>> OpenS3(const S3Options& options);
// OpenS3 of S3OptionsFromUrl(url): credentials from the environment.
StatusOr<std::unique_ptr<ObjectStore>> OpenS3Url(std::string_view url);

}  // namespace wsync::store
