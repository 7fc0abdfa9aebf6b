// The store: records survive reopening; a torn last write (never
// acknowledged) is cut; an acknowledged version that is damaged stops the
// store (tests/regress/store_corruption_test.cc has the rest); compaction
// keeps the state.
#include "wsync/control/store.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

namespace wsync::control {
namespace {

std::string FreshDir(const std::string& name) {
  std::string dir = ::testing::TempDir() + "/wsync_store_" + name + "_" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  return dir;
}

wsync::store::v1::Record Published(uint64_t v) {
  wsync::store::v1::Record r;
  r.mutable_version_published()->set_version(v);
  return r;
}

TEST(LogStore, RecordsSurviveReopen) {
  const std::string dir = FreshDir("reopen");
  {
    Recovered rec;
    auto s = OpenLogStore(dir, &rec);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    for (uint64_t v = 1; v <= 3; ++v) ASSERT_TRUE((*s)->Append(Published(v)).ok());
  }
  Recovered rec;
  auto s = OpenLogStore(dir, &rec);
  ASSERT_TRUE(s.ok());
  ASSERT_EQ(rec.records.size(), 3u);
  EXPECT_EQ(rec.records[2].version_published().version(), 3u);
  EXPECT_EQ(rec.torn_bytes, 0u);
  std::filesystem::remove_all(dir);
}

TEST(LogStore, TornTailIsCutAtTheLastCompleteRecord) {
  const std::string dir = FreshDir("torn");
  {
    Recovered rec;
    auto s = OpenLogStore(dir, &rec);
    ASSERT_TRUE(s.ok());
    for (uint64_t v = 1; v <= 4; ++v) ASSERT_TRUE((*s)->Append(Published(v)).ok());
  }
  // A fifth write torn by a crash: its frame header and part of its payload.
  const std::string log = dir + "/wal.log";
  {
    std::ofstream f(log, std::ios::app | std::ios::binary);
    f.write("\x0c\x00\x00\x00\xaa\xbb\xcc\xdd\x1a\x02", 10);
  }
  {
    Recovered rec;
    auto s = OpenLogStore(dir, &rec);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    ASSERT_EQ(rec.records.size(), 4u);
    EXPECT_EQ(rec.torn_bytes, 10u);
    // Appends continue after the cut; the file stays parseable.
    ASSERT_TRUE((*s)->Append(Published(9)).ok());
  }
  Recovered rec;
  ASSERT_TRUE(OpenLogStore(dir, &rec).ok());
  ASSERT_EQ(rec.records.size(), 5u);
  EXPECT_EQ(rec.records[4].version_published().version(), 9u);
  EXPECT_EQ(rec.torn_bytes, 0u);
  std::filesystem::remove_all(dir);
}

TEST(LogStore, DamagedAcknowledgedLastVersionStopsTheStore) {
  const std::string dir = FreshDir("crc");
  {
    Recovered rec;
    auto s = OpenLogStore(dir, &rec);
    ASSERT_TRUE(s.ok());
    for (uint64_t v = 1; v <= 3; ++v) ASSERT_TRUE((*s)->Append(Published(v)).ok());
  }
  const std::string log = dir + "/wal.log";
  std::fstream f(log, std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(-1, std::ios::end);
  f.put('\x7f');
  f.close();
  // It looks like a torn last write, but version 3 was acknowledged.
  Recovered rec;
  auto s = OpenLogStore(dir, &rec);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(s.status().message().find("version 3 was acknowledged"), std::string::npos) << s.status().ToString();
  std::filesystem::remove_all(dir);
}

TEST(LogStore, CompactionReplacesTheLogBySnapshot) {
  const std::string dir = FreshDir("compact");
  {
    Recovered rec;
    auto s = OpenLogStore(dir, &rec);
    ASSERT_TRUE(s.ok());
    ASSERT_TRUE((*s)->Append(Published(1)).ok());
    wsync::store::v1::Snapshot snap;
    snap.add_versions()->set_version(1);
    snap.set_next_lease_id(17);
    ASSERT_TRUE((*s)->Compact(snap).ok());
    EXPECT_EQ((*s)->LogRecords(), 0u);
    ASSERT_TRUE((*s)->Append(Published(2)).ok());
  }
  Recovered rec;
  ASSERT_TRUE(OpenLogStore(dir, &rec).ok());
  EXPECT_EQ(rec.snapshot.versions_size(), 1);
  EXPECT_EQ(rec.snapshot.next_lease_id(), 17u);
  ASSERT_EQ(rec.records.size(), 1u);
  EXPECT_EQ(rec.records[0].version_published().version(), 2u);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace wsync::control
