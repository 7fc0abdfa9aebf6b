// A real S3-compatible server for the tests: one SeaweedFS process (master,
// volume, filer and S3 gateway) on loopback, in a directory of its own, with
// one identity. Its binary comes from scripts/install-seaweedfs.sh
// ($WSYNC_SEAWEEDFS overrides where).
#pragma once

#include <gtest/gtest.h>

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "../control/etcd_member.h"  // FreePort, Eventually
#include "wsync/store/object_store.h"

namespace wsync::store::testing {

// Where scripts/install-seaweedfs.sh puts the server, or $WSYNC_SEAWEEDFS.
inline std::string SeaweedBinary() {
  if (const char* p = std::getenv("WSYNC_SEAWEEDFS")) return p;
  const char* home = std::getenv("HOME");
  return std::string(home ? home : "/root") + "/.cache/wsync/seaweedfs-4.48/bin/weed";
}

class SeaweedServer {
 public:
  static constexpr const char* kAccessKey = "wsync-test-writer";
  static constexpr const char* kSecretKey = "wsync-test-writer-secret";
  static constexpr const char* kReadKey = "wsync-test-reader";
  static constexpr const char* kReadSecret = "wsync-test-reader-secret";

  SeaweedServer() {
    dir_ = std::filesystem::path(::testing::TempDir()) / ("wsync_seaweedfs_" + std::to_string(::getpid()));
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_ / "data");
    // A writer with every action and a reader that may only read and list.
    std::ofstream(dir_ / "s3.json") << R"({"identities":[)"
                                    << R"({"name":"writer","credentials":[{"accessKey":")" << kAccessKey
                                    << R"(","secretKey":")" << kSecretKey
                                    << R"("}],"actions":["Admin","Read","List","Tagging","Write"]},)"
                                    << R"({"name":"reader","credentials":[{"accessKey":")" << kReadKey
                                    << R"(","secretKey":")" << kReadSecret << R"("}],"actions":["Read","List"]}]})";
    s3_port_ = control::FreePort();
    const auto port = [this](int p) {
      ports_.push_back(p);
      return std::to_string(p);
    };
    std::vector<std::string> args = {SeaweedBinary(), "-logdir=" + (dir_ / "log").string(), "server",
                                     "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-dir=" + (dir_ / "data").string(),
                                     "-master.port=" + port(control::FreePort()),
                                     "-master.port.grpc=" + port(control::FreePort()),
                                     "-volume.port=" + port(control::FreePort()),
                                     "-volume.port.grpc=" + port(control::FreePort()), "-filer",
                                     "-filer.port=" + port(control::FreePort()),
                                     "-filer.port.grpc=" + port(control::FreePort()), "-s3",
                                     "-s3.port=" + port(s3_port_), "-s3.port.grpc=" + port(control::FreePort()),
                                     "-s3.port.iceberg=0", "-s3.port.lance=0",
                                     "-s3.config=" + (dir_ / "s3.json").string(),
                                     "-s3.localSocket=" + (dir_ / "s3.sock").string(),
                                     "-filer.localSocket=" + (dir_ / "filer.sock").string(),
                                     "-master.volumeSizeLimitMB=64",
                                     "-volume.max=16", "-volume.preStopSeconds=0"};
    std::filesystem::create_directories(dir_ / "log");
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    const std::string out = (dir_ / "server.log").string();
    posix_spawn_file_actions_addopen(&fa, 1, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    if (!std::filesystem::exists(args[0]) ||
        ::posix_spawn(&pid_, args[0].c_str(), &fa, nullptr, argv.data(), environ) != 0) {
      pid_ = -1;
    }
    posix_spawn_file_actions_destroy(&fa);
  }
  ~SeaweedServer() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    std::filesystem::remove_all(dir_);
    // The gRPC servers' unix sockets it always makes in /tmp, named by port.
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator("/tmp", ec)) {
      const std::string name = e.path().filename().string();
      for (int p : ports_) {
        const std::string tail = "-" + std::to_string(p) + ".sock";
        if (name.rfind("seaweedfs-", 0) == 0 && name.size() > tail.size() &&
            name.compare(name.size() - tail.size(), tail.size(), tail) == 0) {
          std::filesystem::remove(e.path(), ec);
        }
      }
    }
  }

  bool started() const { return pid_ > 0; }
  std::string endpoint() const { return "http://127.0.0.1:" + std::to_string(s3_port_); }
  S3Options Options(const std::string& bucket, bool writer = true) const {
    S3Options o;
    o.endpoint = endpoint();
    o.bucket = bucket;
    o.access_key = writer ? kAccessKey : kReadKey;
    o.secret_key = writer ? kSecretKey : kReadSecret;
    return o;
  }
  // Waits until the gateway answers and `bucket` exists (created).
  ::testing::AssertionResult Ready(const std::string& bucket) const {
    if (!started()) {
      return ::testing::AssertionFailure() << "no SeaweedFS at " << SeaweedBinary()
                                           << " (run scripts/install-seaweedfs.sh)";
    }
    S3Options o = Options(bucket);
    o.attempts = 1;
    auto s3 = OpenS3(o);
    if (!s3.ok()) return ::testing::AssertionFailure() << s3.status().ToString();
    Status last;
    if (control::Eventually([&] { return (last = (*s3)->CreateBucket()).ok(); }, std::chrono::seconds(90))) {
      return ::testing::AssertionSuccess();
    }
    return ::testing::AssertionFailure() << "SeaweedFS did not come up: " << last.ToString();
  }
  // SIGSTOP: every request times out; SIGCONT: back.
  void Signal(int sig) const { ::kill(pid_, sig); }

 private:
  std::filesystem::path dir_;
  int s3_port_ = 0;
  std::vector<int> ports_;
  pid_t pid_ = -1;
};

}  // namespace wsync::store::testing
