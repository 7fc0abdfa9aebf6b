// The staged codec API (wsync/codec/staged.h) over the chunk codec's stages.
#include "wsync/codec/staged.h"

#include <cstring>

#include "apply_plan.h"
#include "chunk_codec.h"
#include "format.h"
#include "patch_common.h"
#include "patch_encode.h"
#include "wsync/codec/sparse_encode.h"
#include "wsync/util/text.h"

namespace wsync::codec::staged {
namespace {

using internal::Container;
using internal::SparseDelta;
using internal::Task;
using internal::WithWidth;

std::vector<Chunk> ChunksOf(const Container& c, const std::vector<Task>& tasks) {
  std::vector<Chunk> chunks;
  chunks.reserve(tasks.size());
  uint64_t first = 0;
  for (const Task& t : tasks) {
    const internal::TensorEntry& e = c.tensors[t.tensor];
    if (t.chunk == 0) first = 0;
    Chunk ch;
    ch.tensor = t.tensor;
    ch.index = t.chunk;
    ch.dtype = e.dtype;
    ch.width = DTypeWidth(e.dtype);
    ch.first_element = first;
    ch.elements = c.ChunkElements(e, t.chunk);
    first += ch.elements;
    chunks.push_back(ch);
  }
  return chunks;
}

// Consecutive chunks of a tensor on one cell's origin make the cell.
std::vector<Cell> CellsOf(const Container& c, const std::vector<Task>& tasks) {
  std::vector<Cell> cells;
  for (size_t i = 0; i < tasks.size(); ++i) {
    const internal::TensorEntry& e = c.tensors[tasks[i].tensor];
    const internal::Tile& tile = e.tiles[tasks[i].chunk];
    if (tasks[i].chunk == 0 || tile.first == 0) {
      Cell cell;
      cell.tensor = tasks[i].tensor;
      cell.row0 = tile.row0;
      cell.col0 = tile.col0;
      cell.cols = tile.cell_cols;
      cell.tensor_cols = e.cols;
      cell.first_chunk = i;
      cells.push_back(cell);
    }
    Cell& cell = cells.back();
    ++cell.chunks;
    cell.rows = (tile.first + tile.n) / tile.cell_cols;
  }
  return cells;
}

template <typename T>
void CopyOut(const std::vector<T>& v, std::vector<uint8_t>* out) {
  out->resize(v.size() * sizeof(T));
  if (!v.empty()) std::memcpy(out->data(), v.data(), out->size());
}

Status CheckSpec(const ClassSpec& spec, DType dtype) {
  const ExponentField ef = ExponentFieldOf(dtype);
  if (spec.k < 1 || spec.k > kMaxClasses || (spec.k > 1 && ef.mask == 0)) {
    return InvalidArgumentError("class spec with " + std::to_string(spec.k) + " classes for " +
                                std::string(DTypeName(dtype)));
  }
  if (spec.k > 1 && (spec.shift != ef.shift || spec.mask != ef.mask)) {
    return InvalidArgumentError("class spec exponent field does not match " + std::string(DTypeName(dtype)));
  }
  for (int t = 0; t + 1 < spec.k; ++t) {
    if (spec.thr[t] > ef.mask || (t > 0 && spec.thr[t] <= spec.thr[t - 1])) {
      return InvalidArgumentError("class spec thresholds not ascending within the exponent field");
    }
  }
  return Status::Ok();
}

}  // namespace

size_t HistogramBins(DType dtype) {
  const ExponentField ef = ExponentFieldOf(dtype);
  return ef.mask == 0 ? 0 : size_t{ef.mask} + 1;
}

size_t SampledElements(size_t n) { return internal::SampledElements(n); }

// ------------------------------------------------------------------ writer

struct PatchWriter::Impl {
  EncodeOptions options;
  Container c;
  std::vector<Task> tasks;
  std::vector<Chunk> chunks;
  std::vector<Cell> cells;
  std::vector<internal::EncodedChunk> encoded;
  std::vector<uint8_t> done, digested;
  bool checksums = false;

  internal::ChunkEntry& Entry(size_t i) { return c.tensors[chunks[i].tensor].chunks[chunks[i].index]; }
};

PatchWriter::PatchWriter(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
PatchWriter::PatchWriter(PatchWriter&&) noexcept = default;
PatchWriter& PatchWriter::operator=(PatchWriter&&) noexcept = default;
PatchWriter::~PatchWriter() = default;

StatusOr<PatchWriter> PatchWriter::Create(std::span<const TensorView> tensors, const EncodeOptions& options) {
  WSYNC_RETURN_IF_ERROR(internal::ValidateOptions(options));
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->options.pool = nullptr;
  Container& c = impl->c;
  c.kind = PatchKind::kPatch;
  c.chunk_bytes = options.chunk_bytes;
  c.base_version = options.base_version;
  c.target_version = options.target_version;
  WSYNC_RETURN_IF_ERROR(internal::ValidateSet(tensors, /*need_data=*/false));
  WSYNC_ASSIGN_OR_RETURN(c.tensors, internal::EntriesFor(tensors, options));
  impl->tasks = internal::TasksOf(c.tensors);
  impl->chunks = ChunksOf(c, impl->tasks);
  impl->cells = CellsOf(c, impl->tasks);
  impl->encoded.resize(impl->tasks.size());
  impl->done.assign(impl->tasks.size(), 0);
  impl->digested.assign(impl->tasks.size(), 0);
  return PatchWriter(std::move(impl));
}

const std::vector<Chunk>& PatchWriter::chunks() const { return impl_->chunks; }
const std::vector<Cell>& PatchWriter::cells() const { return impl_->cells; }

bool PatchWriter::gridded(size_t i) const { return impl_->c.tensors[impl_->chunks.at(i).tensor].gridded(); }

size_t PatchWriter::ClassSource(size_t i) const {
  const size_t index = impl_->chunks.at(i).index;
  return i - (index - ClassSourceChunk(index));
}

ClassSpec PatchWriter::ChooseClasses(size_t i, const uint32_t* hist, const ChunkChange& change) const {
  const Chunk& ch = impl_->chunks.at(i);
  internal::ChunkCodecOptions co{impl_->options.zstd_level, impl_->options.condition_on_base,
                                 ExponentFieldOf(ch.dtype), impl_->options.max_classes};
  return WithWidth(ch.width, [&](auto zero) {
    using T = decltype(zero);
    SparseDelta<T> d;
    d.pos.assign(change.pos, change.pos + change.count);
    if (change.delta != nullptr) {
      const T* delta = static_cast<const T*>(change.delta);
      d.delta.assign(delta, delta + change.count);
    }
    return internal::ChooseClasses<T>(ch.elements, hist, d, static_cast<const T*>(change.old), co);
  });
}

bool PatchWriter::NeedsRanks(size_t i, size_t count, const ClassSpec& spec) const {
  return internal::NeedsRanks(impl_->chunks.at(i).elements, count, spec);
}

namespace {

// A chunk's change as SetChunk and SetSparseChunk take it, checked: into d.
template <typename T>
Status ChangeOf(const Chunk& ch, const std::string& where, const ChunkChange& change, const ClassSpec& spec,
                SparseDelta<T>* d) {
  WSYNC_RETURN_IF_ERROR(CheckSpec(spec, ch.dtype).WithContext(where));
  if (change.count > ch.elements) return InvalidArgumentError(where + ": more changes than elements");
  if (change.count > 0 && (change.pos == nullptr || change.delta == nullptr)) {
    return InvalidArgumentError(where + ": no positions or deltas");
  }
  if (spec.k > 1 && change.count > 0 && change.old == nullptr) {
    return InvalidArgumentError(where + ": conditioned chunk without old values");
  }
  d->pos.assign(change.pos, change.pos + change.count);
  const T* delta = static_cast<const T*>(change.delta);
  d->delta.assign(delta, delta + change.count);
  for (size_t j = 0; j < change.count; ++j) {
    if (d->pos[j] >= ch.elements || (j > 0 && d->pos[j] <= d->pos[j - 1]) || d->delta[j] == 0) {
      return InvalidArgumentError(where + ": change " + std::to_string(j) + " is out of order, out of range or zero");
    }
  }
  return Status::Ok();
}

// Sparse streams made elsewhere for a chunk: their framing (class header,
// word counts) well formed and their classes spec's.
Status CheckSparseStreams(const Chunk& ch, const std::string& where, const ClassSpec& spec, std::string_view pos,
                          std::string_view val) {
  sparse::ChunkStreams streams;
  WSYNC_RETURN_IF_ERROR(
      internal::LocateSparseStreams(pos, val, ExponentFieldOf(ch.dtype), &streams).WithContext(where));
  bool same = streams.spec.k == spec.k;
  for (int t = 0; same && t < spec.k - 1; ++t) same = streams.spec.thr[t] == spec.thr[t];
  if (!same) return InvalidArgumentError(where + ": the position stream's classes are not the chunk's");
  return Status::Ok();
}

}  // namespace

Status PatchWriter::SetChunk(size_t i, const ChunkChange& change, const ClassSpec& spec, const uint32_t* rank) {
  if (i >= impl_->chunks.size()) return InvalidArgumentError("chunk " + std::to_string(i) + " out of range");
  const Chunk& ch = impl_->chunks[i];
  const std::string where = internal::ChunkWhere(impl_->c.tensors[ch.tensor], ch.index);
  const bool needs_ranks = internal::NeedsRanks(ch.elements, change.count, spec);
  if (needs_ranks && rank == nullptr) return InvalidArgumentError(where + ": ranks needed");
  return WithWidth(ch.width, [&](auto zero) -> Status {
    using T = decltype(zero);
    SparseDelta<T> d;
    WSYNC_RETURN_IF_ERROR(ChangeOf(ch, where, change, spec, &d));
    impl_->encoded[i] = internal::EncodeChunkStaged<T>(ch.elements, d, static_cast<const T*>(change.old), spec,
                                                       needs_ranks ? rank : nullptr, impl_->options.zstd_level);
    impl_->done[i] = 1;
    return Status::Ok();
  });
}

Status PatchWriter::SetSparseCoded(size_t i, uint64_t changed, const ClassSpec& spec, std::string_view pos,
                                   std::string_view val) {
  if (i >= impl_->chunks.size()) return InvalidArgumentError("chunk " + std::to_string(i) + " out of range");
  const Chunk& ch = impl_->chunks[i];
  const std::string where = internal::ChunkWhere(impl_->c.tensors[ch.tensor], ch.index);
  if (!sparse::SparseTried(ch.elements, changed) || changed * 32 > ch.elements) {
    return InvalidArgumentError(where + ": " + std::to_string(changed) + " changes of " +
                                std::to_string(ch.elements) + " elements are not coded in sparse mode alone");
  }
  WSYNC_RETURN_IF_ERROR(CheckSparseStreams(ch, where, spec, pos, val));
  internal::EncodedChunk& e = impl_->encoded[i];
  e.mode = internal::ChunkMode::kSparse;
  e.changed = changed;
  e.pos.assign(pos);
  e.val.assign(val);
  impl_->done[i] = 1;
  return Status::Ok();
}

Status PatchWriter::SetSparseChunk(size_t i, const ChunkChange& change, const ClassSpec& spec, std::string_view pos,
                                   std::string_view val) {
  if (i >= impl_->chunks.size()) return InvalidArgumentError("chunk " + std::to_string(i) + " out of range");
  const Chunk& ch = impl_->chunks[i];
  const std::string where = internal::ChunkWhere(impl_->c.tensors[ch.tensor], ch.index);
  if (!sparse::SparseTried(ch.elements, change.count)) {
    return InvalidArgumentError(where + ": " + std::to_string(change.count) + " changes of " +
                                std::to_string(ch.elements) + " elements are not coded in sparse mode");
  }
  WSYNC_RETURN_IF_ERROR(CheckSparseStreams(ch, where, spec, pos, val));
  return WithWidth(ch.width, [&](auto zero) -> Status {
    using T = decltype(zero);
    SparseDelta<T> d;
    WSYNC_RETURN_IF_ERROR(ChangeOf(ch, where, change, spec, &d));
    // ChooseMode weighs no other mode where the coder would weigh none.
    impl_->encoded[i] = internal::ChooseMode<T>(ch.elements, d, spec, impl_->options.zstd_level, std::string(pos),
                                                std::string(val));
    impl_->done[i] = 1;
    return Status::Ok();
  });
}

Status PatchWriter::SetChecksums(std::span<const uint64_t> target, std::span<const uint64_t> base) {
  Container& c = impl_->c;
  if (target.size() != c.tensors.size() || base.size() != c.tensors.size()) {
    return InvalidArgumentError("checksums for " + std::to_string(target.size()) + "/" +
                                std::to_string(base.size()) + " tensors, the patch has " +
                                std::to_string(c.tensors.size()));
  }
  for (size_t t = 0; t < c.tensors.size(); ++t) c.tensors[t].target_checksum = target[t];
  c.base_set_checksum = internal::SetChecksumOf(std::vector<uint64_t>(base.begin(), base.end()));
  impl_->checksums = true;
  return Status::Ok();
}

Status PatchWriter::SetTileDigest(size_t i, uint64_t digest) {
  if (i >= impl_->chunks.size()) return InvalidArgumentError("chunk " + std::to_string(i) + " out of range");
  if (!gridded(i)) return InvalidArgumentError("chunk " + std::to_string(i) + " is not a tile of a gridded tensor");
  impl_->Entry(i).digest = digest;
  impl_->digested[i] = 1;
  return Status::Ok();
}

StatusOr<std::string> PatchWriter::Finish() {
  for (size_t i = 0; i < impl_->done.size(); ++i) {
    if (!impl_->done[i]) return FailedPreconditionError("chunk " + std::to_string(i) + " was never set");
    if (gridded(i) && !impl_->digested[i]) {
      return FailedPreconditionError("the tile digest of chunk " + std::to_string(i) + " was never set");
    }
  }
  if (!impl_->checksums) return FailedPreconditionError("checksums were never set");
  return internal::Finish(impl_->c, impl_->tasks, impl_->encoded);
}

// ------------------------------------------------------------------ reader

struct PatchReader::Impl {
  Container c;
  std::vector<Task> tasks;
  std::vector<Chunk> chunks;

  // Chunk i with its tensor's and its own directory entries.
  struct Ref {
    const Chunk& chunk;
    const internal::TensorEntry& tensor;
    const internal::ChunkEntry& entry;
  };
  Ref At(size_t i) const {
    const Chunk& ch = chunks.at(i);
    const internal::TensorEntry& e = c.tensors[ch.tensor];
    return {ch, e, e.chunks[ch.index]};
  }
};

PatchReader::PatchReader(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
PatchReader::PatchReader(PatchReader&&) noexcept = default;
PatchReader& PatchReader::operator=(PatchReader&&) noexcept = default;
PatchReader::~PatchReader() = default;

StatusOr<PatchReader> PatchReader::Open(std::string_view patch, bool verify_checksum) {
  auto impl = std::make_unique<Impl>();
  WSYNC_ASSIGN_OR_RETURN(impl->c, internal::ReadContainer(patch, verify_checksum));
  impl->tasks = internal::TasksOf(impl->c.tensors);
  impl->chunks = ChunksOf(impl->c, impl->tasks);
  return PatchReader(std::move(impl));
}

PatchKind PatchReader::kind() const { return impl_->c.kind; }
uint32_t PatchReader::chunk_bytes() const { return impl_->c.chunk_bytes; }
uint64_t PatchReader::base_version() const { return impl_->c.base_version; }
uint64_t PatchReader::target_version() const { return impl_->c.target_version; }
uint64_t PatchReader::base_set_checksum() const { return impl_->c.base_set_checksum; }
size_t PatchReader::tensor_count() const { return impl_->c.tensors.size(); }
uint64_t PatchReader::target_checksum(size_t t) const { return impl_->c.tensors.at(t).target_checksum; }
const std::string& PatchReader::tensor_name(size_t t) const { return impl_->c.tensors.at(t).name; }
const std::vector<Chunk>& PatchReader::chunks() const { return impl_->chunks; }

bool PatchReader::flat() const {
  for (const internal::TensorEntry& e : impl_->c.tensors) {
    if (e.gridded()) return false;
    for (const internal::ChunkEntry& ch : e.chunks) {
      if (ch.absent) return false;
    }
  }
  return true;
}

bool PatchReader::gridded(size_t t) const { return impl_->c.tensors.at(t).gridded(); }

std::vector<TileGrid> PatchReader::grids() const {
  std::vector<TileGrid> out;
  for (const internal::TensorEntry& e : impl_->c.tensors) {
    if (e.gridded()) out.push_back({e.name, e.row_cuts, e.col_cuts});
  }
  return out;
}
uint64_t PatchReader::tile_digest(size_t i) const { return impl_->At(i).entry.digest; }

StatusOr<std::vector<ApplyPlan>> PlanApply(std::span<const PatchReader* const> parts, const Destination& destination,
                                           const ApplyOptions& options, bool as_parts) {
  std::vector<const Container*> containers;
  for (const PatchReader* r : parts) containers.push_back(&r->impl_->c);
  return internal::PlanApply(containers, destination, options, as_parts);
}

StatusOr<std::vector<size_t>> PatchReader::Match(std::span<const MutableTensorView> dst, bool allow_extra) const {
  WSYNC_ASSIGN_OR_RETURN(auto matched, internal::MatchTensors(impl_->c, dst, allow_extra));
  std::vector<size_t> out;
  for (const MutableTensorView* m : matched) out.push_back(static_cast<size_t>(m - dst.data()));
  return out;
}

Status PatchReader::DecodePositions(size_t i, DecodedChunk* out) const {
  const Container& c = impl_->c;
  if (c.kind != PatchKind::kPatch) return FailedPreconditionError("a keyframe has no positions");
  const Impl::Ref r = impl_->At(i);
  return WithWidth(r.chunk.width, [&](auto zero) -> Status {
    using T = decltype(zero);
    SparseDelta<T> d;  // empty and dense chunks decode completely here
    WSYNC_RETURN_IF_ERROR(internal::DecodeChunkPositions<T>(r.entry.mode, r.entry.changed, c.PosStream(r.entry),
                                                            c.ValStream(r.entry), r.chunk.elements,
                                                            ExponentFieldOf(r.tensor.dtype), out, &d)
                              .WithContext(internal::ChunkWhere(r.tensor, r.chunk.index)));
    if (!out->values_pending) {
      out->pos = std::move(d.pos);
      CopyOut(d.delta, &out->delta);
    }
    return Status::Ok();
  });
}

Status PatchReader::DecodeValues(size_t i, const void* old, DecodedChunk* out) const {
  const Impl::Ref r = impl_->At(i);
  return WithWidth(r.chunk.width, [&](auto zero) -> Status {
    using T = decltype(zero);
    if (!out->values_pending) return Status::Ok();
    SparseDelta<T> d;
    WSYNC_RETURN_IF_ERROR(
        internal::DecodeChunkValues<T>(impl_->c.ValStream(r.entry), *out, static_cast<const T*>(old), &d)
            .WithContext(internal::ChunkWhere(r.tensor, r.chunk.index)));
    CopyOut(d.delta, &out->delta);
    out->values_pending = false;
    return Status::Ok();
  });
}

StatusOr<bool> PatchReader::LocateSparse(size_t i, sparse::ChunkStreams* out) const {
  const Impl::Ref r = impl_->At(i);
  if (impl_->c.kind != PatchKind::kPatch || r.entry.mode != internal::ChunkMode::kSparse || r.entry.changed == 0 ||
      r.entry.changed > r.chunk.elements) {
    return false;
  }
  WSYNC_RETURN_IF_ERROR(internal::LocateSparseStreams(impl_->c.PosStream(r.entry), impl_->c.ValStream(r.entry),
                                                      ExponentFieldOf(r.tensor.dtype), out)
                            .WithContext(internal::ChunkWhere(r.tensor, r.chunk.index)));
  return true;
}

uint64_t PatchReader::changed(size_t i) const { return impl_->At(i).entry.changed; }

Status PatchReader::DecodeKeyframe(size_t i, void* out) const {
  const Container& c = impl_->c;
  if (c.kind != PatchKind::kKeyframe) return FailedPreconditionError("not a keyframe");
  const Impl::Ref r = impl_->At(i);
  return WithWidth(r.chunk.width, [&](auto zero) -> Status {
    using T = decltype(zero);
    return internal::DecodeKeyframeChunk<T>(c.PosStream(r.entry), r.chunk.elements, static_cast<T*>(out))
        .WithContext(internal::ChunkWhere(r.tensor, r.chunk.index));
  });
}

Status MergeRankedPositions(const uint32_t* pos_by_class, const void* old_by_class, size_t width,
                            DecodedChunk* out, std::vector<uint8_t>* old_sorted) {
  const size_t m = out->ranks.size();
  // Each class's positions ascend (its ranks do): merge the k lists.
  const int k = static_cast<int>(out->class_counts.size());
  size_t at[kMaxClasses], end[kMaxClasses];
  size_t start = 0;
  for (int c = 0; c < k; ++c) {
    at[c] = start;
    start += out->class_counts[c];
    end[c] = start;
  }
  if (start != m) return DataLossError("position stream: class counts do not sum to the changes");
  out->pos.resize(m);
  old_sorted->resize(m * width);
  const auto* old = static_cast<const uint8_t*>(old_by_class);
  for (size_t j = 0; j < m; ++j) {
    int best = -1;
    for (int c = 0; c < k; ++c) {
      if (at[c] < end[c] && (best < 0 || pos_by_class[at[c]] < pos_by_class[at[best]])) best = c;
    }
    const size_t from = at[best]++;
    if (at[best] < end[best] && pos_by_class[at[best]] <= pos_by_class[from]) {
      return DataLossError("position stream: class " + std::to_string(best) + " positions do not ascend");
    }
    out->pos[j] = pos_by_class[from];
    if (j > 0 && out->pos[j] == out->pos[j - 1]) {
      return DataLossError("position stream: position " + std::to_string(out->pos[j]) + " decoded twice");
    }
    std::memcpy(old_sorted->data() + j * width, old + from * width, width);
  }
  out->ranked = false;
  out->ranks.clear();
  out->class_counts.clear();
  return Status::Ok();
}

}  // namespace wsync::codec::staged
