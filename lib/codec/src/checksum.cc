#include "wsync/codec/checksum.h"

#include <bit>
#include <vector>

#include <xxhash.h>

#include "wsync/util/thread_pool.h"

namespace wsync::codec {

uint64_t BlockDigest(const void* data, size_t nbytes) { return XXH3_64bits(data, nbytes); }

uint64_t CombineBlockDigests(std::span<const uint64_t> digests) {
  // Digests are hashed as little-endian u64; every supported host is
  // little-endian (static_assert below), so the array is hashed as it is.
  static_assert(std::endian::native == std::endian::little);
  return XXH3_64bits(digests.data(), digests.size_bytes());
}

uint64_t TensorChecksum(const void* data, size_t nbytes, ThreadPool* pool) {
  const auto* bytes = static_cast<const uint8_t*>(data);
  std::vector<uint64_t> digests(ChecksumBlockCount(nbytes));
  auto one = [&](size_t i) {
    size_t begin = i * kChecksumBlockBytes;
    size_t len = std::min(kChecksumBlockBytes, nbytes - begin);
    digests[i] = BlockDigest(bytes + begin, len);
  };
  ParallelFor(pool, digests.size(), one);
  return CombineBlockDigests(digests);
}

uint64_t Hash64(const void* data, size_t nbytes) { return XXH3_64bits(data, nbytes); }

}  // namespace wsync::codec
