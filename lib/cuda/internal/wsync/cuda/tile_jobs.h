// A chunk moved between its placement and a slot of a flat image (the
// device's apply into pieces and tile grids, placed.h): the kernels'
// per-element bodies, WSYNC_HD so that the host runs them too.
#pragma once

#include <cstdint>

#include "wsync/codec/tile_map.h"

namespace wsync::cuda {

struct TileJob {
  void* data = nullptr;  // the destination tensor's
  codec::TileMap map;
};

// Element k (< slot) of slot j of the image: the chunk's element k at its
// placement, or zero past the chunk's elements.
template <typename T>
WSYNC_HD inline void GatherTileElement(const TileJob& job, uint64_t j, uint64_t slot, uint64_t k, T* image) {
  image[j * slot + k] = k < job.map.n ? static_cast<const T*>(job.data)[codec::PlacedElement(job.map, k)] : T{0};
}

// The reverse: the chunk's element k at its placement from slot j (k < slot;
// nothing past the chunk's elements).
template <typename T>
WSYNC_HD inline void ScatterTileElement(const TileJob& job, uint64_t j, uint64_t slot, uint64_t k, const T* image) {
  if (k < job.map.n) static_cast<T*>(job.data)[codec::PlacedElement(job.map, k)] = image[j * slot + k];
}

}  // namespace wsync::cuda
