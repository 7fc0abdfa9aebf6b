// IpcHandle's text form, shared by the CUDA and the CUDA-less builds.
#pragma once

#include <algorithm>
#include <charconv>
#include <string>
#include <vector>

#include "wsync/cuda/ipc.h"
#include "wsync/util/text.h"

namespace wsync::cuda::internal {

inline std::string IpcHandleToString(const IpcHandle& h) {
  const std::string hex = Hex(std::string_view(reinterpret_cast<const char*>(h.handle.data()), h.handle.size()));
  return "wsync-ipc-v1:" + std::to_string(h.device) + ":" + std::to_string(h.offset) + ":" +
         std::to_string(h.bytes) + ":" + hex;
}

inline StatusOr<IpcHandle> ParseIpcHandle(std::string_view text) {
  constexpr std::string_view kPrefix = "wsync-ipc-v1:";
  if (text.substr(0, kPrefix.size()) != kPrefix) {
    return InvalidArgumentError("IPC handle does not start with 'wsync-ipc-v1:'");
  }
  text.remove_prefix(kPrefix.size());
  std::vector<std::string_view> f;
  for (size_t at; (at = text.find(':')) != std::string_view::npos; text.remove_prefix(at + 1)) {
    f.push_back(text.substr(0, at));
  }
  f.push_back(text);
  if (f.size() != 4) return InvalidArgumentError("IPC handle has " + std::to_string(f.size()) + " fields, not 4");
  IpcHandle h;
  auto number = [](std::string_view s, auto* v, const char* what) -> Status {
    auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), *v);
    if (ec != std::errc() || p != s.data() + s.size() || s.empty()) {
      return InvalidArgumentError(std::string("IPC handle: bad ") + what + " '" + std::string(s) + "'");
    }
    return Status::Ok();
  };
  WSYNC_RETURN_IF_ERROR(number(f[0], &h.device, "device"));
  WSYNC_RETURN_IF_ERROR(number(f[1], &h.offset, "offset"));
  WSYNC_RETURN_IF_ERROR(number(f[2], &h.bytes, "size"));
  if (h.device < 0) return InvalidArgumentError("IPC handle: negative device");
  if (f[3].size() != 2 * h.handle.size()) {
    return InvalidArgumentError("IPC handle: the handle has " + std::to_string(f[3].size()) + " hex digits, not 128");
  }
  const std::optional<std::string> bytes = FromHex(f[3]);
  if (!bytes) return InvalidArgumentError("IPC handle: the handle is not lowercase hex");
  std::copy(bytes->begin(), bytes->end(), h.handle.begin());
  return h;
}

}  // namespace wsync::cuda::internal
