#include "zstd_util.h"

#include <zstd.h>

namespace wsync::codec::internal {

void ZstdCompress(std::string_view data, int level, std::string* out) {
  size_t bound = ZSTD_compressBound(data.size());
  size_t old = out->size();
  out->resize(old + bound);
  size_t n = ZSTD_compress(out->data() + old, bound, data.data(), data.size(), level);
  // Compression into a buffer of ZSTD_compressBound bytes cannot fail.
  out->resize(old + (ZSTD_isError(n) ? 0 : n));
}

Status ZstdCheckFrameSize(std::string_view frame, size_t expected, std::string_view what) {
  unsigned long long size = ZSTD_getFrameContentSize(frame.data(), frame.size());
  if (size == ZSTD_CONTENTSIZE_ERROR || size == ZSTD_CONTENTSIZE_UNKNOWN) {
    return DataLossError(std::string(what) + ": not a zstd frame with a declared size");
  }
  if (size != expected) {
    return DataLossError(std::string(what) + ": zstd frame holds " + std::to_string(size) + " bytes, expected " +
                         std::to_string(expected));
  }
  return Status::Ok();
}

Status ZstdDecompressExact(std::string_view frame, void* dst, size_t expected, std::string_view what) {
  unsigned long long size = ZSTD_getFrameContentSize(frame.data(), frame.size());
  if (size == ZSTD_CONTENTSIZE_ERROR) {
    return DataLossError(std::string(what) + ": not a zstd frame");
  }
  if (size != ZSTD_CONTENTSIZE_UNKNOWN && size != expected) {
    return DataLossError(std::string(what) + ": zstd frame holds " + std::to_string(size) +
                         " bytes, expected " + std::to_string(expected));
  }
  size_t n = ZSTD_decompress(dst, expected, frame.data(), frame.size());
  if (ZSTD_isError(n)) {
    return DataLossError(std::string(what) + ": zstd: " + ZSTD_getErrorName(n));
  }
  if (n != expected) {
    return DataLossError(std::string(what) + ": zstd frame holds " + std::to_string(n) +
                         " bytes, expected " + std::to_string(expected));
  }
  return Status::Ok();
}

}  // namespace wsync::codec::internal
