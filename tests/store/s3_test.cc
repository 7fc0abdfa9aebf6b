// The S3 client against a real S3-compatible server (SeaweedFS on
// loopback): objects, ranges, multipart, listing, conditions, read-only
// credentials, and a store that stops answering.
#include <gtest/gtest.h>

#include <chrono>
#include <random>

#include "seaweedfs.h"
#include "wsync/store/object_store.h"

namespace wsync::store {
namespace {

using testing::SeaweedServer;

class S3Test : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(server_.Ready("wsync-test"));
    auto s3 = OpenS3(server_.Options("wsync-test"));
    ASSERT_TRUE(s3.ok()) << s3.status().ToString();
    s3_ = std::move(*s3);
  }

  static std::string Bytes(size_t n, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::string s(n, '\0');
    for (char& c : s) c = static_cast<char>(rng());
    return s;
  }

  SeaweedServer server_;
  std::unique_ptr<ObjectStore> s3_;
};

TEST_F(S3Test, ObjectsRangesListingAndDeletion) {
  const std::string a = Bytes(100'000, 1);
  ASSERT_TRUE(s3_->Put("runs/a/v1", a).ok());
  ASSERT_TRUE(s3_->Put("runs/a/v2 with space+plus", "two").ok());
  ASSERT_TRUE(s3_->Put("runs/b/v1", "other run").ok());
  auto got = s3_->Get("runs/a/v1");
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, a);
  auto range = s3_->GetRange("runs/a/v1", 4096, 1000);
  ASSERT_TRUE(range.ok()) << range.status().ToString();
  EXPECT_EQ(*range, a.substr(4096, 1000));
  EXPECT_EQ(s3_->GetRange("runs/a/v1", 99'990, 20).status().code(), StatusCode::kOutOfRange);
  auto size = s3_->Size("runs/a/v1");
  ASSERT_TRUE(size.ok());
  EXPECT_EQ(*size, a.size());
  auto keys = s3_->List("runs/a/");
  ASSERT_TRUE(keys.ok()) << keys.status().ToString();
  EXPECT_EQ(*keys, (std::vector<std::string>{"runs/a/v1", "runs/a/v2 with space+plus"}));
  EXPECT_EQ(*s3_->Get("runs/a/v2 with space+plus"), "two");
  ASSERT_TRUE(s3_->Delete("runs/a/v1").ok());
  EXPECT_TRUE(s3_->Delete("runs/a/v1").ok()) << "deleting what is gone is no error";
  EXPECT_EQ(s3_->Get("runs/a/v1").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(s3_->Size("runs/a/v1").status().code(), StatusCode::kNotFound);
  EXPECT_GT(s3_->requests(), 10u);
  EXPECT_GE(s3_->bytes_read(), a.size() + 1000);
}

TEST_F(S3Test, LargeObjectsGoInPartsAndComeBackWhole) {
  S3Options o = server_.Options("wsync-test");
  o.part_bytes = 5u << 20;
  auto s3 = OpenS3(o);
  ASSERT_TRUE(s3.ok());
  const std::string big = Bytes((12u << 20) + 17, 2);
  const Status put = (*s3)->Put("big", big);
  ASSERT_TRUE(put.ok()) << put.ToString();
  auto got = (*s3)->Get("big");
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_TRUE(*got == big);
  auto tail = (*s3)->GetRange("big", big.size() - 100, 100);
  ASSERT_TRUE(tail.ok());
  EXPECT_EQ(*tail, big.substr(big.size() - 100));
}

TEST_F(S3Test, AnObjectWrittenOnlyWhenAbsent) {
  ASSERT_TRUE(s3_->Put("manifest", "first", /*if_absent=*/true).ok());
  const Status again = s3_->Put("manifest", "second", /*if_absent=*/true);
  EXPECT_EQ(again.code(), StatusCode::kFailedPrecondition) << again.ToString();
  EXPECT_EQ(*s3_->Get("manifest"), "first");
}

TEST_F(S3Test, ReadOnlyCredentialsReadAndCannotWrite) {
  ASSERT_TRUE(s3_->Put("published", "bytes").ok());
  auto reader = OpenS3(server_.Options("wsync-test", /*writer=*/false));
  ASSERT_TRUE(reader.ok());
  auto got = (*reader)->Get("published");
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, "bytes");
  EXPECT_TRUE((*reader)->List("").ok());
  const Status put = (*reader)->Put("forged", "bytes");
  EXPECT_EQ(put.code(), StatusCode::kPermissionDenied) << put.ToString();
  S3Options wrong = server_.Options("wsync-test");
  wrong.secret_key = "not-the-secret";
  auto forged = OpenS3(wrong);
  ASSERT_TRUE(forged.ok());
  const Status s = (*forged)->Get("published").status();
  EXPECT_EQ(s.code(), StatusCode::kPermissionDenied) << s.ToString();
  EXPECT_NE(s.message().find("published"), std::string::npos) << "the error names the key: " << s.ToString();
}

TEST_F(S3Test, AStoreThatStopsAnsweringFailsWithinTheRetryBound) {
  ASSERT_TRUE(s3_->Put("k", "v").ok());
  S3Options o = server_.Options("wsync-test");
  o.attempts = 3;
  o.timeout = std::chrono::milliseconds(500);
  o.backoff = std::chrono::milliseconds(50);
  auto s3 = OpenS3(o);
  ASSERT_TRUE(s3.ok());
  server_.Signal(SIGSTOP);
  const auto t0 = std::chrono::steady_clock::now();
  const Status s = (*s3)->Get("k").status();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  server_.Signal(SIGCONT);
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
  EXPECT_NE(s.message().find("3 attempts"), std::string::npos) << s.ToString();
  // 3 x 0.5 s timeouts and two backoffs of at most 100 ms, with room for a loaded machine.
  EXPECT_LT(seconds, 10.0);
  EXPECT_EQ((*s3)->requests(), 3u);
  auto back = s3_->Get("k");
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, "v");
}

TEST(S3Url, OptionsAndErrors) {
  ::unsetenv("AWS_ACCESS_KEY_ID");
  ::unsetenv("AWS_SECRET_ACCESS_KEY");
  auto o = S3OptionsFromUrl("s3://weights?endpoint=http://127.0.0.1:8333&region=eu-west-1");
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->bucket, "weights");
  EXPECT_EQ(o->endpoint, "http://127.0.0.1:8333");
  EXPECT_EQ(o->region, "eu-west-1");
  EXPECT_TRUE(o->access_key.empty());
  auto tuned = S3OptionsFromUrl("s3://w?endpoint=http://x&attempts=2&timeout_ms=1500");
  ASSERT_TRUE(tuned.ok()) << tuned.status().ToString();
  EXPECT_EQ(tuned->attempts, 2);
  EXPECT_EQ(tuned->timeout, std::chrono::milliseconds(1500));
  EXPECT_EQ(S3OptionsFromUrl("s3://w?endpoint=http://x&attempts=0").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(S3OptionsFromUrl("weights").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(S3OptionsFromUrl("s3://weights").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(S3OptionsFromUrl("s3://w?endpoint=ftp://x").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(S3OptionsFromUrl("s3://w?endpoint=http://x&colour=red").status().code(), StatusCode::kInvalidArgument);
  ::setenv("AWS_ACCESS_KEY_ID", "k", 1);
  EXPECT_EQ(S3OptionsFromUrl("s3://w?endpoint=http://x").status().code(), StatusCode::kInvalidArgument);
  ::unsetenv("AWS_ACCESS_KEY_ID");
}

}  // namespace
}  // namespace wsync::store
