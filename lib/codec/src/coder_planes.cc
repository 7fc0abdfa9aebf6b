// Byte planes (docs/patch-format.md, mode 4 and "Keyframe chunk streams"):
// every element's bytes as planes, zstd.
#include "chunk_coders.h"

#include "zstd_util.h"

namespace wsync::codec::internal {
namespace {

template <typename T>
void ToPlanes(const T* x, size_t n, std::string* planes) {
  planes->resize(n * sizeof(T));
  for (size_t b = 0; b < sizeof(T); ++b) {
    char* dst = planes->data() + b * n;
    for (size_t i = 0; i < n; ++i) dst[i] = static_cast<char>(x[i] >> (8 * b));
  }
}

template <typename T>
void FromPlanes(const std::string& planes, size_t n, T* x) {
  std::fill(x, x + n, T{0});
  for (size_t b = 0; b < sizeof(T); ++b) {
    const auto* src = reinterpret_cast<const uint8_t*>(planes.data() + b * n);
    for (size_t i = 0; i < n; ++i) x[i] |= static_cast<T>(static_cast<T>(src[i]) << (8 * b));
  }
}

}  // namespace

template <typename T>
void EncodeDense(const SparseDelta<T>& d, size_t n, int zstd_level, std::string* out) {
  std::vector<T> dense(n, T{0});
  for (size_t i = 0; i < d.pos.size(); ++i) dense[d.pos[i]] = d.delta[i];
  std::string planes;
  ToPlanes(dense.data(), n, &planes);
  ZstdCompress(planes, zstd_level, out);
}

template <typename T>
Status DecodeDense(std::string_view coded, size_t n, uint64_t changed, SparseDelta<T>* out) {
  WSYNC_RETURN_IF_ERROR(ZstdCheckFrameSize(coded, n * sizeof(T), "dense stream"));
  std::string planes(n * sizeof(T), '\0');
  WSYNC_RETURN_IF_ERROR(ZstdDecompressExact(coded, planes.data(), planes.size(), "dense stream"));
  std::vector<T> dense(n);
  FromPlanes(planes, n, dense.data());
  out->Clear();
  for (size_t i = 0; i < n; ++i) {
    if (dense[i] != 0) {
      out->pos.push_back(static_cast<uint32_t>(i));
      out->delta.push_back(dense[i]);
    }
  }
  if (out->pos.size() != changed) {
    return DataLossError("dense stream: " + std::to_string(out->pos.size()) +
                         " nonzero deltas, directory says " + std::to_string(changed));
  }
  return Status::Ok();
}

template <typename T>
void EncodeKeyframeChunk(const T* values, size_t n, int zstd_level, std::string* out) {
  std::string planes;
  ToPlanes(values, n, &planes);
  ZstdCompress(planes, zstd_level, out);
}

template <typename T>
Status DecodeKeyframeChunk(std::string_view stream, size_t n, T* out) {
  WSYNC_RETURN_IF_ERROR(ZstdCheckFrameSize(stream, n * sizeof(T), "keyframe stream"));
  std::string planes(n * sizeof(T), '\0');
  WSYNC_RETURN_IF_ERROR(ZstdDecompressExact(stream, planes.data(), planes.size(), "keyframe stream"));
  FromPlanes(planes, n, out);
  return Status::Ok();
}

#define WSYNC_INSTANTIATE(T) \
  template void EncodeDense<T>(const SparseDelta<T>&, size_t, int, std::string*); \
  template Status DecodeDense<T>(std::string_view, size_t, uint64_t, SparseDelta<T>*); \
  template void EncodeKeyframeChunk<T>(const T*, size_t, int, std::string*); \
  template Status DecodeKeyframeChunk<T>(std::string_view, size_t, T*);

WSYNC_FOR_EACH_WIDTH(WSYNC_INSTANTIATE)
#undef WSYNC_INSTANTIATE

}  // namespace wsync::codec::internal
