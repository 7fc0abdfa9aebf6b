#include "codec_commands.h"

#include <cinttypes>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "wsync/buffers/safetensors.h"
#include "wsync/codec/bf16.h"
#include "wsync/codec/codec.h"
#include "wsync/util/file.h"
#include "wsync/util/thread_pool.h"
#include "wsync/util/text.h"

namespace wsync::cli {
namespace {

using buffers::OwnedTensor;
using buffers::SafetensorsFile;

struct CommonFlags {
  int zstd_level = 3;
  unsigned threads = 0;
  bool no_condition = false;
  int max_classes = codec::EncodeOptions{}.max_classes;
  uint32_t chunk_mib = 1;
  uint64_t base_version = 0;
  uint64_t target_version = 0;
};

void AddEncodeFlags(CLI::App* cmd, CommonFlags* f) {
  cmd->add_option("--zstd-level", f->zstd_level, "zstd level of the zstd-coded streams (1..19)")
      ->check(CLI::Range(1, 19));
  cmd->add_option("--threads", f->threads, "worker threads (0: all cores)");
  cmd->add_flag("--no-condition", f->no_condition,
                "do not condition coding on the base (patches then merge without it)");
  cmd->add_option("--max-classes", f->max_classes,
                  "most exponent classes per chunk (1..8): fewer encode and apply faster, larger patches")
      ->check(CLI::Range(1, 8));
  cmd->add_option("--chunk-mib", f->chunk_mib, "coding chunk size in MiB (power of two, 1..64)");
  cmd->add_option("--base-version", f->base_version, "base version recorded in the header");
  cmd->add_option("--target-version", f->target_version, "target version recorded in the header");
}

codec::EncodeOptions ToOptions(const CommonFlags& f, ThreadPool* pool) {
  codec::EncodeOptions o;
  o.zstd_level = f.zstd_level;
  o.condition_on_base = !f.no_condition;
  o.max_classes = f.max_classes;
  o.chunk_bytes = f.chunk_mib << 20;
  o.base_version = f.base_version;
  o.target_version = f.target_version;
  o.pool = pool;
  return o;
}

// FP32 tensors of `in` cast to BF16 (round to nearest even); others copied.
std::vector<OwnedTensor> CastToBf16(const std::vector<codec::TensorView>& in) {
  std::vector<OwnedTensor> out;
  for (const auto& t : in) {
    if (t.dtype != codec::DType::kF32) {
      out.push_back(buffers::CopyTensors(std::span(&t, 1))[0]);
      continue;
    }
    OwnedTensor o{t.name, codec::DType::kBF16, t.shape, std::vector<uint8_t>(t.NumElements() * 2)};
    codec::CastFp32ToBf16(reinterpret_cast<const uint32_t*>(t.data), reinterpret_cast<uint16_t*>(o.bytes.data()),
                          t.NumElements());
    out.push_back(std::move(o));
  }
  return out;
}

// Orders `target` like `base` by name; InvalidArgument on a mismatch of sets.
StatusOr<std::vector<codec::TensorView>> AlignByName(const std::vector<codec::TensorView>& base,
                                                     const std::vector<codec::TensorView>& target) {
  std::vector<codec::TensorView> out;
  for (const auto& b : base) {
    const codec::TensorView* found = nullptr;
    for (const auto& t : target) {
      if (t.name == b.name) found = &t;
    }
    if (found == nullptr) return InvalidArgumentError("tensor " + Quoted(b.name) + " is in the base but not the target");
    out.push_back(*found);
  }
  if (target.size() != base.size()) return InvalidArgumentError("the target has tensors the base lacks");
  return out;
}

std::string FormatBytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) {
    b /= 1024;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), u == 0 ? "%.0f %s" : "%.2f %s", b, units[u]);
  return buf;
}

std::string ShapeString(const std::vector<uint64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? "," : "") + std::to_string(shape[i]);
  return s + "]";
}

Status RunDiff(const std::string& base_path, const std::string& target_path, const std::string& out,
               const CommonFlags& f, bool cast) {
  WSYNC_ASSIGN_OR_RETURN(auto base, SafetensorsFile::Open(base_path));
  WSYNC_ASSIGN_OR_RETURN(auto target, SafetensorsFile::Open(target_path));
  ThreadPool pool(f.threads);
  std::vector<OwnedTensor> base_cast, target_cast;
  std::vector<codec::TensorView> bv = base->tensors(), tv = target->tensors();
  if (cast) {
    base_cast = CastToBf16(bv);
    target_cast = CastToBf16(tv);
    bv = buffers::Views(base_cast);
    tv = buffers::Views(target_cast);
  }
  WSYNC_ASSIGN_OR_RETURN(auto aligned, AlignByName(bv, tv));
  WSYNC_ASSIGN_OR_RETURN(std::string patch, codec::EncodePatch(bv, aligned, ToOptions(f, &pool)));
  WSYNC_RETURN_IF_ERROR(WriteFileAtomic(out, patch));
  uint64_t dense = 0;
  for (const auto& t : aligned) dense += t.NumBytes();
  std::printf("%s: %s for %s of tensors (%.1fx)\n", out.c_str(), FormatBytes(patch.size()).c_str(),
              FormatBytes(dense).c_str(), patch.empty() ? 0.0 : static_cast<double>(dense) / patch.size());
  return Status::Ok();
}

// The tensors a patch applies to: a copy of `base` (when given), or zeros
// shaped as a keyframe's tensors.
StatusOr<std::vector<OwnedTensor>> StartingTensors(const codec::PatchInfo& info, const SafetensorsFile* base,
                                                   const std::string& patch_path) {
  std::vector<OwnedTensor> tensors;
  if (base != nullptr) {
    tensors = buffers::CopyTensors(base->tensors());
  } else if (info.kind == codec::PatchKind::kKeyframe) {
    tensors = KeyframeShapedTensors(info);
  } else {
    return InvalidArgumentError(patch_path + " is a patch: apply needs its base (wsync apply BASE PATCH -o OUT)");
  }
  return tensors;
}

Status RunApply(const std::vector<std::string>& inputs, const std::string& out, unsigned threads) {
  const std::string& patch_path = inputs.back();
  WSYNC_ASSIGN_OR_RETURN(std::string patch, ReadFile(patch_path));
  WSYNC_ASSIGN_OR_RETURN(codec::PatchInfo info, codec::InspectPatch(patch));
  std::unique_ptr<SafetensorsFile> base;
  if (inputs.size() == 2) {
    WSYNC_ASSIGN_OR_RETURN(base, SafetensorsFile::Open(inputs[0]));
  }
  WSYNC_ASSIGN_OR_RETURN(std::vector<OwnedTensor> tensors, StartingTensors(info, base.get(), patch_path));
  ThreadPool pool(threads);
  codec::ApplyOptions options;
  options.pool = &pool;
  auto views = buffers::MutableViews(tensors);
  WSYNC_RETURN_IF_ERROR(codec::Apply(patch, views, options).WithContext(patch_path));
  // Write in the patch's tensor order.
  std::vector<codec::TensorView> ordered;
  for (const auto& t : info.tensors) {
    for (const auto& o : tensors) {
      if (o.name == t.name) ordered.push_back(o.View());
    }
  }
  std::map<std::string, std::string> metadata;
  if (base) metadata = base->metadata();
  WSYNC_RETURN_IF_ERROR(buffers::WriteSafetensors(out, ordered, metadata));
  std::printf("%s: %zu tensors at version %" PRIu64 ", verified\n", out.c_str(), ordered.size(), info.target_version);
  return Status::Ok();
}

Status RunMerge(const std::string& base_path, const std::string& p1, const std::string& p2, const std::string& out,
                const CommonFlags& f) {
  WSYNC_ASSIGN_OR_RETURN(std::string a, ReadFile(p1));
  WSYNC_ASSIGN_OR_RETURN(std::string b, ReadFile(p2));
  std::unique_ptr<SafetensorsFile> base;
  std::vector<codec::TensorView> bv;
  if (!base_path.empty()) {
    WSYNC_ASSIGN_OR_RETURN(base, SafetensorsFile::Open(base_path));
    bv = base->tensors();
  }
  ThreadPool pool(f.threads);
  auto merged = codec::MergePatches(a, b, bv, ToOptions(f, &pool));
  if (!merged.ok() && merged.status().code() == StatusCode::kFailedPrecondition && base_path.empty()) {
    return Status(merged.status().code(), merged.status().message() + " (pass --base BASE.safetensors)");
  }
  if (!merged.ok()) return merged.status();
  // The inputs' container checksums cover only their bytes as written: a
  // payload changed and re-checksummed decodes to other changes. Applying
  // the result checks every tensor against the second input's target
  // checksums, as a sink would, before anything is written.
  WSYNC_ASSIGN_OR_RETURN(codec::PatchInfo info, codec::InspectPatch(*merged));
  const bool verifiable = base != nullptr || info.kind == codec::PatchKind::kKeyframe;
  if (verifiable) {
    WSYNC_ASSIGN_OR_RETURN(std::vector<OwnedTensor> tensors, StartingTensors(info, base.get(), p1));
    codec::ApplyOptions options;
    options.pool = &pool;
    Status s = codec::Apply(*merged, buffers::MutableViews(tensors), options);
    if (!s.ok()) {
      return DataLossError("the merge of " + p1 + " and " + p2 + " does not reproduce the second's target (" +
                           s.message() + "): an input is corrupt; nothing written");
    }
  }
  WSYNC_RETURN_IF_ERROR(WriteFileAtomic(out, *merged));
  std::printf("%s: %s%s\n", out.c_str(), FormatBytes(merged->size()).c_str(),
              verifiable ? ", verified against the target checksums"
                         : " (not verified: without --base only the inputs' container checksums were checked)");
  return Status::Ok();
}

Status RunKeyframe(const std::string& target_path, const std::string& out, const CommonFlags& f) {
  WSYNC_ASSIGN_OR_RETURN(auto target, SafetensorsFile::Open(target_path));
  ThreadPool pool(f.threads);
  WSYNC_ASSIGN_OR_RETURN(std::string kf, codec::EncodeKeyframe(target->tensors(), ToOptions(f, &pool)));
  WSYNC_RETURN_IF_ERROR(WriteFileAtomic(out, kf));
  uint64_t dense = 0;
  for (const auto& t : target->tensors()) dense += t.NumBytes();
  std::printf("%s: keyframe %s for %s (%.2fx)\n", out.c_str(), FormatBytes(kf.size()).c_str(),
              FormatBytes(dense).c_str(), static_cast<double>(dense) / kf.size());
  return Status::Ok();
}

Status RunInspect(const std::string& patch_path, const std::string& base_path, bool json) {
  WSYNC_ASSIGN_OR_RETURN(std::string patch, ReadFile(patch_path));
  WSYNC_ASSIGN_OR_RETURN(codec::PatchInfo info, codec::InspectPatch(patch));
  // Entropy bounds need the data: the base, and the target rebuilt from it.
  std::optional<codec::DiffStats> bounds;
  if (!base_path.empty() && info.kind == codec::PatchKind::kPatch) {
    WSYNC_ASSIGN_OR_RETURN(auto base, SafetensorsFile::Open(base_path));
    std::vector<codec::TensorView> ordered;
    for (const auto& t : info.tensors) {
      const codec::TensorView* v = base->Find(t.name);
      if (v == nullptr) return FailedPreconditionError("base lacks tensor " + Quoted(t.name));
      ordered.push_back(*v);
    }
    auto target = buffers::CopyTensors(ordered);
    auto views = buffers::MutableViews(target);
    ThreadPool pool(0);
    codec::ApplyOptions options;
    options.pool = &pool;
    WSYNC_RETURN_IF_ERROR(codec::Apply(patch, views, options));
    WSYNC_ASSIGN_OR_RETURN(bounds, codec::AnalyzeDiff(ordered, buffers::Views(target)));
  }
  uint64_t dense = 0, changed = 0, pos = 0, val = 0, elements = 0;
  for (const auto& t : info.tensors) {
    dense += t.DenseBytes();
    changed += t.changed;
    pos += t.position_bytes;
    val += t.value_bytes;
    elements += t.DenseBytes() / codec::DTypeWidth(t.dtype);
  }
  const double ratio = static_cast<double>(dense) / static_cast<double>(info.total_bytes);
  const char* kind = info.kind == codec::PatchKind::kPatch ? "patch" : "keyframe";
  if (json) {
    nlohmann::ordered_json j;
    j["kind"] = kind;
    j["format_version"] = info.format_version;
    j["base_version"] = info.base_version;
    j["target_version"] = info.target_version;
    j["chunk_bytes"] = info.chunk_bytes;
    j["total_bytes"] = info.total_bytes;
    j["header_bytes"] = info.header_bytes;
    j["dense_bytes"] = dense;
    j["elements"] = elements;
    j["changed"] = changed;
    j["position_bytes"] = pos;
    j["value_bytes"] = val;
    j["ratio"] = ratio;
    if (bounds) {
      j["order0_bound_bytes"] = bounds->Order0Bits() / 8;
      j["order0_bound_ratio"] = dense / (bounds->Order0Bits() / 8);
      j["conditional_bound_bytes"] = bounds->ConditionalBits() / 8;
      j["conditional_bound_ratio"] = dense / (bounds->ConditionalBits() / 8);
    }
    nlohmann::ordered_json tensors = nlohmann::ordered_json::array();
    for (const auto& t : info.tensors) {
      nlohmann::ordered_json o;
      o["name"] = t.name;
      o["dtype"] = codec::DTypeName(t.dtype);
      o["shape"] = t.shape;
      o["dense_bytes"] = t.DenseBytes();
      o["changed"] = t.changed;
      o["position_bytes"] = t.position_bytes;
      o["value_bytes"] = t.value_bytes;
      o["chunks"] = t.chunks;
      o["conditioned_chunks"] = t.conditioned_chunks;
      o["modes"] = {{"empty", t.mode_counts[0]}, {"sparse", t.mode_counts[1]}, {"bitmap", t.mode_counts[2]},
                    {"runs", t.mode_counts[3]}, {"dense", t.mode_counts[4]}};
      if (!t.row_cuts.empty() || !t.col_cuts.empty()) o["grid"] = {{"row_cuts", t.row_cuts}, {"col_cuts", t.col_cuts}};
      if (t.absent_chunks > 0) o["absent_chunks"] = t.absent_chunks;
      tensors.push_back(o);
    }
    j["tensors"] = tensors;
    std::printf("%s\n", j.dump(2).c_str());
    return Status::Ok();
  }
  std::printf("%s %s: version %" PRIu64 " -> %" PRIu64 ", format %u, chunks of %s\n", patch_path.c_str(), kind,
              info.base_version, info.target_version, info.format_version, FormatBytes(info.chunk_bytes).c_str());
  std::printf("%-48s %-6s %-14s %10s %8s %10s %10s %9s\n", "tensor", "dtype", "shape", "changed", "%", "pos B",
              "value B", "ratio");
  for (const auto& t : info.tensors) {
    const uint64_t n = t.DenseBytes() / codec::DTypeWidth(t.dtype);
    const uint64_t bytes = t.position_bytes + t.value_bytes;
    std::printf("%-48s %-6s %-14s %10" PRIu64 " %7.3f%% %10" PRIu64 " %10" PRIu64 " %8.1fx\n", t.name.c_str(),
                std::string(codec::DTypeName(t.dtype)).c_str(), ShapeString(t.shape).c_str(), t.changed,
                n ? 100.0 * t.changed / n : 0.0, t.position_bytes, t.value_bytes,
                bytes ? static_cast<double>(t.DenseBytes()) / bytes : 0.0);
  }
  std::printf("total: %zu tensors, %" PRIu64 " of %" PRIu64 " elements changed (%.3f%%)\n", info.tensors.size(),
              changed, elements, elements ? 100.0 * changed / elements : 0.0);
  std::printf("bytes: %" PRIu64 " (header %" PRIu64 ", positions %" PRIu64 ", values %" PRIu64 ") for %" PRIu64
              " dense: ratio %.1fx\n",
              info.total_bytes, info.header_bytes, pos, val, dense, ratio);
  if (bounds) {
    std::printf("order-0 entropy bound:     %.0f bytes (%.1fx)\n", bounds->Order0Bits() / 8,
                dense / (bounds->Order0Bits() / 8));
    std::printf("conditional entropy bound: %.0f bytes (%.1fx; positions and deltas conditioned on the base exponent)\n",
                bounds->ConditionalBits() / 8, dense / (bounds->ConditionalBits() / 8));
  } else if (info.kind == codec::PatchKind::kPatch) {
    std::printf("entropy bounds: pass --base BASE.safetensors to measure them\n");
  }
  return Status::Ok();
}

}  // namespace

std::vector<buffers::OwnedTensor> KeyframeShapedTensors(const codec::PatchInfo& info) {
  std::vector<buffers::OwnedTensor> tensors;
  for (const auto& t : info.tensors) tensors.push_back({t.name, t.dtype, t.shape, std::vector<uint8_t>(t.DenseBytes())});
  return tensors;
}

void AddCodecCommands(CLI::App& app, std::function<Status()>* run) {
  {
    auto* cmd = app.add_subcommand("diff", "encode the patch from BASE to TARGET");
    auto base = std::make_shared<std::string>(), target = std::make_shared<std::string>(),
         out = std::make_shared<std::string>();
    auto flags = std::make_shared<CommonFlags>();
    auto cast = std::make_shared<bool>(false);
    cmd->add_option("BASE", *base, "base safetensors file")->required()->check(CLI::ExistingFile);
    cmd->add_option("TARGET", *target, "target safetensors file")->required()->check(CLI::ExistingFile);
    cmd->add_option("-o,--output", *out, "patch file to write")->required();
    cmd->add_flag("--cast-bf16", *cast, "cast FP32 tensors to BF16 (round to nearest even) before diffing");
    AddEncodeFlags(cmd, flags.get());
    cmd->callback([=] { *run = [=] { return RunDiff(*base, *target, *out, *flags, *cast); }; });
  }
  {
    auto* cmd = app.add_subcommand("apply", "apply a patch to BASE (or a keyframe to nothing)");
    auto inputs = std::make_shared<std::vector<std::string>>();
    auto out = std::make_shared<std::string>();
    auto threads = std::make_shared<unsigned>(0);
    cmd->add_option("INPUTS", *inputs, "[BASE.safetensors] PATCH")->required()->expected(1, 2)->check(CLI::ExistingFile);
    cmd->add_option("-o,--output", *out, "safetensors file to write")->required();
    cmd->add_option("--threads", *threads, "worker threads (0: all cores)");
    cmd->callback([=] { *run = [=] { return RunApply(*inputs, *out, *threads); }; });
  }
  {
    auto* cmd = app.add_subcommand("merge", "merge patch(j->k) and patch(k->l) into patch(j->l)");
    auto base = std::make_shared<std::string>(), p1 = std::make_shared<std::string>(),
         p2 = std::make_shared<std::string>(), out = std::make_shared<std::string>();
    auto flags = std::make_shared<CommonFlags>();
    cmd->add_option("--base", *base, "version j, needed when the patches are coded relative to it")
        ->check(CLI::ExistingFile);
    cmd->add_option("P1", *p1, "patch j->k (or a keyframe of k)")->required()->check(CLI::ExistingFile);
    cmd->add_option("P2", *p2, "patch k->l")->required()->check(CLI::ExistingFile);
    cmd->add_option("-o,--output", *out, "merged patch to write")->required();
    AddEncodeFlags(cmd, flags.get());
    cmd->callback([=] { *run = [=] { return RunMerge(*base, *p1, *p2, *out, *flags); }; });
  }
  {
    auto* cmd = app.add_subcommand("keyframe", "encode a self-contained keyframe of TARGET");
    auto target = std::make_shared<std::string>(), out = std::make_shared<std::string>();
    auto flags = std::make_shared<CommonFlags>();
    cmd->add_option("TARGET", *target, "safetensors file")->required()->check(CLI::ExistingFile);
    cmd->add_option("-o,--output", *out, "keyframe file to write")->required();
    AddEncodeFlags(cmd, flags.get());
    cmd->callback([=] { *run = [=] { return RunKeyframe(*target, *out, *flags); }; });
  }
  {
    auto* cmd = app.add_subcommand("inspect", "describe a patch or keyframe");
    auto patch = std::make_shared<std::string>(), base = std::make_shared<std::string>();
    auto json = std::make_shared<bool>(false);
    cmd->add_option("PATCH", *patch, "patch or keyframe file")->required()->check(CLI::ExistingFile);
    cmd->add_option("--base", *base, "base safetensors: also measure the entropy bounds")->check(CLI::ExistingFile);
    cmd->add_flag("--json", *json, "machine-readable output");
    cmd->callback([=] { *run = [=] { return RunInspect(*patch, *base, *json); }; });
  }
}

}  // namespace wsync::cli
