// Load on the coordinator: simulated sinks registering, heart-beating and
// reporting over real gRPC while a trainer publishes; RPC throughput and
// latency percentiles. With etcd endpoints, the same load against three
// replicas over etcd follows, in the same run, with etcd's writes counted.
//
// Two loads: as fast as the client threads go (throughput), or --fleet: the
// rate a fleet of that many sinks makes at the daemons' defaults (a
// heartbeat every TTL / 4 = 2.5 s, a report of each version within a spread
// after it is published), open loop: each call starts at its time whether or
// not earlier ones were answered, so a coordinator that falls behind shows as
// latency (and calls the driver itself started late are counted).
#pragma once

#include <string>

namespace wsync::bench {

struct ControlBenchOptions {
  int sinks = 1000;
  int workers = 8;         // client threads (--fleet: connections, each with a scheduling thread)
  double seconds = 5;
  int publish_every_ms = 100;  // --fleet: 5,000
  bool fleet = false;
  int heartbeat_ms = 2500;     // --fleet: each sink's heartbeat period (the daemons': their TTL / 4)
  int report_spread_ms = 1000; // --fleet: sinks report a version within this after it is published
  bool watch = true;           // --fleet: every sink holds a Watch stream open, as sink daemons do
  std::string address;     // empty: an in-process coordinator on 127.0.0.1:0
  std::string store_dir;   // in-process coordinator's durable store (empty: none)
  std::string etcd;        // set: also three in-process replicas over this etcd cluster (host:port,...)
  bool json = false;
};

int RunControlBench(const ControlBenchOptions& options);

}  // namespace wsync::bench
