// Issue 18, item 1 and item 6: the coordinator's store never silently loses
// or changes an acknowledged record, and it is readable by its owner only.
//
// Before: one flipped byte in the middle of wal.log was cut as a "torn tail"
// (the valid records after it destroyed, the head went back from 294 to 147
// and version 148 was handed out again); a zero-length snapshot.pb started an
// empty coordinator; a flipped bit in snapshot.pb changed a timestamp
// silently; snapshot.pb was 0644 and the directory 0755.
#include <sys/stat.h>

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "wsync/control/coordinator_state.h"
#include "wsync/control/store.h"
#include "wsync/control/testing/fake_clock.h"

namespace wsync::control {
namespace {

std::string FreshDir(const std::string& name) {
  std::string dir = ::testing::TempDir() + "/wsync_regress_store_" + name + "_" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  return dir;
}

wsync::store::v1::Record Published(uint64_t v) {
  wsync::store::v1::Record r;
  r.mutable_version_published()->set_version(v);
  r.mutable_version_published()->set_published_unix_ms(1'700'000'000'000 + static_cast<int64_t>(v));
  return r;
}

void Fill(const std::string& dir, uint64_t versions) {
  Recovered rec;
  auto s = OpenLogStore(dir, &rec);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  for (uint64_t v = 1; v <= versions; ++v) ASSERT_TRUE((*s)->Append(Published(v)).ok());
}

void FlipByte(const std::string& path, std::streamoff at) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(at);
  char c;
  f.get(c);
  f.seekp(at);
  f.put(static_cast<char>(c ^ 0x10));
}

TEST(StoreCorruption, FlipInTheMiddleOfTheLogRefusesToStartAndChangesNothing) {
  const std::string dir = FreshDir("middle");
  Fill(dir, 300);
  const std::string log = dir + "/wal.log";
  const auto size = std::filesystem::file_size(log);
  FlipByte(log, static_cast<std::streamoff>(size / 2));
  Recovered rec;
  auto s = OpenLogStore(dir, &rec);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(s.status().message().find("wal.log"), std::string::npos) << s.status().ToString();
  EXPECT_NE(s.status().message().find("offset"), std::string::npos) << s.status().ToString();
  EXPECT_NE(s.status().message().find("--salvage-store"), std::string::npos) << s.status().ToString();
  EXPECT_EQ(std::filesystem::file_size(log), size) << "the log must not be cut";
  std::filesystem::remove_all(dir);
}

TEST(StoreCorruption, SalvageKeepsWhatVerifiesAndNeverReusesAVersion) {
  const std::string dir = FreshDir("salvage");
  Fill(dir, 300);
  const std::string log = dir + "/wal.log";
  FlipByte(log, static_cast<std::streamoff>(std::filesystem::file_size(log) / 2));
  StoreOptions salvage;
  salvage.salvage = true;
  {
    Recovered rec;
    auto s = OpenLogStore(dir, &rec, salvage);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    ASSERT_FALSE(rec.salvage_report.empty());
    EXPECT_NE(rec.salvage_report[0].find("dropped"), std::string::npos) << rec.salvage_report[0];
    EXPECT_LT(rec.records.size(), 300u);
    EXPECT_EQ(rec.version_floor, 300u);
    FakeClock clock;
    auto state = CoordinatorState::Create(CoordinatorOptions{}, &clock, std::move(*s), rec);
    ASSERT_TRUE(state.ok()) << state.status().ToString();
    wsync::v1::VersionSummary v;
    v.set_version(rec.records.size() + 1);  // the version a truncated log would hand out again
    v.set_keyframe(true);
    EXPECT_EQ((*state)->Publish(v).status().code(), StatusCode::kFailedPrecondition);
    v.set_version(301);
    EXPECT_TRUE((*state)->Publish(v).ok());
  }
  // The original is kept; the salvaged store now opens without the flag.
  bool kept = false;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    kept |= e.path().filename().string().rfind("wal.log.corrupt.", 0) == 0;
  }
  EXPECT_TRUE(kept);
  Recovered rec;
  auto s = OpenLogStore(dir, &rec);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(rec.version_floor, 301u);
  std::filesystem::remove_all(dir);
}

TEST(StoreCorruption, LostRecordsBelowTheHighWaterMarkRefuseToStart) {
  const std::string dir = FreshDir("hwm");
  Fill(dir, 10);
  const std::string log = dir + "/wal.log";
  // Lose the last five records whole (a cut at a record boundary: nothing
  // in the log itself shows it).
  const auto size = std::filesystem::file_size(log);
  const auto per = size / 10;
  ASSERT_EQ(per * 10, size);
  std::filesystem::resize_file(log, per * 5);
  Recovered rec;
  auto s = OpenLogStore(dir, &rec);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(s.status().message().find("version 10 was acknowledged"), std::string::npos) << s.status().ToString();
  std::filesystem::remove_all(dir);
}

TEST(StoreCorruption, EmptyOrFlippedSnapshotRefusesToStart) {
  for (const bool empty : {true, false}) {
    const std::string dir = FreshDir(empty ? "empty_snapshot" : "flipped_snapshot");
    {
      Recovered rec;
      auto s = OpenLogStore(dir, &rec);
      ASSERT_TRUE(s.ok());
      wsync::store::v1::Snapshot snap;
      for (uint64_t v = 1; v <= 59; ++v) *snap.add_versions() = Published(v).version_published();
      ASSERT_TRUE((*s)->Compact(snap).ok());
    }
    const std::string path = dir + "/snapshot.pb";
    if (empty) {
      std::filesystem::resize_file(path, 0);
    } else {
      FlipByte(path, static_cast<std::streamoff>(std::filesystem::file_size(path) - 5));
    }
    Recovered rec;
    auto s = OpenLogStore(dir, &rec);
    ASSERT_FALSE(s.ok()) << (empty ? "empty" : "flipped");
    EXPECT_EQ(s.status().code(), StatusCode::kDataLoss);
    EXPECT_NE(s.status().message().find("snapshot.pb"), std::string::npos) << s.status().ToString();
    std::filesystem::remove_all(dir);
  }
}

TEST(StoreCorruption, TornLastWriteIsStillCutAutomatically) {
  const std::string dir = FreshDir("torn");
  Fill(dir, 5);
  const std::string log = dir + "/wal.log";
  // A write that never completed was never acknowledged: the high-water
  // mark moves only after the append returns. Simulate its torn bytes.
  {
    std::ofstream f(log, std::ios::app | std::ios::binary);
    f.write("\x20\x00\x00\x00\x01\x02", 6);
  }
  Recovered rec;
  auto s = OpenLogStore(dir, &rec);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(rec.records.size(), 5u);
  EXPECT_EQ(rec.torn_bytes, 6u);
  std::filesystem::remove_all(dir);
}

TEST(StoreCorruption, StoreIsReadableByItsOwnerOnly) {
  const std::string dir = FreshDir("modes");
  std::filesystem::create_directories(dir);
  ::chmod(dir.c_str(), 0755);
  {
    Recovered rec;
    auto s = OpenLogStore(dir, &rec);
    ASSERT_TRUE(s.ok());
    ASSERT_TRUE((*s)->Append(Published(1)).ok());
    wsync::store::v1::Snapshot snap;
    ASSERT_TRUE((*s)->Compact(snap).ok());
    ASSERT_TRUE((*s)->Append(Published(2)).ok());
  }
  auto mode = [](const std::string& p) {
    struct stat st {};
    EXPECT_EQ(::stat(p.c_str(), &st), 0) << p;
    return st.st_mode & 0777;
  };
  EXPECT_EQ(mode(dir), 0700u);
  for (const char* f : {"snapshot.pb", "wal.log", "versions.hwm"}) EXPECT_EQ(mode(dir + "/" + f), 0600u) << f;
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace wsync::control
