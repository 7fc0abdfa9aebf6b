#include "wsync/buffers/safetensors.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "wsync/util/file.h"

namespace wsync::buffers {
namespace {

std::string TempPath(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("wsync_st_" + std::to_string(::getpid()) + "_" + name)).string();
}

TEST(Safetensors, WriteThenReadRoundTrips) {
  std::vector<OwnedTensor> t = {{"a", codec::DType::kBF16, {2, 3}, std::vector<uint8_t>(12, 7)},
                                {"b", codec::DType::kF32, {}, std::vector<uint8_t>(4, 9)},
                                {"empty", codec::DType::kU8, {0}, {}}};
  std::string path = TempPath("rt.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, Views(t), {{"step", "3"}}).ok());
  auto f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  ASSERT_EQ((*f)->tensors().size(), 3u);
  const codec::TensorView* a = (*f)->Find("a");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->shape, (std::vector<uint64_t>{2, 3}));
  EXPECT_EQ(std::vector<uint8_t>(a->data, a->data + 12), t[0].bytes);
  EXPECT_EQ((*f)->metadata().at("step"), "3");
  std::remove(path.c_str());
}

void ExpectRejected(const std::string& header, const std::string& data, const std::string& needle) {
  std::string bytes(8, '\0');
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>(n >> (8 * i));
  bytes += header + data;
  std::string path = TempPath("bad.safetensors");
  ASSERT_TRUE(WriteFileAtomic(path, bytes).ok());
  auto f = SafetensorsFile::Open(path);
  ASSERT_FALSE(f.ok()) << header;
  EXPECT_NE(f.status().message().find(needle), std::string::npos) << f.status().message();
  std::remove(path.c_str());
}

TEST(Safetensors, HostileHeadersAreRejectedWithReasons) {
  ExpectRejected("not json", "", "JSON");
  ExpectRejected(R"({"a":{"dtype":"BF16","shape":[2],"data_offsets":[0,8]}})", "1234", "outside");
  ExpectRejected(R"({"a":{"dtype":"BF16","shape":[3],"data_offsets":[0,4]}})", "1234", "need 6 bytes");
  ExpectRejected(R"({"a":{"dtype":"Q4","shape":[2],"data_offsets":[0,4]}})", "1234", "unknown dtype");
  ExpectRejected(R"({"a":{"dtype":"U8","shape":[-1],"data_offsets":[0,4]}})", "1234", "non-natural");
  ExpectRejected(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}})",
                 "1234", "overlap");
  ExpectRejected(R"({"a":{"dtype":"U8","shape":[4]}})", "1234", "data_offsets");
}

TEST(Safetensors, HeaderLengthBeyondFileIsRejected) {
  std::string bytes = "\xff\xff\xff\xff\x00\x00\x00\x00{}";
  std::string path = TempPath("len.safetensors");
  ASSERT_TRUE(WriteFileAtomic(path, bytes).ok());
  auto f = SafetensorsFile::Open(path);
  EXPECT_FALSE(f.ok());
  std::remove(path.c_str());
  EXPECT_EQ(SafetensorsFile::Open("/nonexistent/x").status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace wsync::buffers

#include "wsync/buffers/region.h"

namespace wsync::buffers {
namespace {

std::string ShmName(const std::string& tag) { return "/wsync-test-" + tag + "-" + std::to_string(::getpid()); }

TEST(Shm, CreatorAndDaemonShareTheBytes) {
  const std::string name = ShmName("share");
  auto owner = CreateShm(name, 4096, /*unlink_on_close=*/true);
  ASSERT_TRUE(owner.ok()) << owner.status().ToString();
  auto daemon = OpenShm(name);
  ASSERT_TRUE(daemon.ok()) << daemon.status().ToString();
  EXPECT_EQ((*daemon)->size(), 4096u);
  (*owner)->data()[100] = 42;
  EXPECT_EQ((*daemon)->data()[100], 42);
  (*daemon)->data()[7] = 9;  // the daemon writes (a sink applying a patch)
  EXPECT_EQ((*owner)->data()[7], 9);
  EXPECT_EQ(CreateShm(name, 10, false).status().code(), StatusCode::kAlreadyExists);
  owner->reset();
  daemon->reset();
  EXPECT_EQ(OpenShm(name).status().code(), StatusCode::kNotFound);  // unlinked
  EXPECT_EQ(OpenShm("no-slash").status().code(), StatusCode::kInvalidArgument);
}

TEST(TensorTable, ValidationNamesTheTensor) {
  std::vector<TensorEntry> ok = {{"a", codec::DType::kBF16, {4, 4}, 0}, {"b", codec::DType::kF32, {8}, 32}};
  EXPECT_TRUE(ValidateTable(ok, 64).ok());
  EXPECT_NE(ValidateTable(ok, 63).message().find("'b'"), std::string::npos);
  std::vector<TensorEntry> overlap = {{"a", codec::DType::kBF16, {4, 4}, 0}, {"b", codec::DType::kF32, {8}, 28}};
  EXPECT_NE(ValidateTable(overlap, 64).message().find("overlap"), std::string::npos);
  std::vector<TensorEntry> misaligned = {{"a", codec::DType::kF32, {2}, 2}};
  EXPECT_NE(ValidateTable(misaligned, 64).message().find("aligned"), std::string::npos);
  std::vector<TensorEntry> twice = {{"a", codec::DType::kU8, {1}, 0}, {"a", codec::DType::kU8, {1}, 1}};
  EXPECT_NE(ValidateTable(twice, 64).message().find("twice"), std::string::npos);
  std::vector<TensorEntry> huge = {{"h", codec::DType::kF64, {1ull << 62}, 0}};
  EXPECT_FALSE(ValidateTable(huge, 64).ok());
}

}  // namespace
}  // namespace wsync::buffers
