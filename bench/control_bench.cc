#include "control_bench.h"

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cinttypes>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <map>
#include <mutex>
#include <thread>

#include "wsync/control/client.h"
#include "wsync/control/server.h"

namespace wsync::bench {
namespace {

namespace v1 = wsync::v1;
using Clock = std::chrono::steady_clock;

double Percentile(std::vector<double>& v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5))];
}

}  // namespace

int RunControlBench(const ControlBenchOptions& o) {
  spdlog::set_level(spdlog::level::warn);
  std::unique_ptr<control::CoordinatorState> state;
  std::unique_ptr<control::CoordinatorServer> server;
  std::string address = o.address;
  if (address.empty()) {
    control::CoordinatorOptions so;
    so.default_ttl_ms = 60'000;
    control::Recovered recovered;
    std::unique_ptr<control::Store> store = control::NewNullStore();
    if (!o.store_dir.empty()) {
      auto opened = control::OpenLogStore(o.store_dir, &recovered);
      if (!opened.ok()) {
        spdlog::error("{}", opened.status().ToString());
        return 1;
      }
      store = std::move(*opened);
    }
    auto s = control::CoordinatorState::Create(so, control::SystemClock(), std::move(store), recovered);
    if (!s.ok()) return 1;
    state = std::move(*s);
    control::ServerOptions opts;
    opts.listen = {"127.0.0.1:0"};
    auto srv = control::CoordinatorServer::Start(opts, state.get());
    if (!srv.ok()) {
      spdlog::error("{}", srv.status().ToString());
      return 1;
    }
    server = std::move(*srv);
    address = "127.0.0.1:" + std::to_string(server->ports()[0]);
  }
  control::ClientOptions co;
  co.address = address;
  co.timeout_ms = 30'000;
  co.wait_for_ready = true;

  std::mutex mu;
  std::map<std::string, std::vector<double>> latency_us;  // per method
  std::atomic<uint64_t> errors{0}, head{0};
  auto record = [&](const char* method, std::vector<double>& local, Clock::time_point t0, bool ok) {
    local.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    if (!ok) ++errors;
    (void)method;
  };

  // Phase 1: registration.
  const auto start = Clock::now();
  std::vector<std::thread> threads;
  std::vector<std::vector<double>> reg_lat(o.workers), hb_lat(o.workers), rep_lat(o.workers);
  for (int w = 0; w < o.workers; ++w) {
    threads.emplace_back([&, w] {
      auto c = control::NewCoordinatorClient(co);
      if (!c.ok()) return;
      for (int i = w; i < o.sinks; i += o.workers) {
        v1::RegisterRequest r;
        r.set_name("sink-" + std::to_string(i));
        r.set_role(v1::ROLE_SINK);
        r.set_data_address(std::string(64, 'x'));
        auto t0 = Clock::now();
        record("Register", reg_lat[w], t0, (*c)->Register(r).ok());
      }
    });
  }
  for (auto& t : threads) t.join();
  threads.clear();
  const double register_s = std::chrono::duration<double>(Clock::now() - start).count();

  // Phase 2: steady state for o.seconds: heartbeats + reports, a publisher.
  std::atomic<bool> stop{false};
  std::thread publisher([&] {
    auto c = control::NewCoordinatorClient(co);
    if (!c.ok()) return;
    uint64_t v = 0;
    while (!stop) {
      v1::VersionSummary s;
      s.set_version(++v);
      s.set_keyframe(v == 1);
      s.set_base_version(v - 1);
      if ((*c)->Publish(s).ok()) head = v;
      std::this_thread::sleep_for(std::chrono::milliseconds(o.publish_every_ms));
    }
  });
  const auto steady_start = Clock::now();
  for (int w = 0; w < o.workers; ++w) {
    threads.emplace_back([&, w] {
      auto c = control::NewCoordinatorClient(co);
      if (!c.ok()) return;
      while (!stop) {
        for (int i = w; i < o.sinks && !stop; i += o.workers) {
          v1::HeartbeatRequest h;
          h.set_name("sink-" + std::to_string(i));
          auto t0 = Clock::now();
          record("Heartbeat", hb_lat[w], t0, (*c)->Heartbeat(h).ok());
          t0 = Clock::now();
          record("ReportApplied", rep_lat[w], t0, (*c)->ReportApplied(h.name(), head.load()).ok());
        }
      }
    });
  }
  std::this_thread::sleep_for(std::chrono::duration<double>(o.seconds));
  stop = true;
  for (auto& t : threads) t.join();
  publisher.join();
  const double steady_s = std::chrono::duration<double>(Clock::now() - steady_start).count();

  auto merge = [](std::vector<std::vector<double>>& parts) {
    std::vector<double> all;
    for (auto& p : parts) all.insert(all.end(), p.begin(), p.end());
    return all;
  };
  std::vector<double> reg = merge(reg_lat), hb = merge(hb_lat), rep = merge(rep_lat);
  std::vector<double> steady = hb;
  steady.insert(steady.end(), rep.begin(), rep.end());
  const double rps = steady.size() / steady_s;
  if (server) server->Shutdown();
  if (o.json) {
    nlohmann::ordered_json j;
    j["sinks"] = o.sinks;
    j["client_threads"] = o.workers;
    j["register_per_s"] = reg.size() / register_s;
    j["steady_rpcs_per_s"] = rps;
    j["versions_published"] = head.load();
    j["errors"] = errors.load();
    for (auto [name, v] : {std::pair<const char*, std::vector<double>*>{"register", &reg}, {"heartbeat", &hb},
                           {"report_applied", &rep}}) {
      j[name] = {{"count", v->size()}, {"p50_us", Percentile(*v, 0.5)}, {"p99_us", Percentile(*v, 0.99)}};
    }
    std::printf("%s\n", j.dump(2).c_str());
    return errors.load() == 0 ? 0 : 2;
  }
  std::printf("== coordinator load: %d sinks over %d client threads, real gRPC on loopback, store: %s\n", o.sinks,
              o.workers, o.store_dir.empty() ? "none" : o.store_dir.c_str());
  std::printf("registration: %zu RPCs in %.2f s (%.0f/s)\n", reg.size(), register_s, reg.size() / register_s);
  std::printf("steady state: %.1f s, %zu RPCs (%.0f/s), %" PRIu64 " versions published, %" PRIu64 " errors\n",
              steady_s, steady.size(), rps, head.load(), errors.load());
  std::printf("%-14s %10s %10s %10s\n", "method", "count", "p50 us", "p99 us");
  for (auto [name, v] : {std::pair<const char*, std::vector<double>*>{"Register", &reg}, {"Heartbeat", &hb},
                         {"ReportApplied", &rep}}) {
    std::printf("%-14s %10zu %10.0f %10.0f\n", name, v->size(), Percentile(*v, 0.5), Percentile(*v, 0.99));
  }
  return errors.load() == 0 ? 0 : 2;
}

}  // namespace wsync::bench
