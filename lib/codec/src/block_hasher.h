// Streaming form of checksum.h's BlockDigest (private): a checksum block fed
// in pieces, so a sweep can digest the bytes it has just read while they are
// still in cache. Digest() equals BlockDigest of the concatenated pieces.
#pragma once

#include <cstddef>
#include <cstdint>

namespace wsync::codec::internal {

class BlockHasher {
 public:
  BlockHasher();
  BlockHasher(const BlockHasher&) = delete;
  BlockHasher& operator=(const BlockHasher&) = delete;

  // Starts a new block.
  void Reset();
  void Update(const void* data, size_t nbytes);
  // The digest of everything fed since Reset (the state is unchanged).
  uint64_t Digest() const;

 private:
  // XXH3_state_t, kept opaque so that xxhash.h stays out of this header
  // (checksum.cc checks the size and alignment).
  alignas(64) unsigned char state_[640];
};

}  // namespace wsync::codec::internal
