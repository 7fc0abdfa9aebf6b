// libFuzzer target for the patch decoder: any byte string given to
// InspectPatch / Apply (whole tensors and pieces) / MergePatches / SelectForPieces
// / SplitSegments / ApplyAhead must give an error or a result, ApplyAhead
// fed it in slices exactly Apply's,
// never a crash, a hang or an out-of-bounds access. The whole-patch checksum
// is turned off so the fuzzer reaches the structural checks behind it.
#include <cstdint>
#include <string_view>
#include <vector>

#include "wsync/buffers/safetensors.h"
#include "wsync/codec/codec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace wsync;
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  (void)codec::SplitSegments(in);
  {
    // Heads parsed from any prefix (no tensors: nothing is decoded).
    codec::ApplyAhead ahead(std::span<const codec::MutableTensorView>{}, {});
    for (size_t at = 0; at < size; at += 1 + at / 2) ahead.Advance(in.substr(0, at));
  }
  auto info = codec::InspectPatch(in, /*verify_patch_checksum=*/false);
  if (!info.ok()) return 0;
  uint64_t total = 0;
  for (const auto& t : info->tensors) {
    const uint64_t b = t.DenseBytes();
    if (b > (4u << 20) || total + b > (4u << 20)) return 0;  // keep runs fast
    total += b;
  }
  std::vector<buffers::OwnedTensor> dst;
  for (const auto& t : info->tensors) {
    buffers::OwnedTensor o{t.name, t.dtype, t.shape, std::vector<uint8_t>(t.DenseBytes())};
    for (size_t i = 0; i < o.bytes.size(); ++i) o.bytes[i] = static_cast<uint8_t>(i * 37 + 11);
    dst.push_back(std::move(o));
  }
  const auto before = dst;
  auto views = buffers::MutableViews(dst);
  codec::ApplyOptions options;
  options.verify_patch_checksum = false;
  Status s = codec::Apply(in, views, options);
  if (!s.ok()) {
    // All-or-nothing: a rejected patch leaves the destination as it was.
    for (size_t i = 0; i < dst.size(); ++i) {
      if (dst[i].bytes != before[i].bytes) __builtin_trap();
    }
  }
  {
    // Decoding ahead, fed in slices, gives what applying at once gave.
    auto ahead_dst = before;
    codec::ApplyAhead ahead(buffers::MutableViews(ahead_dst), options);
    for (size_t at = 0; at < size; at += 1 + at / 3) ahead.Advance(in.substr(0, at));
    ahead.Advance(in);
    Status a = ahead.Apply(in);
    if (a.ok() != s.ok()) __builtin_trap();
    for (size_t i = 0; i < dst.size(); ++i) {
      if (ahead_dst[i].bytes != (a.ok() ? dst[i].bytes : before[i].bytes)) __builtin_trap();
    }
  }
  auto base = buffers::Views(before);
  (void)codec::MergePatches(in, in, base, {});

  // A sink holding pieces: each tensor whole, or its first row band when it
  // is gridded by rows, in runtime tensors of the piece's shape.
  std::vector<buffers::OwnedTensor> held;
  std::vector<codec::RuntimeTensor> layout;
  for (const auto& t : info->tensors) {
    if (t.shape.empty() || t.shape[0] == 0) continue;
    std::vector<uint64_t> shape = t.shape;
    if (!t.row_cuts.empty()) shape[0] = t.row_cuts[0];
    uint64_t bytes = codec::DTypeWidth(t.dtype);
    for (uint64_t d : shape) bytes *= d;
    held.push_back({t.name + "/held", t.dtype, shape, std::vector<uint8_t>(bytes, 0x5A)});
    codec::Piece p{t.name, std::vector<uint64_t>(shape.size(), 0), shape, std::vector<uint64_t>(shape.size(), 0)};
    layout.push_back({{}, {p}});
  }
  for (size_t i = 0; i < held.size(); ++i) {
    layout[i].view = {held[i].name, held[i].dtype, held[i].shape, held[i].bytes.data()};
  }
  const auto held_before = held;
  if (!codec::Apply(in, layout, options).ok()) {
    for (size_t i = 0; i < held.size(); ++i) {
      if (held[i].bytes != held_before[i].bytes) __builtin_trap();
    }
  }
  (void)codec::SelectForPieces(in, layout);
  return 0;
}
