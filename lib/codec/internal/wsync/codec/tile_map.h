// Where a chunk's elements lie at a placement (docs/patch-format.md,
// "Tiles" and "Pieces"): the one address computation the host's plan and
// the device's gather and scatter share. WSYNC_HD, no allocation.
#pragma once

#include <cstdint>

#include "wsync/codec/dtype.h"

namespace wsync::codec {

// A chunk (a run of its cell's elements in row-major order) at a placement
// in a destination tensor of `cols` columns, whose canonical (r, c) is at
// (r + drow, c + dcol).
struct TileMap {
  uint64_t row0 = 0, col0 = 0, cell_cols = 1;  // the cell: its origin and width
  uint64_t first = 0, n = 0;                    // the chunk: elements [first, first + n) of the cell
  uint64_t cols = 1;                            // the destination's columns
  int64_t drow = 0, dcol = 0;
};

// The destination element of the chunk's element k (< n).
WSYNC_HD inline uint64_t PlacedElement(const TileMap& m, uint64_t k) {
  const uint64_t idx = m.first + k;
  const uint64_t r = m.row0 + idx / m.cell_cols, c = m.col0 + idx % m.cell_cols;
  return static_cast<uint64_t>(static_cast<int64_t>(r) + m.drow) * m.cols +
         static_cast<uint64_t>(static_cast<int64_t>(c) + m.dcol);
}

}  // namespace wsync::codec
