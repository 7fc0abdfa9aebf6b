// CUDA IPC between two processes: a peer exports a range inside its
// allocation; this process maps it with DeviceRegionMapper, reads it, adds
// one to every byte through a patch applied by the DeviceCodec, and the peer
// verifies the change in its own memory. Skips without a GPU.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "wsync/buffers/device_region.h"
#include "wsync/codec/checksum.h"
#include "wsync/codec/codec.h"
#include "wsync/cuda/device_codec.h"

namespace wsync {
namespace {

TEST(CudaIpc, TwoProcessesShareAndPatchOneAllocation) {
  const Status avail = cuda::DeviceAvailable();
  if (!avail.ok()) GTEST_SKIP() << "no GPU: " << avail.ToString();
  int to_peer[2], from_peer[2];
  ASSERT_EQ(pipe(to_peer), 0);
  ASSERT_EQ(pipe(from_peer), 0);
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {  // exec at once: CUDA must not be used after fork
    dup2(to_peer[0], 0);
    dup2(from_peer[1], 1);
    close(to_peer[1]);
    close(from_peer[0]);
    const char* peer = std::getenv("WSYNC_IPC_PEER") != nullptr ? std::getenv("WSYNC_IPC_PEER") : PEER_BINARY;
    execl(peer, peer, nullptr);
    _exit(127);
  }
  close(to_peer[0]);
  close(from_peer[1]);
  FILE* in = fdopen(from_peer[0], "r");
  char line[512] = {};
  ASSERT_NE(fgets(line, sizeof(line), in), nullptr) << "peer printed no handle";
  std::string text(line);
  while (!text.empty() && text.back() == '\n') text.pop_back();
  auto handle = cuda::IpcHandle::Parse(text);
  ASSERT_TRUE(handle.ok()) << handle.status().ToString();
  EXPECT_EQ(handle->offset, 4096u);

  {
    buffers::DeviceRegionMapper mapper;
    auto ptr = mapper.Map(*handle);
    ASSERT_TRUE(ptr.ok()) << ptr.status().ToString();
    auto again = mapper.Map(*handle);  // same allocation: same mapping
    ASSERT_TRUE(again.ok());
    EXPECT_EQ(*again, *ptr);
    EXPECT_EQ(mapper.open_allocations(), 1u);

    // The range as a U8 tensor: read it, patch it (+1 everywhere), apply.
    const size_t n = handle->bytes;
    codec::MutableTensorView view{"shared", codec::DType::kU8, {n}, static_cast<uint8_t*>(*ptr)};
    auto codec = cuda::DeviceCodec::Create();
    ASSERT_TRUE(codec.ok());
    cuda::Workspace ws;
    auto base_sum = (*codec)->TensorChecksum(ws, *ptr, n);
    ASSERT_TRUE(base_sum.ok());
    std::vector<uint8_t> base(n), target(n);
    for (size_t i = 0; i < n; ++i) base[i] = static_cast<uint8_t>((i + 4096) * 7 + 3);
    for (size_t i = 0; i < n; ++i) target[i] = static_cast<uint8_t>(base[i] + 1);
    ASSERT_EQ(*base_sum, codec::TensorChecksum(base.data(), n)) << "mapped memory is not the peer's";
    codec::TensorView bv{"shared", codec::DType::kU8, {n}, base.data()};
    codec::TensorView tv{"shared", codec::DType::kU8, {n}, target.data()};
    auto patch = codec::EncodePatch({&bv, 1}, {&tv, 1}, {});
    ASSERT_TRUE(patch.ok());
    ASSERT_TRUE((*codec)->Apply(ws, *patch, std::span(&view, 1), {}).ok());
    EXPECT_TRUE(mapper.Unmap(*handle).ok());
    EXPECT_TRUE(mapper.Unmap(*handle).ok());
    EXPECT_EQ(mapper.open_allocations(), 0u);
  }
  ASSERT_EQ(write(to_peer[1], "check\n", 6), 6);
  close(to_peer[1]);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  fclose(in);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the peer did not see the change in its memory";
}

}  // namespace
}  // namespace wsync
