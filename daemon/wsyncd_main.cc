// wsyncd: the wsync daemon. `wsyncd coordinator` runs the control plane;
// the source and sink roles arrive with the data plane.
#include <CLI/CLI.hpp>
#include <spdlog/spdlog.h>
#include <sys/resource.h>

#include <csignal>
#include <functional>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "coordinator_config.h"
#include "data_daemon.h"
#include "wsync/store/object_store.h"
#include "wsync/control/coordinator_state.h"
#include "wsync/control/replica.h"
#include "wsync/control/server.h"
#include "wsync/control/store.h"
#include "wsync/util/memory.h"
#include "wsync/util/text.h"

namespace {

using namespace wsync;

int Fail(const Status& s) {
  spdlog::critical("{}", s.ToString());
  return 1;
}

// Blocks SIGINT and SIGTERM in every thread started after this; Waiter()
// then waits for one of them on a thread of its own and calls `stop`.
class StopSignals {
 public:
  StopSignals() {
    sigemptyset(&set_);
    sigaddset(&set_, SIGINT);
    sigaddset(&set_, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set_, nullptr);
  }
  std::thread Waiter(std::function<void()> stop) {
    return std::thread([this, stop = std::move(stop)] {
      int sig = 0;
      sigwait(&set_, &sig);
      spdlog::info("signal {}: shutting down", sig);
      stop();
    });
  }

 private:
  sigset_t set_;
};

// --check-config: the options (and files) were accepted; nothing started.
int ConfigOk(const char* role) {
  std::printf("wsyncd %s: configuration ok\n", role);
  return 0;
}

// Where the server answers from, and what it says of itself at start.
std::string Serving(const daemon::CoordinatorConfig& config, const control::CoordinatorServer& server) {
  std::string where;
  size_t tcp = 0;
  for (const auto& a : config.server.listen) {
    std::string shown = a;
    if (a.rfind("unix:", 0) != 0) shown = a.substr(0, a.rfind(':') + 1) + std::to_string(server.ports()[tcp++]);
    where += (where.empty() ? "" : ", ") + shown;
  }
  return where + " (token " + (config.server.token.empty() ? "off" : "on") + ", TLS " +
         (config.server.tls.cert_file.empty() ? "off" : (config.server.tls.client_ca_file.empty() ? "on" : "mTLS")) +
         ", metrics " +
         (config.server.metrics_listen.empty() ? "off" : "127.0.0.1:" + std::to_string(server.metrics_port())) + ")";
}

// A replica over etcd: serves always, answers from the state only while it leads.
int RunReplica(const daemon::CoordinatorConfig& config) {
  StopSignals signals;  // before any thread starts
  auto replica = control::Replica::Start(config.replica, control::SystemClock());
  if (!replica.ok()) return Fail(replica.status());
  auto server = control::CoordinatorServer::Start(config.server, replica->get());
  if (!server.ok()) return Fail(server.status());
  std::string etcd;
  for (const auto& e : config.replica.etcd_endpoints) etcd += (etcd.empty() ? "" : ",") + e;
  spdlog::info("coordinator replica {} serving on {}; etcd {} (prefix {}, leader lease {} s)",
               config.replica.advertise, Serving(config, **server), etcd, config.replica.prefix,
               config.replica.lease_ttl_s);
  std::thread waiter = signals.Waiter([&] { (*server)->Shutdown(); });
  (*server)->Wait();
  waiter.join();
  server->reset();
  replica->reset();  // resigns: another replica leads at once
  return 0;
}

int RunCoordinator(daemon::CoordinatorConfig config, bool check_only) {
  Status s = daemon::FinishCoordinatorConfig(&config);
  if (!s.ok()) return Fail(s);
  if (check_only) return ConfigOk("coordinator");
  if (!config.replica.etcd_endpoints.empty()) return RunReplica(config);
  control::Recovered recovered;
  std::unique_ptr<control::Store> store;
  if (config.store_dir.empty()) {
    spdlog::warn("no --store-dir: state is kept in memory only and lost on restart");
    store = control::NewNullStore();
  } else {
    control::StoreOptions so;
    so.salvage = config.salvage_store;
    auto opened = control::OpenLogStore(config.store_dir, &recovered, so);
    if (!opened.ok()) return Fail(opened.status());
    store = std::move(*opened);
    if (config.salvage_store) {
      if (recovered.salvage_report.empty()) std::fprintf(stderr, "salvage: the store verified; nothing was dropped\n");
      for (const auto& line : recovered.salvage_report) std::fprintf(stderr, "salvage: %s\n", line.c_str());
    }
  }
  auto state = control::CoordinatorState::Create(config.state, control::SystemClock(), std::move(store), recovered);
  if (!state.ok()) return Fail(state.status());
  std::unique_ptr<daemon::StoreFollower> follower;  // stops before the state goes
  if (!config.follow_store.url.empty()) {
    auto started = daemon::StoreFollower::Start(config.follow_store, state->get());
    if (!started.ok()) return Fail(started.status().WithContext("--follow-store"));
    follower = std::move(*started);
  }

  StopSignals signals;  // before any thread starts

  auto server = control::CoordinatorServer::Start(config.server, state->get());
  if (!server.ok()) return Fail(server.status());
  spdlog::info("coordinator serving on {}, head version {}", Serving(config, **server), (*state)->head());
  std::thread waiter = signals.Waiter([&] { (*server)->Shutdown(); });
  (*server)->Wait();
  waiter.join();
  return 0;
}

int RunData(bool source, daemon::DataDaemonConfig config, const std::string& token_file,
            const std::string& security, bool check_only) {
  if (config.coordinator.address.empty()) {
    if (const char* env = std::getenv("WSYNC_COORDINATOR")) config.coordinator.address = env;
  }
  if (!token_file.empty()) {
    auto token = control::ReadTokenFile(token_file);
    if (!token.ok()) return Fail(token.status());
    config.coordinator.token = *token;
  } else if (const char* env = std::getenv("WSYNC_TOKEN")) {
    config.coordinator.token = env;
  }
  // The data plane's credential is the cluster token (docs/security.md).
  if (security == "auto") {
    config.security.mode = config.coordinator.token.empty() ? exchange::SecurityMode::kNone
                                                            : exchange::SecurityMode::kAuthenticate;
  } else {
    auto mode = exchange::ParseSecurityMode(security);
    if (!mode.ok()) return Fail(mode.status());
    config.security.mode = *mode;
  }
  config.security.cluster_token = config.coordinator.token;
  if (config.local_socket.rfind("unix:", 0) == 0) config.local_socket = config.local_socket.substr(5);
  if (config.local_socket.empty()) return Fail(InvalidArgumentError("--local unix:PATH is required"));
  if (config.name.empty()) return Fail(InvalidArgumentError("--name is required"));
  if (config.coordinator.address.empty()) {
    return Fail(InvalidArgumentError("no coordinator: --coordinator or env WSYNC_COORDINATOR"));
  }
  for (const auto& [url, run] : {std::pair{config.store.url, config.store.run},
                                  {config.store_tier.url, config.store_tier.run}}) {
    if (url.empty()) continue;
    auto store = store::S3OptionsFromUrl(url);
    if (!store.ok()) return Fail(store.status().WithContext("--store"));
    if (run.empty()) return Fail(InvalidArgumentError("--store needs --store-run (the run's key prefix)"));
  }
  if (check_only) return ConfigOk(source ? "source" : "sink");
  StopSignals signals;  // before any thread starts
  auto d = source ? daemon::StartSource(config) : daemon::StartSink(config);
  if (!d.ok()) return Fail(d.status());
  std::thread waiter = signals.Waiter([&] { (*d)->Shutdown(); });
  (*d)->Wait();
  waiter.join();
  return 0;
}

// An option given in MiB (a fraction is fine) and kept in bytes.
CLI::Option* AddMibOption(CLI::App* cmd, const std::string& name, uint64_t* bytes, const std::string& help,
                          const std::string& default_mib) {
  return cmd
      ->add_option(name,
                   [bytes](const std::vector<std::string>& v) {
                     *bytes = static_cast<uint64_t>(std::stod(v.at(0)) * (1 << 20));
                     return true;
                   },
                   help)
      ->default_str(default_mib)
      ->check(CLI::Range(0.0, 1048576.0));
}

// An option taking one of `choices`' words, each setting *out to its value;
// the default shown is the word of *out's value as it stands.
template <typename T>
CLI::Option* AddChoiceOption(CLI::App* cmd, const std::string& name, T* out,
                             std::vector<std::pair<std::string, T>> choices, const std::string& help) {
  std::vector<std::string> words;
  std::string current;
  for (const auto& [word, value] : choices) {
    words.push_back(word);
    if (value == *out) current = word;
  }
  return cmd
      ->add_option(name,
                   [out, choices = std::move(choices)](const std::vector<std::string>& v) {
                     for (const auto& [word, value] : choices) {
                       if (word == v.at(0)) *out = value;
                     }
                     return true;
                   },
                   help)
      ->default_str(current)
      ->check(CLI::IsMember(words));
}

}  // namespace

int main(int argc, char** argv) {
  wsync::RetainFreedMemory();  // every publish and apply reuses the last one's scratch
  // A registration passes a descriptor per memory region (thousands with a
  // region per tensor): the soft limit of open files is raised to the hard one.
  if (rlimit nofile{}; ::getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_cur < nofile.rlim_max) {
    nofile.rlim_cur = nofile.rlim_max;
    (void)::setrlimit(RLIMIT_NOFILE, &nofile);
  }
  CLI::App app{"wsyncd: the wsync daemon"};
  app.require_subcommand(1);
  std::string log_level = "info";
  app.add_option("--log-level", log_level, "trace, debug, info, warn, error")->capture_default_str();
  bool check_only = false;
  app.add_flag("--check-config", check_only,
               "check the options, the config and token files, and exit (0: the daemon would start with them)");

  auto* coord = app.add_subcommand("coordinator", "run the coordinator (versions, leases, staleness)");
  daemon::CoordinatorConfig config;
  std::string config_file, policy;
  std::vector<std::string> listen;
  std::optional<uint64_t> max_staleness, ttl;
  std::optional<uint32_t> fanout;
  std::optional<size_t> heartbeat_reports_from;
  std::optional<uint64_t> heartbeat_budget;
  coord->add_option("--config", config_file, "TOML file with a [coordinator] table")->check(CLI::ExistingFile);
  coord->add_option("--listen", listen, "host:port or unix:PATH (repeatable)");
  coord->add_option("--store-dir", config.store_dir, "directory of the durable store");
  coord->add_flag("--salvage-store", config.salvage_store,
                  "start from what verifies in a damaged store, setting damaged files aside and saying what was "
                  "dropped (without it a damaged store stops the coordinator)");
  coord->add_option("--token-file", config.token_file, "file holding the bearer token (or env WSYNC_TOKEN)");
  coord->add_option("--max-staleness", max_staleness, "bound on head - applied per sink (0: none)");
  coord->add_option("--staleness-policy", policy, "block or evict");
  coord->add_option("--fanout", fanout, "children per parent in the sync tree");
  coord->add_option("--node-ttl-ms", ttl, "default node and lease TTL");
  coord->add_option("--heartbeat-reports-from", heartbeat_reports_from,
                    "from this many nodes on, with no staleness bound, sinks let their heartbeats carry their applied "
                    "versions instead of a report per version (0: never; default 2000)");
  coord->add_option("--heartbeat-budget", heartbeat_budget,
                    "heartbeats per second the fleet is paced to with no staleness bound: past it sinks are asked "
                    "for heartbeats less often, and their TTLs stretch to four of those periods (0: never paced; "
                    "default 4000)");
  coord->add_option("--metrics-listen", config.server.metrics_listen, "Prometheus endpoint host:port");
  bool metrics_no_auth = false, reflection = false;
  coord->add_flag("--metrics-no-auth", metrics_no_auth,
                  "serve /metrics without the token (by default, with a token, it asks for HTTP basic auth with "
                  "the token as the password)");
  coord->add_flag("--inject-faults", config.server.inject_faults,
                  "tests only: honour the fault-injection metadata of calls (a replica killing itself between a "
                  "commit and its answer)")->group("");
  coord->add_flag("--reflection", reflection,
                  "enable gRPC server reflection (grpcurl); it is not behind the token");
  coord->add_option("--tls-cert", config.server.tls.cert_file, "server certificate (PEM)");
  coord->add_option("--tls-key", config.server.tls.key_file, "server key (PEM)");
  coord->add_option("--tls-client-ca", config.server.tls.client_ca_file, "CA of client certificates: require mTLS");
  std::string etcd_endpoints;
  std::optional<int> lease_ttl;
  auto& replica = config.replica;
  coord->add_option("--etcd", etcd_endpoints,
                    "run as one of several replicas over this etcd cluster (host:port,...): one leads, the others "
                    "send clients to it; replaces --store-dir")->group("Replicas over etcd");
  coord->add_option("--advertise", replica.advertise, "host:port clients reach this replica at")
      ->group("Replicas over etcd");
  coord->add_option("--etcd-prefix", replica.prefix, "the keys of this coordinator in etcd")
      ->capture_default_str()->group("Replicas over etcd");
  coord->add_option("--lease-ttl-s", lease_ttl, "the leader's etcd lease: a dead leader is replaced after about this "
                                                "(default 2)")->group("Replicas over etcd");
  coord->add_option("--etcd-ca", replica.etcd_ca_file, "CA of the etcd members: TLS")->group("Replicas over etcd");
  coord->add_option("--etcd-cert", replica.etcd_cert_file, "client certificate for etcd")->group("Replicas over etcd");
  coord->add_option("--etcd-key", replica.etcd_key_file, "its key")->group("Replicas over etcd");
  coord->add_option("--etcd-user", replica.etcd_user, "etcd user (etcd authentication)")->group("Replicas over etcd");
  coord->add_option("--etcd-password-file", config.etcd_password_file, "file holding its password")
      ->group("Replicas over etcd");
  auto& follow = config.follow_store;
  coord->add_option("--follow-store", follow.url,
                    "a region's coordinator: announce the versions of a run in this S3-compatible object store "
                    "(s3://BUCKET?endpoint=...; read-only credentials: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY), "
                    "for sinks given the store with --store; not with --etcd")
      ->group("Following a store");
  coord->add_option("--store-run", follow.run, "the key prefix of the run's versions in the store")
      ->group("Following a store");
  coord->add_option("--store-verify-key", follow.verify_key,
                    "announce only versions whose manifest this Ed25519 public key (PEM) verifies")
      ->check(CLI::ExistingFile)
      ->group("Following a store");
  coord->add_option("--store-poll-ms", follow.poll_ms, "how often the store is asked for a newer version")
      ->capture_default_str()
      ->check(CLI::Range(uint64_t{1}, uint64_t{3'600'000}))
      ->group("Following a store");
  daemon::DataDaemonConfig data;
  std::string data_token_file, data_security = "auto";
  auto add_data_flags = [&](CLI::App* cmd) {
    cmd->add_option("--coordinator", data.coordinator.address, "host:port or unix:PATH, or replicas: a comma-separated list (env WSYNC_COORDINATOR)");
    cmd->add_option("--token-file", data_token_file, "bearer token file (or env WSYNC_TOKEN)");
    cmd->add_option("--tls-ca", data.coordinator.tls_ca_file, "CA certificate: TLS to the coordinator");
    cmd->add_option("--data-security", data_security,
                    "what data-plane peers must prove: none, auth (the cluster token, by a challenge), encrypt "
                    "(auth, and every message AES-256-GCM); auto: auth with a token, none without")
        ->capture_default_str()->check(CLI::IsMember({"auto", "none", "auth", "encrypt"}));
    cmd->add_option("--local", data.local_socket, "unix:PATH of the local API (mode 0600)")->required();
    cmd->add_option("--listen", data.listen, "data-plane (UCX) listen address host:port")->capture_default_str();
    cmd->add_option("--name", data.name, "unique node name")->required();
    cmd->add_option("--threads", data.threads, "codec threads")->capture_default_str();
    cmd->add_option("--node-ttl-ms", data.node_ttl_ms, "heartbeat TTL")->capture_default_str();
    cmd->add_option("--rate-limit", data.rate_limit_bytes_per_s, "bytes/s per data-plane link (0: none)");
    cmd->add_option("--hold-ttl-ms", data.hold_ttl_ms,
                    "sinks: a hold that its holder does not renew for this long ends (0 < ms <= 600000)")
        ->capture_default_str()->check(CLI::Range(uint64_t{1}, uint64_t{600'000}));
    cmd->add_option("--retain-versions", data.retain_versions,
                    "sources: keep the patches of at least this many versions back from the head (a restarted "
                    "sink catches up with one merged patch), besides what leases and live sinks need")
        ->capture_default_str();
    cmd->add_option("--retry-max-ms", data.retry_max_ms, "sinks: the longest delay between failed sync attempts")
        ->capture_default_str()->check(CLI::Range(uint64_t{100}, uint64_t{600'000}));
    AddMibOption(cmd, "--segment-mib", &data.segment_bytes,
                 "sources: encode versions in segments of about this many MiB of weights (a fraction is fine), "
                 "each served as soon as it is encoded (0: encode whole versions)",
                 "64");
    AddChoiceOption(cmd, "--device-base", &data.device_base,
                    {{"device", daemon::DeviceBase::kDevice}, {"host", daemon::DeviceBase::kHost}},
                    "sources of weights in GPU memory: where the base of the next patch is kept: device (one "
                    "copy of the model on the GPU) or host (page-locked host memory; the model crosses PCIe "
                    "twice per publish)");
    AddChoiceOption(cmd, "--entropy-stage", &data.entropy_stage,
                    {{"host", cuda::EntropyStage::kHost}, {"device", cuda::EntropyStage::kDevice}},
                    "weights in GPU memory: where sparse-coded chunks are entropy-coded and decoded: host (the "
                    "--threads pool; faster unless the host has very few cores to spare) or device (a chunk per "
                    "GPU thread)");
    cmd->add_flag("--no-decode-ahead", [&data](int64_t) { data.decode_ahead = false; },
                  "sinks: decode a patch once all of it is in, not while it arrives (figures: "
                  "scripts/bench_shaped_link.py)");
    AddMibOption(cmd, "--keyframe-stage-mib", &data.keyframe_keep_bytes,
                 "sinks: a keyframe whose weights take at most this many MiB is decoded into memory and checked "
                 "while the engine still generates, then copied in during the pause; a larger one is decoded "
                 "during the pause (0: every keyframe is)",
                 "1024");
    AddMibOption(cmd, "--stage-mib", &data.stage_keep_bytes,
                 "sinks: staging keeps at most this many MiB of a version's changes (8 bytes per changed BF16 "
                 "value) while the engine still generates; changes past it are checked then and decoded again "
                 "during the pause, in groups of this size",
                 "4096");
    cmd->add_option("--inject-corrupt-every", data.corrupt_every, "fault injection: corrupt every Nth chunk sent")
        ->group("");
    cmd->add_option("--inject-fail-announce", data.fail_announce,
                    "fault injection: the source's announce of this version to the coordinator fails")
        ->group("");
  };
  auto* source = app.add_subcommand("source", "run next to a trainer: snapshot, encode, publish, serve");
  add_data_flags(source);
  source->add_option("--store", data.store.url,
                     "also mirror every version to an S3-compatible object store: s3://BUCKET?endpoint=http://HOST:PORT "
                     "(credentials: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY; docs/object-store.md)")
      ->group("Object store");
  source->add_option("--store-run", data.store.run, "the key prefix of this run's versions in the store")
      ->group("Object store");
  source->add_option("--store-keyframe-every", data.store.keyframe_every, "a keyframe in the store every N versions")
      ->capture_default_str()
      ->group("Object store");
  source->add_option("--store-merge-every", data.store.merge_every,
                     "every N versions also a merged patch from N versions back, for pullers that far behind (0: none)")
      ->capture_default_str()
      ->group("Object store");
  source->add_option("--store-signing-key", data.store.signing_key,
                     "sign every manifest with this Ed25519 private key (PEM; pullers verify with its public key)")
      ->check(CLI::ExistingFile)
      ->group("Object store");
  source->add_option("--store-keep", data.store.keep_versions,
                     "versions kept in the store back from the newest (older ones collected; 0: all kept)")
      ->capture_default_str()
      ->group("Object store");
  auto* sink = app.add_subcommand("sink", "run next to an inference server: pull, verify, apply, relay");
  add_data_flags(sink);
  auto& tier = data.store_tier;
  sink->add_option("--store", tier.url,
                   "read versions from this S3-compatible object store when no daemon serves them (no parent, an "
                   "unreachable one, or one lacking the version past --store-wait-ms): s3://BUCKET?endpoint=... "
                   "(read-only credentials: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY; none: anonymous)")
      ->group("Object store");
  sink->add_option("--store-run", tier.run, "the key prefix of the run's versions in the store")->group("Object store");
  sink->add_option("--store-verify-key", tier.verify_key,
                   "accept only manifests signed by this Ed25519 public key (PEM: the run's signing key's)")
      ->check(CLI::ExistingFile)
      ->group("Object store");
  sink->add_option("--store-wait-ms", tier.wait_ms,
                   "how long a parent that lacks a version (a relay still receiving it) is waited for before the "
                   "store is read")
      ->capture_default_str()
      ->group("Object store");
  sink->add_option("--store-parallel", tier.parallel, "ranged GETs in flight per object")
      ->capture_default_str()
      ->check(CLI::Range(1, 256))
      ->group("Object store");
  AddMibOption(sink, "--store-range-mib", &tier.range_bytes, "the size of each ranged GET", "8")
      ->group("Object store");
  CLI11_PARSE(app, argc, argv);

  spdlog::set_level(spdlog::level::from_str(log_level));
  spdlog::set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%l%$ [%n] %v");
  if (coord->parsed()) {
    // Precedence: defaults < config file < environment < flags.
    daemon::CoordinatorConfig merged;
    if (!config_file.empty()) {
      Status s = daemon::LoadCoordinatorToml(config_file, &merged);
      if (!s.ok()) return Fail(s);
    }
    if (const char* env = std::getenv("WSYNC_TOKEN")) merged.server.token = env;
    if (!listen.empty()) merged.server.listen = listen;
    if (!config.store_dir.empty()) merged.store_dir = config.store_dir;
    merged.salvage_store = config.salvage_store;
    if (!config.token_file.empty()) merged.token_file = config.token_file;
    if (!config.server.metrics_listen.empty()) merged.server.metrics_listen = config.server.metrics_listen;
    if (metrics_no_auth) merged.server.metrics_auth = false;
    if (reflection) merged.server.reflection = true;
    if (config.server.inject_faults) merged.server.inject_faults = true;
    if (!config.server.tls.cert_file.empty()) merged.server.tls.cert_file = config.server.tls.cert_file;
    if (!config.server.tls.key_file.empty()) merged.server.tls.key_file = config.server.tls.key_file;
    if (!config.server.tls.client_ca_file.empty()) merged.server.tls.client_ca_file = config.server.tls.client_ca_file;
    if (max_staleness) merged.state.max_staleness = *max_staleness;
    if (fanout) merged.state.fanout = *fanout;
    if (ttl) merged.state.default_ttl_ms = *ttl;
    if (heartbeat_reports_from) merged.state.heartbeat_reports_from = *heartbeat_reports_from;
    if (heartbeat_budget) merged.state.heartbeat_budget = *heartbeat_budget;
    if (!policy.empty()) {
      auto p = daemon::ParsePolicy(policy);
      if (!p.ok()) return Fail(p.status());
      merged.state.policy = *p;
    }
    if (!etcd_endpoints.empty()) merged.replica.etcd_endpoints = SplitList(etcd_endpoints);
    if (!replica.advertise.empty()) merged.replica.advertise = replica.advertise;
    if (replica.prefix != control::ReplicaOptions{}.prefix) merged.replica.prefix = replica.prefix;
    if (lease_ttl) merged.replica.lease_ttl_s = *lease_ttl;
    for (auto [from, to] : {std::pair{&replica.etcd_ca_file, &merged.replica.etcd_ca_file},
                            {&replica.etcd_cert_file, &merged.replica.etcd_cert_file},
                            {&replica.etcd_key_file, &merged.replica.etcd_key_file},
                            {&replica.etcd_user, &merged.replica.etcd_user},
                            {&config.etcd_password_file, &merged.etcd_password_file}}) {
      if (!from->empty()) *to = *from;
    }
    merged.follow_store = config.follow_store;
    return RunCoordinator(merged, check_only);
  }
  if (source->parsed() || sink->parsed()) {
    return RunData(source->parsed(), data, data_token_file, data_security, check_only);
  }
  return 0;
}
