// A chunk gathered from its placement into a slot of a flat image (the
// device's apply into pieces and tile grids, placed.h): the kernel's
// per-element body, WSYNC_HD so that the host runs it too.
#pragma once

#include <cstdint>

#include "wsync/codec/tile_map.h"

namespace wsync::cuda {

struct TileJob {
  const void* src = nullptr;  // the destination tensor's data
  codec::TileMap map;
};

// Element k (< slot) of slot j of the image: the chunk's element k at its
// placement, or zero past the chunk's elements.
template <typename T>
WSYNC_HD inline void GatherTileElement(const TileJob& job, uint64_t j, uint64_t slot, uint64_t k, T* image) {
  image[j * slot + k] = k < job.map.n ? static_cast<const T*>(job.src)[codec::PlacedElement(job.map, k)] : T{0};
}

}  // namespace wsync::cuda
