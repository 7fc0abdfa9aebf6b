#include "measure.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include <spdlog/spdlog.h>

namespace wsync::bench {
namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

bool Equal(const std::vector<codec::MutableTensorView>& got, const std::vector<codec::TensorView>& want) {
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(got[i].data, want[i].data, want[i].NumBytes()) != 0) return false;
  }
  return true;
}

// wsync's own codec behind the same interface as the baselines.
class WsyncMethod : public Baseline {
 public:
  WsyncMethod(const MeasureOptions& o, std::span<const codec::TensorView> base) {
    encode_.pool = o.pool;
    encode_.zstd_level = o.zstd_level;
    encode_.condition_on_base = o.condition;
    encode_.max_classes = o.max_classes;
    if (!o.hash_base) encode_.base_set_checksum = codec::SetChecksum(base, o.pool);
    apply_.pool = o.pool;
  }
  std::string name() const override { return "wsync"; }
  StatusOr<std::string> Encode(std::span<const codec::TensorView> base,
                               std::span<const codec::TensorView> target) override {
    return codec::EncodePatch(base, target, encode_);
  }
  Status Apply(const std::string& patch, std::span<const codec::MutableTensorView> dst) override {
    return codec::Apply(patch, dst, apply_);
  }

 private:
  codec::EncodeOptions encode_;
  codec::ApplyOptions apply_;
};

}  // namespace

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

std::vector<codec::MutableTensorView> Scratch::Reset(const std::vector<codec::TensorView>& base) {
  bool same = dst_.size() == base.size();
  for (size_t i = 0; same && i < base.size(); ++i) same = dst_[i].bytes.size() == base[i].NumBytes();
  if (!same) dst_ = buffers::CopyTensors(base);
  for (size_t i = 0; i < base.size(); ++i) {
    dst_[i].name = base[i].name;
    dst_[i].dtype = base[i].dtype;
    dst_[i].shape = base[i].shape;
    std::memcpy(dst_[i].bytes.data(), base[i].data, base[i].NumBytes());
  }
  return buffers::MutableViews(dst_);
}

PairResult MeasurePair(const std::string& label, const std::vector<codec::TensorView>& base,
                       const std::vector<codec::TensorView>& target, const MeasureOptions& options,
                       Scratch* scratch) {
  PairResult r;
  r.label = label;
  for (const auto& t : target) {
    r.dense_bytes += t.NumBytes();
    r.elements += t.NumElements();
  }
  auto stats = codec::AnalyzeDiff(base, target);
  if (stats.ok()) {
    r.changed = stats->changed;
    r.order0_bytes = stats->Order0Bits() / 8;
    r.conditional_bytes = stats->ConditionalBits() / 8;
  }

  std::vector<std::unique_ptr<Baseline>> methods;
  methods.push_back(std::make_unique<WsyncMethod>(options, base));
  if (options.baselines) {
    methods.push_back(MakePulseBaseline());
    methods.push_back(MakeNaiveBaseline());
    methods.push_back(MakeDenseZstdBaseline());
  }
  for (auto& method : methods) {
    MethodResult m;
    m.name = method->name();
    std::vector<double> enc, app;
    std::string patch;
    m.exact = true;
    if (scratch->FirstRun(m.name)) {
      auto p = method->Encode(base, target);
      if (p.ok()) (void)method->Apply(*p, scratch->Reset(base));  // checked in the timed runs
    }
    for (int k = 0; k < options.repeat; ++k) {
      scratch->SampleMemcpy(r.dense_bytes);
      double t0 = Now();
      auto p = method->Encode(base, target);
      enc.push_back(Now() - t0);
      if (!p.ok()) {
        spdlog::error("{}: {} encode failed: {}", label, m.name, p.status().ToString());
        m.exact = false;
        break;
      }
      patch = std::move(*p);
      auto dst = scratch->Reset(base);
      t0 = Now();
      Status s = method->Apply(patch, dst);
      app.push_back(Now() - t0);
      m.exact = m.exact && s.ok() && Equal(dst, target);
    }
    m.bytes = patch.size();
    m.encode_s = Median(enc);
    m.apply_s = Median(app);
    r.methods.push_back(m);
  }
  return r;
}

void Scratch::SampleMemcpy(uint64_t bytes) {
  if (copy_from_.size() != bytes) {
    copy_from_.assign(bytes, 1);
    copy_to_.assign(bytes, 2);
  }
  const double t0 = Now();
  std::memcpy(copy_to_.data(), copy_from_.data(), bytes);
  const double t = Now() - t0;
  if (bytes > 0) copy_from_[memcpy_bps_.size() % bytes] ^= copy_to_[0];  // keep the copy observable
  if (t > 0) memcpy_bps_.push_back(static_cast<double>(bytes) / t);
}

double Scratch::MemcpyBytesPerSecond() const { return Median(memcpy_bps_); }

bool Scratch::FirstRun(const std::string& method) { return warmed_.insert(method).second; }

}  // namespace wsync::bench
