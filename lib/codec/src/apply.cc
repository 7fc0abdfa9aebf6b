// Applying patches and keyframes: the parts of a version applied as one,
// whole or into pieces, and decoding while a stream arrives. Which chunk
// goes where is apply_plan.cc's; the per-chunk loops are apply_chunks.cc's.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "apply_chunks.h"
#include "apply_plan.h"
#include "format.h"
#include "patch_common.h"
#include "wsync/codec/codec.h"
#include "wsync/util/thread_pool.h"

namespace wsync::codec {
namespace {

using internal::CheckPiecesParts;
using internal::CheckPresent;
using internal::CheckWholeParts;
using internal::ChunkEntry;
using internal::Container;
using internal::DeltaApply;
using internal::KeyframeApply;
using internal::MatchTensors;
using internal::PiecesPlan;
using internal::Plan;
using internal::StageBudget;
using internal::WholePlan;
using internal::Work;

bool HoldsBase(const Container& c, const std::vector<const MutableTensorView*>& dst, ThreadPool* pool) {
  auto data = [&](size_t t) { return static_cast<const uint8_t*>(dst[t]->data); };
  return internal::EntriesSetChecksum(c.tensors, data, pool) == c.base_set_checksum;
}

// The parts of one version (one container each, disjoint tensors) applied
// as one, in two steps. Staging reads the destination only: keyframes
// decoded and verified in scratch, patches staged (DeltaApply). Committing
// writes: each patch's changed values (all undone if any fails), then the
// keyframes.
struct PartApply {
  Container c;
  Plan plan;
  std::function<bool()> holds_base;  // patches; null: unknown
  std::unique_ptr<DeltaApply> delta;  // patches: made when staging began
  std::unique_ptr<KeyframeApply> keyframe;
};

// Plans a part whose container p->c is read: into destination tensors of
// its tensors' names. REQUIRES: *p stays where it is (holds_base refers to p->c).
Status PlanWholePart(std::span<const MutableTensorView> tensors, bool allow_extra, ThreadPool* pool, PartApply* p) {
  WSYNC_ASSIGN_OR_RETURN(auto dst, MatchTensors(p->c, tensors, allow_extra));
  p->plan = WholePlan(p->c, dst, tensors.data());
  WSYNC_RETURN_IF_ERROR(CheckPresent(p->c, p->plan));
  const Container* held = &p->c;
  p->holds_base = [held, dst, pool] { return HoldsBase(*held, dst, pool); };
  return Status::Ok();
}

// Plans a part whose container p->c is read into pieces (other_parts: see
// PiecesPlan).
Status PlanPiecesPart(std::span<const RuntimeTensor> runtime, bool other_parts, PartApply* p) {
  WSYNC_ASSIGN_OR_RETURN(p->plan, PiecesPlan(p->c, runtime, /*need_data=*/true, other_parts));
  return CheckPresent(p->c, p->plan);
}

Status ReadWholePart(std::string_view patch, std::span<const MutableTensorView> tensors, bool allow_extra,
                     const ApplyOptions& options, PartApply* p) {
  WSYNC_ASSIGN_OR_RETURN(p->c, internal::ReadContainer(patch, options.verify_patch_checksum));
  return PlanWholePart(tensors, allow_extra, options.pool, p);
}

// Reads a part applied into pieces (other_parts: see PiecesPlan).
Status ReadPiecesPart(std::string_view patch, std::span<const RuntimeTensor> runtime, bool other_parts,
                      const ApplyOptions& options, PartApply* p) {
  WSYNC_ASSIGN_OR_RETURN(p->c, internal::ReadContainer(patch, options.verify_patch_checksum));
  return PlanPiecesPart(runtime, other_parts, p);
}

// The budget of a version's staged changes; null: no bound.
std::unique_ptr<StageBudget> BudgetOf(const ApplyOptions& options) {
  if (options.stage_keep_bytes == std::numeric_limits<uint64_t>::max()) return nullptr;
  return std::make_unique<StageBudget>(options.stage_keep_bytes);
}

Status StageAll(std::span<PartApply* const> parts, const ApplyOptions& options, StageBudget* budget) {
  ThreadPool* pool = options.pool;
  uint64_t keep = options.keyframe_keep_bytes;  // shared by the version's keyframes
  for (PartApply* p : parts) {
    if (p->c.kind == PatchKind::kKeyframe) {
      p->keyframe = std::make_unique<KeyframeApply>(p->c, p->plan, pool, keep);
      WSYNC_RETURN_IF_ERROR(p->keyframe->Verify());
      keep -= std::min(keep, p->keyframe->kept_bytes());
    } else {
      if (!p->delta) p->delta = std::make_unique<DeltaApply>(p->c, p->plan, pool, budget);
      WSYNC_RETURN_IF_ERROR(p->delta->Stage(p->holds_base));
    }
  }
  return Status::Ok();
}

// REQUIRES: StageAll(parts) succeeded.
Status CommitAll(std::span<PartApply* const> parts) {
  std::vector<DeltaApply*> applied;
  // Puts back what the parts before wrote; a part's changes past the
  // staging budget cannot be, and the destination then holds neither version.
  auto undone = [&](Status s) {
    bool all = true;
    for (DeltaApply* d : applied) all = d->Undo() && all;
    if (all || s.code() == StatusCode::kDataLoss) return s;
    return DataLossError(s.message() + "; an earlier part's changes past the staging budget were written and cannot "
                                       "be taken back: the destination holds neither version");
  };
  for (PartApply* p : parts) {
    if (!p->delta) continue;
    if (Status s = p->delta->Commit(); !s.ok()) return undone(s);
    applied.push_back(p->delta.get());
  }
  for (PartApply* p : parts) {
    if (!p->keyframe) continue;
    if (Status s = p->keyframe->Write(); !s.ok()) return undone(s.WithContext("a verified keyframe failed to decode again"));
  }
  return Status::Ok();
}

Status ApplyAll(std::span<PartApply* const> parts, const ApplyOptions& options) {
  std::unique_ptr<StageBudget> budget = BudgetOf(options);
  WSYNC_RETURN_IF_ERROR(StageAll(parts, options, budget.get()));
  return CommitAll(parts);
}

Status ApplyWhole(std::string_view patch, std::span<const MutableTensorView> tensors, const ApplyOptions& options) {
  PartApply part;
  WSYNC_RETURN_IF_ERROR(ReadWholePart(patch, tensors, options.allow_extra_tensors, options, &part));
  PartApply* parts[] = {&part};
  return ApplyAll(parts, options);
}

Status ApplyPieces(std::string_view patch, std::span<const RuntimeTensor> runtime, const ApplyOptions& options) {
  PartApply part;
  WSYNC_RETURN_IF_ERROR(ReadPiecesPart(patch, runtime, /*other_parts=*/false, options, &part));
  PartApply* parts[] = {&part};
  return ApplyAll(parts, options);
}

std::vector<PartApply*> Pointers(std::vector<PartApply>& parts) {
  std::vector<PartApply*> out;
  for (PartApply& p : parts) out.push_back(&p);
  return out;
}

std::vector<const Container*> Containers(std::span<PartApply* const> parts) {
  std::vector<const Container*> out;
  for (const PartApply* p : parts) out.push_back(&p->c);
  return out;
}

Status ApplyWholeParts(std::span<const std::string_view> patches, std::span<const MutableTensorView> tensors,
                       const ApplyOptions& options) {
  if (patches.empty()) return InvalidArgumentError("no parts to apply");
  std::vector<PartApply> parts(patches.size());
  for (size_t i = 0; i < patches.size(); ++i) {
    WSYNC_RETURN_IF_ERROR(ReadWholePart(patches[i], tensors, /*allow_extra=*/true, options, &parts[i]));
  }
  const std::vector<PartApply*> all = Pointers(parts);
  WSYNC_RETURN_IF_ERROR(CheckWholeParts(Containers(all), tensors, options));
  return ApplyAll(all, options);
}

Status ApplyPiecesParts(std::span<const std::string_view> patches, std::span<const RuntimeTensor> runtime,
                        const ApplyOptions& options) {
  if (patches.empty()) return InvalidArgumentError("no parts to apply");
  std::vector<PartApply> parts(patches.size());
  for (size_t i = 0; i < patches.size(); ++i) {
    WSYNC_RETURN_IF_ERROR(ReadPiecesPart(patches[i], runtime, /*other_parts=*/true, options, &parts[i]));
  }
  const std::vector<PartApply*> all = Pointers(parts);
  WSYNC_RETURN_IF_ERROR(CheckPiecesParts(Containers(all), runtime));
  return ApplyAll(all, options);
}

}  // namespace

Status Apply(std::string_view patch, const Destination& destination, const ApplyOptions& options) {
  return destination.pieces() ? ApplyPieces(patch, destination.runtime(), options)
                              : ApplyWhole(patch, destination.tensors(), options);
}

Status Apply(std::span<const std::string_view> parts, const Destination& destination, const ApplyOptions& options) {
  return destination.pieces() ? ApplyPiecesParts(parts, destination.runtime(), options)
                              : ApplyWholeParts(parts, destination.tensors(), options);
}

// ---- ApplyAhead

struct ApplyAhead::Impl {
  // One segment: a container and its plan, read from its head as soon as
  // its preamble and directory are in.
  struct Segment {
    uint64_t begin = 0;     // in the stream
    uint64_t header = 0;    // preamble and directory bytes
    uint64_t total = 0;
    std::string head;       // those bytes, to check that Apply is given the same
    PartApply part;
    std::vector<size_t> order;  // patches: works by where their streams end
    size_t next = 0;            // works of `order` staged ahead
  };

  std::vector<MutableTensorView> tensors;
  std::vector<RuntimeTensor> runtime;
  bool pieces = false;
  ApplyOptions options;
  std::vector<std::unique_ptr<Segment>> segments;
  uint64_t end = 0;      // where the next segment begins
  bool stopped = false;  // something did not parse: Apply reads it again and says what
  size_t staged = 0;
  // Prepare's result: the parts checked and staged, for these bytes.
  std::vector<PartApply*> ready;
  std::string_view ready_for;
  // Apply's: the parts written, for Confirm.
  std::vector<PartApply*> written;
  // What staging keeps of the stream's changes; null: no bound.
  std::unique_ptr<StageBudget> budget;

  // Whether the segments read ahead are `stream`'s: the same places and the same heads.
  bool Reads(std::string_view stream, std::span<const std::string_view> split) const {
    if (stopped || segments.size() != split.size()) return false;
    for (size_t i = 0; i < split.size(); ++i) {
      const Segment& seg = *segments[i];
      if (split[i].data() != stream.data() + seg.begin || split[i].size() != seg.total ||
          split[i].substr(0, seg.header) != seg.head) {
        return false;
      }
    }
    return true;
  }

  // Opens the segment at `end` when its head is in; false when not (yet).
  bool Open(std::string_view prefix) {
    if (prefix.size() < end + internal::kPreambleBytes) return false;
    const std::string_view rest = prefix.substr(end);
    StatusOr<internal::Preamble> pre = internal::ReadPreamble(rest);
    if (!pre.ok()) return Stop();
    if (rest.size() < pre->HeaderBytes()) return false;
    auto seg = std::make_unique<Segment>();
    seg->begin = end;
    seg->header = pre->HeaderBytes();
    seg->total = pre->TotalBytes();
    seg->head = std::string(rest.substr(0, seg->header));
    PartApply& p = seg->part;
    StatusOr<Container> c = internal::ReadContainer(rest, /*verify_checksum=*/false, /*head_only=*/true);
    if (!c.ok()) return Stop();
    p.c = std::move(*c);
    const Status planned = pieces ? PlanPiecesPart(runtime, /*other_parts=*/true, &p)
                                  : PlanWholePart(tensors, /*allow_extra=*/true, options.pool, &p);
    if (!planned.ok()) return Stop();
    if (p.c.kind == PatchKind::kPatch) {
      p.delta = std::make_unique<DeltaApply>(p.c, p.plan, options.pool, budget.get());
      seg->order.resize(p.plan.works.size());
      for (size_t i = 0; i < seg->order.size(); ++i) seg->order[i] = i;
      std::stable_sort(seg->order.begin(), seg->order.end(), [&](size_t a, size_t b) { return StreamEnd(p, a) < StreamEnd(p, b); });
    }
    end += seg->total;
    segments.push_back(std::move(seg));
    return true;
  }

  static uint64_t StreamEnd(const PartApply& p, size_t work) {
    const Work& w = p.plan.works[work];
    const ChunkEntry& ch = p.c.tensors[w.tensor].chunks[w.chunk];
    return ch.offset + ch.pos_len + ch.val_len;
  }

  bool Stop() {
    stopped = true;
    return false;
  }

  // Stages the works of a patch segment whose streams are in `prefix`.
  void Stage(Segment& seg, std::string_view prefix) {
    PartApply& p = seg.part;
    if (!p.delta || seg.next == seg.order.size()) return;
    const uint64_t have = std::min<uint64_t>(prefix.size() - seg.begin, seg.total) - seg.header;
    p.c.payload = prefix.substr(seg.begin + seg.header, have);
    size_t upto = seg.next;
    while (upto < seg.order.size() && StreamEnd(p, seg.order[upto]) <= have) ++upto;
    if (upto == seg.next) return;
    const size_t first = seg.next;
    ParallelFor(options.pool, upto - first, [&](size_t k) { p.delta->StageAhead(seg.order[first + k]); });
    staged += upto - first;
    seg.next = upto;
  }
};

ApplyAhead::ApplyAhead(std::span<const MutableTensorView> tensors, const ApplyOptions& options)
    : impl_(std::make_unique<Impl>()) {
  impl_->tensors.assign(tensors.begin(), tensors.end());
  impl_->options = options;
  impl_->budget = BudgetOf(options);
}

ApplyAhead::ApplyAhead(std::span<const RuntimeTensor> runtime, const ApplyOptions& options)
    : impl_(std::make_unique<Impl>()) {
  impl_->runtime.assign(runtime.begin(), runtime.end());
  impl_->pieces = true;
  impl_->options = options;
  impl_->budget = BudgetOf(options);
}

ApplyAhead::ApplyAhead(ApplyAhead&&) noexcept = default;
ApplyAhead& ApplyAhead::operator=(ApplyAhead&&) noexcept = default;
ApplyAhead::~ApplyAhead() = default;

size_t ApplyAhead::staged_ahead() const { return impl_->staged; }

size_t ApplyAhead::decoded_again() const {
  size_t n = 0;
  for (const PartApply* p : impl_->written) n += p->delta ? p->delta->decoded_again() : 0;
  return n;
}

void ApplyAhead::Advance(std::string_view prefix) {
  Impl& m = *impl_;
  while (!m.stopped) {
    if (!m.segments.empty()) m.Stage(*m.segments.back(), prefix);
    if (m.segments.empty() || prefix.size() >= m.end) {
      if (!m.Open(prefix)) break;
    } else {
      break;
    }
  }
}

Status ApplyAhead::Prepare(std::string_view stream) {
  Impl& m = *impl_;
  m.ready.clear();
  m.ready_for = {};
  m.written.clear();
  WSYNC_ASSIGN_OR_RETURN(std::vector<std::string_view> segments, SplitSegments(stream));
  if (!m.Reads(stream, segments)) {
    // Another stream than the one read ahead (or a part of none): read this one.
    m.segments.clear();
    m.end = 0;
    m.stopped = false;
    m.budget = BudgetOf(m.options);
  }
  Advance(stream);  // every chunk not staged yet, the last segment's too
  // Bytes the reader ahead cannot take: Apply applies them as given, and says what is wrong.
  if (!m.Reads(stream, segments)) return Status::Ok();
  std::vector<PartApply*> parts;
  for (size_t i = 0; i < segments.size(); ++i) {
    PartApply& p = m.segments[i]->part;
    // The directory read ahead is this one; the whole segment is checked
    // (its checksum) before a byte is written.
    WSYNC_ASSIGN_OR_RETURN(Container whole, internal::ReadContainer(segments[i], m.options.verify_patch_checksum));
    p.c.payload = whole.payload;
    parts.push_back(&p);
  }
  if (m.pieces) {
    WSYNC_RETURN_IF_ERROR(CheckPiecesParts(Containers(parts), m.runtime));
  } else {
    WSYNC_RETURN_IF_ERROR(CheckWholeParts(Containers(parts), m.tensors, m.options));
  }
  WSYNC_RETURN_IF_ERROR(StageAll(parts, m.options, m.budget.get()));
  m.ready = std::move(parts);
  m.ready_for = stream;
  return Status::Ok();
}

Status ApplyAhead::Apply(std::string_view stream) {
  Impl& m = *impl_;
  if (m.ready.empty() || m.ready_for.data() != stream.data() || m.ready_for.size() != stream.size()) {
    WSYNC_RETURN_IF_ERROR(Prepare(stream));
  }
  if (m.ready.empty()) {
    WSYNC_ASSIGN_OR_RETURN(std::vector<std::string_view> segments, SplitSegments(stream));
    m.segments.clear();
    return m.pieces ? ApplyPiecesParts(segments, m.runtime, m.options)
                    : ApplyWholeParts(segments, m.tensors, m.options);
  }
  std::vector<PartApply*> parts = std::exchange(m.ready, {});
  m.ready_for = {};
  WSYNC_RETURN_IF_ERROR(CommitAll(parts));
  m.written = std::move(parts);
  return Status::Ok();
}

Status ApplyAhead::Confirm() const {
  const Impl& m = *impl_;
  for (const PartApply* p : m.written) {
    if (auto bad = internal::ResultMismatch(p->c, p->plan, m.options.pool)) {
      return DataLossError(*bad + ": the destination no longer holds version " + std::to_string(p->c.target_version) +
                           " (written by another writer after the patch was checked)");
    }
  }
  return Status::Ok();
}

}  // namespace wsync::codec
