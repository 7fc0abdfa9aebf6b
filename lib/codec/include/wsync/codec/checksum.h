// The tensor checksum of the patch format: a two-level xxh3-64.
//
//   block digest  = XXH3_64bits(block bytes)            (blocks of 1 MiB; the
//                                                       last one may be short)
//   tensor digest = XXH3_64bits(block digests as little-endian u64[])
//
// Blocks are independent, so a GPU or many threads compute the digests in
// parallel and combine them once. An empty tensor has no blocks: its digest
// is XXH3_64bits of zero bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace wsync {
class ThreadPool;
}

namespace wsync::codec {

inline constexpr size_t kChecksumBlockBytes = size_t{1} << 20;

// Number of checksum blocks of a tensor of `nbytes` bytes.
inline size_t ChecksumBlockCount(size_t nbytes) {
  return (nbytes + kChecksumBlockBytes - 1) / kChecksumBlockBytes;
}

// XXH3-64 of one block (any length).
uint64_t BlockDigest(const void* data, size_t nbytes);

// Combines block digests into the tensor digest.
uint64_t CombineBlockDigests(std::span<const uint64_t> digests);

// The tensor digest of `nbytes` bytes at `data`; parallel over blocks when a
// pool is given.
uint64_t TensorChecksum(const void* data, size_t nbytes, ThreadPool* pool = nullptr);

// XXH3-64 of a byte string: the format's checksum for everything that is not
// tensor data (patch headers, set digests).
uint64_t Hash64(const void* data, size_t nbytes);

}  // namespace wsync::codec
