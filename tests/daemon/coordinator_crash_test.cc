// Multi-process: a real `wsyncd coordinator` with a store directory is
// killed with SIGKILL and restarted; the state it acknowledged is identical,
// versions never go backwards, and a torn last log record is survived.
#include <gtest/gtest.h>

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <thread>

#include "wsync/control/client.h"

extern char** environ;

namespace wsync::control {
namespace {

namespace v1 = wsync::v1;

class Daemon {
 public:
  Daemon(const std::string& sock, const std::string& store) {
    std::vector<std::string> args = {WSYNCD_BINARY,   "coordinator", "--listen",        "unix:" + sock,
                                     "--store-dir",   store,         "--metrics-listen", "127.0.0.1:0",
                                     "--token-file",  TokenFile()};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    EXPECT_EQ(posix_spawn(&pid_, WSYNCD_BINARY, nullptr, nullptr, argv.data(), environ), 0);
  }
  ~Daemon() { Kill(SIGKILL); }
  void Kill(int sig) {
    if (pid_ <= 0) return;
    ::kill(pid_, sig);
    int status;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
  }
  static std::string TokenFile() {
    // Written once per test process, removed when it ends.
    struct File {
      std::string path = ::testing::TempDir() + "/wsync_crash_token_" + std::to_string(::getpid());
      File() { std::ofstream(path) << "crash-test-token\n"; }
      ~File() { std::remove(path.c_str()); }
    };
    static File file;
    return file.path;
  }

 private:
  pid_t pid_ = -1;
};

std::unique_ptr<CoordinatorClient> Connect(const std::string& sock) {
  ClientOptions o;
  o.address = "unix:" + sock;
  o.token = "crash-test-token";
  o.timeout_ms = 5000;
  o.wait_for_ready = true;
  auto c = NewCoordinatorClient(o);
  EXPECT_TRUE(c.ok());
  for (int i = 0; i < 100; ++i) {
    if ((*c)->GetStatus().ok()) return std::move(*c);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ADD_FAILURE() << "coordinator did not come up on " << sock;
  return std::move(*c);
}

// The durable part of a status: what must survive a crash.
std::string Durable(const v1::StatusResponse& s) {
  std::string out = "head=" + std::to_string(s.head_version()) + "\n";
  for (const auto& n : s.nodes()) {
    out += "node " + n.name() + " role=" + std::to_string(n.role()) + " applied=" +
           std::to_string(n.applied_version()) + " incarnation=" + std::to_string(n.incarnation()) +
           " addr=" + n.data_address() + "\n";
  }
  for (const auto& l : s.leases()) {
    out += "lease " + std::to_string(l.id()) + " " + l.node() + " v" + std::to_string(l.version()) + " until " +
           std::to_string(l.expires_unix_ms()) + "\n";
  }
  return out;
}

TEST(CoordinatorCrash, SigkillLosesNothingAndVersionsNeverGoBack) {
  const std::string base = ::testing::TempDir() + "/wsync_crash_" + std::to_string(::getpid());
  std::filesystem::remove_all(base);
  std::filesystem::create_directories(base);
  const std::string sock = base + "/c.sock", store = base + "/store";
  std::string before;
  {
    Daemon d(sock, store);
    auto c = Connect(sock);
    for (const char* name : {"trainer-src", "rollout-0"}) {
      v1::RegisterRequest r;
      r.set_name(name);
      r.set_role(std::string(name) == "trainer-src" ? v1::ROLE_SOURCE : v1::ROLE_SINK);
      r.set_data_address(std::string("ucx-blob-") + name);
      r.set_ttl_ms(60'000);
      ASSERT_TRUE(c->Register(r).ok());
    }
    for (uint64_t v = 1; v <= 5; ++v) {
      v1::VersionSummary s;
      s.set_version(v);
      s.set_base_version(v - 1);
      s.set_keyframe(v == 1);
      ASSERT_TRUE(c->Publish(s).ok());
    }
    ASSERT_TRUE(c->ReportApplied("rollout-0", 4).ok());
    ASSERT_TRUE(c->AcquireLease("rollout-0", 4, 600'000).ok());
    before = Durable(*c->GetStatus());
    d.Kill(SIGKILL);
  }
  // A torn write: half a record at the end of the log.
  {
    std::ofstream log(store + "/wal.log", std::ios::app | std::ios::binary);
    log.write("\x40\x00\x00\x00\x12\x34", 6);
  }
  Daemon d(sock, store);
  auto c = Connect(sock);
  auto after = c->GetStatus();
  ASSERT_TRUE(after.ok()) << after.status().ToString();
  EXPECT_EQ(Durable(*after), before);
  v1::VersionSummary again;
  again.set_version(5);
  EXPECT_EQ(c->Publish(again).status().code(), StatusCode::kFailedPrecondition);
  again.set_version(6);
  again.set_base_version(5);
  EXPECT_TRUE(c->Publish(again).ok());
  d.Kill(SIGTERM);
  std::filesystem::remove_all(base);
}

}  // namespace
}  // namespace wsync::control
