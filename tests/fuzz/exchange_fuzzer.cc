// libFuzzer target for the pull protocol, both directions: any byte string
// given to the parser of any message a server receives (PULL, REFETCH,
// CANCEL, HELLO, PROOF) or a puller receives (HEADER, CHUNK, ABORT,
// CHALLENGE, DENIED, SEALED) must give an error or a checked value, never a
// crash or an out-of-bounds access; a value that parses encodes back to the
// same bytes (one encoding per message); a sealed message only opens when it
// authenticates.
#include <cstdint>
#include <string>
#include <string_view>

#include "crypto.h"
#include "wire.h"

namespace {

using namespace wsync;
using namespace wsync::exchange;

void Check(bool ok) {
  if (!ok) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  if (auto m = wire::ParsePull(in); m.ok()) Check(wire::Encode(*m) == in && m->from < m->to);
  if (auto m = wire::ParseHeader(in); m.ok()) {
    if (m->code == StatusCode::kOk) {
      Check(wire::Encode(*m) == in);
      Check(CheckStreamShape(m->total, m->chunk).ok());
    }
  }
  if (auto m = wire::ParseEnd(in); m.ok()) Check(wire::EncodeEnd(*m) == in && *m != kUnknownTotal);
  if (auto m = wire::ParseChunk(in); m.ok()) Check(m->size() + 1 == in.size() && m->size() <= kMaxChunkBytes);
  for (auto type : {ExchangeMessage::kRefetch, ExchangeMessage::kCancel}) {
    if (wire::ParseBare(in, type).ok()) Check(in.size() == 1);
  }
  for (auto type : {ExchangeMessage::kAbort, ExchangeMessage::kDenied}) {
    if (auto m = wire::ParseRefusal(in, type); m.ok()) Check(m->code != StatusCode::kOk);
  }
  if (auto m = wire::ParseHello(in); m.ok()) Check(wire::Encode(*m) == in);
  if (auto m = wire::ParseChallenge(in); m.ok()) Check(wire::Encode(*m) == in);
  if (auto m = wire::ParseProof(in); m.ok()) Check(wire::Encode(*m) == in);
  // Forging: without the key, no input opens (the fuzzer cannot find a tag).
  static const crypto::Key key = crypto::ClusterKey("fuzz");
  crypto::Opener opener(key);
  Check(!opener.Open(1, 1, in).ok());
  // A message sealed under the key opens once, and only at its place.
  if (size <= 4096) {
    crypto::Sealer sealer(key);
    const std::string sealed = sealer.Seal(7, 9, in);
    crypto::Opener fresh(key);
    Check(!fresh.Open(7, 10, sealed).ok());
    auto plain = fresh.Open(7, 9, sealed);
    Check(plain.ok() && *plain == in);
    Check(!fresh.Open(7, 9, sealed).ok());  // a replay
  }
  return 0;
}
