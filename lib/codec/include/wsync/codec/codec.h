// wsync::codec: the patch format's reference implementation.
//
// A patch takes a set of tensors from a base version to a target version,
// losslessly: every element's new bit pattern is old + d (mod 2^w), with d
// coded sparsely. A keyframe is a self-contained copy of a set. Both are one
// byte string, specified in docs/patch-format.md.
//
// Every decoder here treats its input as hostile: lengths, counts and offsets
// are checked before use and failures name what was wrong. Applying is
// all-or-nothing: on any error the destination holds exactly what it held
// before the call.
//
// Thread safety: all functions are reentrant. Work runs on the ThreadPool of
// the options when one is given (one ParallelFor at a time per pool).
#pragma once

#include <concepts>
#include <cstdint>
#include <functional>
#include <limits>
#include <utility>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "wsync/codec/dtype.h"
#include "wsync/util/status.h"

namespace wsync {
class ThreadPool;
}

namespace wsync::codec {

// A tensor the caller owns. REQUIRES: data points to NumBytes() readable bytes
// for as long as the view is used.
struct TensorView {
  std::string name;
  DType dtype = DType::kBF16;
  std::vector<uint64_t> shape;
  const uint8_t* data = nullptr;

  // Elements (product of shape; 1 for a scalar). Saturates to UINT64_MAX.
  uint64_t NumElements() const;
  uint64_t NumBytes() const;
};

// A tensor the codec writes into. REQUIRES: data points to NumBytes()
// writable bytes for as long as the view is used.
struct MutableTensorView {
  std::string name;
  DType dtype = DType::kBF16;
  std::vector<uint64_t> shape;
  uint8_t* data = nullptr;

  uint64_t NumElements() const;
  uint64_t NumBytes() const;
  TensorView AsConst() const { return {name, dtype, shape, data}; }
};

// The tile grid of one tensor (docs/patch-format.md, "Tiles"): cuts of its
// two-dimensional view (rows = shape[0], columns = the product of the other
// dimensions; a 1-D tensor is a column, a scalar one element). The cuts split
// the tensor into cells; chunks never cross a cell, and every chunk of a
// gridded tensor carries the digest of its target bytes, so that a sink that
// holds whole cells (a tensor-parallel shard) can decode, apply and verify
// them alone. A tensor with no cuts is coded as in a flat tensor.
struct TileGrid {
  std::string tensor;
  std::vector<uint64_t> row_cuts;  // strictly ascending, each in (0, rows)
  std::vector<uint64_t> col_cuts;  // strictly ascending, each in (0, columns)
};

struct EncodeOptions {
  // Level for the zstd-coded streams (directory, bitmaps, dense deltas,
  // keyframes). 1..19.
  int zstd_level = 3;
  // Condition the position and value models on the exponent of the base
  // value (better ratio). A patch coded without it merges without the base.
  bool condition_on_base = true;
  // Most exponent classes per chunk when conditioning, 1..8 (the format's
  // limit). The dial between ratio and speed: each class costs encode and
  // apply a compare and a bit deposit per element. 6 is where the ratio
  // stops moving (docs/codec.md); fewer is faster at a larger patch.
  int max_classes = 6;
  // Coding chunk size: a power of two in [1 MiB, 64 MiB].
  uint32_t chunk_bytes = 1u << 20;
  // Informational versions recorded in the header.
  uint64_t base_version = 0;
  uint64_t target_version = 0;
  // The base's set checksum (SetChecksum(base)), when the caller knows it:
  // a source does, it is the target_set_checksum of the patch or keyframe
  // that made the base its head. EncodePatch then does not hash the base.
  // REQUIRES: equal to SetChecksum(base). A wrong value cannot corrupt
  // weights (every tensor's result is verified against the target's
  // checksums), but appliers would then misreport a corrupt patch as a
  // wrong base, and merges against the base would be refused.
  std::optional<uint64_t> base_set_checksum;
  // Runs chunks in parallel when set.
  ThreadPool* pool = nullptr;
  // Tile grids by tensor name (GridsFor builds them from sinks' pieces).
  // Tensors without one are not gridded. InvalidArgument for a grid naming
  // no tensor of the set or a cut out of range.
  std::vector<TileGrid> grids;
};

// Encodes the patch from `base` to `target`.
// REQUIRES: base[i] and target[i] have the same name, dtype and shape, names
// are unique. InvalidArgument naming the tensor otherwise.
StatusOr<std::string> EncodePatch(std::span<const TensorView> base,
                                  std::span<const TensorView> target,
                                  const EncodeOptions& options);

// Encodes a keyframe: a self-contained, entropy-coded copy of `target`.
StatusOr<std::string> EncodeKeyframe(std::span<const TensorView> target,
                                     const EncodeOptions& options);

struct ApplyOptions {
  ThreadPool* pool = nullptr;
  // Check the whole-patch checksum before decoding. Only tests and fuzzers
  // turn this off, to exercise the structural checks behind it.
  bool verify_patch_checksum = true;
  // Accept destination tensors that the patch does not mention (left as is).
  bool allow_extra_tensors = false;
  // A keyframe whose values take at most this many bytes is kept decoded
  // from its check (for an ApplyAhead: before the destination is written)
  // and copied into the destination when written; a larger one is decoded
  // a second time then. 0: always decoded again (no memory beyond a
  // chunk's per thread).
  uint64_t keyframe_keep_bytes = 0;
  // What staging keeps of a version's patch changes (per changed value its
  // position, delta and old value: 8 bytes for BF16), at most this many
  // bytes over all its parts. A chunk past it is decoded and checked when
  // staged and its change dropped; the writes decode it again, in groups
  // of at most this many bytes, after the changes kept. A value another
  // writer changed in such a chunk since its check is found before the
  // group is written: in the first group everything written is put back
  // (FailedPrecondition), in a later one the groups written before it
  // cannot be, and the apply fails with DataLoss: the destination then
  // holds neither version. Default: no bound.
  uint64_t stage_keep_bytes = std::numeric_limits<uint64_t>::max();
};

// Merges patch(j->k) and patch(k->l) into patch(j->l), identical in effect
// to applying both. `first` may also be a keyframe (of k): the result is then
// a keyframe of l. `base` holds version j (the first patch's base); it is
// needed only when a patch's coding is conditioned on the base, and then
// FailedPrecondition says so. FailedPrecondition too when the patches do not
// chain (second's base is not first's target).
StatusOr<std::string> MergePatches(std::string_view first, std::string_view second,
                                   std::span<const TensorView> base,
                                   const EncodeOptions& options);

// ---- Pieces: a sink that holds parts of the canonical tensors.
//
// A piece is a box of a canonical tensor (a tensor of the patch) held at a
// box of the same shape in a runtime tensor (an engine's parameter: a
// tensor-parallel shard, a fused qkv or gate_up tensor). Supported boxes are
// rectangles of the two-dimensional view: a box may start and end anywhere
// in dimensions 0 and 1 and spans every further dimension whole, in the
// canonical tensor and the runtime tensor alike (these dimensions must be
// equal). Several pieces may hold the same canonical box (replicated
// key/value heads); runtime elements no piece covers are never written.
struct Piece {
  std::string canonical;                  // name of the canonical tensor
  std::vector<uint64_t> start;            // box start in the canonical tensor, per dimension
  std::vector<uint64_t> extent;           // box extent, per dimension
  std::vector<uint64_t> runtime_start;    // where the box starts in the runtime tensor
};

struct RuntimeTensor {
  MutableTensorView view;      // the runtime tensor (its dtype is every piece's)
  std::vector<Piece> pieces;
};

// Checks pieces against the canonical tensors (names, dtypes and shapes;
// data unused) and the tile grids their patches are coded with: every box
// inside both tensors and of a supported shape (InvalidArgument), no two
// boxes overlapping in a runtime tensor (InvalidArgument), every canonical
// tensor named in `canonical` with the runtime tensor's dtype, and every
// piece a union of whole cells of its tensor's grid, or the whole of an
// ungridded tensor (FailedPrecondition). Errors name the runtime tensor and
// the piece. What a sink checks when it registers pieces.
Status ValidatePieces(std::span<const RuntimeTensor> runtime, std::span<const TensorView> canonical,
                      std::span<const TileGrid> grids);

// The tile grids that make every piece of these layouts a union of whole
// cells: the union of the pieces' box boundaries per canonical tensor.
// REQUIRES: pieces valid (ValidatePieces).
std::vector<TileGrid> GridsFor(std::span<const std::vector<RuntimeTensor>> layouts,
                               std::span<const TensorView> canonical);

// Where an apply writes: whole tensors, matched by name, or the pieces of
// runtime tensors. Made from any contiguous range of either.
class Destination {
 public:
  template <typename R>
    requires std::convertible_to<const R&, std::span<const MutableTensorView>>
  Destination(const R& tensors) : tensors_(tensors) {}  // NOLINT: implicit by design
  template <typename R>
    requires std::convertible_to<const R&, std::span<const RuntimeTensor>>
  Destination(const R& runtime) : runtime_(runtime), pieces_(true) {}  // NOLINT: implicit by design

  bool pieces() const { return pieces_; }
  std::span<const MutableTensorView> tensors() const { return tensors_; }
  std::span<const RuntimeTensor> runtime() const { return runtime_; }

 private:
  std::span<const MutableTensorView> tensors_;
  std::span<const RuntimeTensor> runtime_;
  bool pieces_ = false;
};

// Applies one version in place: a patch or a keyframe, or the parts of a
// version published by several sources (each source a disjoint subset of the
// tensors, one patch or keyframe per part), all or nothing. The destination
// must not be read while this runs. A destination that does not hold the
// patch's base version is FailedPrecondition (a sink then needs a keyframe);
// a corrupt patch DataLoss.
//
// Whole tensors: matched by name, each with the patch's dtype and shape
// (tensors the patch does not mention: allow_extra_tensors). A patch is
// decoded chunk by chunk into scratch and every result verified against its
// checksum before the first byte is written (a chunk that fails to decode
// or a checksum that differs is named, the destination unchanged); then
// only the changed values are written. A keyframe is decoded and verified
// before the first byte is written. A selection (SelectForPieces) is
// refused (FailedPrecondition).
//
// Pieces: exactly the changes that fall inside the pieces, nothing outside
// them. Only the chunks inside some piece are decoded; each result is
// verified before the writes against its digest (a piece that covers an
// ungridded tensor whole against the tensor's checksum); nothing is written
// on any failure.
// FailedPrecondition when a piece cuts a chunk (the source's grid does not
// include this layout: GridsFor), names a tensor the patch lacks, or the
// patch lacks a chunk a piece needs; DataLoss when a result differs from its
// digest (a corrupt patch, or pieces that do not hold the base).
//
// Parts: every part is verified before anything is written, then the
// patch parts written one after the other and the keyframes, every part undone
// when any fails. Tensors are matched by name across the parts; a tensor in
// two parts is FailedPrecondition, as is a destination tensor (or a piece's
// tensor) in none (unless allow_extra_tensors, for whole tensors). One part
// given as a list is checked as the parts of a version are.
Status Apply(std::string_view patch, const Destination& destination, const ApplyOptions& options);
Status Apply(std::span<const std::string_view> parts, const Destination& destination, const ApplyOptions& options);

// ---- Streams: one or more containers back to back (docs/patch-format.md,
// "Streams"). A stream of one container is a plain patch or keyframe; a
// stream of several (segments, each over its own tensors) is applied as the
// parts of one version are, all or nothing.

// The segments of a stream. DataLoss naming the segment when a preamble does
// not parse or the bytes end inside a segment; an empty stream has none.
StatusOr<std::vector<std::string_view>> SplitSegments(std::string_view stream);

// One container of a stream's segments (the same kind, chunk size and
// versions; disjoint tensors, taken in order), with `base_set_checksum` as
// the set checksum of the base (patches: that of all segments' tensors,
// which no segment records). Byte for byte the container that encoding all
// the tensors at once gives. InvalidArgument naming what differs; the
// segments' errors (DataLoss) as ReadContainer's.
StatusOr<std::string> JoinSegments(std::span<const std::string_view> segments, uint64_t base_set_checksum);

// Consecutive groups [begin, end) of whole tensors of about `bytes` (dense)
// each: the segments of a set (one group when bytes is 0 or the set is
// smaller; a tensor larger than `bytes` is a group of its own or ends one).
std::vector<std::pair<size_t, size_t>> SegmentGroups(std::span<const TensorView> tensors, uint64_t bytes);

// The patch from base to target encoded segment by segment (SegmentGroups
// of about segment_bytes; each segment a container of its tensors with the
// options' grids for them), each handed to on_segment(index, bytes) as soon
// as it is encoded (an error from it ends the encode); returns them joined
// (JoinSegments: the bytes EncodePatch gives). base_tensor_checksums: the
// base's tensor checksums on options.grids when the caller knows them (a
// source: its last target's), else empty (hashed here).
// options.base_set_checksum is not used. EncodePatch's errors.
StatusOr<std::string> EncodeSegmented(std::span<const TensorView> base, std::span<const TensorView> target,
                                      const EncodeOptions& options, uint64_t segment_bytes,
                                      std::span<const uint64_t> base_tensor_checksums,
                                      const std::function<Status(size_t, std::string_view)>& on_segment);

// An apply staged while the stream arrives, so that the destination's
// readers stop only for the writes. Fed the stream's bytes as they come in
// (Advance), it stages each chunk of a patch segment as soon as its streams
// are in: decoded against the destination's bytes at that moment, its
// result built in scratch and checked against the patch's digest, the
// change kept with the old values it replaces. Prepare(stream) stages the
// rest and checks everything; Apply(stream) then writes the changed values
// and nothing else, each only where the destination still holds the value
// it was staged against: codec::Apply's contract, one segment being one
// part. Until Apply only reads the destination (its readers may go on);
// Apply and Confirm need no other writer. A value changed by another writer
// between staging and Apply is found as it is overwritten: Apply puts back
// what it wrote and returns FailedPrecondition naming the chunk. A write
// elsewhere in a chunk is found by Confirm. Keyframe segments are decoded
// and verified by Prepare, written by Apply. What staging keeps: per change
// a 4-byte position, the delta and the old value (8 bytes for BF16), up to
// ApplyOptions::stage_keep_bytes.
// Not thread-safe; the tensors must outlive it.
class ApplyAhead {
 public:
  ApplyAhead(std::span<const MutableTensorView> tensors, const ApplyOptions& options);
  ApplyAhead(std::span<const RuntimeTensor> runtime, const ApplyOptions& options);
  ApplyAhead(ApplyAhead&&) noexcept;
  ApplyAhead& operator=(ApplyAhead&&) noexcept;
  ~ApplyAhead();

  // The stream's first bytes: the same bytes at every call, growing. Bytes
  // that do not parse stop the decoding ahead; Apply reads them again and
  // names what is wrong.
  void Advance(std::string_view prefix);
  // The complete stream, before the destination may be written: checks it
  // (each segment's checksum, its tensors against the destination's) and
  // stages every chunk not staged yet, writing nothing. An error is the one
  // Apply would return (a corrupt or mismatched patch is refused here).
  // Apply of the same bytes then only writes.
  Status Prepare(std::string_view stream);
  // Applies the complete stream (prepared first if Prepare was not given it).
  Status Apply(std::string_view stream);
  // After a successful Apply, reads the destination back (the readers may
  // have resumed): DataLoss naming the first chunk that is not the
  // version's (another writer changed a value the patch did not, between
  // staging and Apply). Ok for a stream Apply could not stage (it was
  // applied whole and verified then).
  Status Confirm() const;
  // Chunks staged while the stream arrived.
  size_t staged_ahead() const;
  // Chunks whose change staging did not keep (past
  // ApplyOptions::stage_keep_bytes), decoded again by the last Apply.
  size_t decoded_again() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A 64-bit name of a layout (runtime tensors' names and shapes and their
// pieces; never 0): what a sink sends with a pull so that a source that
// serves that layout sends only its selection (SelectForPieces).
uint64_t LayoutFingerprint(std::span<const RuntimeTensor> runtime);

// The part of a patch or keyframe that the pieces need: the same directory
// with every other chunk marked absent and its streams dropped (a selection,
// docs/patch-format.md). Apply into pieces takes it as it takes the whole
// patch; into whole tensors refuses it (FailedPrecondition). The bytes a sink holding one
// shard receives. Pieces of tensors the patch lacks are left out (they are
// another part's, when several sources publish the version).
StatusOr<std::string> SelectForPieces(std::string_view patch, std::span<const RuntimeTensor> runtime);

enum class PatchKind : uint8_t { kPatch = 1, kKeyframe = 2 };

struct TensorInfo {
  std::string name;
  DType dtype = DType::kBF16;
  std::vector<uint64_t> shape;
  uint64_t changed = 0;          // elements changed (all, for a keyframe)
  uint64_t position_bytes = 0;   // bytes of position streams
  uint64_t value_bytes = 0;      // bytes of value streams
  uint64_t target_checksum = 0;
  uint32_t chunks = 0;
  uint32_t conditioned_chunks = 0;  // chunks whose coding uses the base
  uint32_t mode_counts[5] = {};     // chunks per mode (see ChunkMode)
  uint32_t absent_chunks = 0;       // chunks a selection left out
  std::vector<uint64_t> row_cuts;   // the tile grid (empty: not gridded)
  std::vector<uint64_t> col_cuts;

  uint64_t DenseBytes() const;
};

struct PatchInfo {
  PatchKind kind = PatchKind::kPatch;
  uint16_t format_version = 0;
  uint32_t chunk_bytes = 0;
  uint64_t base_version = 0;
  uint64_t target_version = 0;
  uint64_t base_set_checksum = 0;  // 0 for a keyframe
  uint64_t target_set_checksum = 0;
  uint64_t total_bytes = 0;        // the whole patch
  uint64_t header_bytes = 0;       // preamble + directory
  std::vector<TensorInfo> tensors;
};

// Parses and validates the header and directory (and the whole-patch
// checksum); decodes no stream.
StatusOr<PatchInfo> InspectPatch(std::string_view patch, bool verify_patch_checksum = true);

// The set checksum the patch format records for a set of ungridded
// tensors: Hash64 over the tensors' checksums (checksum.h) in order.
uint64_t SetChecksum(std::span<const TensorView> tensors, ThreadPool* pool = nullptr);

// The set checksum of tensors with these tensor checksums, in order:
// SetChecksum without the data (what a daemon computes from checksums it
// keeps, or a device computed).
uint64_t SetChecksumOf(std::span<const uint64_t> tensor_checksums);

// The tensor checksums SetChecksum(tensors, grids) takes the set's of, in
// order (InvalidArgument as SetChecksum's).
StatusOr<std::vector<uint64_t>> TensorChecksums(std::span<const TensorView> tensors, std::span<const TileGrid> grids,
                                                ThreadPool* pool = nullptr);

// The checksum the format records for tensor t coded with `grid`: the
// 1 MiB blocks of each cell in turn (docs/patch-format.md, "Checksums");
// without a grid (nullptr, or no cuts) TensorChecksum of its bytes.
// InvalidArgument when the grid does not fit t.
StatusOr<uint64_t> TensorChecksumOf(const TensorView& t, const TileGrid* grid, ThreadPool* pool = nullptr);
// SetChecksum of tensors coded with these grids (by tensor name; a tensor
// without one is ungridded). InvalidArgument for a grid that fits no tensor.
StatusOr<uint64_t> SetChecksum(std::span<const TensorView> tensors, std::span<const TileGrid> grids,
                               ThreadPool* pool = nullptr);

// Entropy bounds of the change from base to target, in bits.
struct DiffStats {
  uint64_t elements = 0;
  uint64_t changed = 0;
  uint64_t dense_bytes = 0;
  double position_bits_order0 = 0;       // sum over tensors of n * H(m/n)
  double position_bits_conditional = 0;  // conditioned on the base exponent
  double value_bits_order0 = 0;          // order-0 entropy of the deltas
  double value_bits_conditional = 0;     // entropy of the deltas given the base exponent
  double Order0Bits() const { return position_bits_order0 + value_bits_order0; }
  double ConditionalBits() const { return position_bits_conditional + value_bits_conditional; }
};

// Measures the empirical entropy bounds that a patch can be compared with.
StatusOr<DiffStats> AnalyzeDiff(std::span<const TensorView> base,
                                std::span<const TensorView> target);

}  // namespace wsync::codec
