// Writes one valid message of each pull-protocol type into DIR: the seed
// corpus of exchange_fuzzer.
#include <fstream>
#include <string>
#include <vector>

#include "crypto.h"
#include "wire.h"

int main(int argc, char** argv) {
  using namespace wsync;
  using namespace wsync::exchange;
  if (argc != 2) return 2;
  wire::Header ok;
  ok.kind = codec::PatchKind::kKeyframe;
  ok.to = 5;
  ok.total = 123456;
  ok.chunk = 1 << 20;
  wire::Header refused;
  refused.code = StatusCode::kNotFound;
  refused.error = "no such version";
  crypto::Sealer sealer(crypto::ClusterKey("seed"));  // not the fuzzer's key: nothing may open it
  const std::vector<std::string> seeds = {
      wire::Encode(wire::Pull{3, 7}),
      wire::Encode(wire::Pull{3, 7, 0x1234567890abcdef, 1}),
      wire::Encode(ok),
      wire::Encode(refused),
      wire::EncodeChunk(std::string(100, 'x')),
      wire::EncodeBare(ExchangeMessage::kRefetch),
      wire::EncodeBare(ExchangeMessage::kCancel),
      wire::Encode(ExchangeMessage::kAbort, {StatusCode::kUnavailable, "parent lost"}),
      wire::Encode(ExchangeMessage::kDenied, {StatusCode::kUnauthenticated, "wrong cluster credential"}),
      wire::Encode(wire::Hello{}),
      wire::Encode(wire::Challenge{}),
      wire::Encode(wire::Proof{}),
      sealer.Seal(1, 1, wire::Encode(wire::Pull{0, 9})),
  };
  for (size_t i = 0; i < seeds.size(); ++i) {
    std::ofstream(std::string(argv[1]) + "/exchange-" + std::to_string(i), std::ios::binary) << seeds[i];
  }
  return 0;
}
