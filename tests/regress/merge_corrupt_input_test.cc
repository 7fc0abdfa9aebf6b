// Issue 18, item 5: `wsync merge` wrote a corrupt merged patch with exit 0
// when its first input was corrupt (a payload byte flipped, the container
// checksum recomputed, so that the container verified): merge checked nothing
// that apply would. Now, for every such flip, merge either fails (DataLoss
// once the inputs parse) and writes nothing, or writes a patch that takes the
// base to the true target bit for bit.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>

#include "../codec/test_tensors.h"
#include "wsync/buffers/safetensors.h"
#include "wsync/codec/checksum.h"
#include "wsync/codec/codec.h"
#include "wsync/util/file.h"

namespace wsync {
namespace {

constexpr size_t kChecksumOffset = 32, kPreambleBytes = 40;  // docs/patch-format.md

void Rechecksum(std::string* patch) {
  const uint64_t sum = codec::Hash64(patch->data(), kChecksumOffset) ^
                       codec::Hash64(patch->data() + kPreambleBytes, patch->size() - kPreambleBytes);
  std::memcpy(patch->data() + kChecksumOffset, &sum, 8);
}

int RunCommand(const std::string& cmd, std::string* err) {
  const std::string errfile = cmd.substr(cmd.rfind(' ') + 1) + ".err";
  const int rc = std::system((cmd + " > /dev/null 2> " + errfile).c_str());
  auto text = ReadFile(errfile);
  *err = text.ok() ? *text : "";
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

TEST(MergeCorruptInput, NeverWritesAWrongPatchWithSuccess) {
  const std::string dir = ::testing::TempDir() + "/wsync_regress_merge_" + std::to_string(::getpid());
  std::filesystem::create_directories(dir);
  std::mt19937_64 rng(18);
  std::vector<buffers::OwnedTensor> v0 = {testing::RandomTensor("w", codec::DType::kBF16, {300000}, rng),
                                          testing::RandomTensor("b", codec::DType::kBF16, {4096}, rng)};
  std::vector<buffers::OwnedTensor> v1, v2;
  for (const auto& t : v0) v1.push_back(testing::Perturb(t, 0.02, rng));
  for (const auto& t : v1) v2.push_back(testing::Perturb(t, 0.02, rng));
  ASSERT_TRUE(buffers::WriteSafetensors(dir + "/s0.safetensors", buffers::Views(v0), {}).ok());
  codec::EncodeOptions eo;
  auto p01 = codec::EncodePatch(buffers::Views(v0), buffers::Views(v1), eo);
  auto p12 = codec::EncodePatch(buffers::Views(v1), buffers::Views(v2), eo);
  ASSERT_TRUE(p01.ok() && p12.ok());
  ASSERT_TRUE(WriteFileAtomic(dir + "/p12", *p12).ok());
  const uint64_t target = codec::SetChecksum(buffers::Views(v2));

  int refused = 0, equivalent = 0;
  for (int trial = 0; trial < 24; ++trial) {
    std::string bad = *p01;
    // A byte of the payload's second half (the coded streams).
    const size_t at = bad.size() / 2 + rng() % (bad.size() / 2);
    bad[at] = static_cast<char>(bad[at] ^ (1 + rng() % 255));
    Rechecksum(&bad);
    ASSERT_TRUE(WriteFileAtomic(dir + "/p01", bad).ok());
    const std::string out = dir + "/p02." + std::to_string(trial);
    std::string err;
    const int rc = RunCommand(std::string(WSYNC_BINARY) + " merge --base " + dir + "/s0.safetensors " + dir + "/p01 " +
                           dir + "/p12 -o " + out,
                       &err);
    if (rc != 0) {
      EXPECT_FALSE(std::filesystem::exists(out)) << "a failed merge wrote " << out;
      ++refused;
      continue;
    }
    // Success is allowed only for a result that is right.
    auto merged = ReadFile(out);
    ASSERT_TRUE(merged.ok());
    auto w = v0;
    codec::ApplyOptions ao;
    ASSERT_TRUE(codec::Apply(*merged, buffers::MutableViews(w), ao).ok()) << "trial " << trial;
    EXPECT_EQ(codec::SetChecksum(buffers::Views(w)), target) << "trial " << trial;
    ++equivalent;
  }
  EXPECT_GT(refused, 12) << "most flips of coded bytes must be caught (" << equivalent << " were harmless)";
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace wsync
