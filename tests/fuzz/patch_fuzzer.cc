// libFuzzer target for the patch decoder: any byte string given to
// InspectPatch / ApplyPatch / MergePatches must give an error or a result,
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
  Status s = codec::ApplyPatch(in, views, options);
  if (!s.ok()) {
    // All-or-nothing: a rejected patch leaves the destination as it was.
    for (size_t i = 0; i < dst.size(); ++i) {
      if (dst[i].bytes != before[i].bytes) __builtin_trap();
    }
  }
  auto base = buffers::Views(before);
  (void)codec::MergePatches(in, in, base, {});
  return 0;
}
