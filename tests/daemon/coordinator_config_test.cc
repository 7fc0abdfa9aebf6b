#include "coordinator_config.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "wsync/util/file.h"
#include "wsync/util/text.h"

namespace wsync::daemon {
namespace {

// The files a test wrote, removed when its process ends.
struct WrittenFiles {
  std::vector<std::string> paths;
  ~WrittenFiles() {
    for (const auto& p : paths) std::remove(p.c_str());
  }
};

std::string Write(const std::string& name, const std::string& text) {
  static WrittenFiles written;
  std::string path = ::testing::TempDir() + "/wsync_cfg_" + std::to_string(::getpid()) + "_" + name;
  EXPECT_TRUE(WriteFileAtomic(path, text).ok());
  written.paths.push_back(path);
  return path;
}

TEST(CoordinatorConfig, ExampleFileLoads) {
  CoordinatorConfig c;
  Status s = LoadCoordinatorToml(WSYNC_SOURCE_DIR "/config/coordinator.example.toml", &c);
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(c.server.listen.size(), 2u);
  EXPECT_EQ(c.state.max_staleness, 4u);
  EXPECT_EQ(c.state.policy, wsync::v1::STALENESS_BLOCK);
  EXPECT_EQ(c.state.fanout, 4u);
  EXPECT_EQ(c.state.heartbeat_reports_from, 2000u);
  EXPECT_EQ(c.state.heartbeat_budget, 4000u);
  EXPECT_EQ(c.server.tls.client_ca_file, "/etc/wsync/tls/ca.pem");
}

TEST(CoordinatorConfig, ErrorsNameFileKeyAndProblem) {
  CoordinatorConfig c;
  Status s = LoadCoordinatorToml(Write("a.toml", "[coordinator]\nfanot = 3\n"), &c);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("coordinator.fanot: unknown key"), std::string::npos) << s.message();
  s = LoadCoordinatorToml(Write("b.toml", "[coordinator]\nfanout = \"four\"\n"), &c);
  EXPECT_NE(s.message().find("coordinator.fanout: must be an integer"), std::string::npos) << s.message();
  s = LoadCoordinatorToml(Write("c.toml", "[coordinator]\nfanout = 0\n"), &c);
  EXPECT_NE(s.message().find("outside"), std::string::npos) << s.message();
  s = LoadCoordinatorToml(Write("d.toml", "[coordinator]\nstaleness_policy = \"drop\"\n"), &c);
  EXPECT_NE(s.message().find("'drop'"), std::string::npos) << s.message();
  s = LoadCoordinatorToml(Write("e.toml", "[coordinator\n"), &c);
  EXPECT_NE(s.message().find(":1:"), std::string::npos) << s.message();
  s = LoadCoordinatorToml(Write("f.toml", "[sink]\n"), &c);
  EXPECT_NE(s.message().find("unknown table 'sink'"), std::string::npos) << s.message();
}

TEST(CoordinatorConfig, FinishChecksTheMergedResult) {
  CoordinatorConfig c;
  EXPECT_NE(FinishCoordinatorConfig(&c).message().find("no listen address"), std::string::npos);
  c.server.listen = {"localhost"};
  EXPECT_NE(FinishCoordinatorConfig(&c).message().find("not host:port"), std::string::npos);
  c.server.listen = {"127.0.0.1:0"};
  c.server.tls.cert_file = "x.pem";
  EXPECT_NE(FinishCoordinatorConfig(&c).message().find("both a certificate and a key"), std::string::npos);
  c.server.tls = {};
  c.token_file = "/nonexistent/token";
  EXPECT_EQ(FinishCoordinatorConfig(&c).code(), StatusCode::kNotFound);
  c.token_file = Write("token", "  abc\n");
  ASSERT_TRUE(FinishCoordinatorConfig(&c).ok());
  EXPECT_EQ(c.server.token, "abc");
}

TEST(CoordinatorConfig, ReplicasOverEtcd) {
  CoordinatorConfig c;
  Status s = LoadCoordinatorToml(Write("r.toml", "[coordinator]\nlisten = [\"0.0.0.0:7600\"]\n"
                                                 "[coordinator.etcd]\nendpoints = [\"e1:2379\", \"e2:2379\"]\n"
                                                 "advertise = \"c1:7600\"\nlease_ttl_s = 3\n"),
                                 &c);
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(c.replica.etcd_endpoints, (std::vector<std::string>{"e1:2379", "e2:2379"}));
  EXPECT_EQ(c.replica.lease_ttl_s, 3);
  c.state.fanout = 7;
  ASSERT_TRUE(FinishCoordinatorConfig(&c).ok());
  EXPECT_EQ(c.replica.coordinator.fanout, 7u) << "the replicas run with the coordinator's options";

  s = LoadCoordinatorToml(Write("r2.toml", "[coordinator.etcd]\nendpoint = \"e1\"\n"), &c);
  EXPECT_NE(s.message().find("coordinator.etcd.endpoint: unknown key"), std::string::npos) << s.message();
  CoordinatorConfig both;
  both.server.listen = {"127.0.0.1:0"};
  both.store_dir = "/var/lib/wsync";
  both.replica.etcd_endpoints = {"e1:2379"};
  both.replica.advertise = "c1:7600";
  EXPECT_NE(FinishCoordinatorConfig(&both).message().find("exclude each other"), std::string::npos);
  both.store_dir.clear();
  both.replica.advertise.clear();
  EXPECT_NE(FinishCoordinatorConfig(&both).message().find("--advertise"), std::string::npos);
  EXPECT_EQ(SplitList(" a:1, b:2,,c:3 "), (std::vector<std::string>{"a:1", "b:2", "c:3"}));
  EXPECT_TRUE(SplitList(" , ").empty());
}

}  // namespace
}  // namespace wsync::daemon
