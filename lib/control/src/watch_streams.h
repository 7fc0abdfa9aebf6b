// The coordinator's Watch streams (internal to wsync::control), served with
// gRPC's callback API: a fleet's streams (every sink holds one) take no
// thread each, and only versions wake them.
//
// Thread safety: every method may be called from any thread. gRPC's calls
// (StartWrite, Finish) are made with no lock held, since a completion may
// run on the calling thread.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include "wsync/control/coordinator_state.h"
#include "wsync/control/server.h"
#include "wsync/v1/coordinator.grpc.pb.h"

namespace wsync::control {

class WatchHub;

// One Watch stream: the versions after the caller's, then each new one as
// it is announced, one write in flight at a time. The hub pumps it when
// versions change, gRPC when a write completes. A stream that breaks (the
// caller's process died) reports the node's watch broken; one the server
// ends (its replica stopped leading, the server stops) does not. Reference
// counted: gRPC holds one until OnDone; whoever calls into it holds one.
class WatchReactor final : public grpc::ServerWriteReactor<wsync::v1::VersionSummary> {
 public:
  WatchReactor(WatchHub* hub, std::shared_ptr<CoordinatorState> state, const wsync::v1::WatchRequest& req);

  const CoordinatorState* state() const { return state_.get(); }
  void Ref() { refs_.fetch_add(1); }
  void Unref();

  // Writes the next version the caller lacks, unless a write is in flight;
  // whether it started one. `listed`: the versions after `listed_after` (the
  // hub's one listing for every stream), used when it holds all this stream
  // lacks; otherwise the stream lists its own.
  bool Pump(const wsync::v1::ListVersionsResponse* listed = nullptr, uint64_t listed_after = 0);
  // Ends the stream from the server's side (no WatchBroken).
  void End();

  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;

 private:
  ~WatchReactor() override = default;
  // The stream broke under the caller: its node's watch is broken, unless
  // the server ended the stream first. REQUIRES: mu_ held.
  void BrokenLocked();
  // Whether to call Finish now: ended, no write in flight, not finished. REQUIRES: mu_ held.
  bool TakeFinishLocked();

  WatchHub* const hub_;
  const std::shared_ptr<CoordinatorState> state_;  // the state watched: a replica that stops leading ends it
  std::atomic<int> refs_{1};                       // gRPC's, until OnDone
  std::mutex mu_;
  uint64_t after_;  // the newest version written
  const std::string node_;
  const uint64_t incarnation_;
  std::deque<wsync::v1::VersionSummary> pending_;
  wsync::v1::VersionSummary out_;  // the write in flight
  bool writing_ = false;
  bool ended_ = false;
  bool finished_ = false;
};

// The Watch streams open on a server, and the one thread that writes a new
// version to all of them (listed once) and ends those whose state is no
// longer the one served (a replica stopped leading).
class WatchHub {
 public:
  explicit WatchHub(StateHolder* holder);
  ~WatchHub();

  // No more streams; every open one ends (without WatchBroken).
  void Stop();
  bool stopping() const { return stopping_.load(); }
  // Whether `state` is still the one the server answers with.
  bool Holds(const CoordinatorState* state) const;

  // A new stream: it starts with the versions its caller lacks.
  void Add(WatchReactor* r);
  // From the stream's OnDone.
  void Remove(WatchReactor* r);
  // A stream started a write, or one completed (OnWriteDone).
  void WriteStarted();
  void WriteDone();

 private:
  // A new version goes out in slices of this many writes; the next slice
  // starts once half of them completed (or after kSliceWait): each write's
  // completion is a callback on gRPC's threads, and a whole fleet's at once
  // would queue every call arriving meanwhile (heartbeats) behind them.
  static constexpr size_t kSlice = 256;
  static constexpr std::chrono::milliseconds kSliceWait{50};
  // The writing thread's nice: the calls' threads go first.
  static constexpr int kNice = 10;
  void AwaitSlice();

  // `f` on every stream open now, with no lock held.
  void ForEach(const std::function<void(WatchReactor*)>& f);
  void Run();

  StateHolder* const holder_;
  std::atomic<bool> stopping_{false};
  std::mutex mu_;
  std::set<WatchReactor*> reactors_;
  std::mutex writes_mu_;
  std::condition_variable writes_cv_;
  size_t writes_in_flight_ = 0;
  std::thread thread_;
};

// A stream refused before it starts (authentication, no leader).
class RefusedWatch final : public grpc::ServerWriteReactor<wsync::v1::VersionSummary> {
 public:
  explicit RefusedWatch(grpc::Status status) { Finish(std::move(status)); }
  void OnDone() override { delete this; }
};

}  // namespace wsync::control
