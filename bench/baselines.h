// Baseline patch encodings measured beside wsync's codec in the same run.
#pragma once

#include <memory>
#include <span>
#include <string>

#include "wsync/codec/codec.h"

namespace wsync::bench {

// A lossless patch encoding with encode and apply, measured side by side
// (wsync's codec is one too); apply writes into dst (which holds the base).
class Baseline {
 public:
  virtual ~Baseline() = default;
  virtual std::string name() const = 0;
  virtual StatusOr<std::string> Encode(std::span<const codec::TensorView> base,
                                       std::span<const codec::TensorView> target) = 0;
  virtual Status Apply(const std::string& patch, std::span<const codec::MutableTensorView> dst) = 0;
};

// Per tensor: u32 count, then int32 flat index + raw value per change.
std::unique_ptr<Baseline> MakeNaiveBaseline();

// PULSE-style (Miahi & Belilovsky 2026): per tensor, sorted flat indices
// delta-encoded and narrowed to the smallest unsigned type that holds every
// gap, the raw new values, the whole payload zstd level 1.
std::unique_ptr<Baseline> MakePulseBaseline();

// zstd -3 of the full target (a dense copy).
std::unique_ptr<Baseline> MakeDenseZstdBaseline();

}  // namespace wsync::bench
