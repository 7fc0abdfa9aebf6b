// The store: records survive reopening; a torn or corrupt tail is cut at the
// last complete record; compaction keeps the state.
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
  const std::string log = dir + "/wal.log";
  const auto size = std::filesystem::file_size(log);
  // Cut the last record in the middle (each record here is 8 + 2 or 3 bytes).
  std::filesystem::resize_file(log, size - 3);
  {
    Recovered rec;
    auto s = OpenLogStore(dir, &rec);
    ASSERT_TRUE(s.ok());
    ASSERT_EQ(rec.records.size(), 3u);
    EXPECT_GT(rec.torn_bytes, 0u);
    // Appends continue after the cut; the file stays parseable.
    ASSERT_TRUE((*s)->Append(Published(9)).ok());
  }
  Recovered rec;
  ASSERT_TRUE(OpenLogStore(dir, &rec).ok());
  ASSERT_EQ(rec.records.size(), 4u);
  EXPECT_EQ(rec.records[3].version_published().version(), 9u);
  EXPECT_EQ(rec.torn_bytes, 0u);
  std::filesystem::remove_all(dir);
}

TEST(LogStore, CorruptRecordEndsTheLog) {
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
  Recovered rec;
  ASSERT_TRUE(OpenLogStore(dir, &rec).ok());
  EXPECT_EQ(rec.records.size(), 2u);
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
