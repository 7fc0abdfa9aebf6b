// The exporting process of ipc_test: allocates device memory, fills it with
// a pattern, prints "<handle>\n" for a range at an offset inside the
// allocation, then waits for "check\n" on stdin and verifies that the
// importer added 1 to every byte of the range. Exit 0 when it did.
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "wsync/cuda/device_codec.h"
#include "wsync/cuda/ipc.h"

int main() {
  constexpr size_t kBytes = 1 << 20, kOffset = 4096, kRange = 8192;
  auto buf = wsync::cuda::DeviceBuffer::Allocate(kBytes);
  if (!buf.ok()) {
    std::fprintf(stderr, "peer: %s\n", buf.status().ToString().c_str());
    return 2;
  }
  std::vector<uint8_t> pattern(kBytes);
  for (size_t i = 0; i < kBytes; ++i) pattern[i] = static_cast<uint8_t>(i * 7 + 3);
  if (!buf->CopyFromHost(pattern.data(), kBytes).ok()) return 2;
  auto h = wsync::cuda::ExportDeviceMemory(static_cast<uint8_t*>(buf->data()) + kOffset, kRange);
  if (!h.ok()) {
    std::fprintf(stderr, "peer: %s\n", h.status().ToString().c_str());
    return 2;
  }
  std::cout << h->ToString() << std::endl;
  std::string line;
  if (!std::getline(std::cin, line) || line != "check") return 3;
  std::vector<uint8_t> now(kBytes);
  if (!buf->CopyToHost(now.data(), kBytes).ok()) return 2;
  for (size_t i = 0; i < kBytes; ++i) {
    const bool in = i >= kOffset && i < kOffset + kRange;
    if (now[i] != static_cast<uint8_t>(pattern[i] + (in ? 1 : 0))) {
      std::fprintf(stderr, "peer: byte %zu is %d\n", i, now[i]);
      return 1;
    }
  }
  return 0;
}
