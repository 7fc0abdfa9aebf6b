#include "wsync/codec/checksum.h"

#include <bit>
#include <vector>

// The hash is compiled into this file, so it uses the vector extensions the
// codec is built for (AVX2 on x86-64-v3) rather than the shared library's
// baseline; the digests are the same, XXH3 is defined bit for bit.
#define XXH_INLINE_ALL
#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>

#include "block_hasher.h"
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

namespace internal {
namespace {

static_assert(sizeof(XXH3_state_t) <= 640 && alignof(XXH3_state_t) <= 64);

XXH3_state_t* State(unsigned char* storage) { return reinterpret_cast<XXH3_state_t*>(storage); }
const XXH3_state_t* State(const unsigned char* storage) { return reinterpret_cast<const XXH3_state_t*>(storage); }

}  // namespace

BlockHasher::BlockHasher() { Reset(); }

void BlockHasher::Reset() {
  XXH3_INITSTATE(State(state_));
  XXH3_64bits_reset(State(state_));
}

void BlockHasher::Update(const void* data, size_t nbytes) { XXH3_64bits_update(State(state_), data, nbytes); }

uint64_t BlockHasher::Digest() const { return XXH3_64bits_digest(State(state_)); }

}  // namespace internal
}  // namespace wsync::codec
