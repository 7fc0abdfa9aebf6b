// Carving one block of scratch memory (device or host) into aligned pieces
// by offset; host code only, the block itself is never touched.
#pragma once

#include <cstddef>
#include <cstdint>

namespace wsync::cuda {

// Offsets of aligned pieces (256 bytes, the device's allocation alignment)
// within one block of bytes() bytes.
class Carver {
 public:
  template <typename T>
  size_t Add(size_t count) {
    offset_ = (offset_ + 255) / 256 * 256;
    const size_t at = offset_;
    offset_ += count * sizeof(T) + 8;
    return at;
  }
  size_t bytes() const { return offset_ + 256; }

 private:
  size_t offset_ = 0;
};

// The piece at offset of the block at base.
template <typename T>
T* At(void* base, size_t offset) {
  return reinterpret_cast<T*>(static_cast<uint8_t*>(base) + offset);
}

}  // namespace wsync::cuda
