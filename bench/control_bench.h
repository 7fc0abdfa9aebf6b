// Load on the coordinator: simulated sinks registering, heart-beating and
// reporting over real gRPC while a trainer publishes; RPC throughput and
// latency percentiles. With etcd endpoints, the same load against three
// replicas over etcd follows, in the same run, with etcd's writes counted.
#pragma once

#include <string>

namespace wsync::bench {

struct ControlBenchOptions {
  int sinks = 1000;
  int workers = 8;         // client threads, each driving sinks / workers sinks
  double seconds = 5;
  int publish_every_ms = 100;
  std::string address;     // empty: an in-process coordinator on 127.0.0.1:0
  std::string store_dir;   // in-process coordinator's durable store (empty: none)
  std::string etcd;        // set: also three in-process replicas over this etcd cluster (host:port,...)
  bool json = false;
};

int RunControlBench(const ControlBenchOptions& options);

}  // namespace wsync::bench
