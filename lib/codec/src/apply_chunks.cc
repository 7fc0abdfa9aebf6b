// The apply side's per-chunk loops (apply_chunks.h): keyframe chunks
// verified then written (copied from what was verified, or decoded again), patch chunks decoded, added and verified while in
// cache, and undone.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>
#include <span>
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

// Where change k of a chunk lies at its placement.
template <typename T>
T* ChangeAt(const internal::Tile& tile, const Placement& at, T* contiguous, uint32_t pos) {
  if (contiguous != nullptr) return contiguous + pos;
  return reinterpret_cast<T*>(at.data) + PlacedElement(MapOf(tile, at), pos);
}

}  // namespace

ResultDigests::ResultDigests(const Container& c, const Plan& p)
    : c_(c), p_(p), tiles_(p.works.size()), groups_(p.GroupBytes(c)) {}

void ResultDigests::Record(size_t i, const uint8_t* bytes) {
  const Work& w = p_.works[i];
  const TensorEntry& t = c_.tensors[w.tensor];
  const size_t len = t.tiles[w.chunk].n * DTypeWidth(t.dtype);
  if (t.gridded()) {
    tiles_[i] = BlockDigest(bytes, len);
  } else {
    groups_.DigestChunk(w.group, internal::FirstBlock(t, w.chunk), bytes, len);
  }
}

std::optional<std::string> ResultDigests::Mismatch() const {
  for (size_t i = 0; i < p_.works.size(); ++i) {
    const Work& w = p_.works[i];
    const TensorEntry& t = c_.tensors[w.tensor];
    if (t.gridded() && tiles_[i] != t.chunks[w.chunk].digest) return p_.WorkWhere(c_, i);
  }
  for (size_t g = 0; g < p_.group_tensor.size(); ++g) {
    const TensorEntry& t = c_.tensors[p_.group_tensor[g]];
    if (!t.gridded() && groups_.Tensor(g) != t.target_checksum) return p_.group_where[g];
  }
  return std::nullopt;
}

std::optional<std::string> ResultMismatch(const Container& c, const Plan& p, ThreadPool* pool) {
  ResultDigests digests(c, p);
  ParallelFor(pool, p.works.size(), [&](size_t i) {
    const Work& w = p.works[i];
    const TensorEntry& t = c.tensors[w.tensor];
    thread_local std::vector<uint8_t> scratch;
    digests.Record(i, internal::ChunkBytes(t.tiles[w.chunk], w.at, DTypeWidth(t.dtype), &scratch));
  });
  return digests.Mismatch();
}

Status KeyframeApply::Verify() {
  uint64_t bytes = 0;
  for (const Work& w : p_.works) {
    const TensorEntry& t = c_.tensors[w.tensor];
    bytes += t.tiles[w.chunk].n * DTypeWidth(t.dtype);
  }
  kept_.assign(bytes <= keep_bytes_ ? p_.works.size() : 0, {});
  kept_bytes_ = kept_.empty() ? 0 : bytes;
  ResultDigests verifier(c_, p_);
  FirstError error;
  ParallelFor(pool_, p_.works.size(), [&](size_t i) {
    const Work& w = p_.works[i];
    const TensorEntry& t = c_.tensors[w.tensor];
    WithWidth(DTypeWidth(t.dtype), [&](auto zero) {
      using T = decltype(zero);
      std::vector<uint8_t> local;
      std::vector<uint8_t>& scratch = kept_.empty() ? local : kept_[i];
      scratch.resize(t.tiles[w.chunk].n * sizeof(T));
      Status s = internal::DecodeKeyframeChunk<T>(c_.PosStream(t.chunks[w.chunk]), t.tiles[w.chunk].n,
                                                  reinterpret_cast<T*>(scratch.data()));
      if (!s.ok()) return error.Record(i, s.WithContext(ChunkWhere(t, w.chunk)));
      verifier.Record(i, scratch.data());
    });
  });
  if (Status s = error.status(); !s.ok()) {
    Release();
    return s;
  }
  if (auto bad = verifier.Mismatch()) {
    Release();
    return DataLossError(*bad + ": keyframe content does not match its checksum; destination not modified");
  }
  return Status::Ok();
}

Status KeyframeApply::Write() {
  if (!kept_.empty()) {
    // The values checked before: copied in, nothing decoded now.
    ParallelFor(pool_, p_.works.size(), [&](size_t i) {
      const Work& w = p_.works[i];
      const TensorEntry& t = c_.tensors[w.tensor];
      const size_t width = DTypeWidth(t.dtype);
      const internal::Tile& tile = t.tiles[w.chunk];
      if (uint8_t* at = internal::ContiguousAt(tile, w.at, width)) {
        std::memcpy(at, kept_[i].data(), kept_[i].size());
      } else {
        internal::Scatter(tile, w.at, width, kept_[i].data());
      }
    });
    Release();
    return Status::Ok();
  }
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

Status DeltaApply::StageWork(size_t i, bool budgeted) {
  const Work& w = p_.works[i];
  const TensorEntry& t = c_.tensors[w.tensor];
  const ChunkEntry& ch = t.chunks[w.chunk];
  const internal::Tile& tile = t.tiles[w.chunk];
  return WithWidth(DTypeWidth(t.dtype), [&](auto zero) -> Status {
    using T = decltype(zero);
    // The chunk's bytes copied (the destination is only read), decoded
    // against, changed and digested there.
    thread_local std::vector<uint8_t> scratch;
    scratch.resize(tile.n * sizeof(T));
    internal::Gather(tile, w.at, sizeof(T), scratch.data());
    T* x = reinterpret_cast<T*>(scratch.data());
    SparseDelta<T>& d = decoded_[i].Get<T>();
    Status s = internal::DecodeChunk<T>(ch.mode, ch.changed, c_.PosStream(ch), c_.ValStream(ch), x, tile.n,
                                        ExponentFieldOf(t.dtype), &d);
    if (!s.ok()) return s.WithContext(ChunkWhere(t, w.chunk));
    std::vector<T>& old = decoded_[i].Old<T>();
    old.resize(d.pos.size());
    for (size_t k = 0; k < d.pos.size(); ++k) old[k] = x[d.pos[k]];
    internal::ScatterAdd<T>(x, d);
    digests_.Record(i, scratch.data());
    if (budgeted && budget_ != nullptr && !budget_->Take(ChangeBytes(d.pos.size(), sizeof(T)))) {
      Drop(i);  // checked; decoded again when written
    } else {
      staged_[i] = kKept;
    }
    return Status::Ok();
  });
}

void DeltaApply::Drop(size_t i) {
  decoded_[i] = Decoded{};
  staged_[i] = kChecked;
}

uint64_t DeltaApply::KeepBytes(size_t i) const {
  const Work& w = p_.works[i];
  const TensorEntry& t = c_.tensors[w.tensor];
  return ChangeBytes(t.chunks[w.chunk].changed, DTypeWidth(t.dtype));
}

size_t DeltaApply::decoded_again() const {
  return static_cast<size_t>(std::count(committed_.begin(), committed_.end(), kChecked));
}

void DeltaApply::StageAhead(size_t i) { (void)StageWork(i, /*budgeted=*/true); }

Status DeltaApply::Stage(const std::function<bool()>& holds_base) {
  FirstError error;
  ParallelFor(pool_, p_.works.size(), [&](size_t i) {
    if (staged_[i] != kNone) return;
    if (Status s = StageWork(i, /*budgeted=*/true); !s.ok()) error.Record(i, s);
  });
  auto fail = [&](Status s) {
    if (holds_base && !holds_base()) return WrongBase(c_);
    return s;
  };
  if (error.failed()) {
    if (holds_base || error.status().code() != StatusCode::kDataLoss) return fail(error.status());
    return fail(DataLossError(error.status().message() +
                              " (the patch is corrupted or the pieces do not hold its base); destination unchanged"));
  }
  if (auto bad = digests_.Mismatch()) {
    return fail(DataLossError(*bad + ": result does not match the patch's checksum (" +
                              (holds_base ? std::string("the patch is corrupted")
                                          : std::string("the patch is corrupted or the pieces do not hold its base")) +
                              "); destination unchanged"));
  }
  return Status::Ok();
}

bool DeltaApply::CommitWork(size_t i) {
  const Work& w = p_.works[i];
  const TensorEntry& t = c_.tensors[w.tensor];
  const internal::Tile& tile = t.tiles[w.chunk];
  return WithWidth(DTypeWidth(t.dtype), [&](auto zero) -> bool {
    using T = decltype(zero);
    T* contiguous = reinterpret_cast<T*>(internal::ContiguousAt(tile, w.at, sizeof(T)));
    const SparseDelta<T>& d = decoded_[i].Get<T>();
    const std::vector<T>& old = decoded_[i].Old<T>();
    for (size_t k = 0; k < d.pos.size(); ++k) {
      T* x = ChangeAt(tile, w.at, contiguous, d.pos[k]);
      if (*x != old[k]) {
        for (size_t j = 0; j < k; ++j) *ChangeAt(tile, w.at, contiguous, d.pos[j]) = old[j];
        return false;
      }
      *x = static_cast<T>(old[k] + d.delta[k]);
    }
    committed_[i] = kKept;
    return true;
  });
}

void DeltaApply::UndoWork(size_t i) {
  const Work& w = p_.works[i];
  const TensorEntry& t = c_.tensors[w.tensor];
  const internal::Tile& tile = t.tiles[w.chunk];
  WithWidth(DTypeWidth(t.dtype), [&](auto zero) {
    using T = decltype(zero);
    T* contiguous = reinterpret_cast<T*>(internal::ContiguousAt(tile, w.at, sizeof(T)));
    const SparseDelta<T>& d = decoded_[i].Get<T>();
    const std::vector<T>& old = decoded_[i].Old<T>();
    for (size_t k = 0; k < d.pos.size(); ++k) *ChangeAt(tile, w.at, contiguous, d.pos[k]) = old[k];
  });
  committed_[i] = kNone;
}

Status DeltaApply::ChangedSinceStaged(const std::string& where, bool undone) const {
  const std::string what = where + ": a value changed after the patch was checked against it (another writer of "
                                   "the weights)";
  if (undone) return FailedPreconditionError(what + "; change undone");
  return DataLossError(what + ", found after changes past the staging budget were written, which cannot be taken "
                              "back: the destination holds neither version");
}

Status DeltaApply::Commit() {
  FirstError error;
  ParallelFor(pool_, p_.works.size(), [&](size_t i) {
    if (staged_[i] != kKept || CommitWork(i)) return;
    error.Record(i, ChangedSinceStaged(p_.WorkWhere(c_, i), /*undone=*/true));
  });
  if (error.failed()) {
    Undo();
    return error.status();
  }
  return CommitDropped();
}

Status DeltaApply::CommitDropped() {
  std::vector<size_t> dropped;
  for (size_t i = 0; i < staged_.size(); ++i) {
    if (staged_[i] == kChecked) dropped.push_back(i);
  }
  bool wrote = false;  // a group past the budget is written for good
  for (size_t begin = 0; begin < dropped.size();) {
    // A group the budget holds (at least one work), decoded against the
    // destination now and checked again: a value changed since the check
    // is found before the group is written.
    size_t end = begin + 1;
    uint64_t bytes = KeepBytes(dropped[begin]);
    while (end < dropped.size() && bytes + KeepBytes(dropped[end]) <= budget_->cap()) bytes += KeepBytes(dropped[end++]);
    const std::span<const size_t> group(dropped.data() + begin, end - begin);
    FirstError decoded;
    ParallelFor(pool_, group.size(), [&](size_t k) {
      if (Status s = StageWork(group[k], /*budgeted=*/false); !s.ok()) decoded.Record(k, s);
    });
    std::optional<std::string> bad = decoded.failed() ? std::optional<std::string>(decoded.status().message())
                                                      : digests_.Mismatch();
    FirstError written;
    if (!bad) {
      ParallelFor(pool_, group.size(), [&](size_t k) {
        const size_t i = group[k];
        if (!CommitWork(i)) written.Record(k, FailedPreconditionError(p_.WorkWhere(c_, i)));
      });
      if (written.failed()) bad = written.status().message();
    }
    if (bad) {
      for (size_t i : group) {
        if (committed_[i] == kKept) UndoWork(i);
        Drop(i);
      }
      const bool undone = !wrote;
      if (undone) Undo();
      return ChangedSinceStaged(*bad, undone);
    }
    for (size_t i : group) {
      Drop(i);
      committed_[i] = kChecked;
    }
    wrote = true;
    begin = end;
  }
  return Status::Ok();
}

Status DeltaApply::Run(const std::function<bool()>& holds_base) {
  WSYNC_RETURN_IF_ERROR(Stage(holds_base));
  return Commit();
}

bool DeltaApply::Undo() {
  ParallelFor(pool_, p_.works.size(), [&](size_t i) {
    if (committed_[i] == kKept) UndoWork(i);
  });
  return std::find(committed_.begin(), committed_.end(), kChecked) == committed_.end();
}

}  // namespace wsync::codec::internal
