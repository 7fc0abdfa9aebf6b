// libFuzzer target for the patch decoder: any byte string given to
// InspectPatch / Apply (whole tensors and pieces) / MergePatches / SelectForPieces
// / SplitSegments / ApplyAhead must give an error or a result, ApplyAhead
// fed it in slices exactly Apply's, the device's sparse-chunk decoders
// (sparse_decode.h, run here on the CPU) accepting and decoding exactly
// what the host decoder does, the device's apply plan never placing an
// element outside its destination, never a crash, a hang or an
// out-of-bounds access. The whole-patch checksum
// is turned off so the fuzzer reaches the structural checks behind it.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string_view>
#include <vector>

#include "wsync/buffers/safetensors.h"
#include "wsync/codec/codec.h"
#include "wsync/codec/sparse_decode.h"
#include "wsync/codec/staged.h"

namespace {

// Chunk i of a sparse-coded patch decoded by the device's agents and by the
// host: the same verdict, the same ranks, and (over made-up old values, the
// same for both) the same deltas.
template <typename T>
void CompareSparseDecoders(const wsync::codec::staged::PatchReader& r, size_t i) {
  wsync::codec::sparse::ChunkStreams cs;
  auto located = r.LocateSparse(i, &cs);
  if (!located.ok() || !*located) return;
  const uint64_t n = r.chunks()[i].elements, changed = r.changed(i);
  if (changed > (uint64_t{1} << 20)) return;
  const int k = cs.spec.k;
  std::vector<uint32_t> ranks(changed);
  uint64_t counts[wsync::codec::kMaxClasses] = {};
  wsync::codec::sparse::SearchTables tables;  // the device's lookup
  const bool agent_ok =
      wsync::codec::sparse::DecodeSparseRanks(cs.pos, n, changed, k, counts, ranks.data(), &tables).ok();
  wsync::codec::staged::DecodedChunk dc;
  const bool host_ok = r.DecodePositions(i, &dc).ok();
  if (agent_ok != host_ok) __builtin_trap();
  if (!host_ok) return;
  if (k == 1 ? dc.pos != ranks : (dc.ranks != ranks || !std::equal(dc.class_counts.begin(), dc.class_counts.end(), counts))) {
    __builtin_trap();
  }
  // Values over made-up old values (their classes pick the tables), the same
  // for both decoders.
  std::vector<T> old(changed);
  for (size_t j = 0; j < changed; ++j) old[j] = static_cast<T>(j * 0x9E3779B97F4A7C15ull >> 3);
  if (k > 1) {
    dc.pos = ranks;
    dc.ranked = false;
  }
  std::vector<T> delta(changed);
  const bool agent_values =
      wsync::codec::sparse::DecodeSparseValues<T>(cs.val, changed, cs.spec, k > 1 ? old.data() : nullptr, delta.data(),
                                                  &tables)
          .ok();
  const bool host_values = r.DecodeValues(i, k > 1 ? old.data() : nullptr, &dc).ok();
  if (agent_values != host_values) __builtin_trap();
  if (host_values && std::memcmp(dc.delta.data(), delta.data(), changed * sizeof(T)) != 0) __builtin_trap();
}

// The device's plan of an apply (staged::PlanApply): every work's elements
// inside its destination tensor (the kernels write where the plan says,
// unchecked).
void CheckPlan(std::string_view in, const wsync::codec::Destination& d, std::span<const uint64_t> numel) {
  using namespace wsync;
  auto r = codec::staged::PatchReader::Open(in, /*verify_checksum=*/false);
  if (!r.ok()) return;
  const codec::staged::PatchReader* parts[] = {&*r};
  auto plans = codec::staged::PlanApply(parts, d, {}, /*as_parts=*/false);
  if (!plans.ok()) return;
  for (const codec::staged::Work& w : (*plans)[0].works) {
    if (w.dst >= numel.size() || w.map.n == 0) __builtin_trap();
    const uint64_t row_end = w.map.cell_cols - w.map.first % w.map.cell_cols - 1;
    for (uint64_t k : {uint64_t{0}, w.map.n - 1, std::min(row_end, w.map.n - 1)}) {
      if (codec::PlacedElement(w.map, k) >= numel[w.dst]) __builtin_trap();
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace wsync;
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  (void)codec::SplitSegments(in);
  {
    // Heads parsed from any prefix (no tensors: nothing is decoded).
    codec::ApplyAhead ahead(std::span<const codec::MutableTensorView>{}, {});
    for (size_t at = 0; at < size; at += 1 + at / 2) ahead.Advance(in.substr(0, at));
  }
  if (auto r = codec::staged::PatchReader::Open(in, /*verify_checksum=*/false);
      r.ok() && r->kind() == codec::PatchKind::kPatch) {
    for (size_t i = 0; i < r->chunks().size(); ++i) {
      switch (r->chunks()[i].width) {
        case 1: CompareSparseDecoders<uint8_t>(*r, i); break;
        case 2: CompareSparseDecoders<uint16_t>(*r, i); break;
        case 4: CompareSparseDecoders<uint32_t>(*r, i); break;
        default: CompareSparseDecoders<uint64_t>(*r, i); break;
      }
    }
  }
  auto info = codec::InspectPatch(in, /*verify_patch_checksum=*/false);
  if (!info.ok()) return 0;
  uint64_t total = 0;
  for (const auto& t : info->tensors) {
    const uint64_t b = t.DenseBytes();
    if (b > (4u << 20) || total + b > (4u << 20)) return 0;  // keep runs fast
    total += b;
  }
  std::vector<buffers::OwnedTensor> dst;
  for (const auto& t : info->tensors) {
    buffers::OwnedTensor o{t.name, t.dtype, t.shape, std::vector<uint8_t>(t.DenseBytes())};
    for (size_t i = 0; i < o.bytes.size(); ++i) o.bytes[i] = static_cast<uint8_t>(i * 37 + 11);
    dst.push_back(std::move(o));
  }
  const auto before = dst;
  auto views = buffers::MutableViews(dst);
  std::vector<uint64_t> numel;
  for (const auto& v : views) numel.push_back(v.NumElements());
  CheckPlan(in, views, numel);
  codec::ApplyOptions options;
  options.verify_patch_checksum = false;
  Status s = codec::Apply(in, views, options);
  if (!s.ok()) {
    // All-or-nothing: a rejected patch leaves the destination as it was.
    for (size_t i = 0; i < dst.size(); ++i) {
      if (dst[i].bytes != before[i].bytes) __builtin_trap();
    }
  }
  {
    // Decoding ahead, fed in slices, gives what applying at once gave.
    auto ahead_dst = before;
    codec::ApplyAhead ahead(buffers::MutableViews(ahead_dst), options);
    for (size_t at = 0; at < size; at += 1 + at / 3) ahead.Advance(in.substr(0, at));
    ahead.Advance(in);
    Status a = ahead.Apply(in);
    if (a.ok() != s.ok()) __builtin_trap();
    for (size_t i = 0; i < dst.size(); ++i) {
      if (ahead_dst[i].bytes != (a.ok() ? dst[i].bytes : before[i].bytes)) __builtin_trap();
    }
  }
  auto base = buffers::Views(before);
  (void)codec::MergePatches(in, in, base, {});

  // A sink holding pieces: each tensor whole, or its first row band when it
  // is gridded by rows, in runtime tensors of the piece's shape.
  std::vector<buffers::OwnedTensor> held;
  std::vector<codec::RuntimeTensor> layout;
  for (const auto& t : info->tensors) {
    if (t.shape.empty() || t.shape[0] == 0) continue;
    std::vector<uint64_t> shape = t.shape;
    if (!t.row_cuts.empty()) shape[0] = t.row_cuts[0];
    uint64_t bytes = codec::DTypeWidth(t.dtype);
    for (uint64_t d : shape) bytes *= d;
    held.push_back({t.name + "/held", t.dtype, shape, std::vector<uint8_t>(bytes, 0x5A)});
    codec::Piece p{t.name, std::vector<uint64_t>(shape.size(), 0), shape, std::vector<uint64_t>(shape.size(), 0)};
    layout.push_back({{}, {p}});
  }
  for (size_t i = 0; i < held.size(); ++i) {
    layout[i].view = {held[i].name, held[i].dtype, held[i].shape, held[i].bytes.data()};
  }
  std::vector<uint64_t> held_numel;
  for (const auto& rt : layout) held_numel.push_back(rt.view.NumElements());
  CheckPlan(in, layout, held_numel);
  const auto held_before = held;
  if (!codec::Apply(in, layout, options).ok()) {
    for (size_t i = 0; i < held.size(); ++i) {
      if (held[i].bytes != held_before[i].bytes) __builtin_trap();
    }
  }
  (void)codec::SelectForPieces(in, layout);
  return 0;
}
