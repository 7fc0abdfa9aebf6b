// Run positions (docs/patch-format.md "Run positions"): alternating run
// lengths, range coded.
#include "chunk_coders.h"

#include "range_coder.h"

namespace wsync::codec::internal {
namespace {

struct RunModels {
  EGModel unchanged;
  EGModel changed;
};

}  // namespace

size_t CountRuns(const std::vector<uint32_t>& pos) {
  size_t runs = 0;
  for (size_t i = 0; i < pos.size(); ++i) runs += (i == 0 || pos[i] != pos[i - 1] + 1) ? 1 : 0;
  return runs;
}

void EncodeRunPositions(const std::vector<uint32_t>& pos, const ClassSpec& spec, std::string* out) {
  WriteClassHeader(spec, out);
  auto models = std::make_unique<RunModels>();
  RangeEncoder enc(out);
  uint32_t cur = 0;
  size_t i = 0;
  while (i < pos.size()) {
    size_t j = i + 1;
    while (j < pos.size() && pos[j] == pos[j - 1] + 1) ++j;
    enc.EncodeEG(models->unchanged, pos[i] - cur);
    enc.EncodeEG(models->changed, j - i - 1);
    cur = pos[j - 1] + 1;
    i = j;
  }
  enc.Finish();
}

Status DecodeRunPositions(std::string_view coded, size_t n, uint64_t changed, std::vector<uint32_t>* pos) {
  auto models = std::make_unique<RunModels>();
  RangeDecoder dec(coded);
  pos->clear();
  pos->reserve(changed);
  uint64_t cur = 0;
  while (pos->size() < changed) {
    uint64_t skip, len;
    if (!dec.DecodeEG(models->unchanged, n - cur, &skip) || cur + skip >= n) {
      return DataLossError("run stream: run overruns the chunk of " + std::to_string(n) + " elements");
    }
    cur += skip;
    const uint64_t left = std::min<uint64_t>(n - cur, changed - pos->size());
    if (!dec.DecodeEG(models->changed, left - 1, &len)) {
      return DataLossError("run stream: changed run overruns the chunk or the changed count");
    }
    for (uint64_t k = 0; k <= len; ++k) pos->push_back(static_cast<uint32_t>(cur + k));
    cur += len + 1;
  }
  if (dec.overrun() > 4 || dec.corrupt()) return DataLossError("run stream: truncated or corrupt");
  return Status::Ok();
}

}  // namespace wsync::codec::internal
