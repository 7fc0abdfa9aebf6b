// A generator of realistic weight sequences at scale: FP32 master weights of
// a Llama-shaped model take Adam-like steps (normalized momentum of Gaussian
// gradients, decoupled weight decay) at a given learning rate and are cast to
// BF16 (round to nearest even) after every step, as an RL trainer does.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "wsync/buffers/safetensors.h"
#include "wsync/util/thread_pool.h"

namespace wsync::bench {

struct SynthOptions {
  uint64_t params = 64u << 20;
  uint64_t hidden = 0;  // 0: chosen from params
  double lr = 1e-6;
  double weight_decay = 0.01;
  double momentum = 0.9;
  uint64_t seed = 1;
};

class SynthModel {
 public:
  SynthModel(const SynthOptions& options, ThreadPool* pool);

  // Takes one optimizer step on the FP32 masters.
  void Step();
  // Casts the masters to BF16 into `out` (shaped like Tensors(), reused).
  void CastTo(std::vector<buffers::OwnedTensor>* out) const;
  // Empty BF16 tensors of the model's names and shapes.
  std::vector<buffers::OwnedTensor> Tensors() const;
  uint64_t params() const { return total_; }
  int step() const { return step_; }

 private:
  struct Tensor {
    std::string name;
    std::vector<uint64_t> shape;
    uint64_t offset, numel;
    bool norm;
  };
  SynthOptions options_;
  ThreadPool* pool_;
  std::vector<Tensor> tensors_;
  uint64_t total_ = 0;
  std::vector<float> master_, momentum_;
  int step_ = 0;
};

}  // namespace wsync::bench
