// Writes a few valid patches and keyframes into DIR as the fuzzer's seed
// corpus: every chunk mode, several dtypes, conditioned and not.
#include <cstdio>
#include <random>
#include <string>

#include "../codec/test_tensors.h"
#include "wsync/util/file.h"

int main(int argc, char** argv) {
  using namespace wsync;
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DIR\n", argv[0]);
    return 2;
  }
  std::mt19937_64 rng(1);
  int written = 0;
  auto put = [&](const StatusOr<std::string>& bytes) {
    if (!bytes.ok()) return;
    std::string path = std::string(argv[1]) + "/seed_" + std::to_string(written++);
    if (!WriteFileAtomic(path, *bytes).ok()) std::fprintf(stderr, "cannot write %s\n", path.c_str());
  };
  for (double density : {0.0, 0.01, 0.3, 1.0}) {
    for (bool condition : {true, false}) {
      std::vector<buffers::OwnedTensor> base = {
          testing::RandomTensor("a", codec::DType::kBF16, {700}, rng),
          testing::RandomTensor("b", codec::DType::kF32, {64, 3}, rng),
          testing::RandomTensor("c", codec::DType::kF8E4M3, {100}, rng)};
      std::vector<buffers::OwnedTensor> target = {testing::PerturbByExponent(base[0], density, 120, rng),
                                                  testing::Perturb(base[1], density, rng),
                                                  testing::Perturb(base[2], density, rng)};
      codec::EncodeOptions options;
      options.condition_on_base = condition;
      put(codec::EncodePatch(buffers::Views(base), buffers::Views(target), options));
      put(codec::EncodeKeyframe(buffers::Views(target), options));
      // Gridded (tiles with digests), and a selection for one piece.
      options.grids = {{"a", {350}, {}}, {"b", {32}, {1}}};
      auto gridded = codec::EncodePatch(buffers::Views(base), buffers::Views(target), options);
      put(gridded);
      put(codec::EncodeKeyframe(buffers::Views(target), options));
      std::vector<uint8_t> shard(350 * 2);
      std::vector<codec::RuntimeTensor> layout = {
          {{"a_shard", codec::DType::kBF16, {350}, shard.data()}, {{"a", {350}, {350}, {0}}}}};
      if (gridded.ok()) put(codec::SelectForPieces(*gridded, layout));
    }
  }
  std::printf("%d seeds in %s\n", written, argv[1]);
  return 0;
}
