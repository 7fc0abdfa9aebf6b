// The coordinator's published layout (internal to wsync::control): the
// tensors every version carries, set by the first source (or, for a layout
// of several parts, by each part's source) and checked against every later
// one (wsync/control/layout.h).
//
// Thread safety: not thread-safe. REQUIRES for every method: the
// coordinator's mutex held (a test using it alone: one thread).
#pragma once

#include <cstdint>
#include <optional>

#include "record_log.h"
#include "wsync/util/status.h"
#include "wsync/v1/coordinator.pb.h"
#include "wsync/v1/store.pb.h"

namespace wsync::control {

class LayoutRegistry {
 public:
  // CoordinatorState::SetLayout's contract; a change goes through `log`
  // (a layout_set record holding the whole layout).
  Status Set(const wsync::v1::Layout& layout, const RecordLog& log);
  // The layout; `set` once it is (every part of one of several parts).
  wsync::v1::GetLayoutResponse Get() const;
  // Applies a layout_set record.
  void Apply(const wsync::v1::Layout& layout) { layout_ = layout; }

  // The layout, unset before any Set.
  const std::optional<wsync::v1::Layout>& layout() const { return layout_; }
  // The parts (sources) the layout is set for: 0 before any, else at least 1.
  uint32_t parts() const;

  // Writes the layout, if set, into `snapshot`; LoadFrom applies it.
  void SaveTo(wsync::store::v1::Snapshot* snapshot) const;
  void LoadFrom(const wsync::store::v1::Snapshot& snapshot);

 private:
  // A part of a layout of several. REQUIRES: `layout` has a tensor.
  Status SetPart(const wsync::v1::Layout& layout, const RecordLog& log);

  std::optional<wsync::v1::Layout> layout_;
};

}  // namespace wsync::control
