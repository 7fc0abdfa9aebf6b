// Helpers of the tests that run a real etcd (Debian's etcd-server): one
// member on loopback, a free port, waiting for a condition.
#pragma once

#include <gtest/gtest.h>

#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace wsync::control {

inline int FreePort() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

inline bool Eventually(const std::function<bool()>& pred, std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < end) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return pred();
}

// One etcd member on loopback, in a directory of its own; with `tls_dir`,
// serving TLS with that directory's server certificate and requiring client
// certificates of its CA.
class EtcdMember {
 public:
  explicit EtcdMember(const std::string& tls_dir = "") : tls_dir_(tls_dir) {
    dir_ = std::filesystem::path(::testing::TempDir()) / ("wsync_etcd_" + std::to_string(::getpid()));
    std::filesystem::remove_all(dir_);
    endpoint_ = "127.0.0.1:" + std::to_string(FreePort());
    const std::string scheme = tls_dir.empty() ? "http://" : "https://";
    const std::string peer = "http://127.0.0.1:" + std::to_string(FreePort());
    std::vector<std::string> args = {"etcd", "--name", "test", "--data-dir", dir_.string(),
                                     "--listen-client-urls", scheme + endpoint_,
                                     "--advertise-client-urls", scheme + endpoint_,
                                     "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                                     "--initial-cluster", "test=" + peer, "--log-outputs", "stderr",
                                     "--logger", "zap", "--log-level", "error"};
    if (!tls_dir.empty()) {
      args.insert(args.end(), {"--cert-file", tls_dir + "/server.pem", "--key-file", tls_dir + "/server.key",
                               "--trusted-ca-file", tls_dir + "/ca.pem", "--client-cert-auth"});
    }
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    if (::posix_spawnp(&pid_, "etcd", nullptr, nullptr, argv.data(), environ) != 0) pid_ = -1;
  }
  ~EtcdMember() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    std::filesystem::remove_all(dir_);
  }
  bool started() const { return pid_ > 0; }
  // SIGSTOP: every call times out, as without a majority; SIGCONT: back.
  void Signal(int sig) const { ::kill(pid_, sig); }
  const std::string& endpoint() const { return endpoint_; }
  // etcdctl's exit status.
  int Ctl(const std::string& args) const {
    std::string tls;
    if (!tls_dir_.empty()) {
      tls = " --cacert " + tls_dir_ + "/ca.pem --cert " + tls_dir_ + "/client.pem --key " + tls_dir_ + "/client.key";
    }
    return std::system(
        ("ETCDCTL_API=3 etcdctl --endpoints " + endpoint_ + tls + " " + args + " >/dev/null 2>&1").c_str());
  }

 private:
  std::string tls_dir_;
  std::filesystem::path dir_;
  std::string endpoint_;
  pid_t pid_ = -1;
};

}  // namespace wsync::control
