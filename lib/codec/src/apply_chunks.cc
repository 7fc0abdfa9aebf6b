// The apply side's per-chunk loops (apply_chunks.h): keyframe chunks
// verified then written, patch chunks decoded, added and verified while in
// cache, and undone.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "apply_chunks.h"
#include "apply_plan.h"
#include "chunk_codec.h"
#include "format.h"
#include "patch_common.h"
#include "wsync/codec/checksum.h"
#include "wsync/codec/codec.h"
#include "wsync/util/first_error.h"
#include "wsync/util/thread_pool.h"

namespace wsync::codec::internal {
namespace {

Status WrongBase(const Container& c) {
  return FailedPreconditionError("the destination does not hold the patch's base version " +
                                 std::to_string(c.base_version) +
                                 " (base checksum differs); destination unchanged");
}

// Verifies what the works wrote (their digests, and each group's tensor
// checksum), naming the first mismatch.
class Verifier {
 public:
  Verifier(const Container& c, const Plan& p) : c_(c), p_(p), tiles_(p.works.size()), groups_(p.GroupBytes(c)) {}

  // Records the result bytes of work i (chunk order).
  void Record(size_t i, const uint8_t* bytes) {
    const Work& w = p_.works[i];
    const TensorEntry& t = c_.tensors[w.tensor];
    const size_t len = t.tiles[w.chunk].n * DTypeWidth(t.dtype);
    if (t.gridded()) {
      tiles_[i] = BlockDigest(bytes, len);
    } else {
      groups_.DigestChunk(w.group, internal::FirstBlock(t, w.chunk), bytes, len);
    }
  }

  // The first mismatch, as the work or group index.
  std::optional<std::string> Mismatch() const {
    for (size_t i = 0; i < p_.works.size(); ++i) {
      const Work& w = p_.works[i];
      const TensorEntry& t = c_.tensors[w.tensor];
      if (t.gridded() && tiles_[i] != t.chunks[w.chunk].digest) {
        return ChunkWhere(t, w.chunk) + (p_.whole ? "" : " in " + p_.group_where[w.group]);
      }
    }
    for (size_t g = 0; g < p_.group_tensor.size(); ++g) {
      const TensorEntry& t = c_.tensors[p_.group_tensor[g]];
      if (!t.gridded() && groups_.Tensor(g) != t.target_checksum) return p_.group_where[g];
    }
    return std::nullopt;
  }

 private:
  const Container& c_;
  const Plan& p_;
  std::vector<uint64_t> tiles_;
  Digests groups_;
};

}  // namespace

Status KeyframeApply::Verify() {
  Verifier verifier(c_, p_);
  FirstError error;
  ParallelFor(pool_, p_.works.size(), [&](size_t i) {
    const Work& w = p_.works[i];
    const TensorEntry& t = c_.tensors[w.tensor];
    WithWidth(DTypeWidth(t.dtype), [&](auto zero) {
      using T = decltype(zero);
      std::vector<T> scratch(t.tiles[w.chunk].n);
      Status s = internal::DecodeKeyframeChunk<T>(c_.PosStream(t.chunks[w.chunk]), scratch.size(), scratch.data());
      if (!s.ok()) return error.Record(i, s.WithContext(ChunkWhere(t, w.chunk)));
      verifier.Record(i, reinterpret_cast<const uint8_t*>(scratch.data()));
    });
  });
  WSYNC_RETURN_IF_ERROR(error.status());
  if (auto bad = verifier.Mismatch()) {
    return DataLossError(*bad + ": keyframe content does not match its checksum; destination not modified");
  }
  return Status::Ok();
}

Status KeyframeApply::Write() {
  FirstError error;
  ParallelFor(pool_, p_.works.size(), [&](size_t i) {
    const Work& w = p_.works[i];
    const TensorEntry& t = c_.tensors[w.tensor];
    const internal::Tile& tile = t.tiles[w.chunk];
    WithWidth(DTypeWidth(t.dtype), [&](auto zero) {
      using T = decltype(zero);
      const std::string_view stream = c_.PosStream(t.chunks[w.chunk]);
      if (uint8_t* at = internal::ContiguousAt(tile, w.at, sizeof(T))) {
        return error.Record(i, internal::DecodeKeyframeChunk<T>(stream, tile.n, reinterpret_cast<T*>(at)));
      }
      std::vector<T> scratch(tile.n);
      error.Record(i, internal::DecodeKeyframeChunk<T>(stream, tile.n, scratch.data()));
      internal::Scatter(tile, w.at, sizeof(T), reinterpret_cast<const uint8_t*>(scratch.data()));
    });
  });
  return error.status();
}

void DeltaApply::Predecode(size_t i) {
  const Work& w = p_.works[i];
  const TensorEntry& t = c_.tensors[w.tensor];
  const ChunkEntry& ch = t.chunks[w.chunk];
  const internal::Tile& tile = t.tiles[w.chunk];
  WithWidth(DTypeWidth(t.dtype), [&](auto zero) {
    using T = decltype(zero);
    thread_local std::vector<uint8_t> scratch;
    const T* x = reinterpret_cast<const T*>(internal::ChunkBytes(tile, w.at, sizeof(T), &scratch));
    Status s = internal::DecodeChunk<T>(ch.mode, ch.changed, c_.PosStream(ch), c_.ValStream(ch), x, tile.n,
                                        ExponentFieldOf(t.dtype), &decoded_[i].Get<T>());
    ready_[i] = s.ok() ? 1 : 0;
  });
}

Status DeltaApply::Run(const std::function<bool()>& holds_base) {
  Verifier verifier(c_, p_);
  FirstError error;
  ParallelFor(pool_, p_.works.size(), [&](size_t i) {
    const uint8_t* result = nullptr;
    Status s = Chunk(i, /*undo=*/false, &result);
    if (!s.ok()) return error.Record(i, s);
    verifier.Record(i, result);
  });
  auto fail = [&](Status s) {
    Undo();
    if (holds_base && !holds_base()) return WrongBase(c_);
    return s;
  };
  if (error.failed()) {
    if (holds_base || error.status().code() != StatusCode::kDataLoss) return fail(error.status());
    return fail(DataLossError(error.status().message() +
                              " (the patch is corrupted or the pieces do not hold its base); change undone"));
  }
  if (auto bad = verifier.Mismatch()) {
    return fail(DataLossError(*bad + ": result does not match the patch's checksum (" +
                              (holds_base ? std::string("the patch is corrupted")
                                          : std::string("the patch is corrupted or the pieces do not hold its base")) +
                              "); change undone, destination unchanged"));
  }
  return Status::Ok();
}

void DeltaApply::Undo() {
  ParallelFor(pool_, p_.works.size(), [&](size_t i) {
    if (applied_[i]) (void)Chunk(i, /*undo=*/true, nullptr);
    applied_[i] = 0;
  });
}

Status DeltaApply::Chunk(size_t i, bool undo, const uint8_t** result) {
  const Work& w = p_.works[i];
  const TensorEntry& t = c_.tensors[w.tensor];
  const ChunkEntry& ch = t.chunks[w.chunk];
  const internal::Tile& tile = t.tiles[w.chunk];
  return WithWidth(DTypeWidth(t.dtype), [&](auto zero) -> Status {
    using T = decltype(zero);
    thread_local std::vector<uint8_t> scratch;
    uint8_t* at = internal::ContiguousAt(tile, w.at, sizeof(T));
    uint8_t* bytes = at;
    if (at == nullptr) {
      scratch.resize(tile.n * sizeof(T));
      internal::Gather(tile, w.at, sizeof(T), scratch.data());
      bytes = scratch.data();
    }
    T* x = reinterpret_cast<T*>(bytes);
    SparseDelta<T>& d = decoded_[i].Get<T>();
    if (!undo && !ready_[i]) {
      Status s = internal::DecodeChunk<T>(ch.mode, ch.changed, c_.PosStream(ch), c_.ValStream(ch), x, tile.n,
                                          ExponentFieldOf(t.dtype), &d);
      if (!s.ok()) return s.WithContext(ChunkWhere(t, w.chunk));
    }
    internal::ScatterAdd<T>(x, d, undo);
    if (at == nullptr) internal::Scatter(tile, w.at, sizeof(T), bytes);
    if (!undo) {
      applied_[i] = 1;
      *result = bytes;
    }
    return Status::Ok();
  });
}

}  // namespace wsync::codec::internal
