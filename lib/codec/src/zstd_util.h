// zstd one-shot helpers (private).
#pragma once

#include <string>
#include <string_view>

#include "wsync/util/status.h"

namespace wsync::codec::internal {

// Appends the zstd frame of `data` to *out.
void ZstdCompress(std::string_view data, int level, std::string* out);

// OK when `frame` starts a zstd frame that declares exactly `expected`
// bytes of content (cheap: reads the frame header only).
Status ZstdCheckFrameSize(std::string_view frame, size_t expected, std::string_view what);

// Decompresses one frame that must hold exactly `expected` bytes into dst.
// DataLoss naming `what` when the frame is malformed or of another size.
Status ZstdDecompressExact(std::string_view frame, void* dst, size_t expected, std::string_view what);

}  // namespace wsync::codec::internal
