// The source and sink daemons: the pieces of lib/ and daemon/ wired together.
//
//   wsyncd source: the trainer registers its tensors (shared memory) and
//     calls Publish(version) through the local API; the source snapshots them
//     into its VersionHistory, asks the coordinator whether the staleness
//     policy allows the version, publishes it, and serves pulls.
//   wsyncd sink: the inference server registers its tensors; the sink
//     watches versions, pulls (applied, head) from the parent the coordinator
//     assigned (a keyframe when it has nothing, is told to resync, or the
//     patch does not fit), applies between the server's holds, reports the
//     applied version, and serves what it holds or is receiving to its own
//     children (relay, cut-through).
//
// Thread safety: Start/Shutdown/Wait from one thread.
#pragma once

#include <memory>
#include <string>

#include "store_mirror.h"
#include "store_tier.h"
#include "wsync/control/client.h"
#include "wsync/cuda/device_codec.h"
#include "wsync/exchange/exchange.h"
#include "wsync/util/status.h"

namespace wsync::daemon {

// Where a source keeps the base of its next patch (the last published
// version) when the trainer's weights are in GPU memory (docs/gpu.md,
// "Memory on the trainer's GPU").
enum class DeviceBase {
  kDevice,  // one copy of the model on the trainer's GPU
  kHost,    // page-locked host memory: next to no GPU memory, the model crosses PCIe twice per publish
};

struct DataDaemonConfig {
  std::string name;                      // unique node name
  control::ClientOptions coordinator;    // address, token, TLS
  std::string local_socket;              // unix socket path of the local API (mode 0600)
  std::string listen = "127.0.0.1:0";    // data-plane (UCX) listen address
  exchange::SecurityOptions security;    // what data-plane peers must prove (docs/security.md)
  uint64_t node_ttl_ms = 10'000;
  unsigned threads = 2;                  // codec threads
  uint64_t rate_limit_bytes_per_s = 0;   // per data-plane link
  uint64_t hold_ttl_ms = 30'000;         // sinks: a hold not renewed for this long ends
  uint64_t retain_versions = 4;          // sources: versions kept back from the head at least
  // Sinks: retry delays after a failed sync grow from the first to the last
  // (x2 per failure, each drawn in [delay/2, delay]; docs/data-plane.md).
  uint64_t retry_first_ms = 200;
  uint64_t retry_max_ms = 30'000;
  // Sinks: decode a pulled stream chunk by chunk while it arrives (host
  // tensors; docs/data-plane.md, "Streaming"). Off: decode once it is in.
  bool decode_ahead = true;
  // Sinks: a keyframe whose weights take at most this many bytes is
  // decoded into memory and checked before the engine's holds end, and
  // copied in between them; a larger one is decoded between them.
  uint64_t keyframe_keep_bytes = 1ull << 30;
  // Sinks: what staging keeps of a version's changes before the holds end
  // (8 bytes per changed BF16 value); past it, changes are checked before
  // and decoded again between the holds (codec::ApplyOptions).
  uint64_t stage_keep_bytes = 4ull << 30;
  // Sources: a version of host weights larger than this is encoded in
  // segments of whole tensors of about this many bytes, announced once the
  // first is encoded and served to its pullers as it is encoded (0: encoded
  // whole, announced once encoded).
  uint64_t segment_bytes = 64u << 20;
  DeviceBase device_base = DeviceBase::kDevice;  // sources of weights in GPU memory
  // Weights in GPU memory: where sparse-coded chunks are entropy-coded and
  // decoded (cuda::EntropyStage).
  cuda::EntropyStage entropy_stage = cuda::EntropyStage::kHost;
  StoreMirrorOptions store;              // sources: the object store versions are mirrored to (url empty: none)
  StoreTierOptions store_tier;           // sinks: the object store read when no daemon serves a version
  uint64_t corrupt_every = 0;            // fault injection (tests)
  uint64_t fail_announce = 0;            // fault injection (tests): announcing this version fails
};

class DataDaemon {
 public:
  virtual ~DataDaemon() = default;
  virtual void Shutdown() = 0;
  virtual void Wait() = 0;
};

StatusOr<std::unique_ptr<DataDaemon>> StartSource(const DataDaemonConfig& config);
StatusOr<std::unique_ptr<DataDaemon>> StartSink(const DataDaemonConfig& config);

}  // namespace wsync::daemon
