// Bitmap positions (docs/patch-format.md, mode 2): a change bitmap, zstd.
#include "chunk_coders.h"

#include "zstd_util.h"

namespace wsync::codec::internal {
void EncodeBitmapPositions(const std::vector<uint32_t>& pos, size_t n, const ClassSpec& spec,
                           int zstd_level, std::string* out) {
  WriteClassHeader(spec, out);
  std::string bits((n + 7) / 8, '\0');
  for (uint32_t p : pos) bits[p >> 3] = static_cast<char>(bits[p >> 3] | (1 << (p & 7)));
  ZstdCompress(bits, zstd_level, out);
}

Status DecodeBitmapPositions(std::string_view coded, size_t n, uint64_t changed, std::vector<uint32_t>* pos) {
  WSYNC_RETURN_IF_ERROR(ZstdCheckFrameSize(coded, (n + 7) / 8, "bitmap stream"));
  std::string bits((n + 7) / 8, '\0');
  WSYNC_RETURN_IF_ERROR(ZstdDecompressExact(coded, bits.data(), bits.size(), "bitmap stream"));
  if (n % 8 != 0 && (static_cast<uint8_t>(bits.back()) >> (n % 8)) != 0) {
    return DataLossError("bitmap stream: bits set past the chunk's end");
  }
  pos->clear();
  for (size_t i = 0; i < bits.size(); ++i) {
    uint32_t byte = static_cast<uint8_t>(bits[i]);
    while (byte != 0) {
      if (pos->size() == changed) {
        return DataLossError("bitmap stream: more than the " + std::to_string(changed) + " changed elements");
      }
      pos->push_back(static_cast<uint32_t>(i * 8 + std::countr_zero(byte)));
      byte &= byte - 1;
    }
  }
  if (pos->size() != changed) {
    return DataLossError("bitmap stream: " + std::to_string(pos->size()) + " bits set, directory says " +
                         std::to_string(changed));
  }
  return Status::Ok();
}

}  // namespace wsync::codec::internal
