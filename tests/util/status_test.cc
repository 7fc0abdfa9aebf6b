#include "wsync/util/status.h"

#include <gtest/gtest.h>

#include <atomic>

#include "wsync/util/thread_pool.h"

namespace wsync {
namespace {

StatusOr<int> Half(int x) {
  if (x % 2) return InvalidArgumentError("odd: " + std::to_string(x));
  return x / 2;
}

Status Quarter(int x, int* out) {
  WSYNC_ASSIGN_OR_RETURN(int h, Half(x));
  WSYNC_ASSIGN_OR_RETURN(*out, Half(h));
  return Status::Ok();
}

TEST(Status, CodesMessagesAndMacros) {
  int out = 0;
  EXPECT_TRUE(Quarter(8, &out).ok());
  EXPECT_EQ(out, 2);
  Status s = Quarter(6, &out);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.ToString(), "InvalidArgument: odd: 3");
  EXPECT_EQ(s.WithContext("q").message(), "q: odd: 3");
  EXPECT_EQ(ErrnoToStatus(ENOENT, "open x").code(), StatusCode::kNotFound);
  EXPECT_EQ(static_cast<int>(StatusCode::kDataLoss), 15);  // gRPC's value
}

TEST(ThreadPool, RunsEveryIndexOnce) {
  for (size_t threads : {1, 2, 5}) {
    ThreadPool pool(threads);
    EXPECT_EQ(pool.size(), threads);
    for (size_t n : {0, 1, 7, 1000}) {
      std::vector<std::atomic<int>> hits(n);
      pool.ParallelFor(n, [&](size_t i) { hits[i]++; });
      for (auto& h : hits) EXPECT_EQ(h.load(), 1);
    }
  }
}

}  // namespace
}  // namespace wsync

#include "wsync/util/crc32c.h"

namespace wsync {
namespace {

TEST(Crc32c, KnownAnswers) {
  // RFC 3720 B.4 test vectors.
  std::string zeros(32, '\0'), ones(32, '\xff');
  EXPECT_EQ(Crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);
  EXPECT_EQ(Crc32c(ones.data(), ones.size()), 0x62A8AB43u);
  EXPECT_EQ(Crc32c("123456789", 9), 0xE3069283u);
  // Incremental equals one-shot.
  EXPECT_EQ(Crc32c("6789", 4, Crc32c("12345", 5)), 0xE3069283u);
}

}  // namespace
}  // namespace wsync

#include "wsync/util/text.h"

namespace wsync {
namespace {

TEST(Hex, RoundTripsEveryByteAndRefusesWhatIsNotLowercaseHex) {
  std::string all;
  for (int c = 0; c < 256; ++c) all.push_back(static_cast<char>(c));
  const std::string hex = Hex(all);
  EXPECT_EQ(hex.substr(0, 8), "00010203");
  EXPECT_EQ(hex.substr(hex.size() - 4), "feff");
  EXPECT_EQ(FromHex(hex), all);
  EXPECT_EQ(FromHex(""), std::string());
  EXPECT_EQ(FromHex("abc"), std::nullopt);  // odd length
  EXPECT_EQ(FromHex("AB"), std::nullopt);   // upper case
  EXPECT_EQ(FromHex("0g"), std::nullopt);
}

}  // namespace
}  // namespace wsync
