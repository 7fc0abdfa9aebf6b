// IPC handle text form and the mapper's bookkeeping, without a GPU.
#include "wsync/buffers/device_region.h"

#include <gtest/gtest.h>

#include "wsync/cuda/device_codec.h"

namespace wsync {
namespace {

cuda::IpcHandle Handle(uint8_t tag, uint64_t offset) {
  cuda::IpcHandle h;
  h.handle.fill(tag);
  h.handle[63] = 0xA5;
  h.device = 1;
  h.offset = offset;
  h.bytes = 4096;
  return h;
}

TEST(IpcHandle, TextRoundTrip) {
  const cuda::IpcHandle h = Handle(7, 1234);
  auto back = cuda::IpcHandle::Parse(h.ToString());
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_TRUE(back->SameAllocation(h));
  EXPECT_EQ(back->offset, 1234u);
  EXPECT_EQ(back->bytes, 4096u);
}

TEST(IpcHandle, MalformedTextNamesTheField) {
  const std::string good = Handle(7, 0).ToString();
  EXPECT_NE(cuda::IpcHandle::Parse("nope").status().message().find("wsync-ipc-v1"), std::string::npos);
  EXPECT_NE(cuda::IpcHandle::Parse("wsync-ipc-v1:x:0:1:00").status().message().find("device"), std::string::npos);
  EXPECT_NE(cuda::IpcHandle::Parse(good.substr(0, good.size() - 2)).status().message().find("hex digits"),
            std::string::npos);
  std::string upper = good;
  upper.back() = 'G';
  EXPECT_FALSE(cuda::IpcHandle::Parse(upper).ok());
}

TEST(DeviceRegionMapper, OneMappingPerAllocationClosedByTheLastUser) {
  std::vector<uint8_t> fake_allocation(1 << 16);
  int opens = 0, closes = 0;
  buffers::DeviceRegionMapper mapper({[&](const cuda::IpcHandle&) -> StatusOr<void*> {
                                        ++opens;
                                        return static_cast<void*>(fake_allocation.data());
                                      },
                                      [&](void*) {
                                        ++closes;
                                        return Status::Ok();
                                      }});
  auto a = mapper.Map(Handle(1, 0));
  auto b = mapper.Map(Handle(1, 512));
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(*a, fake_allocation.data());
  EXPECT_EQ(*b, fake_allocation.data() + 512);
  EXPECT_EQ(opens, 1);
  EXPECT_EQ(mapper.open_allocations(), 1u);
  ASSERT_TRUE(mapper.Map(Handle(2, 0)).ok());
  EXPECT_EQ(opens, 2);
  EXPECT_TRUE(mapper.Unmap(Handle(1, 0)).ok());
  EXPECT_EQ(closes, 0);
  EXPECT_TRUE(mapper.Unmap(Handle(1, 512)).ok());
  EXPECT_EQ(closes, 1);
  EXPECT_EQ(mapper.Unmap(Handle(1, 0)).code(), StatusCode::kNotFound);
  EXPECT_EQ(mapper.open_allocations(), 1u);
}

TEST(DeviceRegionMapper, WithoutAGpuMappingFailsCleanly) {
  if (cuda::DeviceAvailable().ok()) GTEST_SKIP() << "a GPU is present; ipc_test covers real mappings";
  buffers::DeviceRegionMapper mapper;
  auto p = mapper.Map(Handle(3, 0));
  EXPECT_FALSE(p.ok());
  EXPECT_EQ(mapper.open_allocations(), 0u);
}

}  // namespace
}  // namespace wsync
