#include "wsync/control/replica.h"

#include <spdlog/spdlog.h>

#include <signal.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <thread>

#include "etcd.h"
#include "fault_injection.h"

namespace wsync::control {
namespace {

namespace pb = etcdserverpb;
namespace v1 = wsync::v1;
namespace store = wsync::store::v1;
using Steady = std::chrono::steady_clock;

// etcd refuses requests over --max-request-bytes (1.5 MiB by default) and
// transactions of more than --max-txn-ops operations (128 by default).
constexpr size_t kMaxValueBytes = 1'400'000;
constexpr int kMaxPutsPerTxn = 120;

// How long past the leader's lease a replica that cannot reach etcd keeps
// answering NOT_LEADER (an election may still be under way) before it
// answers ETCD_UNREACHABLE (no replica can lead until etcd's majority is back).
constexpr int kEtcdGraceMs = 3000;

struct Keys {
  explicit Keys(const std::string& prefix)
      : leader(prefix + "/leader"), snapshot(prefix + "/snapshot"), log(prefix + "/log/") {}
  std::string LogKey(uint64_t seq) const {
    char digits[24];
    std::snprintf(digits, sizeof(digits), "%020llu", static_cast<unsigned long long>(seq));
    return log + digits;
  }
  std::string leader, snapshot, log;
};

std::string PutU64(uint64_t v) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(v >> (56 - 8 * i));
  return out;
}

uint64_t GetU64(const std::string& s) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v = (v << 8) | static_cast<unsigned char>(s[i]);
  return v;
}

// The transaction passes only while `election` (the create revision of the
// leader key this replica made) is the leader key's.
void Fence(const Keys& keys, int64_t election, pb::TxnRequest* txn) {
  pb::Compare* c = txn->add_compare();
  c->set_result(pb::Compare::EQUAL);
  c->set_target(pb::Compare::CREATE);
  c->set_key(keys.leader);
  c->set_create_revision(election);
  txn->add_failure()->mutable_request_range()->set_key(keys.leader);
}

std::string LeaderIn(const pb::TxnResponse& r) {
  for (const auto& op : r.responses()) {
    if (op.has_response_range() && op.response_range().kvs_size() > 0) return op.response_range().kvs(0).value();
  }
  return "";
}

// The coordinator's log in etcd, written only under the leader's fence.
// After any write whose outcome is not known (etcd unreachable, no majority)
// or that the fence refused, the store is deposed: nothing more is written
// and the replica steps down, so the next leader starts from what etcd holds.
class EtcdStore : public Store {
 public:
  EtcdStore(Etcd* etcd, Keys keys, int64_t election, uint64_t next_seq, std::atomic<bool>* deposed,
            std::atomic<uint64_t>* writes)
      : etcd_(etcd), keys_(std::move(keys)), election_(election), next_seq_(next_seq), deposed_(deposed),
        writes_(writes) {}

  Status Append(const store::Record& record) override { return AppendBatch({record}); }

  // As few fenced transactions as etcd's limits allow, in order.
  Status AppendBatch(const std::vector<store::Record>& records) override {
    size_t i = 0;
    while (i < records.size()) {
      pb::TxnRequest txn;
      Fence(keys_, election_, &txn);
      size_t bytes = 0;
      uint64_t seq = next_seq_;
      for (; i < records.size() && txn.success_size() < kMaxPutsPerTxn; ++i) {
        std::string value = records[i].SerializeAsString();
        if (value.size() > kMaxValueBytes) {
          return ResourceExhaustedError("a coordinator record of " + std::to_string(value.size()) +
                                        " bytes is over what one etcd request carries; raise etcd's "
                                        "--max-request-bytes");
        }
        if (txn.success_size() > 0 && bytes + value.size() > kMaxValueBytes) break;
        bytes += value.size();
        pb::PutRequest* put = txn.add_success()->mutable_request_put();
        put->set_key(keys_.LogKey(seq++));
        put->set_value(std::move(value));
      }
      WSYNC_RETURN_IF_ERROR(Commit(txn, txn.success_size() > 1 ? "records" : "record"));
      log_records_ += static_cast<size_t>(seq - next_seq_);
      next_seq_ = seq;
    }
    return Status::Ok();
  }

  Status Compact(const store::Snapshot& snapshot) override {
    pb::TxnRequest txn;
    Fence(keys_, election_, &txn);
    pb::PutRequest* put = txn.add_success()->mutable_request_put();
    put->set_key(keys_.snapshot);
    put->set_value(PutU64(next_seq_) + snapshot.SerializeAsString());
    if (put->value().size() > kMaxValueBytes) {
      return ResourceExhaustedError("the coordinator's snapshot (" + std::to_string(put->value().size()) +
                                    " bytes) is over what one etcd request carries; raise etcd's --max-request-bytes "
                                    "(the log keeps growing until it fits)");
    }
    pb::DeleteRangeRequest* del = txn.add_success()->mutable_request_delete_range();
    del->set_key(keys_.log);
    del->set_range_end(keys_.LogKey(next_seq_));
    WSYNC_RETURN_IF_ERROR(Commit(txn, "snapshot"));
    log_records_ = 0;
    return Status::Ok();
  }

  size_t LogRecords() const override { return log_records_; }

 private:
  Status Commit(const pb::TxnRequest& txn, const char* what) {
    if (deposed_->load()) return NotLeaderError("");
    auto r = etcd_->Txn(txn);
    if (!r.ok()) {
      deposed_->store(true);
      return UnavailableError(std::string("etcd did not confirm the coordinator's ") + what + " (" +
                              r.status().message() + "): not acknowledged; the replica steps down and the next "
                              "leader starts from what etcd committed");
    }
    if (!r->succeeded()) {
      deposed_->store(true);
      return NotLeaderError(LeaderIn(*r));
    }
    ++*writes_;
    if (fault::die_after_commit) ::raise(SIGKILL);  // committed, and no answer will say so
    return Status::Ok();
  }

  Etcd* etcd_;
  Keys keys_;
  int64_t election_;
  uint64_t next_seq_;
  size_t log_records_ = 0;
  std::atomic<bool>* deposed_;
  std::atomic<uint64_t>* writes_;
};

// What etcd holds of the coordinator: the snapshot and the records after it.
StatusOr<Recovered> Recover(Etcd& etcd, const Keys& keys, uint64_t* next_seq) {
  Recovered out;
  *next_seq = 0;
  pb::RangeRequest snap;
  snap.set_key(keys.snapshot);
  WSYNC_ASSIGN_OR_RETURN(auto s, etcd.Range(snap));
  if (s.kvs_size() > 0) {
    const std::string& v = s.kvs(0).value();
    if (v.size() < 8 || !out.snapshot.ParseFromArray(v.data() + 8, static_cast<int>(v.size() - 8))) {
      return DataLossError("etcd key " + keys.snapshot + " is not a coordinator snapshot");
    }
    *next_seq = GetU64(v);
  }
  pb::RangeRequest log;
  log.set_key(keys.log);
  log.set_range_end(PrefixEnd(keys.log));
  log.set_sort_order(pb::RangeRequest::ASCEND);
  WSYNC_ASSIGN_OR_RETURN(auto l, etcd.Range(log));
  for (const auto& kv : l.kvs()) {
    const uint64_t seq = std::strtoull(kv.key().c_str() + keys.log.size(), nullptr, 10);
    if (seq < *next_seq) continue;  // compacted into the snapshot
    if (seq != *next_seq) {
      return DataLossError("etcd holds coordinator record " + std::to_string(seq) + " after " +
                           std::to_string(*next_seq) + ": a record is missing");
    }
    store::Record r;
    if (!r.ParseFromString(kv.value())) return DataLossError("etcd key " + kv.key() + " is not a coordinator record");
    out.records.push_back(std::move(r));
    ++*next_seq;
  }
  return out;
}

}  // namespace

struct Replica::Impl {
  ReplicaOptions options;
  const Clock* clock;
  Keys keys;
  std::unique_ptr<Etcd> etcd;

  mutable std::mutex mu;
  std::condition_variable wake;
  bool stop = false;
  std::shared_ptr<CoordinatorState> state;  // set while leading
  Steady::time_point valid_until;            // the lease surely holds until then
  std::string leader;
  int64_t lease = 0;
  std::atomic<bool> deposed{false};
  std::atomic<uint64_t> writes{0};
  std::thread loop;
  std::string etcd_error;                 // the last etcd call's error ("" when it succeeded)
  Steady::time_point etcd_failing_since;  // the first of the failures in a row (epoch: none)

  // The loop thread's own:
  int64_t held_revision = 0;  // etcd's revision when the leader key was last read held (0: not)
  int64_t stale_lease = 0;    // a lease of an earlier term whose revoke etcd did not confirm

  Impl(ReplicaOptions o, const Clock* c) : options(std::move(o)), clock(c), keys(options.prefix) {}

  // Waits `ms` or until stopped; false when stopped.
  bool Sleep(int ms) {
    std::unique_lock<std::mutex> lock(mu);
    wake.wait_for(lock, std::chrono::milliseconds(ms), [&] { return stop; });
    return !stop;
  }

  int64_t UnreachableAfterMs() const { return options.lease_ttl_s * 1000L + kEtcdGraceMs; }

  void EtcdAnswered() {
    std::lock_guard<std::mutex> lock(mu);
    etcd_error.clear();
    etcd_failing_since = {};
  }
  void EtcdFailed(const std::string& error) {
    std::lock_guard<std::mutex> lock(mu);
    etcd_error = error;
    if (etcd_failing_since == Steady::time_point{}) etcd_failing_since = Steady::now();
  }
  int64_t EtcdFailingMsLocked() const {
    if (etcd_failing_since == Steady::time_point{}) return 0;
    return std::max<int64_t>(1, std::chrono::duration_cast<std::chrono::milliseconds>(Steady::now() -
                                                                                       etcd_failing_since).count());
  }

  void Run() {
    while (Sleep(0)) {
      RevokeStaleLease();
      if (!Campaign()) {
        AwaitLeadershipChange();
        continue;
      }
      Lead();
      StepDown();
    }
    StepDown();
  }

  // While another replica leads: until the leader key changes (etcd's
  // watch), at most watch_ms, after which the key is read again (which also
  // tells whether etcd still answers); a poll period when etcd does not answer.
  void AwaitLeadershipChange() {
    if (held_revision == 0) {
      Sleep(options.poll_ms);
      return;
    }
    auto changed = etcd->WaitForChange(keys.leader, held_revision, options.watch_ms);
    if (!changed.ok()) {
      spdlog::debug("coordinator replica {}: watching the leader key: {}", options.advertise,
                    changed.status().ToString());
      Sleep(options.poll_ms);
    }
  }

  // A lease this replica held as leader and could not revoke when it
  // stepped down (etcd had no majority) keeps the leader key, and every
  // replica waiting, until its TTL runs out after etcd returns: revoke it
  // as soon as etcd answers.
  void RevokeStaleLease() {
    if (stale_lease == 0) return;
    Status revoked = etcd->Revoke(stale_lease);
    if (revoked.ok() || revoked.code() == StatusCode::kNotFound) {
      spdlog::info("coordinator replica {}: revoked the lease of its last term as leader", options.advertise);
      stale_lease = 0;
    }
  }

  // Becomes the leader if the leadership is vacant: true when it did.
  bool Campaign() {
    pb::RangeRequest get;
    get.set_key(keys.leader);
    held_revision = 0;
    auto held = etcd->Range(get);
    if (!held.ok()) {
      Follow("", held.status().message());
      return false;
    }
    EtcdAnswered();
    if (held->kvs_size() > 0) {
      if (held->kvs(0).value() == options.advertise) {
        ResignEarlierTerm(held->kvs(0).create_revision());
        return false;
      }
      held_revision = held->header().revision();
      Follow(held->kvs(0).value(), "");
      return false;
    }
    const auto sent = Steady::now();
    auto id = etcd->Grant(options.lease_ttl_s);
    if (!id.ok()) {
      Follow("", id.status().message());
      return false;
    }
    pb::TxnRequest txn;
    pb::Compare* vacant = txn.add_compare();
    vacant->set_result(pb::Compare::EQUAL);
    vacant->set_target(pb::Compare::CREATE);
    vacant->set_key(keys.leader);
    vacant->set_create_revision(0);
    pb::PutRequest* put = txn.add_success()->mutable_request_put();
    put->set_key(keys.leader);
    put->set_value(options.advertise);
    put->set_lease(*id);
    txn.add_failure()->mutable_request_range()->set_key(keys.leader);
    auto won = etcd->Txn(txn);
    if (!won.ok() || !won->succeeded()) {
      (void)etcd->Revoke(*id);
      Follow(won.ok() ? LeaderIn(*won) : "", won.ok() ? "" : won.status().message());
      return false;
    }
    const int64_t election = won->header().revision();
    uint64_t next_seq = 0;
    auto recovered = Recover(*etcd, keys, &next_seq);
    if (!recovered.ok()) {
      spdlog::error("elected, but the state in etcd cannot be read: {}; resigning", recovered.status().ToString());
      (void)etcd->Revoke(*id);
      return false;
    }
    deposed = false;
    auto state = CoordinatorState::Create(options.coordinator, clock,
                                          std::make_unique<EtcdStore>(etcd.get(), keys, election, next_seq, &deposed, &writes),
                                          *recovered);
    if (!state.ok()) {
      spdlog::error("elected, but the state in etcd does not recover: {}; resigning", state.status().ToString());
      (void)etcd->Revoke(*id);
      return false;
    }
    std::lock_guard<std::mutex> lock(mu);
    lease = *id;
    this->state = std::shared_ptr<CoordinatorState>(std::move(state.value()));
    valid_until = sent + std::chrono::seconds(options.lease_ttl_s);
    leader = options.advertise;
    spdlog::info("coordinator replica {}: leading (election revision {}, {} records after the snapshot)",
                 options.advertise, election, recovered->records.size());
    return true;
  }

  // The leader key names this replica, which does not lead: it is left
  // from an earlier term (a restart, or a revoke etcd never confirmed).
  // Deleting it (only the key of that election) lets a leader be elected
  // now rather than when its lease runs out; writes of that term, if its
  // process still runs, fail at the fence.
  void ResignEarlierTerm(int64_t election) {
    pb::TxnRequest txn;
    pb::Compare* same = txn.add_compare();
    same->set_result(pb::Compare::EQUAL);
    same->set_target(pb::Compare::CREATE);
    same->set_key(keys.leader);
    same->set_create_revision(election);
    txn.add_success()->mutable_request_delete_range()->set_key(keys.leader);
    auto r = etcd->Txn(txn);
    if (!r.ok()) {
      Follow("", r.status().message());
      return;
    }
    spdlog::info("coordinator replica {}: the leader key named this replica from an earlier term; removed it",
                 options.advertise);
    std::lock_guard<std::mutex> lock(mu);
    leader.clear();
  }

  // Keeps the lease while leading; returns when it is lost or on stop.
  void Lead() {
    const int every_ms = std::max(100, options.lease_ttl_s * 1000 / 3);
    while (Sleep(every_ms) && !deposed.load()) {
      const auto sent = Steady::now();
      auto ttl = etcd->KeepAlive(lease);
      if (ttl.ok()) {
        EtcdAnswered();
      } else {
        EtcdFailed(ttl.status().message());
      }
      std::lock_guard<std::mutex> lock(mu);
      if (ttl.ok() && *ttl > 0) {
        valid_until = sent + std::chrono::seconds(options.lease_ttl_s);
      } else if (ttl.ok() || Steady::now() >= valid_until) {
        spdlog::warn("coordinator replica {}: lost the leader's lease ({})", options.advertise,
                     ttl.ok() ? "expired" : ttl.status().message());
        return;
      }
    }
    if (deposed.load()) spdlog::warn("coordinator replica {}: a write was not committed; stepping down", options.advertise);
  }

  void StepDown() {
    int64_t id;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (!state) return;
      state.reset();
      leader.clear();
      id = lease;
      lease = 0;
    }
    // Another replica leads at once instead of after the TTL.
    if (!etcd->Revoke(id).ok()) stale_lease = id;
    spdlog::info("coordinator replica {}: stepped down", options.advertise);
  }

  void Follow(const std::string& now, const std::string& error) {
    if (!error.empty()) EtcdFailed(error);
    std::lock_guard<std::mutex> lock(mu);
    if (now != leader && !now.empty()) {
      spdlog::info("coordinator replica {}: following the leader at {}", options.advertise, now);
    }
    if (error != last_error && !error.empty()) {
      spdlog::error("coordinator replica {}: cannot read the leadership from etcd: {}", options.advertise, error);
    }
    last_error = error;
    leader = now;
  }
  std::string last_error;  // the last etcd error a follower met (logged once)
};

Replica::Replica(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Replica::~Replica() {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stop = true;
  }
  impl_->wake.notify_all();
  impl_->etcd->CancelWaits();
  if (impl_->loop.joinable()) impl_->loop.join();
}

StatusOr<std::unique_ptr<Replica>> Replica::Start(const ReplicaOptions& options, const Clock* clock) {
  if (options.advertise.empty()) return InvalidArgumentError("a coordinator replica needs --advertise host:port");
  if (options.lease_ttl_s < 1) return InvalidArgumentError("the leader's lease TTL is at least 1 s");
  if (options.poll_ms < 1 || options.watch_ms < 1) return InvalidArgumentError("poll_ms and watch_ms are at least 1");
  if (options.prefix.empty() || options.prefix.back() == '/') {
    return InvalidArgumentError("etcd prefix '" + options.prefix + "' must be non-empty and not end in '/'");
  }
  auto impl = std::make_unique<Impl>(options, clock);
  EtcdOptions etcd;
  etcd.endpoints = options.etcd_endpoints;
  etcd.ca_file = options.etcd_ca_file;
  etcd.cert_file = options.etcd_cert_file;
  etcd.key_file = options.etcd_key_file;
  etcd.user = options.etcd_user;
  etcd.password = options.etcd_password;
  WSYNC_ASSIGN_OR_RETURN(impl->etcd, Etcd::Connect(etcd));
  Impl* raw = impl.get();
  impl->loop = std::thread([raw] { raw->Run(); });
  return std::unique_ptr<Replica>(new Replica(std::move(impl)));
}

StatusOr<std::shared_ptr<CoordinatorState>> Replica::Current() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (impl_->state && !impl_->deposed.load() && Steady::now() < impl_->valid_until) return impl_->state;
  const int64_t failing = impl_->EtcdFailingMsLocked();
  if (failing >= impl_->UnreachableAfterMs() && !impl_->state) {
    return EtcdUnreachableError(impl_->options.advertise, failing, impl_->etcd_error);
  }
  const std::string leader = impl_->leader == impl_->options.advertise ? "" : impl_->leader;
  if (failing == 0) return NotLeaderError(leader);
  return NotLeaderError(leader, "etcd has failed this replica for " + std::to_string(failing) + " ms: " +
                                    impl_->etcd_error);
}

v1::ReplicaResponse Replica::Describe() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  v1::ReplicaResponse r;
  r.set_address(impl_->options.advertise);
  r.set_role(impl_->state ? v1::ReplicaResponse::LEADER : v1::ReplicaResponse::FOLLOWER);
  r.set_leader(impl_->leader);
  r.set_etcd_error(impl_->etcd_error);
  r.set_etcd_failing_ms(impl_->EtcdFailingMsLocked());
  r.set_etcd_writes(impl_->writes.load());
  r.set_unreachable_after_ms(impl_->UnreachableAfterMs());
  return r;
}

bool Replica::leading() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->state != nullptr;
}

uint64_t Replica::etcd_writes() const { return impl_->writes.load(); }

std::string Replica::leader() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->leader;
}

}  // namespace wsync::control
