#include "synth.h"

#include <bit>
#include <cmath>
#include <cstring>

#include "wsync/codec/bf16.h"

namespace wsync::bench {
namespace {

constexpr uint64_t kBlock = 1 << 20;

uint64_t SplitMix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Fast approximately standard-normal numbers: a centred binomial(64, 1/2)
// scaled to unit variance, plus a uniform jitter to smooth the lattice.
struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(SplitMix(seed) | 1) {}
  uint64_t Next() {
    s ^= s >> 12;
    s ^= s << 25;
    s ^= s >> 27;
    return s * 0x2545F4914F6CDD1Dull;
  }
  float Normal() {
    uint64_t a = Next(), b = Next();
    float jitter = static_cast<float>(b >> 40) * (1.0f / 16777216.0f) - 0.5f;
    return (static_cast<float>(std::popcount(a)) - 32.0f + jitter) * 0.25f;
  }
};

}  // namespace

SynthModel::SynthModel(const SynthOptions& options, ThreadPool* pool) : options_(options), pool_(pool) {
  uint64_t d = options.hidden;
  if (d == 0) d = options.params >= (1ull << 30) ? 4096 : options.params >= (1ull << 26) ? 2048 : 512;
  const uint64_t ff = d * 11 / 4 / 64 * 64;
  auto add = [&](std::string name, std::vector<uint64_t> shape, bool norm) {
    uint64_t n = 1;
    for (auto s : shape) n *= s;
    tensors_.push_back({std::move(name), std::move(shape), total_, n, norm});
    total_ += n;
  };
  for (int l = 0; total_ < options.params; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    add(p + "input_layernorm.weight", {d}, true);
    add(p + "self_attn.q_proj.weight", {d, d}, false);
    add(p + "self_attn.k_proj.weight", {d, d}, false);
    add(p + "self_attn.v_proj.weight", {d, d}, false);
    add(p + "self_attn.o_proj.weight", {d, d}, false);
    add(p + "post_attention_layernorm.weight", {d}, true);
    add(p + "mlp.gate_proj.weight", {ff, d}, false);
    add(p + "mlp.up_proj.weight", {ff, d}, false);
    add(p + "mlp.down_proj.weight", {d, ff}, false);
  }
  master_.resize(total_);
  momentum_.resize(total_);
  const size_t blocks = (total_ + kBlock - 1) / kBlock;
  pool_->ParallelFor(blocks, [&](size_t b) {
    Rng rng(options_.seed * 1000003 + b);
    const uint64_t end = std::min(total_, (b + 1) * kBlock);
    for (uint64_t i = b * kBlock; i < end; ++i) {
      master_[i] = 0.02f * rng.Normal();
      momentum_[i] = 0;
    }
  });
  for (const auto& t : tensors_) {
    if (t.norm) std::fill(master_.begin() + t.offset, master_.begin() + t.offset + t.numel, 1.0f);
  }
}

void SynthModel::Step() {
  ++step_;
  const float lr = static_cast<float>(options_.lr);
  const float beta = static_cast<float>(options_.momentum);
  // Normalizes the momentum of iid unit gradients to unit RMS.
  const float norm = 1.0f / std::sqrt((1 - beta) / (1 + beta));
  const float decay = 1.0f - lr * static_cast<float>(options_.weight_decay);
  const size_t blocks = (total_ + kBlock - 1) / kBlock;
  pool_->ParallelFor(blocks, [&](size_t b) {
    Rng rng(SplitMix(options_.seed) ^ (static_cast<uint64_t>(step_) << 40) ^ b);
    const uint64_t end = std::min(total_, (b + 1) * kBlock);
    for (uint64_t i = b * kBlock; i < end; ++i) {
      momentum_[i] = beta * momentum_[i] + (1 - beta) * rng.Normal();
      master_[i] = master_[i] * decay - lr * norm * momentum_[i];
    }
  });
}

std::vector<buffers::OwnedTensor> SynthModel::Tensors() const {
  std::vector<buffers::OwnedTensor> out;
  for (const auto& t : tensors_) out.push_back({t.name, codec::DType::kBF16, t.shape, std::vector<uint8_t>(t.numel * 2)});
  return out;
}

void SynthModel::CastTo(std::vector<buffers::OwnedTensor>* out) const {
  if (out->size() != tensors_.size()) *out = Tensors();
  pool_->ParallelFor(tensors_.size(), [&](size_t i) {
    const Tensor& t = tensors_[i];
    std::vector<uint32_t> bits(std::min<uint64_t>(t.numel, kBlock));
    auto* dst = reinterpret_cast<uint16_t*>((*out)[i].bytes.data());
    for (uint64_t off = 0; off < t.numel; off += kBlock) {
      const uint64_t n = std::min<uint64_t>(kBlock, t.numel - off);
      std::memcpy(bits.data(), master_.data() + t.offset + off, n * 4);
      codec::CastFp32ToBf16(bits.data(), dst + off, n);
    }
  });
}

}  // namespace wsync::bench
