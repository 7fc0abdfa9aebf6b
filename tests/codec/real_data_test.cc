// Every pair of snapshots in ../shared/data (every gap) round-trips bit for
// bit; merged chains equal the direct patch's effect.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "wsync/buffers/safetensors.h"
#include "wsync/codec/codec.h"
#include "wsync/util/thread_pool.h"

namespace wsync::codec {
namespace {

namespace fs = std::filesystem;
using buffers::SafetensorsFile;

std::string DataDir() {
  const char* env = std::getenv("WSYNC_DATA_DIR");
  return env ? env : WSYNC_SHARED_DATA_DIR;
}

std::vector<std::vector<std::string>> Runs() {
  std::vector<std::vector<std::string>> runs;
  std::error_code ec;
  for (const auto& dir : fs::directory_iterator(DataDir(), ec)) {
    if (!dir.is_directory()) continue;
    std::vector<std::string> files;
    for (const auto& f : fs::directory_iterator(dir.path())) {
      if (f.path().extension() == ".safetensors") files.push_back(f.path());
    }
    std::sort(files.begin(), files.end());
    if (files.size() >= 2) runs.push_back(files);
  }
  return runs;
}

std::unique_ptr<SafetensorsFile> Open(const std::string& path) {
  auto f = SafetensorsFile::Open(path);
  EXPECT_TRUE(f.ok()) << f.status().ToString();
  return f.ok() ? std::move(*f) : nullptr;
}

TEST(RealData, EveryPairEveryGapRoundTrips) {
  auto runs = Runs();
  if (runs.empty()) GTEST_SKIP() << "no snapshots under " << DataDir() << " (set WSYNC_DATA_DIR)";
  ThreadPool pool(2);
  int pairs = 0;
  for (const auto& files : runs) {
    std::vector<std::unique_ptr<SafetensorsFile>> snaps;
    for (const auto& f : files) snaps.push_back(Open(f));
    for (size_t i = 0; i < snaps.size(); ++i) {
      for (size_t j = i + 1; j < snaps.size(); ++j) {
        EncodeOptions options;
        options.pool = &pool;
        auto patch = EncodePatch(snaps[i]->tensors(), snaps[j]->tensors(), options);
        ASSERT_TRUE(patch.ok()) << patch.status().ToString();
        auto dst = buffers::CopyTensors(snaps[i]->tensors());
        auto views = buffers::MutableViews(dst);
        ApplyOptions apply;
        apply.pool = &pool;
        ASSERT_TRUE(codec::Apply(*patch, views, apply).ok()) << files[i] << " -> " << files[j];
        for (size_t t = 0; t < dst.size(); ++t) {
          const auto& want = snaps[j]->tensors()[t];
          ASSERT_EQ(0, std::memcmp(dst[t].bytes.data(), want.data, want.NumBytes())) << want.name;
        }
        ++pairs;
      }
    }
  }
  EXPECT_GT(pairs, 0);
}

TEST(RealData, MergedChainEqualsSequentialApply) {
  auto runs = Runs();
  if (runs.empty()) GTEST_SKIP() << "no snapshots under " << DataDir();
  for (const auto& files : runs) {
    std::vector<std::unique_ptr<SafetensorsFile>> snaps;
    for (const auto& f : files) snaps.push_back(Open(f));
    auto base = snaps[0]->tensors();
    std::string merged = *EncodePatch(snaps[0]->tensors(), snaps[1]->tensors(), {});
    for (size_t k = 2; k < snaps.size(); ++k) {
      auto next = EncodePatch(snaps[k - 1]->tensors(), snaps[k]->tensors(), {});
      ASSERT_TRUE(next.ok());
      auto m = MergePatches(merged, *next, base, {});
      ASSERT_TRUE(m.ok()) << m.status().ToString();
      merged = *m;
    }
    auto dst = buffers::CopyTensors(base);
    auto views = buffers::MutableViews(dst);
    ASSERT_TRUE(codec::Apply(merged, views, {}).ok());
    for (size_t t = 0; t < dst.size(); ++t) {
      const auto& want = snaps.back()->tensors()[t];
      ASSERT_EQ(0, std::memcmp(dst[t].bytes.data(), want.data, want.NumBytes())) << want.name;
    }
  }
}

}  // namespace
}  // namespace wsync::codec
