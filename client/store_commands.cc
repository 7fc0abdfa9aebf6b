#include "store_commands.h"

#include <spdlog/spdlog.h>

#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "wsync/buffers/safetensors.h"
#include "wsync/codec/codec.h"
#include "wsync/store/object_store.h"
#include "wsync/store/versions.h"
#include "wsync/util/thread_pool.h"
#include "wsync/util/text.h"
#include "codec_commands.h"
#include "local_commands.h"

namespace wsync::cli {
namespace {

using buffers::OwnedTensor;
using buffers::SafetensorsFile;
constexpr const char* kVersionKey = "wsync_version";

struct PullFlags {
  std::string url, run, out;
  uint64_t to = 0;             // 0: the newest
  bool follow = false;
  uint64_t poll_ms = 1000;
  int parallel = 8;
  uint64_t range_mib = 8;
  unsigned threads = 2;
  int max_failures = 10;
  std::string verify_key;      // Ed25519 public key (PEM): only manifests it verifies
  std::string publish_to;      // a source's local API: each version pulled is published through it
};

// The tensors a file holds and the version its metadata names (nothing and
// 0 when there is no file).
StatusOr<uint64_t> LoadHeld(const std::string& path, std::vector<OwnedTensor>* tensors) {
  if (!std::filesystem::exists(path)) return uint64_t{0};
  WSYNC_ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(path));
  const auto it = file->metadata().find(kVersionKey);
  if (it == file->metadata().end()) {
    return FailedPreconditionError(path + " was not written by `wsync store pull` (no " + kVersionKey +
                                   " in its metadata): pass another -o");
  }
  *tensors = buffers::CopyTensors(file->tensors());
  return std::strtoull(it->second.c_str(), nullptr, 10);
}

// One catch-up to `to`: fetched, verified, applied in memory, then the file
// replaced (the old one stays whole on any failure).
Status CatchUp(store::ObjectStore& s3, store::VersionReader& reader, const PullFlags& f, uint64_t from, uint64_t to,
               std::vector<OwnedTensor>* tensors, ThreadPool* pool) {
  const uint64_t requests_before = s3.requests();
  WSYNC_ASSIGN_OR_RETURN(auto plan, reader.Plan(from, to));
  WSYNC_ASSIGN_OR_RETURN(store::Manifest manifest, reader.ManifestOf(to));
  std::vector<OwnedTensor> work = *tensors;
  uint64_t bytes = 0;
  codec::ApplyOptions ao;
  ao.pool = pool;
  for (const auto& step : plan) {
    WSYNC_ASSIGN_OR_RETURN(std::string object, reader.Fetch(step.object));
    bytes += object.size();
    if (step.object.kind == store::StoredObject::Kind::kKeyframe) {
      WSYNC_ASSIGN_OR_RETURN(auto info, codec::InspectPatch(object));
      work = KeyframeShapedTensors(info);
    }
    auto views = buffers::MutableViews(work);
    WSYNC_RETURN_IF_ERROR(codec::Apply(object, views, ao).WithContext(step.object.key));
  }
  // The manifest names the version's set checksum: what was applied is it.
  if (codec::SetChecksum(buffers::Views(work), {}) != manifest.set_checksum) {
    return DataLossError("version " + std::to_string(to) + ": the tensors' set checksum is not the manifest's");
  }
  const std::string tmp = f.out + ".partial";
  WSYNC_RETURN_IF_ERROR(buffers::WriteSafetensors(tmp, buffers::Views(work),
                                                  {{kVersionKey, std::to_string(to)}, {"wsync_run", f.run}}));
  std::error_code ec;
  std::filesystem::rename(tmp, f.out, ec);
  if (ec) return InternalError("renaming " + tmp + " to " + f.out + ": " + ec.message());
  *tensors = std::move(work);
  std::printf("%s: version %" PRIu64 " from the store (%zu objects, %" PRIu64 " bytes, %" PRIu64 " requests%s)\n",
              f.out.c_str(), to, plan.size(), bytes, s3.requests() - requests_before,
              plan.front().object.kind == store::StoredObject::Kind::kKeyframe ? ", from a keyframe" : "");
  std::fflush(stdout);
  return Status::Ok();
}

Status RunPull(const PullFlags& f) {
  WSYNC_ASSIGN_OR_RETURN(auto s3, store::OpenS3Url(f.url));
  WSYNC_ASSIGN_OR_RETURN(auto verifier, store::Verifier::FromPemFileIfAny(f.verify_key));
  store::VersionReader reader(*s3, f.run, f.parallel, f.range_mib << 20, verifier.get());
  std::vector<OwnedTensor> tensors;
  WSYNC_ASSIGN_OR_RETURN(uint64_t held, LoadHeld(f.out, &tensors));
  ThreadPool pool(f.threads);
  int failures = 0;
  uint64_t published = 0;  // the newest version published through --publish-to
  std::chrono::milliseconds backoff(f.poll_ms);
  for (;;) {
    Status s;
    auto newest = reader.Newest();
    if (!newest.ok()) {
      s = newest.status();
    } else {
      const uint64_t target = f.to > 0 ? std::min(f.to, *newest) : *newest;
      if (target > held) {
        s = CatchUp(*s3, reader, f, held, target, &tensors, &pool);
        if (s.ok()) held = target;
      } else if (!f.follow) {
        std::printf("%s: version %" PRIu64 ", the newest in the store\n", f.out.c_str(), held);
      }
    }
    // A region's gateway: each version pulled, published to the region's
    // own source (its daemons then follow it as any version). Already
    // there (a restarted gateway): nothing to do.
    if (s.ok() && !f.publish_to.empty() && published < held) {
      s = PublishFile(f.publish_to, f.out, held);
      if (s.ok() || s.HasReason(reasons::kStaleVersion)) {
        s = Status::Ok();
        published = held;
      }
    }
    if (!f.follow) return s;
    if (f.to > 0 && held >= f.to) return Status::Ok();
    if (s.ok()) {
      failures = 0;
      backoff = std::chrono::milliseconds(f.poll_ms);
    } else if (s.code() != StatusCode::kNotFound || held > 0) {
      // NotFound before anything was pulled: the run has not started yet.
      if (++failures >= f.max_failures) {
        return s.WithContext(std::to_string(failures) + " failures in a row");
      }
      spdlog::warn("store pull: {} (failure {} of {}); trying again in {} ms", s.ToString(), failures, f.max_failures,
                   backoff.count());
    }
    std::this_thread::sleep_for(backoff);
    if (!s.ok()) backoff = std::min(backoff * 2, std::chrono::milliseconds(30'000));
  }
}

Status RunList(const std::string& url, const std::string& run, const std::string& verify_key) {
  WSYNC_ASSIGN_OR_RETURN(auto s3, store::OpenS3Url(url));
  WSYNC_ASSIGN_OR_RETURN(auto verifier, store::Verifier::FromPemFileIfAny(verify_key));
  store::VersionReader reader(*s3, run, 8, uint64_t{8} << 20, verifier.get());
  WSYNC_ASSIGN_OR_RETURN(auto versions, store::ListVersions(*s3, run));
  for (uint64_t v : versions) {
    WSYNC_ASSIGN_OR_RETURN(store::Manifest m, reader.ManifestOf(v));
    std::printf("version %" PRIu64 "%s:", v, m.signature.empty() ? "" : " (signed)");
    for (const auto& obj : m.objects) {
      if (obj.kind == store::StoredObject::Kind::kKeyframe) {
        std::printf(" keyframe %" PRIu64 " bytes", obj.bytes);
      } else {
        std::printf(" patch from %" PRIu64 " %" PRIu64 " bytes", obj.base, obj.bytes);
      }
    }
    std::printf("\n");
  }
  return Status::Ok();
}

}  // namespace

void AddStoreCommands(CLI::App& app, std::function<Status()>* run) {
  auto* store = app.add_subcommand("store", "versions in an S3-compatible object store (docs/object-store.md)");
  store->require_subcommand(1);
  auto f = std::make_shared<PullFlags>();
  auto* pull = store->add_subcommand(
      "pull", "keep a safetensors file at a run's newest version, from the store alone (read access is enough)");
  pull->add_option("--store", f->url, "s3://BUCKET?endpoint=http://HOST:PORT (credentials: AWS_ACCESS_KEY_ID, "
                                      "AWS_SECRET_ACCESS_KEY; none: anonymous)")
      ->required();
  pull->add_option("--run", f->run, "the run's key prefix")->required();
  pull->add_option("-o,--out", f->out, "the safetensors file kept (written whole, then renamed)")->required();
  pull->add_option("--to", f->to, "stop at this version (0: the newest)");
  pull->add_flag("--follow", f->follow, "keep following new versions (until --to, if given)");
  pull->add_option("--poll-ms", f->poll_ms, "how often --follow looks for a new version")->capture_default_str();
  pull->add_option("--parallel", f->parallel, "ranged GETs in flight per object")->capture_default_str();
  pull->add_option("--range-mib", f->range_mib, "the size of each ranged GET")->capture_default_str();
  pull->add_option("--threads", f->threads, "codec threads")->capture_default_str();
  pull->add_option("--max-failures", f->max_failures, "--follow gives up after this many failures in a row")
      ->capture_default_str();
  pull->add_option("--publish-to", f->publish_to,
                   "a region's gateway: publish each version pulled through this source (unix:PATH of its local "
                   "API), for the region's sinks to follow through its own coordinator and relays");
  pull->add_option("--verify-key", f->verify_key,
                   "the run's Ed25519 public key (PEM): accept only manifests the source signed")
      ->check(CLI::ExistingFile);
  pull->callback([run, f] { *run = [f] { return RunPull(*f); }; });
  auto list_url = std::make_shared<std::string>(), list_run = std::make_shared<std::string>(),
       list_key = std::make_shared<std::string>();
  auto* ls = store->add_subcommand("ls", "the versions a run holds in the store, with their objects");
  ls->add_option("--store", *list_url, "s3://BUCKET?endpoint=http://HOST:PORT")->required();
  ls->add_option("--run", *list_run, "the run's key prefix")->required();
  ls->add_option("--verify-key", *list_key, "the run's Ed25519 public key (PEM): refuse unsigned manifests")
      ->check(CLI::ExistingFile);
  ls->callback([run, list_url, list_run, list_key] {
    *run = [list_url, list_run, list_key] { return RunList(*list_url, *list_run, *list_key); };
  });
}

}  // namespace wsync::cli
