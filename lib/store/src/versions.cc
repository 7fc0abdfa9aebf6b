#include "wsync/store/versions.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <cinttypes>
#include <cstdio>
#include <limits>
#include <map>
#include <mutex>
#include <thread>

#include "sigv4.h"
#include "wsync/util/text.h"

namespace wsync::store {
namespace {

std::string Digits(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "%020" PRIu64, v);
  return buf;
}

const char* KindName(StoredObject::Kind k) { return k == StoredObject::Kind::kKeyframe ? "keyframe" : "patch"; }

bool SameObjects(const Manifest& a, const Manifest& b) {
  if (a.version != b.version || a.set_checksum != b.set_checksum || a.objects.size() != b.objects.size()) return false;
  for (size_t i = 0; i < a.objects.size(); ++i) {
    const StoredObject &x = a.objects[i], &y = b.objects[i];
    if (x.kind != y.kind || x.base != y.base || x.key != y.key || x.bytes != y.bytes || x.sha256 != y.sha256) {
      return false;
    }
  }
  return true;
}

// The version whose objects a key of this run is one of (RUN/versions/<v>/...).
std::optional<uint64_t> KeyVersion(std::string_view run, std::string_view key) {
  const std::string prefix = std::string(run) + "/versions/";
  if (key.substr(0, prefix.size()) != prefix) return std::nullopt;
  key.remove_prefix(prefix.size());
  if (key.size() < 21 || key[20] != '/') return std::nullopt;
  uint64_t v = 0;
  for (char c : key.substr(0, 20)) {
    if (c < '0' || c > '9') return std::nullopt;
    v = v * 10 + static_cast<uint64_t>(c - '0');
  }
  return v;
}

// The version a manifest key names, if it is one of this run's.
std::optional<uint64_t> ManifestVersion(std::string_view run, std::string_view key) {
  const auto v = KeyVersion(run, key);
  if (!v || key != ManifestKey(run, *v)) return std::nullopt;
  return v;
}

// The versions among keys that have a manifest, ascending.
std::vector<uint64_t> ManifestVersions(std::string_view run, const std::vector<std::string>& keys) {
  std::vector<uint64_t> out;
  for (const auto& k : keys) {
    if (auto v = ManifestVersion(run, k)) out.push_back(*v);
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

std::string VersionPrefix(std::string_view run, uint64_t version) {
  return std::string(run) + "/versions/" + Digits(version) + "/";
}
std::string PatchKey(std::string_view run, uint64_t version, uint64_t base) {
  return VersionPrefix(run, version) + "patch-" + Digits(base);
}
std::string KeyframeKey(std::string_view run, uint64_t version) { return VersionPrefix(run, version) + "keyframe"; }
std::string ManifestKey(std::string_view run, uint64_t version) {
  return VersionPrefix(run, version) + "manifest.json";
}
std::string HeadKey(std::string_view run) { return std::string(run) + "/head"; }

std::string Manifest::SignedBytes() const {
  Manifest unsigned_copy = *this;
  unsigned_copy.signature.clear();
  return unsigned_copy.ToJson();
}

std::string Manifest::ToJson() const {
  nlohmann::json j;
  j["format"] = kFormat;
  j["version"] = version;
  j["set_checksum"] = set_checksum;
  j["objects"] = nlohmann::json::array();
  for (const StoredObject& o : objects) {
    j["objects"].push_back(
        {{"kind", KindName(o.kind)}, {"base", o.base}, {"key", o.key}, {"bytes", o.bytes}, {"sha256", o.sha256}});
  }
  if (!signature.empty()) j["signature"] = signature;
  return j.dump(1);
}

StatusOr<Manifest> Manifest::Parse(std::string_view json, std::string_view where) {
  const auto bad = [&](const std::string& what) {
    return DataLossError("manifest " + Quoted(std::string(where)) + ": " + what);
  };
  const nlohmann::json j = nlohmann::json::parse(json, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return bad("not a JSON object");
  if (!j.contains("format") || j["format"] != kFormat) return bad("format is not " + std::string(kFormat));
  const auto u64 = [](const nlohmann::json& v) { return v.is_number_unsigned() || (v.is_number_integer() && v >= 0); };
  if (!j.contains("version") || !u64(j["version"]) || !j.contains("set_checksum") || !u64(j["set_checksum"])) {
    return bad("version or set_checksum missing or not an unsigned integer");
  }
  Manifest m;
  m.version = j["version"].get<uint64_t>();
  m.set_checksum = j["set_checksum"].get<uint64_t>();
  if (!j.contains("objects") || !j["objects"].is_array() || j["objects"].empty()) return bad("no objects");
  for (const auto& o : j["objects"]) {
    if (!o.is_object() || !o.contains("kind") || !o["kind"].is_string() || !o.contains("key") ||
        !o["key"].is_string() || !o.contains("bytes") || !u64(o["bytes"]) || !o.contains("sha256") ||
        !o["sha256"].is_string() || !o.contains("base") || !u64(o["base"])) {
      return bad("an object without kind, base, key, bytes and sha256");
    }
    StoredObject s;
    const std::string kind = o["kind"];
    if (kind == "patch") {
      s.kind = StoredObject::Kind::kPatch;
    } else if (kind == "keyframe") {
      s.kind = StoredObject::Kind::kKeyframe;
    } else {
      return bad("unknown object kind " + Quoted(kind));
    }
    s.base = o["base"].get<uint64_t>();
    s.key = o["key"];
    s.bytes = o["bytes"].get<uint64_t>();
    s.sha256 = o["sha256"];
    if (s.kind == StoredObject::Kind::kPatch && s.base >= m.version) {
      return bad("a patch whose base " + std::to_string(s.base) + " is not before its version");
    }
    if (s.sha256.size() != 64) return bad("object " + Quoted(s.key) + ": sha256 is not 64 hex digits");
    m.objects.push_back(std::move(s));
  }
  if (j.contains("signature")) {
    if (!j["signature"].is_string() || j["signature"].get<std::string>().size() != 128) {
      return bad("signature is not 128 hex digits");
    }
    m.signature = j["signature"];
  }
  return m;
}

Status VersionWriter::Publish(uint64_t version, uint64_t set_checksum, const std::vector<Upload>& uploads) {
  if (uploads.empty()) return InvalidArgumentError("version " + std::to_string(version) + ": nothing to publish");
  Manifest m;
  m.version = version;
  m.set_checksum = set_checksum;
  for (const Upload& u : uploads) {
    if (u.kind == StoredObject::Kind::kPatch && u.base >= version) {
      return InvalidArgumentError("a patch to version " + std::to_string(version) + " from " + std::to_string(u.base));
    }
    StoredObject o;
    o.kind = u.kind;
    o.base = u.kind == StoredObject::Kind::kPatch ? u.base : 0;
    o.key = u.kind == StoredObject::Kind::kPatch ? PatchKey(run_, version, u.base) : KeyframeKey(run_, version);
    o.bytes = u.bytes.size();
    o.sha256 = sigv4::Sha256Hex(u.bytes);
    WSYNC_RETURN_IF_ERROR(store_.Put(o.key, u.bytes).WithContext("uploading version " + std::to_string(version)));
    m.objects.push_back(std::move(o));
  }
  if (signer_ != nullptr) m.signature = signer_->Sign(m.SignedBytes());
  const std::string key = ManifestKey(run_, version);
  Status put = store_.Put(key, m.ToJson(), /*if_absent=*/true);
  if (put.code() == StatusCode::kFailedPrecondition) {
    WSYNC_ASSIGN_OR_RETURN(std::string there, store_.Get(key));
    WSYNC_ASSIGN_OR_RETURN(Manifest theirs, Manifest::Parse(there, key));
    if (!SameObjects(theirs, m)) {
      return FailedPreconditionError("version " + std::to_string(version) +
                                     " was published to the store by another uploader with other objects");
    }
    put = Status::Ok();
  }
  WSYNC_RETURN_IF_ERROR(put);
  return store_.Put(HeadKey(run_), nlohmann::json{{"version", version}}.dump());
}

StatusOr<std::vector<uint64_t>> ListVersions(ObjectStore& store, std::string_view run) {
  WSYNC_ASSIGN_OR_RETURN(auto keys, store.List(std::string(run) + "/versions/"));
  return ManifestVersions(run, keys);
}

StatusOr<size_t> VersionWriter::Collect(uint64_t oldest) {
  WSYNC_ASSIGN_OR_RETURN(auto keys, store_.List(run_ + "/versions/"));
  const std::vector<uint64_t> versions = ManifestVersions(run_, keys);
  // The newest keyframe at or below `oldest`: everything before it goes.
  uint64_t keep = 0;
  for (auto it = versions.rbegin(); it != versions.rend(); ++it) {
    if (*it > oldest) continue;
    WSYNC_ASSIGN_OR_RETURN(std::string json, store_.Get(ManifestKey(run_, *it)));
    WSYNC_ASSIGN_OR_RETURN(Manifest m, Manifest::Parse(json, ManifestKey(run_, *it)));
    if (std::any_of(m.objects.begin(), m.objects.end(),
                    [](const StoredObject& o) { return o.kind == StoredObject::Kind::kKeyframe; })) {
      keep = *it;
      break;
    }
  }
  size_t removed = 0;
  for (uint64_t v : versions) {
    if (v >= keep) break;
    // The manifest first: a reader never finds a version whose objects are gone.
    WSYNC_RETURN_IF_ERROR(store_.Delete(ManifestKey(run_, v)));
    WSYNC_ASSIGN_OR_RETURN(auto objects, store_.List(VersionPrefix(run_, v)));
    for (const auto& k : objects) WSYNC_RETURN_IF_ERROR(store_.Delete(k));
    ++removed;
  }
  // Objects of versions whose manifest never came (a failed or refused
  // upload) below `keep` go too.
  for (const auto& k : keys) {
    const auto v = KeyVersion(run_, k);
    if (v && *v < keep && !std::binary_search(versions.begin(), versions.end(), *v)) {
      WSYNC_RETURN_IF_ERROR(store_.Delete(k));
    }
  }
  return removed;
}

StatusOr<uint64_t> VersionReader::Newest() {
  auto head = store_.Get(HeadKey(run_));
  if (head.ok()) {
    const nlohmann::json j = nlohmann::json::parse(*head, nullptr, false);
    if (!j.is_discarded() && j.is_object() && j.contains("version") && j["version"].is_number_unsigned()) {
      const uint64_t v = j["version"].get<uint64_t>();
      // The head is written after its manifest: it names a version readers
      // can reach unless it lags behind a newer one.
      if (!store_.Size(ManifestKey(run_, v + 1)).ok()) return v;
    }
  } else if (head.status().code() != StatusCode::kNotFound) {
    return head.status();
  }
  WSYNC_ASSIGN_OR_RETURN(auto versions, ListVersions(store_, run_));
  if (versions.empty()) return NotFoundError("no version of run " + Quoted(run_) + " in the store");
  return versions.back();
}

StatusOr<Manifest> VersionReader::ManifestOf(uint64_t version) {
  const std::string key = ManifestKey(run_, version);
  WSYNC_ASSIGN_OR_RETURN(std::string json, store_.Get(key));
  WSYNC_ASSIGN_OR_RETURN(Manifest m, Manifest::Parse(json, key));
  if (m.version != version) {
    return DataLossError("manifest " + Quoted(key) + " names version " + std::to_string(m.version));
  }
  if (verifier_ != nullptr && !verifier_->Verify(m.SignedBytes(), m.signature)) {
    return PermissionDeniedError("the manifest of version " + std::to_string(version) + " of run " + Quoted(run_) +
                                 (m.signature.empty() ? " is not signed" : "'s signature does not verify") +
                                 " with the run's public key: refused");
  }
  return m;
}

StatusOr<std::vector<VersionReader::Step>> VersionReader::Plan(uint64_t from, uint64_t to) {
  if (to <= from) return InvalidArgumentError("no catch-up from version " + std::to_string(from) + " to " +
                                              std::to_string(to));
  WSYNC_ASSIGN_OR_RETURN(auto all, ListVersions(store_, run_));
  std::vector<uint64_t> versions;
  for (uint64_t v : all) {
    if (v > from && v <= to) versions.push_back(v);
  }
  if (versions.empty() || versions.back() != to) {
    return NotFoundError("version " + std::to_string(to) + " of run " + Quoted(run_) + " is not in the store");
  }
  // The cheapest way to each version, in version order: a keyframe, or a
  // patch from a version reached before it.
  constexpr uint64_t kNone = std::numeric_limits<uint64_t>::max();
  std::map<uint64_t, std::pair<uint64_t, Step>> best;  // version -> (bytes, last step)
  if (from > 0) best[from] = {0, Step{}};
  for (uint64_t v : versions) {
    WSYNC_ASSIGN_OR_RETURN(Manifest m, ManifestOf(v));
    uint64_t cost = kNone;
    Step step;
    for (const StoredObject& o : m.objects) {
      uint64_t c = kNone;
      if (o.kind == StoredObject::Kind::kKeyframe) {
        c = o.bytes;
      } else if (auto it = best.find(o.base); it != best.end()) {
        c = it->second.first + o.bytes;
      }
      if (c < cost) {
        cost = c;
        step = Step{v, o};
      }
    }
    if (cost != kNone) best[v] = {cost, step};
  }
  if (!best.count(to)) {
    return NotFoundError("no way from version " + std::to_string(from) + " to " + std::to_string(to) + " in run " +
                         Quoted(run_) + " (the patches from it were collected and no keyframe follows it)");
  }
  std::vector<Step> steps;
  for (uint64_t v = to; v != from;) {
    const Step& s = best[v].second;
    steps.push_back(s);
    v = s.object.kind == StoredObject::Kind::kKeyframe ? from : s.object.base;
    if (s.object.kind == StoredObject::Kind::kKeyframe) break;
  }
  std::reverse(steps.begin(), steps.end());
  return steps;
}

StatusOr<std::string> VersionReader::Fetch(const StoredObject& object) {
  std::string out(object.bytes, '\0');
  const uint64_t ranges = (object.bytes + range_bytes_ - 1) / range_bytes_;
  std::atomic<uint64_t> next{0};
  std::mutex mu;
  Status first;
  auto work = [&] {
    for (uint64_t r = next++; r < ranges; r = next++) {
      const uint64_t at = r * range_bytes_, len = std::min(range_bytes_, object.bytes - at);
      auto bytes = store_.GetRange(object.key, at, len);
      if (!bytes.ok()) {
        std::lock_guard<std::mutex> lock(mu);
        if (first.ok()) first = bytes.status();
        next = ranges;  // stop the others
        return;
      }
      std::copy(bytes->begin(), bytes->end(), out.begin() + static_cast<ptrdiff_t>(at));
    }
  };
  std::vector<std::thread> threads;
  const uint64_t n = std::min<uint64_t>(static_cast<uint64_t>(std::max(parallel_, 1)), ranges);
  for (uint64_t i = 1; i < n; ++i) threads.emplace_back(work);
  work();
  for (auto& t : threads) t.join();
  if (first.code() == StatusCode::kOutOfRange) {
    return DataLossError("object " + Quoted(object.key) + " is shorter than its manifest's " +
                         std::to_string(object.bytes) + " bytes (truncated)");
  }
  WSYNC_RETURN_IF_ERROR(first);
  // A longer object than listed is another object.
  WSYNC_ASSIGN_OR_RETURN(uint64_t size, store_.Size(object.key));
  if (size != object.bytes) {
    return DataLossError("object " + Quoted(object.key) + " holds " + std::to_string(size) + " bytes, its manifest " +
                         std::to_string(object.bytes));
  }
  if (sigv4::Sha256Hex(out) != object.sha256) {
    return DataLossError("object " + Quoted(object.key) + " does not match its manifest's SHA-256 (corrupted or "
                         "replaced in the store)");
  }
  return out;
}

}  // namespace wsync::store
