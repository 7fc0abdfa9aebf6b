#include "store_tier.h"

#include "wsync/util/text.h"

namespace wsync::daemon {

StatusOr<std::unique_ptr<StoreTier>> StoreTier::Open(const StoreTierOptions& options) {
  if (options.run.empty()) return InvalidArgumentError("--store-run: the run's key prefix is empty");
  if (options.parallel < 1) return InvalidArgumentError("--store-parallel must be at least 1");
  if (options.range_bytes == 0) return InvalidArgumentError("--store-range-mib must be above 0");
  WSYNC_ASSIGN_OR_RETURN(auto s3, store::OpenS3Url(options.url));
  WSYNC_ASSIGN_OR_RETURN(auto verifier, store::Verifier::FromPemFileIfAny(options.verify_key));
  return std::unique_ptr<StoreTier>(new StoreTier(options, std::move(s3), std::move(verifier)));
}

StoreTier::StoreTier(const StoreTierOptions& options, std::unique_ptr<store::ObjectStore> store,
                     std::unique_ptr<store::Verifier> verifier)
    : options_(options),
      where_("the store " + options.url.substr(0, options.url.find('?')) + " (run " + Quoted(options.run) + ")"),
      store_(std::move(store)),
      verifier_(std::move(verifier)),
      reader_(*store_, options.run, options.parallel, options.range_bytes, verifier_.get()) {}

StatusOr<StoreTier::Plan> StoreTier::PlanTo(uint64_t from, uint64_t head) {
  WSYNC_ASSIGN_OR_RETURN(auto versions, store::ListVersions(*store_, options_.run));
  Plan plan;
  for (uint64_t v : versions) {
    if (v > from && v <= head) plan.version = v;
  }
  if (plan.version == 0) {
    return NotFoundError(where_ + " holds no version above " + std::to_string(from) + " up to " +
                         std::to_string(head) + " yet");
  }
  WSYNC_ASSIGN_OR_RETURN(plan.steps, reader_.Plan(from, plan.version));
  WSYNC_ASSIGN_OR_RETURN(store::Manifest manifest, reader_.ManifestOf(plan.version));
  plan.set_checksum = manifest.set_checksum;
  return plan;
}

}  // namespace wsync::daemon
