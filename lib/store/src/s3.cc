// ObjectStore over S3's REST API with libcurl: one easy handle per request,
// path-style addressing, SigV4 (sigv4.h), bounded retries.
#include <curl/curl.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cstdlib>
#include <ctime>
#include <mutex>
#include <random>
#include <thread>

#include "sigv4.h"
#include "xml.h"
#include "wsync/store/object_store.h"
#include "wsync/util/text.h"

namespace wsync::store {
namespace {

struct Response {
  long status = 0;
  std::string body;
  std::map<std::string, std::string> headers;  // lower-case names
  CURLcode curl = CURLE_OK;
  std::string curl_error;
};

// What one request is: everything but the signature, which each attempt
// makes afresh (its date).
struct Call {
  std::string method;
  std::string key;                             // empty: the bucket itself
  std::map<std::string, std::string> query;
  std::map<std::string, std::string> headers;  // lower-case, signed
  std::string_view body;
};

std::string Lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

std::string Trim(std::string s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  size_t i = 0;
  while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
  return s.substr(i);
}

size_t OnBody(char* p, size_t size, size_t n, void* out) {
  static_cast<std::string*>(out)->append(p, size * n);
  return size * n;
}

size_t OnHeader(char* p, size_t size, size_t n, void* out) {
  const std::string line(p, size * n);
  const size_t colon = line.find(':');
  if (colon != std::string::npos) {
    (*static_cast<std::map<std::string, std::string>*>(out))[Lower(line.substr(0, colon))] =
        Trim(line.substr(colon + 1));
  }
  return size * n;
}

struct ReadState {
  std::string_view body;
  size_t at = 0;
};

size_t OnRead(char* p, size_t size, size_t n, void* state) {
  auto* s = static_cast<ReadState*>(state);
  const size_t k = std::min(size * n, s->body.size() - s->at);
  std::copy_n(s->body.data() + s->at, k, p);
  s->at += k;
  return k;
}

std::string AmzDate() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buf[20];
  std::strftime(buf, sizeof(buf), "%Y%m%dT%H%M%SZ", &tm);
  return buf;
}

class S3Store : public ObjectStore {
 public:
  explicit S3Store(S3Options o) : o_(std::move(o)) {
    const size_t scheme = o_.endpoint.find("://");
    host_ = o_.endpoint.substr(scheme == std::string::npos ? 0 : scheme + 3);
    if (!host_.empty() && host_.back() == '/') host_.pop_back();
    if (!o_.endpoint.empty() && o_.endpoint.back() == '/') o_.endpoint.pop_back();
  }

  Status Put(const std::string& key, std::string_view bytes, bool if_absent) override {
    if (bytes.size() > o_.part_bytes) return PutMultipart(key, bytes, if_absent);
    Call c{"PUT", key, {}, {}, bytes};
    if (if_absent) c.headers["if-none-match"] = "*";
    WSYNC_ASSIGN_OR_RETURN(Response r, Run(c));
    return Expect(r, c, {200});
  }

  StatusOr<std::string> Get(const std::string& key) override {
    const Call c{"GET", key, {}, {}, {}};
    WSYNC_ASSIGN_OR_RETURN(Response r, Run(c));
    WSYNC_RETURN_IF_ERROR(Expect(r, c, {200}));
    bytes_read_ += r.body.size();
    return std::move(r.body);
  }

  StatusOr<std::string> GetRange(const std::string& key, uint64_t offset, uint64_t length) override {
    if (length == 0) return std::string();
    Call c{"GET", key, {}, {}, {}};
    c.headers["range"] = "bytes=" + std::to_string(offset) + "-" + std::to_string(offset + length - 1);
    WSYNC_ASSIGN_OR_RETURN(Response r, Run(c));
    const Status ends_early =
        OutOfRangeError("object " + Quoted(key) + " ends before byte " + std::to_string(offset + length));
    if (r.status == 416) return ends_early;
    WSYNC_RETURN_IF_ERROR(Expect(r, c, {200, 206}));
    bytes_read_ += r.body.size();
    if (r.status == 200) {  // the range ignored: the whole object came
      if (r.body.size() < offset + length) return ends_early;
      return r.body.substr(offset, length);
    }
    if (r.body.size() != length) return ends_early;
    return std::move(r.body);
  }

  StatusOr<uint64_t> Size(const std::string& key) override {
    const Call c{"HEAD", key, {}, {}, {}};
    WSYNC_ASSIGN_OR_RETURN(Response r, Run(c));
    WSYNC_RETURN_IF_ERROR(Expect(r, c, {200}));
    const auto it = r.headers.find("content-length");
    if (it == r.headers.end()) return InternalError("HEAD " + Quoted(key) + ": no Content-Length");
    return std::strtoull(it->second.c_str(), nullptr, 10);
  }

  StatusOr<std::vector<std::string>> List(const std::string& prefix) override {
    std::vector<std::string> keys;
    std::string token;
    for (;;) {
      Call c{"GET", "", {{"list-type", "2"}, {"prefix", prefix}}, {}, {}};
      if (!token.empty()) c.query["continuation-token"] = token;
      WSYNC_ASSIGN_OR_RETURN(Response r, Run(c));
      WSYNC_RETURN_IF_ERROR(Expect(r, c, {200}));
      for (auto& k : XmlValues(r.body, "Key")) keys.push_back(std::move(k));
      if (XmlValue(r.body, "IsTruncated") != "true") break;
      token = XmlValue(r.body, "NextContinuationToken");
      if (token.empty()) return InternalError("listing " + Quoted(prefix) + ": truncated without a continuation token");
    }
    std::sort(keys.begin(), keys.end());
    return keys;
  }

  Status Delete(const std::string& key) override {
    const Call c{"DELETE", key, {}, {}, {}};
    WSYNC_ASSIGN_OR_RETURN(Response r, Run(c));
    if (r.status == 404) return Status::Ok();
    return Expect(r, c, {200, 204});
  }

  Status CreateBucket() override {
    const Call c{"PUT", "", {}, {}, {}};
    WSYNC_ASSIGN_OR_RETURN(Response r, Run(c));
    if (r.status == 409 && XmlValue(r.body, "Code") == "BucketAlreadyOwnedByYou") return Status::Ok();
    return Expect(r, c, {200});
  }

  uint64_t requests() const override { return requests_.load(); }
  uint64_t bytes_read() const override { return bytes_read_.load(); }

 private:
  Status PutMultipart(const std::string& key, std::string_view bytes, bool if_absent) {
    if (if_absent) {
      auto size = Size(key);
      if (size.ok()) return FailedPreconditionError("object " + Quoted(key) + " exists");
      if (size.status().code() != StatusCode::kNotFound) return size.status();
    }
    const Call start{"POST", key, {{"uploads", ""}}, {}, {}};
    WSYNC_ASSIGN_OR_RETURN(Response r, Run(start));
    WSYNC_RETURN_IF_ERROR(Expect(r, start, {200}));
    const std::string id = XmlValue(r.body, "UploadId");
    if (id.empty()) return InternalError("multipart upload of " + Quoted(key) + ": no UploadId in the answer");
    std::string parts = "<CompleteMultipartUpload>";
    Status s;
    for (uint64_t at = 0, n = 1; at < bytes.size() && s.ok(); at += o_.part_bytes, ++n) {
      const Call part{"PUT",
                      key,
                      {{"partNumber", std::to_string(n)}, {"uploadId", id}},
                      {},
                      bytes.substr(at, std::min<uint64_t>(o_.part_bytes, bytes.size() - at))};
      auto pr = Run(part);
      s = pr.ok() ? Expect(*pr, part, {200}) : pr.status();
      if (!s.ok()) break;
      const auto etag = pr->headers.find("etag");
      if (etag == pr->headers.end()) {
        s = InternalError("multipart upload of " + Quoted(key) + ": part " + std::to_string(n) + " has no ETag");
        break;
      }
      parts += "<Part><PartNumber>" + std::to_string(n) + "</PartNumber><ETag>" + etag->second + "</ETag></Part>";
    }
    parts += "</CompleteMultipartUpload>";
    if (s.ok()) {
      const Call done{"POST", key, {{"uploadId", id}}, {}, parts};
      auto dr = Run(done);
      s = dr.ok() ? Expect(*dr, done, {200}) : dr.status();
      // S3 may answer 200 and report the failure in the body.
      if (s.ok() && dr->body.find("<Error>") != std::string::npos) {
        s = UnavailableError("multipart upload of " + Quoted(key) + " failed: " + XmlValue(dr->body, "Code") + ": " +
                             XmlValue(dr->body, "Message"));
      }
    }
    if (!s.ok()) {
      const Call abort{"DELETE", key, {{"uploadId", id}}, {}, {}};
      (void)Run(abort);
    }
    return s;
  }

  // The request, retried while what fails is transient (a body shorter
  // than its Content-Length among them).
  StatusOr<Response> Run(const Call& c) {
    std::chrono::milliseconds wait = o_.backoff;
    thread_local std::mt19937_64 rng(std::random_device{}());
    Response r;
    for (int attempt = 1;; ++attempt) {
      r = Once(c);
      ++requests_;
      bool transient = r.curl != CURLE_OK || r.status >= 500 || r.status == 429;
      if (!transient && (r.status == 200 || r.status == 206) && c.method == "GET") {
        const auto len = r.headers.find("content-length");
        if (len != r.headers.end() && std::strtoull(len->second.c_str(), nullptr, 10) != r.body.size()) {
          transient = true;  // truncated
          r.curl_error = "body shorter than announced (" + std::to_string(r.body.size()) + " bytes)";
        }
      }
      if (!transient || attempt >= o_.attempts) {
        if (transient) return UnavailableError(Describe(c, r) + " (after " + std::to_string(attempt) + " attempts)");
        return r;
      }
      std::uniform_int_distribution<int64_t> jitter(wait.count() / 2, wait.count());
      std::this_thread::sleep_for(std::chrono::milliseconds(jitter(rng)));
      wait = std::min(wait * 2, o_.max_backoff);
    }
  }

  Response Once(const Call& c) {
    static std::once_flag once;
    std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
    Response r;
    const std::string path = "/" + o_.bucket + (c.key.empty() ? "" : "/" + sigv4::UriEncode(c.key, true));
    const std::string query = sigv4::CanonicalQuery(c.query);
    const std::string url = o_.endpoint + path + (query.empty() ? "" : "?" + query);
    std::map<std::string, std::string> headers = c.headers;
    if (!o_.access_key.empty()) {
      sigv4::Request sr{c.method, host_, path, c.query, c.headers, sigv4::Sha256Hex(c.body), AmzDate()};
      headers["authorization"] = sigv4::Authorization(sr, o_.region, o_.access_key, o_.secret_key);
      headers["x-amz-date"] = sr.amz_date;
      headers["x-amz-content-sha256"] = sr.payload_sha256;
    }
    CURL* h = curl_easy_init();
    if (h == nullptr) {
      r.curl = CURLE_FAILED_INIT;
      r.curl_error = "curl_easy_init failed";
      return r;
    }
    curl_slist* list = nullptr;
    for (const auto& [k, v] : headers) list = curl_slist_append(list, (k + ": " + v).c_str());
    list = curl_slist_append(list, "Expect:");  // no 100-continue round trip
    ReadState rs{c.body, 0};
    char err[CURL_ERROR_SIZE] = {0};
    curl_easy_setopt(h, CURLOPT_URL, url.c_str());
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, list);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_ERRORBUFFER, err);
    curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(o_.connect_timeout.count()));
    curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, static_cast<long>(o_.timeout.count()));
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, OnBody);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, &r.body);
    curl_easy_setopt(h, CURLOPT_HEADERFUNCTION, OnHeader);
    curl_easy_setopt(h, CURLOPT_HEADERDATA, &r.headers);
    if (c.method == "HEAD") {
      curl_easy_setopt(h, CURLOPT_NOBODY, 1L);
    } else if (c.method == "PUT") {
      curl_easy_setopt(h, CURLOPT_UPLOAD, 1L);
      curl_easy_setopt(h, CURLOPT_READFUNCTION, OnRead);
      curl_easy_setopt(h, CURLOPT_READDATA, &rs);
      curl_easy_setopt(h, CURLOPT_INFILESIZE_LARGE, static_cast<curl_off_t>(c.body.size()));
    } else if (c.method == "POST") {
      curl_easy_setopt(h, CURLOPT_POST, 1L);
      curl_easy_setopt(h, CURLOPT_POSTFIELDS, c.body.data());
      curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(c.body.size()));
    } else if (c.method != "GET") {
      curl_easy_setopt(h, CURLOPT_CUSTOMREQUEST, c.method.c_str());
    }
    r.curl = curl_easy_perform(h);
    if (r.curl != CURLE_OK) r.curl_error = err[0] != 0 ? err : curl_easy_strerror(r.curl);
    curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &r.status);
    curl_slist_free_all(list);
    curl_easy_cleanup(h);
    return r;
  }

  std::string Describe(const Call& c, const Response& r) const {
    std::string what = c.method + " " + (c.key.empty() ? "bucket " + Quoted(o_.bucket) : Quoted(c.key)) + " at " +
                       o_.endpoint;
    if (r.curl != CURLE_OK) return what + ": " + r.curl_error;
    what += ": HTTP " + std::to_string(r.status);
    const std::string code = XmlValue(r.body, "Code"), message = XmlValue(r.body, "Message");
    if (!code.empty()) what += " " + code;
    if (!message.empty()) what += " (" + message + ")";
    if (!r.curl_error.empty()) what += ": " + r.curl_error;
    return what;
  }

  Status Expect(const Response& r, const Call& c, std::initializer_list<long> ok) const {
    if (std::find(ok.begin(), ok.end(), r.status) != ok.end()) return Status::Ok();
    const std::string what = Describe(c, r);
    switch (r.status) {
      case 404:
        return NotFoundError(what);
      case 403:
        return PermissionDeniedError(what);
      case 401:
        return UnauthenticatedError(what);
      case 412:
        return FailedPreconditionError(what);
      default:
        return r.status >= 500 || r.status == 0 ? UnavailableError(what) : InvalidArgumentError(what);
    }
  }

  S3Options o_;
  std::string host_;
  std::atomic<uint64_t> requests_{0}, bytes_read_{0};
};

}  // namespace

StatusOr<S3Options> S3OptionsFromUrl(std::string_view url) {
  constexpr std::string_view kScheme = "s3://";
  if (url.substr(0, kScheme.size()) != kScheme) {
    return InvalidArgumentError("store URL " + Quoted(std::string(url)) + ": expected s3://BUCKET?endpoint=...");
  }
  url.remove_prefix(kScheme.size());
  S3Options o;
  const size_t q = url.find('?');
  o.bucket = std::string(url.substr(0, q));
  if (o.bucket.empty()) return InvalidArgumentError("store URL: no bucket");
  std::string_view rest = q == std::string_view::npos ? "" : url.substr(q + 1);
  while (!rest.empty()) {
    const size_t amp = rest.find('&');
    const std::string_view kv = rest.substr(0, amp);
    rest = amp == std::string_view::npos ? "" : rest.substr(amp + 1);
    const size_t eq = kv.find('=');
    const std::string k(kv.substr(0, eq)), v(eq == std::string_view::npos ? "" : kv.substr(eq + 1));
    if (k == "endpoint") {
      o.endpoint = v;
    } else if (k == "region") {
      o.region = v;
    } else if (k == "attempts" || k == "timeout_ms") {
      char* end = nullptr;
      const long n = std::strtol(v.c_str(), &end, 10);
      if (v.empty() || *end != '\0' || n < 1) {
        return InvalidArgumentError("store URL: " + k + " must be a positive integer, not " + Quoted(v));
      }
      if (k == "attempts") {
        o.attempts = static_cast<int>(n);
      } else {
        o.timeout = std::chrono::milliseconds(n);
      }
    } else {
      return InvalidArgumentError("store URL: unknown parameter " + Quoted(k) +
                                  " (endpoint, region, attempts, timeout_ms)");
    }
  }
  if (o.endpoint.empty()) return InvalidArgumentError("store URL: no endpoint (?endpoint=http://HOST:PORT)");
  if (o.endpoint.rfind("http://", 0) != 0 && o.endpoint.rfind("https://", 0) != 0) {
    return InvalidArgumentError("store URL: endpoint " + Quoted(o.endpoint) + " is not http:// or https://");
  }
  const char* key = std::getenv("AWS_ACCESS_KEY_ID");
  const char* secret = std::getenv("AWS_SECRET_ACCESS_KEY");
  if ((key == nullptr) != (secret == nullptr)) {
    return InvalidArgumentError("AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY must be set together");
  }
  if (key != nullptr) {
    o.access_key = key;
    o.secret_key = secret;
  }
  return o;
}

StatusOr<std::unique_ptr<ObjectStore>> OpenS3Url(std::string_view url) {
  WSYNC_ASSIGN_OR_RETURN(S3Options o, S3OptionsFromUrl(url));
  return OpenS3(o);
}

StatusOr<std::unique_ptr<ObjectStore>> OpenS3(const S3Options& options) {
  if (options.endpoint.empty() || options.bucket.empty()) return InvalidArgumentError("S3 store: endpoint and bucket");
  if (options.attempts < 1) return InvalidArgumentError("S3 store: attempts must be at least 1");
  if (options.part_bytes < (5u << 20)) return InvalidArgumentError("S3 store: parts must be at least 5 MiB");
  return std::unique_ptr<ObjectStore>(std::make_unique<S3Store>(options));
}

}  // namespace wsync::store
