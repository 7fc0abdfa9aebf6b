#include "security_bench.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <cstring>
#include <random>
#include <stdexcept>

#include "wsync/exchange/exchange.h"

namespace wsync::bench {
namespace {

using exchange::SecurityMode;
using Clock = std::chrono::steady_clock;

constexpr uint32_t kChunk = 1u << 20;  // the daemons' chunk size

class OneStream : public exchange::PatchProvider {
 public:
  StatusOr<std::shared_ptr<exchange::PatchStream>> Open(uint64_t, uint64_t) override { return stream; }
  std::shared_ptr<exchange::PatchStream> stream;
};

// One daemon's data-plane end over UCX.
struct End {
  explicit End(SecurityMode mode) : handler(exchange::SecurityOptions{mode, "bench-cluster-token"}) {
    transport::TransportOptions o;
    o.listen = "127.0.0.1:0";
    o.max_message_bytes = exchange::kMaxMessageBytes;
    auto t = transport::CreateUcxTransport(o, &handler);
    if (!t.ok()) throw std::runtime_error(t.status().ToString());
    transport = std::move(*t);
    (void)handler.Bind(transport.get());
    server = std::make_unique<exchange::PatchServer>(&handler, &provider);
    fetcher = std::make_unique<exchange::PatchFetcher>(&handler);
    handler.Attach(server.get(), fetcher.get());
  }
  ~End() {
    handler.Detach();
    server.reset();
    fetcher.reset();
    transport.reset();
  }
  exchange::ExchangeHandler handler;
  OneStream provider;
  std::unique_ptr<transport::Transport> transport;
  std::unique_ptr<exchange::PatchServer> server;
  std::unique_ptr<exchange::PatchFetcher> fetcher;
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int RunSecurityBench(const SecurityBenchOptions& options) {
  spdlog::set_level(spdlog::level::warn);
  const SecurityMode modes[] = {SecurityMode::kNone, SecurityMode::kAuthenticate, SecurityMode::kEncrypt};
  std::printf("pull over UCX (tcp, 127.0.0.1), 1 MiB chunks, median of %d, interleaved\n", options.repeat);
  std::printf("%12s %10s %12s %12s %12s %10s %10s\n", "bytes", "", "none ms", "auth ms", "encrypt ms", "auth x",
              "encrypt x");
  for (uint64_t size : options.sizes) {
    std::string bytes(size, '\0');
    std::mt19937_64 rng(size);
    for (size_t i = 0; i + 8 <= bytes.size(); i += 8) {
      const uint64_t r = rng();
      std::memcpy(bytes.data() + i, &r, 8);
    }
    const auto stream = exchange::PatchStream::FromBytes(codec::PatchKind::kPatch, 1, 2, bytes,
                                                         static_cast<uint32_t>(std::min<uint64_t>(kChunk, std::max<uint64_t>(size, 4096))));
    std::map<SecurityMode, std::vector<double>> ms;
    std::map<SecurityMode, std::pair<std::unique_ptr<End>, std::unique_ptr<End>>> pairs;
    std::map<SecurityMode, transport::PeerId> parents;
    for (SecurityMode mode : modes) {
      auto source = std::make_unique<End>(mode);
      auto sink = std::make_unique<End>(mode);
      source->provider.stream = stream;
      auto parent = sink->transport->Connect(source->transport->LocalConnInfo());
      if (!parent.ok()) return 1;
      // The handshake happens once per connection: warm it (and the link) up.
      auto warm = sink->fetcher->Pull(*parent, 1, 2, 0, 0, std::chrono::seconds(60));
      if (!warm.ok() || !(*warm)->WaitComplete(Clock::now() + std::chrono::minutes(2)).ok()) return 1;
      parents[mode] = *parent;
      pairs[mode] = {std::move(source), std::move(sink)};
    }
    for (int r = 0; r < options.repeat; ++r) {
      for (SecurityMode mode : modes) {
        auto& sink = *pairs[mode].second;
        const auto t0 = Clock::now();
        auto pulled = sink.fetcher->Pull(parents[mode], 1, 2, 0, 0, std::chrono::seconds(60));
        if (!pulled.ok() || !(*pulled)->WaitComplete(Clock::now() + std::chrono::minutes(2)).ok()) {
          std::fprintf(stderr, "pull failed\n");
          return 1;
        }
        ms[mode].push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
        if (r == 0 && (*pulled)->Assemble() != bytes) {
          std::fprintf(stderr, "pulled bytes differ (%s)\n", std::string(exchange::SecurityModeName(mode)).c_str());
          return 1;
        }
      }
    }
    const double none = Median(ms[SecurityMode::kNone]);
    const double auth = Median(ms[SecurityMode::kAuthenticate]);
    const double enc = Median(ms[SecurityMode::kEncrypt]);
    std::printf("%12llu %10s %12.2f %12.2f %12.2f %9.2fx %9.2fx\n", static_cast<unsigned long long>(size),
                size < kChunk ? "(patch)" : size <= (16u << 20) ? "(patch)" : "(keyframe)", none, auth, enc,
                auth / none, enc / none);
  }
  return 0;
}

}  // namespace wsync::bench
