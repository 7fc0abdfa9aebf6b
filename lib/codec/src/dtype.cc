#include "wsync/codec/dtype.h"

#include <array>
#include <string>

namespace wsync::codec {
namespace {

struct DTypeInfo {
  DType dtype;
  std::string_view name;
  size_t width;
  ExponentField exponent;
};

constexpr std::array<DTypeInfo, 15> kInfos = {{
    {DType::kBool, "BOOL", 1, {0, 0}},
    {DType::kU8, "U8", 1, {0, 0}},
    {DType::kI8, "I8", 1, {0, 0}},
    {DType::kF8E4M3, "F8_E4M3", 1, {3, 0xF}},
    {DType::kF8E5M2, "F8_E5M2", 1, {2, 0x1F}},
    {DType::kI16, "I16", 2, {0, 0}},
    {DType::kU16, "U16", 2, {0, 0}},
    {DType::kF16, "F16", 2, {10, 0x1F}},
    {DType::kBF16, "BF16", 2, {7, 0xFF}},
    {DType::kI32, "I32", 4, {0, 0}},
    {DType::kU32, "U32", 4, {0, 0}},
    {DType::kF32, "F32", 4, {23, 0xFF}},
    {DType::kI64, "I64", 8, {0, 0}},
    {DType::kU64, "U64", 8, {0, 0}},
    {DType::kF64, "F64", 8, {52, 0x7FF}},
}};

const DTypeInfo* Find(DType dtype) {
  for (const auto& info : kInfos) {
    if (info.dtype == dtype) return &info;
  }
  return nullptr;
}

}  // namespace

size_t DTypeWidth(DType dtype) {
  const DTypeInfo* info = Find(dtype);
  return info ? info->width : 0;
}

std::string_view DTypeName(DType dtype) {
  const DTypeInfo* info = Find(dtype);
  return info ? info->name : std::string_view("INVALID");
}

StatusOr<DType> ParseDType(std::string_view name) {
  for (const auto& info : kInfos) {
    if (info.name == name) return info.dtype;
  }
  return InvalidArgumentError("unknown dtype '" + std::string(name) + "'");
}

bool IsValidDType(uint8_t code) { return Find(static_cast<DType>(code)) != nullptr; }

ExponentField ExponentFieldOf(DType dtype) {
  const DTypeInfo* info = Find(dtype);
  return info ? info->exponent : ExponentField{};
}

}  // namespace wsync::codec
