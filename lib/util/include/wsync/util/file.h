// Whole-file reads and atomic whole-file writes.
#pragma once

#include <string>
#include <string_view>

#include "wsync/util/status.h"

namespace wsync {

StatusOr<std::string> ReadFile(const std::string& path);

// Writes all n bytes to fd, retrying short writes and EINTR; errors name `what`.
Status WriteAll(int fd, const void* data, size_t n, const std::string& what);

// Writes through `path.tmp.PID` (created with `mode`) + fsync + rename:
// readers see the old file or the new one, never a partial one.
Status WriteFileAtomic(const std::string& path, std::string_view data, unsigned mode = 0644);

}  // namespace wsync
