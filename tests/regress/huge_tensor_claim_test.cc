// Regression (found by the fuzzer): a tiny directory claiming a tensor of
// 2^40 elements made the reader size 2^20 chunk entries before reading any,
// exhausting memory. It must be rejected up front, naming the tensor.
#include <gtest/gtest.h>

#include "format.h"

namespace wsync::codec::internal {
namespace {

TEST(Regress, DirectoryClaimingHugeTensorIsRejectedBeforeAllocating) {
  Container c;
  c.kind = PatchKind::kPatch;
  c.chunk_bytes = 1u << 20;
  TensorEntry t;
  t.name = "huge";
  t.dtype = DType::kU8;
  t.shape = {uint64_t{1} << 40};
  c.tensors.push_back(t);  // no chunk entries written
  std::string bytes = WriteContainer(c, "");
  auto parsed = ReadContainer(bytes, true);
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(parsed.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(parsed.status().message().find("'huge'"), std::string::npos) << parsed.status().message();
  EXPECT_NE(parsed.status().message().find("chunks but only"), std::string::npos) << parsed.status().message();
}

}  // namespace
}  // namespace wsync::codec::internal
