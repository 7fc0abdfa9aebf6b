#include "control_bench.h"

#include <grpcpp/grpcpp.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cinttypes>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <functional>
#include <map>
#include <mutex>
#include <queue>
#include <random>
#include <thread>

#include <unistd.h>

#include "wsync/control/client.h"
#include "wsync/control/replica.h"
#include "wsync/control/server.h"
#include "wsync/util/text.h"
#include "wsync/v1/coordinator.grpc.pb.h"

namespace wsync::bench {
namespace {

namespace v1 = wsync::v1;
using Clock = std::chrono::steady_clock;

double Percentile(std::vector<double>& v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5))];
}

// A server's state holder set once the replica exists.
class Deferred : public control::StateHolder {
 public:
  void Set(control::Replica* r) { replica_.store(r); }
  StatusOr<std::shared_ptr<control::CoordinatorState>> Current() override {
    control::Replica* r = replica_.load();
    if (r == nullptr) return NotLeaderError("");
    return r->Current();
  }

 private:
  std::atomic<control::Replica*> replica_{nullptr};
};

struct Load {
  double register_per_s = 0, steady_s = 0, rps = 0;
  double offered_rps = 0;  // --fleet: the rate the fleet makes
  uint64_t versions = 0, errors = 0, late = 0;
  bool reports_on_heartbeats = false;  // --fleet: the coordinator took applied versions from heartbeats
  uint64_t paced_ms = 0;               // --fleet: the heartbeat period the coordinator asked for (0: as run)
  // microseconds; rep: a report's call, or with reports on heartbeats, from
  // the apply to the answer of the heartbeat that first carried it
  std::vector<double> reg, hb, rep;
  std::vector<double> watch;          // --fleet: from a version's publish to each watcher's receipt, microseconds
};

// --fleet: the address that answers the fleet's calls (the one
// coordinator, or the replica that leads), asked of each in turn.
StatusOr<std::string> LeaderOf(const std::string& addresses) {
  for (const auto& a : SplitList(addresses)) {
    control::ClientOptions co;
    co.address = a;
    co.timeout_ms = 5'000;
    WSYNC_ASSIGN_OR_RETURN(auto c, control::NewCoordinatorClient(co));
    auto r = c->DescribeReplica();
    if (r.ok() && (r->role() == v1::ReplicaResponse::SINGLE || r->role() == v1::ReplicaResponse::LEADER)) return a;
  }
  return UnavailableError("no coordinator at " + addresses + " leads");
}

// --fleet: open loop, as a fleet calls: each sink's heartbeat and reports
// start at their time whether or not earlier calls have been answered (the
// callback API: a call in flight holds no thread). Sinks are split over
// --workers connections, one scheduling thread each. A call is late when it
// starts more than 100 ms after its time (this machine fell behind the
// fleet); its latency is measured from its start. The Watch streams go over
// --workers connections of their own: a sink's heartbeat shares its
// connection with its own Watch stream alone, and thousands of sinks' new
// versions queued on one connection ahead of a heartbeat's answer would time
// the driver's connections, not the coordinator.
class FleetDriver {
 public:
  FleetDriver(const std::string& leader, const ControlBenchOptions& o) : o_(o), lat_(o.workers) {
    for (int w = 0; w < 2 * o.workers; ++w) {
      grpc::ChannelArguments args;
      args.SetInt("wsync.bench.channel", w);  // a connection per channel, as sinks on many hosts have
      auto stub = v1::Coordinator::NewStub(grpc::CreateCustomChannel(leader, grpc::InsecureChannelCredentials(), args));
      (w < o.workers ? stubs_ : watch_stubs_).push_back(std::move(stub));
    }
  }
  // The watch streams are deleted here, after Run has seen every one end.
  ~FleetDriver() {
    for (WatchStream* ws : watches_) delete ws;
  }

  // One heartbeat (of the first sink) before the steady state: the fleet's
  // first heartbeats are spread over the period the coordinator asks for,
  // as a paced fleet's are, not over the driver's.
  void LearnPace() {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::HeartbeatRequest req;
    req.set_name("sink-0");
    v1::HeartbeatResponse resp;
    if (stubs_[0]->Heartbeat(&ctx, req, &resp).ok()) paced_ms_ = resp.heartbeat_interval_ms();
  }

  // Unless --no-watch, every sink opens its Watch stream first, as a sink
  // daemon does (open until Run ends).
  void OpenWatches(const std::atomic<uint64_t>& head, const std::atomic<int64_t>& published_at_us) {
    if (!o_.watch) return;
    for (int i = 0; i < o_.sinks; ++i) {
      auto* ws = new WatchStream(this, head, published_at_us);
      ws->req.set_node("sink-" + std::to_string(i));
      ws->req.set_after(head.load());
      {
        std::lock_guard<std::mutex> lock(mu_);
        ++in_flight_;
        watches_.push_back(ws);
      }
      watch_stubs_[i % o_.workers]->async()->Watch(&ws->ctx, &ws->req, ws);
      ws->StartRead(&ws->msg);
      ws->StartCall();
    }
  }

  // Drives until `stop`; then ends the watches and waits for the calls in flight.
  void Run(const std::atomic<bool>& stop, const std::atomic<uint64_t>& head,
           const std::atomic<int64_t>& published_at_us) {
    std::vector<std::thread> threads;
    for (int w = 0; w < o_.workers; ++w) threads.emplace_back([&, w] { Schedule(w, stop, head, published_at_us); });
    for (auto& t : threads) t.join();
    std::unique_lock<std::mutex> lock(mu_);
    for (WatchStream* ws : watches_) ws->ctx.TryCancel();
    done_.wait_for(lock, std::chrono::seconds(60), [&] { return in_flight_ == 0; });
  }

  // Microseconds from each version's publish to each watcher's receipt of it.
  std::vector<double> WatchLatencies() {
    std::lock_guard<std::mutex> lock(mu_);
    return watch_lat_;
  }
  uint64_t watch_errors() const { return watch_errors_; }

  std::vector<double> Latencies(bool report) {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<double> all;
    for (auto& l : lat_) all.insert(all.end(), (report ? l.rep : l.hb).begin(), (report ? l.rep : l.hb).end());
    return all;
  }
  uint64_t errors() const { return errors_; }
  uint64_t late() const { return late_; }
  uint64_t calls() const { return calls_; }  // answered, heartbeats and reports
  bool reports_on_heartbeats() const { return reports_on_heartbeats_; }
  uint64_t paced_ms() const { return paced_ms_; }
  // Each sink's heartbeat period: the driver's, or the one the coordinator
  // asks for, as Membership does (one pace for the whole fleet: the last
  // answer's stands for every sink).
  std::chrono::milliseconds period() const {
    return std::chrono::milliseconds(std::max<uint64_t>(o_.heartbeat_ms, paced_ms_.load()));
  }

 private:
  struct Call {
    grpc::ClientContext ctx;
    v1::HeartbeatRequest hb;
    v1::HeartbeatResponse hb_resp;
    v1::ReportAppliedRequest rep;
    v1::ReportAppliedResponse rep_resp;
    Clock::time_point start;
    // A heartbeat that first carries a version applied at `applied_at`:
    // the report's latency is from then to its answer.
    bool carries_report = false;
    Clock::time_point applied_at;
  };
  struct Lat {
    std::vector<double> hb, rep;
  };
  // One sink's Watch stream: each version read is timed from its publish.
  class WatchStream : public grpc::ClientReadReactor<v1::VersionSummary> {
   public:
    WatchStream(FleetDriver* d, const std::atomic<uint64_t>& head, const std::atomic<int64_t>& published_at_us)
        : d_(d), head_(head), published_at_us_(published_at_us) {}
    void OnReadDone(bool ok) override {
      if (!ok) return;  // the stream ends: OnDone follows
      if (msg.version() == head_.load()) {
        const int64_t now_us =
            std::chrono::duration_cast<std::chrono::microseconds>(Clock::now().time_since_epoch()).count();
        std::lock_guard<std::mutex> lock(d_->mu_);
        d_->watch_lat_.push_back(static_cast<double>(now_us - published_at_us_.load()));
      }
      StartRead(&msg);
    }
    void OnDone(const grpc::Status& s) override {
      if (!s.ok() && s.error_code() != grpc::StatusCode::CANCELLED) ++d_->watch_errors_;
      std::lock_guard<std::mutex> lock(d_->mu_);
      if (--d_->in_flight_ == 0) d_->done_.notify_all();
    }
    grpc::ClientContext ctx;
    v1::WatchRequest req;
    v1::VersionSummary msg;

   private:
    FleetDriver* d_;
    const std::atomic<uint64_t>& head_;
    const std::atomic<int64_t>& published_at_us_;
  };

  void Schedule(int w, const std::atomic<bool>& stop, const std::atomic<uint64_t>& head,
                const std::atomic<int64_t>& published_at_us) {
    using Us = std::chrono::microseconds;
    const auto t0 = Clock::now();
    struct Due {
      Clock::time_point at;
      int sink;
      bool report;
      bool operator>(const Due& d) const { return at > d.at; }
    };
    std::priority_queue<Due, std::vector<Due>, std::greater<Due>> due;
    std::vector<uint64_t> reported(o_.sinks, 0);
    // What each sink holds and when it applied it; the newest a heartbeat carried.
    std::vector<uint64_t> applied(o_.sinks, 0), carried(o_.sinks, 0);
    std::vector<Clock::time_point> applied_at(o_.sinks);
    // Heartbeats spread evenly over a period, as sinks started at random.
    const int64_t period_us = std::chrono::duration_cast<Us>(period()).count();
    for (int i = w; i < o_.sinks; i += o_.workers) {
      due.push({t0 + Us(period_us * i / o_.sinks), i, false});
    }
    uint64_t scheduled_for = head.load();
    std::mt19937_64 rng(w);
    while (!stop) {
      // A new version: every sink of this thread reports it within the spread.
      if (const uint64_t v = head.load(); v != scheduled_for) {
        scheduled_for = v;
        const auto at = Clock::time_point(Us(published_at_us.load()));
        for (int i = w; i < o_.sinks; i += o_.workers) {
          due.push({at + Us(static_cast<int64_t>(rng() % (static_cast<uint64_t>(o_.report_spread_ms) * 1000))), i, true});
        }
      }
      const Due d = due.top();
      if (d.at > Clock::now()) {
        std::this_thread::sleep_until(std::min(d.at, Clock::now() + std::chrono::milliseconds(5)));
        continue;
      }
      due.pop();
      const uint64_t v = head.load();
      if (d.report && reported[d.sink] == v) continue;
      auto* call = new Call;
      call->start = Clock::now();
      if (call->start - d.at > std::chrono::milliseconds(100)) ++late_;
      call->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
      {
        std::lock_guard<std::mutex> lock(mu_);
        ++in_flight_;
      }
      const std::string name = "sink-" + std::to_string(d.sink);
      if (d.report) {
        reported[d.sink] = v;
        applied[d.sink] = v;
        applied_at[d.sink] = d.at;
      }
      if (d.report && reports_on_heartbeats_) {
        // The coordinator takes applied versions from heartbeats: the next one carries it.
        delete call;
        std::lock_guard<std::mutex> lock(mu_);
        if (--in_flight_ == 0) done_.notify_all();
      } else if (d.report) {
        carried[d.sink] = v;  // reported by its own call: no heartbeat counts it
        call->rep.set_name(name);
        call->rep.set_version(v);
        stubs_[w]->async()->ReportApplied(&call->ctx, &call->rep, &call->rep_resp,
                                          [this, w, call](grpc::Status s) { Done(w, call, true, s); });
      } else {
        call->hb.set_name(name);
        call->hb.set_applied_version(applied[d.sink]);
        if (applied[d.sink] > carried[d.sink]) {
          call->carries_report = true;
          call->applied_at = applied_at[d.sink];
        }
        carried[d.sink] = applied[d.sink];
        stubs_[w]->async()->Heartbeat(&call->ctx, &call->hb, &call->hb_resp,
                                      [this, w, call](grpc::Status s) { Done(w, call, false, s); });
        due.push({d.at + period(), d.sink, false});
      }
    }
  }

  void Done(int w, Call* call, bool report, const grpc::Status& s) {
    const auto now = Clock::now();
    const double us = std::chrono::duration<double, std::micro>(now - call->start).count();
    const bool carried = call->carries_report && s.ok();
    const double carried_us = std::chrono::duration<double, std::micro>(now - call->applied_at).count();
    if (!report && s.ok() && call->hb_resp.reports_on_heartbeats()) reports_on_heartbeats_ = true;
    if (!report && s.ok()) paced_ms_ = call->hb_resp.heartbeat_interval_ms();
    delete call;
    if (!s.ok()) ++errors_;
    ++calls_;
    std::lock_guard<std::mutex> lock(mu_);
    (report ? lat_[w].rep : lat_[w].hb).push_back(us);
    if (carried) lat_[w].rep.push_back(carried_us);
    if (--in_flight_ == 0) done_.notify_all();
  }

  const ControlBenchOptions& o_;
  std::vector<std::unique_ptr<v1::Coordinator::Stub>> stubs_, watch_stubs_;
  std::atomic<uint64_t> errors_{0}, late_{0}, watch_errors_{0};
  std::atomic<bool> reports_on_heartbeats_{false};  // as the coordinator's heartbeat answers say
  std::atomic<uint64_t> paced_ms_{0};               // the period the last heartbeat answer asked for
  std::atomic<uint64_t> calls_{0};
  std::mutex mu_;
  std::condition_variable done_;
  uint64_t in_flight_ = 0;
  std::vector<Lat> lat_;
  std::vector<WatchStream*> watches_;  // owned: deleted with the driver, after every OnDone
  std::vector<double> watch_lat_;
};

// Simulated sinks against `address` (one coordinator, or replicas): they
// register, then heart-beat and report while a trainer publishes.
Load Drive(const std::string& address, const ControlBenchOptions& o,
           const std::function<void()>& at_steady_state = {}) {
  control::ClientOptions co;
  co.address = address;
  co.timeout_ms = 30'000;
  co.wait_for_ready = true;
  std::atomic<uint64_t> errors{0}, head{0};
  auto record = [&](std::vector<double>& local, Clock::time_point t0, bool ok) {
    local.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    if (!ok) ++errors;
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
        // The daemons' TTL: four heartbeat periods (the coordinator paces a
        // large fleet by it). The fleet's registration must end within it:
        // heartbeats start once every sink is registered.
        if (o.fleet) r.set_ttl_ms(4 * static_cast<uint64_t>(o.heartbeat_ms));
        auto t0 = Clock::now();
        record(reg_lat[w], t0, (*c)->Register(r).ok());
      }
    });
  }
  for (auto& t : threads) t.join();
  threads.clear();
  const double register_s = std::chrono::duration<double>(Clock::now() - start).count();

  // Phase 2: steady state for o.seconds: heartbeats + reports, a publisher.
  if (at_steady_state) at_steady_state();
  std::atomic<bool> stop{false};
  std::atomic<int64_t> published_at_us{0};
  std::thread publisher([&] {
    auto c = control::NewCoordinatorClient(co);
    if (!c.ok()) return;
    uint64_t v = 0;
    while (!stop) {
      v1::VersionSummary s;
      s.set_version(++v);
      s.set_keyframe(v == 1);
      s.set_base_version(v - 1);
      if ((*c)->Publish(s).ok()) {
        published_at_us = std::chrono::duration_cast<std::chrono::microseconds>(Clock::now().time_since_epoch()).count();
        head = v;
      }
      const auto next = Clock::now() + std::chrono::milliseconds(o.publish_every_ms);
      while (!stop && Clock::now() < next) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
  std::atomic<uint64_t> late{0};
  std::unique_ptr<FleetDriver> fleet;
  if (o.fleet) {
    auto leader = LeaderOf(address);
    if (leader.ok()) {
      fleet = std::make_unique<FleetDriver>(*leader, o);
    } else {
      spdlog::error("{}", leader.status().ToString());
      ++errors;
    }
  }
  if (fleet) {
    fleet->LearnPace();
    fleet->OpenWatches(head, published_at_us);
  }
  const auto steady_start = Clock::now();
  if (fleet) {
    threads.emplace_back([&] { fleet->Run(stop, head, published_at_us); });
  }
  for (int w = 0; w < o.workers && !o.fleet; ++w) {
    threads.emplace_back([&, w] {
      auto c = control::NewCoordinatorClient(co);
      if (!c.ok()) return;
      while (!stop) {
        for (int i = w; i < o.sinks && !stop; i += o.workers) {
          v1::HeartbeatRequest h;
          h.set_name("sink-" + std::to_string(i));
          auto t0 = Clock::now();
          record(hb_lat[w], t0, (*c)->Heartbeat(h).ok());
          t0 = Clock::now();
          record(rep_lat[w], t0, (*c)->ReportApplied(h.name(), head.load()).ok());
        }
      }
    });
  }
  std::this_thread::sleep_for(std::chrono::duration<double>(o.seconds));
  stop = true;
  for (auto& t : threads) t.join();
  publisher.join();

  auto merge = [](std::vector<std::vector<double>>& parts) {
    std::vector<double> all;
    for (auto& p : parts) all.insert(all.end(), p.begin(), p.end());
    return all;
  };
  Load l;
  l.steady_s = std::chrono::duration<double>(Clock::now() - steady_start).count();
  l.reg = merge(reg_lat);
  l.hb = fleet ? fleet->Latencies(false) : merge(hb_lat);
  l.rep = fleet ? fleet->Latencies(true) : merge(rep_lat);
  if (fleet) {
    errors += fleet->errors() + fleet->watch_errors();
    late += fleet->late();
    l.watch = fleet->WatchLatencies();
  }
  l.register_per_s = l.reg.size() / register_s;
  l.rps = (fleet ? fleet->calls() : l.hb.size() + l.rep.size()) / l.steady_s;
  l.versions = head.load();
  l.errors = errors.load();
  l.late = late.load();
  if (fleet) {
    // Applied versions ride on heartbeats when the coordinator says so: no report calls.
    l.reports_on_heartbeats = fleet->reports_on_heartbeats();
    l.paced_ms = fleet->paced_ms();
    const double period_ms = static_cast<double>(fleet->period().count());
    l.offered_rps = o.sinks * (1000.0 / period_ms + (l.reports_on_heartbeats ? 0 : 1000.0 / o.publish_every_ms));
  }
  return l;
}

// The in-process coordinator the bench measures when given no address: in
// memory, or with its durable store.
struct Embedded {
  std::unique_ptr<control::CoordinatorState> state;
  std::unique_ptr<control::CoordinatorServer> server;
  std::string address;
};

StatusOr<Embedded> StartEmbedded(const ControlBenchOptions& o) {
  Embedded e;
  control::CoordinatorOptions so;
  so.default_ttl_ms = 60'000;
  control::Recovered recovered;
  std::unique_ptr<control::Store> store = control::NewNullStore();
  if (!o.store_dir.empty()) {
    WSYNC_ASSIGN_OR_RETURN(store, control::OpenLogStore(o.store_dir, &recovered));
  }
  WSYNC_ASSIGN_OR_RETURN(e.state, control::CoordinatorState::Create(so, control::SystemClock(), std::move(store),
                                                                    recovered));
  control::ServerOptions opts;
  opts.listen = {"127.0.0.1:0"};
  WSYNC_ASSIGN_OR_RETURN(e.server, control::CoordinatorServer::Start(opts, e.state.get()));
  e.address = "127.0.0.1:" + std::to_string(e.server->ports()[0]);
  return e;
}

// Three replicas over the etcd cluster at o.etcd, each serving on
// 127.0.0.1:0; the address list every client gets, once one leads.
struct Replicas {
  std::vector<std::unique_ptr<control::Replica>> replicas;
  std::vector<std::unique_ptr<control::CoordinatorServer>> servers;
  std::vector<std::unique_ptr<Deferred>> holders;
  std::string addresses;
  uint64_t EtcdWrites() const {
    uint64_t n = 0;
    for (const auto& r : replicas) n += r->etcd_writes();
    return n;
  }
};

StatusOr<Replicas> StartReplicas(const ControlBenchOptions& o) {
  Replicas out;
  const std::vector<std::string> endpoints = SplitList(o.etcd);
  // Port 0 cannot be advertised: the ports are taken first, then served.
  for (int i = 0; i < 3; ++i) {
    control::ServerOptions opts;
    opts.listen = {"127.0.0.1:0"};
    control::ReplicaOptions ro;
    ro.etcd_endpoints = endpoints;
    ro.prefix = "/wsync-bench-" + std::to_string(::getpid());
    ro.coordinator.default_ttl_ms = 60'000;
    // The holder is filled in below: a server needs its port before the replica can advertise it.
    auto holder = std::make_unique<Deferred>();
    WSYNC_ASSIGN_OR_RETURN(auto server, control::CoordinatorServer::Start(opts, holder.get()));
    ro.advertise = "127.0.0.1:" + std::to_string(server->ports()[0]);
    WSYNC_ASSIGN_OR_RETURN(auto replica, control::Replica::Start(ro, control::SystemClock()));
    holder->Set(replica.get());
    out.addresses += (out.addresses.empty() ? "" : ",") + ro.advertise;
    out.replicas.push_back(std::move(replica));
    out.servers.push_back(std::move(server));
    out.holders.push_back(std::move(holder));
  }
  const auto end = Clock::now() + std::chrono::seconds(30);
  while (std::none_of(out.replicas.begin(), out.replicas.end(), [](const auto& r) { return r->leading(); })) {
    if (Clock::now() > end) return UnavailableError("no replica was elected within 30 s (is etcd at " + o.etcd + "?)");
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return out;
}

void PrintLoad(const char* what, const Load& l) {
  std::printf("-- %s\n", what);
  std::printf("registration: %zu RPCs (%.0f/s)\n", l.reg.size(), l.register_per_s);
  std::printf("steady state: %.1f s, %.0f RPCs/s, %" PRIu64 " versions published, %" PRIu64 " errors\n", l.steady_s,
              l.rps, l.versions, l.errors);
  if (l.offered_rps > 0) {
    std::printf("fleet rate: %.0f RPCs/s offered; %" PRIu64 " calls started over 100 ms late; applied versions %s\n",
                l.offered_rps, l.late,
                l.reports_on_heartbeats ? "on heartbeats (ReportApplied: from the apply to that heartbeat's answer)"
                                        : "in ReportApplied calls");
    if (l.paced_ms > 0) std::printf("heartbeats paced by the coordinator: one per sink every %" PRIu64 " ms\n", l.paced_ms);
  }
  std::printf("%-14s %10s %10s %10s\n", "method", "count", "p50 us", "p99 us");
  for (auto [name, v] : {std::pair<const char*, const std::vector<double>*>{"Register", &l.reg},
                         {"Heartbeat", &l.hb}, {"ReportApplied", &l.rep}, {"Watch (deliver)", &l.watch}}) {
    if (v == &l.watch && v->empty()) continue;
    std::vector<double> copy = *v;
    std::printf("%-14s %10zu %10.0f %10.0f\n", name, v->size(), Percentile(copy, 0.5), Percentile(copy, 0.99));
  }
}

nlohmann::ordered_json LoadJson(const Load& l) {
  nlohmann::ordered_json j;
  j["register_per_s"] = l.register_per_s;
  j["steady_rpcs_per_s"] = l.rps;
  j["versions_published"] = l.versions;
  j["errors"] = l.errors;
  if (l.offered_rps > 0) {
    j["offered_rpcs_per_s"] = l.offered_rps;
    j["reports_on_heartbeats"] = l.reports_on_heartbeats;
    j["late_calls"] = l.late;
    j["heartbeat_paced_ms"] = l.paced_ms;
  }
  for (auto [name, v] : {std::pair<const char*, const std::vector<double>*>{"register", &l.reg},
                         {"heartbeat", &l.hb}, {"report_applied", &l.rep}, {"watch_delivery", &l.watch}}) {
    std::vector<double> copy = *v;
    j[name] = {{"count", v->size()}, {"p50_us", Percentile(copy, 0.5)}, {"p99_us", Percentile(copy, 0.99)}};
  }
  return j;
}

}  // namespace

int RunControlBench(const ControlBenchOptions& o) {
  spdlog::set_level(spdlog::level::warn);
  nlohmann::ordered_json j;
  j["sinks"] = o.sinks;
  j["client_threads"] = o.workers;
  uint64_t errors = 0;
  if (!o.json) {
    std::printf("== coordinator load: %d sinks over %d client threads, real gRPC on loopback\n", o.sinks, o.workers);
    if (o.fleet) {
      std::printf("at the fleet's rate: a heartbeat per sink every %d ms, a version every %d ms reported by every "
                  "sink within %d ms\n", o.heartbeat_ms, o.publish_every_ms, o.report_spread_ms);
    }
  }
  if (!o.address.empty()) {
    Load l = Drive(o.address, o);
    errors += l.errors;
    if (o.json) j["external"] = LoadJson(l);
    else PrintLoad(("coordinator at " + o.address).c_str(), l);
  } else {
    auto embedded = StartEmbedded(o);
    if (!embedded.ok()) {
      spdlog::error("{}", embedded.status().ToString());
      return 1;
    }
    Load l = Drive(embedded->address, o);
    embedded->server->Shutdown();
    errors += l.errors;
    const std::string what = "one coordinator, store: " + (o.store_dir.empty() ? std::string("none") : o.store_dir);
    if (o.json) j["embedded"] = LoadJson(l);
    else PrintLoad(what.c_str(), l);
  }
  if (!o.etcd.empty()) {
    auto replicas = StartReplicas(o);
    if (!replicas.ok()) {
      spdlog::error("{}", replicas.status().ToString());
      return 1;
    }
    uint64_t writes_before = 0;
    Load l = Drive(replicas->addresses, o, [&] { writes_before = replicas->EtcdWrites(); });
    const uint64_t writes = replicas->EtcdWrites() - writes_before;  // in the steady state
    for (auto& s : replicas->servers) s->Shutdown();
    errors += l.errors;
    const double per_version = l.versions ? static_cast<double>(writes) / l.versions : 0;
    if (o.json) {
      j["replicas"] = LoadJson(l);
      j["replicas"]["etcd_writes"] = writes;
      j["replicas"]["etcd_writes_per_version"] = per_version;
    } else {
      PrintLoad(("three replicas over etcd " + o.etcd).c_str(), l);
      std::printf("etcd writes in the steady state: %" PRIu64 " (%.1f per published version: the version and "
                  "each sink's first report of it)\n", writes, per_version);
    }
  }
  if (o.json) {
    j["errors"] = errors;
    std::printf("%s\n", j.dump(2).c_str());
  }
  return errors == 0 ? 0 : 2;
}

}  // namespace wsync::bench
