// The apply side's plan (private): which chunk goes where, with the checks
// and errors of Apply, shared by apply.cc, apply_chunks.cc and staged.cc
// (defined in apply_plan.cc).
//
// A whole-set apply places every chunk of every tensor at the destination
// tensor of its name; a sink holding pieces places the chunks inside its
// pieces in its runtime tensors (a replicated box: several placements of
// one chunk). Both run the same sequence: decode against the bytes at the
// placement, add, verify, undo everything on any failure (apply_chunks.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "format.h"
#include "patch_common.h"
#include "wsync/codec/codec.h"
#include "wsync/codec/staged.h"
#include "wsync/util/status.h"

namespace wsync::codec::internal {

// One chunk at one placement.
struct Work {
  size_t tensor = 0;  // in the container
  size_t chunk = 0;
  Placement at;
  size_t group = 0;   // ungridded tensors: the placed tensor its checksum verifies
  size_t dst = 0;     // the destination (whole) or runtime (pieces) tensor
};

// The works of one part, and the placed tensors (groups) whose checksums
// verify them.
struct Plan {
  std::vector<Work> works;
  std::vector<size_t> group_tensor;      // per group: its container tensor
  std::vector<std::string> group_where;  // per group: how errors name it
  bool whole = true;                     // every tensor at its own destination

  // How errors name work i: its chunk, and where it is placed unless whole.
  std::string WorkWhere(const Container& c, size_t i) const {
    const Work& w = works[i];
    return ChunkWhere(c.tensors[w.tensor], w.chunk) + (whole ? "" : " in " + group_where[w.group]);
  }

  std::vector<uint64_t> GroupBytes(const Container& c) const {
    std::vector<uint64_t> out;
    for (size_t t : group_tensor) out.push_back(c.tensors[t].nbytes);
    return out;
  }
};

// first: the caller's list of destinations (Work::dst indexes it).
Plan WholePlan(const Container& c, const std::vector<const MutableTensorView*>& dst, const MutableTensorView* first);

// The works that apply a container into pieces. need_data: the runtime
// tensors' data must be set.
// other_parts: pieces of tensors the container lacks belong to other parts
// of the version (skipped) rather than being an error.
StatusOr<Plan> PiecesPlan(const Container& c, std::span<const RuntimeTensor> runtime, bool need_data,
                          bool other_parts = false);

// FailedPrecondition (AbsentChunk) for the first work whose chunk the patch
// lacks (a selection for other pieces).
Status CheckPresent(const Container& c, const Plan& p);

// Parts of one version hold disjoint tensors, which cover the destination
// (unless allow_extra_tensors).
Status CheckWholeParts(std::span<const Container* const> parts, std::span<const MutableTensorView> tensors,
                       const ApplyOptions& options);

// The same for pieces: every piece's tensor in exactly one part.
Status CheckPiecesParts(std::span<const Container* const> parts, std::span<const RuntimeTensor> runtime);

// Matches the container's tensors to destination views by name.
StatusOr<std::vector<const MutableTensorView*>> MatchTensors(const Container& c,
                                                             std::span<const MutableTensorView> dst,
                                                             bool allow_extra);

// The works Apply would run for each part (chunk indices in task order),
// with its checks and errors; as_parts: the containers are the parts of one
// version (Apply's list form).
StatusOr<std::vector<staged::ApplyPlan>> PlanApply(std::span<const Container* const> parts,
                                                   const Destination& destination, const ApplyOptions& options,
                                                   bool as_parts);

}  // namespace wsync::codec::internal
