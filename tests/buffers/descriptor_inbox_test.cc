// The memory socket: descriptors passed with a token are handed over once,
// in order, as the same memory; bad messages are refused and hold nothing;
// unclaimed descriptors end after their TTL.
#include "wsync/buffers/descriptor_inbox.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "wsync/buffers/region.h"

namespace wsync::buffers {
namespace {

std::string SocketPath() {
  return ::testing::TempDir() + "/inbox-" + std::to_string(::getpid()) + "-" +
         ::testing::UnitTest::GetInstance()->current_test_info()->name();
}

// A memfd of `size` bytes filled with `fill`.
OwnedFd Memory(size_t size, char fill) {
  OwnedFd fd(::memfd_create("wsync-test", MFD_CLOEXEC));
  EXPECT_GE(fd.get(), 0);
  EXPECT_EQ(::ftruncate(fd.get(), static_cast<off_t>(size)), 0);
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  EXPECT_NE(p, MAP_FAILED);
  std::memset(p, fill, size);
  ::munmap(p, size);
  return fd;
}

// Sends `token` with `fds` on a new connection; the inbox's answer byte ('k',
// 'e'), or 0 when the connection ended without one.
char Send(const std::string& path, const std::string& token, const std::vector<int>& fds) {
  OwnedFd s(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  if (::connect(s.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) return 0;
  iovec iov{const_cast<char*>(token.data()), token.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  std::vector<char> control(CMSG_SPACE(sizeof(int) * std::max<size_t>(fds.size(), 1)));
  if (!fds.empty()) {
    msg.msg_control = control.data();
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* h = CMSG_FIRSTHDR(&msg);
    h->cmsg_level = SOL_SOCKET;
    h->cmsg_type = SCM_RIGHTS;
    h->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(h), fds.data(), sizeof(int) * fds.size());
  }
  if (::sendmsg(s.get(), &msg, MSG_NOSIGNAL) < 0) return 0;
  char answer = 0;
  return ::recv(s.get(), &answer, 1, 0) == 1 ? answer : 0;
}

TEST(DescriptorInbox, HandsOverTheSameMemoryOnceInOrder) {
  auto inbox = DescriptorInbox::Listen(SocketPath());
  ASSERT_TRUE(inbox.ok()) << inbox.status().ToString();
  OwnedFd a = Memory(4096, 'a'), b = Memory(8192, 'b');
  ASSERT_EQ(Send((*inbox)->path(), "tok-1", {a.get()}), 'k');
  ASSERT_EQ(Send((*inbox)->path(), "tok-1", {b.get()}), 'k');  // messages of one token add up
  auto fds = (*inbox)->Take("tok-1");
  ASSERT_TRUE(fds.ok()) << fds.status().ToString();
  ASSERT_EQ(fds->size(), 2u);
  auto first = MapDescriptor((*fds)[0].get(), "first");
  auto second = MapDescriptor((*fds)[1].get(), "second");
  ASSERT_TRUE(first.ok() && second.ok());
  EXPECT_EQ((*first)->size(), 4096u);
  EXPECT_EQ((*second)->size(), 8192u);
  EXPECT_EQ((*first)->data()[4095], 'a');
  EXPECT_EQ((*second)->data()[0], 'b');
  // The same memory: a write through the mapping is seen through the sender's descriptor.
  (*first)->data()[0] = 'z';
  char seen = 0;
  ASSERT_EQ(::pread(a.get(), &seen, 1, 0), 1);
  EXPECT_EQ(seen, 'z');

  auto again = (*inbox)->Take("tok-1");
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().code(), StatusCode::kNotFound);
  EXPECT_NE(again.status().message().find("tok-1"), std::string::npos) << again.status().message();
}

TEST(DescriptorInbox, TakesWhatPassDescriptorsSendsInMessagesOfAtMost253) {
  auto inbox = DescriptorInbox::Listen(SocketPath());
  ASSERT_TRUE(inbox.ok()) << inbox.status().ToString();
  std::vector<MemoryFile> files;
  std::vector<int> fds;
  for (int i = 0; i < 300; ++i) {
    auto m = CreateMemoryFile(4096, "wsync-test");
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    (*m).region->data()[0] = static_cast<uint8_t>(i);
    fds.push_back(m->fd.get());
    files.push_back(std::move(*m));
  }
  const std::string token = NewDescriptorToken();
  ASSERT_EQ(token.size(), 32u);
  ASSERT_TRUE(PassDescriptors((*inbox)->path(), token, fds, std::chrono::seconds(5)).ok());
  auto got = (*inbox)->Take(token);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  ASSERT_EQ(got->size(), 300u);
  for (int i : {0, 252, 253, 299}) {
    auto r = MapDescriptor((*got)[i].get(), "received");
    ASSERT_TRUE(r.ok());
    EXPECT_EQ((*r)->data()[0], static_cast<uint8_t>(i)) << "descriptor " << i << " is not the memory sent in that place";
  }
  auto missing = PassDescriptors(SocketPath() + "-none", token, fds, std::chrono::milliseconds(100));
  EXPECT_EQ(missing.code(), StatusCode::kUnavailable);
  EXPECT_NE(missing.message().find("-none"), std::string::npos) << missing.message();
}

TEST(DescriptorInbox, RefusesBadMessagesAndHoldsNothingOfThem) {
  DescriptorInbox::Options o;
  o.max_held = 2;
  auto inbox = DescriptorInbox::Listen(SocketPath(), o);
  ASSERT_TRUE(inbox.ok()) << inbox.status().ToString();
  OwnedFd a = Memory(64, 'a'), b = Memory(64, 'b'), c = Memory(64, 'c');
  const std::string& path = (*inbox)->path();
  EXPECT_EQ(Send(path, "no/slashes", {a.get()}), 'e');
  EXPECT_EQ(Send(path, std::string(65, 'x'), {a.get()}), 'e');
  EXPECT_EQ(Send(path, "nothing", {}), 'e');
  EXPECT_EQ(Send(path, "many", {a.get(), b.get(), c.get()}), 'e');  // more than max_held
  for (const char* t : {"no/slashes", "nothing", "many"}) EXPECT_FALSE((*inbox)->Take(t).ok()) << t;
  EXPECT_EQ(Send(path, "fits", {a.get(), b.get()}), 'k');
  EXPECT_TRUE((*inbox)->Take("fits").ok());
  OwnedFd sock(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  auto mapped = MapDescriptor(sock.get(), "a socket");
  ASSERT_FALSE(mapped.ok());
  EXPECT_NE(mapped.status().message().find("a socket is not a memory file"), std::string::npos)
      << mapped.status().message();
}

TEST(DescriptorInbox, ClosesWhatIsNotClaimedWithinItsTtl) {
  DescriptorInbox::Options o;
  o.ttl = std::chrono::milliseconds(50);
  auto inbox = DescriptorInbox::Listen(SocketPath(), o);
  ASSERT_TRUE(inbox.ok()) << inbox.status().ToString();
  OwnedFd a = Memory(64, 'a');
  ASSERT_EQ(Send((*inbox)->path(), "late", {a.get()}), 'k');
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // past the TTL
  auto fds = (*inbox)->Take("late");
  ASSERT_FALSE(fds.ok());
  EXPECT_EQ(fds.status().code(), StatusCode::kNotFound);
}

TEST(DescriptorInbox, RemovesItsSocketWhenDestroyed) {
  const std::string path = SocketPath();
  {
    auto inbox = DescriptorInbox::Listen(path);
    ASSERT_TRUE(inbox.ok());
    EXPECT_EQ(::access(path.c_str(), F_OK), 0);
  }
  EXPECT_NE(::access(path.c_str(), F_OK), 0);
  EXPECT_EQ(Send(path, "gone", {}), 0);
}

}  // namespace
}  // namespace wsync::buffers
