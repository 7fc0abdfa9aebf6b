// The project's one integer codec: little-endian fixed-width integers and
// LEB128 varints, written to a string and read back with every read checked
// against the remaining length. Used by the patch format, the pull protocol,
// the transport's frame and the coordinator's store.
//
// Reads never throw or read out of bounds; the first failure sticks and the
// status names what was being read (`what`) and the field.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "wsync/util/status.h"

namespace wsync {

// The fixed-width little-endian value at p. REQUIRES: sizeof(T) bytes there.
template <typename T>
T LoadLE(const char* p) {
  uint64_t r = 0;
  for (size_t i = 0; i < sizeof(T); ++i) r |= static_cast<uint64_t>(static_cast<uint8_t>(p[i])) << (8 * i);
  return static_cast<T>(r);
}

// Writes v at p, little-endian. REQUIRES: sizeof(T) writable bytes there.
template <typename T>
void StoreLE(char* p, T v) {
  for (size_t i = 0; i < sizeof(T); ++i) p[i] = static_cast<char>(static_cast<uint64_t>(v) >> (8 * i));
}

class ByteWriter {
 public:
  explicit ByteWriter(std::string* out) : out_(out) {}
  void U8(uint8_t v) { out_->push_back(static_cast<char>(v)); }
  void U16(uint16_t v) { Fixed(v, 2); }
  void U32(uint32_t v) { Fixed(v, 4); }
  void U64(uint64_t v) { Fixed(v, 8); }
  // LEB128: 7 bits a byte, high bit set on all but the last byte.
  void Varint(uint64_t v) {
    while (v >= 0x80) {
      U8(static_cast<uint8_t>(v) | 0x80);
      v >>= 7;
    }
    U8(static_cast<uint8_t>(v));
  }
  void Bytes(std::string_view s) { out_->append(s); }
  std::string* out() { return out_; }
  size_t size() const { return out_->size(); }

 private:
  void Fixed(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) U8(static_cast<uint8_t>(v >> (8 * i)));
  }
  std::string* out_;
};

// Every read checks the remaining length; the first failure sticks and names
// the field being read.
class ByteReader {
 public:
  ByteReader(std::string_view data, std::string what) : data_(data), what_(std::move(what)) {}

  bool U8(uint8_t* v, const char* field) { return Fixed(v, 1, field); }
  bool U16(uint16_t* v, const char* field) { return Fixed(v, 2, field); }
  bool U32(uint32_t* v, const char* field) { return Fixed(v, 4, field); }
  bool U64(uint64_t* v, const char* field) { return Fixed(v, 8, field); }
  bool Varint(uint64_t* v, const char* field) {
    uint64_t result = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (pos_ >= data_.size()) return Fail(field, "truncated varint");
      uint8_t b = static_cast<uint8_t>(data_[pos_++]);
      if (shift == 63 && b > 1) return Fail(field, "varint overflows 64 bits");
      result |= static_cast<uint64_t>(b & 0x7F) << shift;
      if ((b & 0x80) == 0) {
        *v = result;
        return true;
      }
    }
    return Fail(field, "varint longer than 10 bytes");
  }
  // A varint that must be <= max.
  bool VarintAtMost(uint64_t* v, uint64_t max, const char* field) {
    if (!Varint(v, field)) return false;
    if (*v > max) {
      return Fail(field, "value " + std::to_string(*v) + " exceeds limit " + std::to_string(max));
    }
    return true;
  }
  bool Bytes(size_t n, std::string_view* out, const char* field) {
    if (n > data_.size() - pos_) {
      return Fail(field, "needs " + std::to_string(n) + " bytes, " +
                             std::to_string(data_.size() - pos_) + " left");
    }
    *out = data_.substr(pos_, n);
    pos_ += n;
    return true;
  }

  size_t remaining() const { return data_.size() - pos_; }
  size_t position() const { return pos_; }
  bool ok() const { return status_.ok(); }
  const Status& status() const { return status_; }
  bool Fail(std::string_view field, std::string_view why) {
    if (status_.ok()) {
      status_ = DataLossError(what_ + ": " + std::string(field) + ": " + std::string(why));
    }
    return false;
  }

 private:
  template <typename T>
  bool Fixed(T* v, size_t n, const char* field) {
    if (n > data_.size() - pos_) return Fail(field, "truncated");
    *v = LoadLE<T>(data_.data() + pos_);
    pos_ += n;
    return true;
  }

  std::string_view data_;
  std::string what_;
  size_t pos_ = 0;
  Status status_;
};

}  // namespace wsync
