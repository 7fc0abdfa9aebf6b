// The pull protocol's messages (private): one encoder and one checked parser
// per message, pure functions over bytes. docs/data-plane.md gives the
// grammar; every integer goes through wsync/util/bytes.h (little-endian).
//
// A parser checks the type byte, the length and every field before the
// caller sees a value, and answers DataLoss naming the message and the field
// otherwise. No parser allocates more than the message it is given.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

#include "wsync/codec/codec.h"
#include "wsync/exchange/exchange.h"
#include "wsync/util/status.h"

namespace wsync::exchange::wire {

using Nonce = std::array<uint8_t, 32>;
using Mac = std::array<uint8_t, 32>;

inline constexpr uint8_t kProtocolVersion = 1;
inline constexpr size_t kMaxErrorText = 1024;  // error texts longer than this are cut by the sender
inline constexpr size_t kSealOverhead = 1 + 8 + 16;
// The longest message a peer may send before it has proved its credential
// (HELLO and PROOF are shorter; the transport enforces it).
inline constexpr uint32_t kMaxUntrustedMessage = 256;
// The longest message at all: a chunk of the largest size, sealed.
inline constexpr uint32_t kMaxMessage = kMaxChunkBytes + 64;

// The type of a message (its first byte), or nullopt-like 0 when empty.
inline uint8_t TypeOf(std::string_view m) { return m.empty() ? 0 : static_cast<uint8_t>(m[0]); }

struct Pull {
  uint64_t from = 0;  // 0: a keyframe of `to`
  uint64_t to = 0;
  uint64_t layout = 0;  // the puller's pieces (codec::LayoutFingerprint); 0: the whole set
  uint32_t part = 0;    // versions of several sources: which part (a source serves its own)
};
std::string Encode(const Pull& m);
StatusOr<Pull> ParsePull(std::string_view m);

// A HEADER: the stream's shape, or why there is none (code != kOk).
struct Header {
  StatusCode code = StatusCode::kOk;
  std::string error;  // code != kOk
  codec::PatchKind kind = codec::PatchKind::kPatch;
  uint64_t from = 0, to = 0, total = 0;
  uint32_t chunk = 0;
};
std::string Encode(const Header& m);
// Checks the shape against the limits of exchange.h (code == kOk).
StatusOr<Header> ParseHeader(std::string_view m);

// CHUNK: the type byte, then the chunk's bytes (which chunk: the seq).
std::string EncodeChunk(std::string_view bytes);
StatusOr<std::string_view> ParseChunk(std::string_view m);

// END: the total of a stream whose HEADER said kUnknownTotal, after its
// last chunk (seq kEndSeq).
std::string EncodeEnd(uint64_t total);
StatusOr<uint64_t> ParseEnd(std::string_view m);

// REFETCH and CANCEL: the type byte only.
std::string EncodeBare(ExchangeMessage type);
Status ParseBare(std::string_view m, ExchangeMessage type);

// ABORT (the server ends a stream after its header) and DENIED (a peer's
// credential or mode was refused): a status and a text.
struct Refusal {
  StatusCode code = StatusCode::kUnavailable;
  std::string text;
};
std::string Encode(ExchangeMessage type, const Refusal& m);
StatusOr<Refusal> ParseRefusal(std::string_view m, ExchangeMessage type);

// The handshake (docs/security.md).
struct Hello {
  uint8_t version = kProtocolVersion;
  uint8_t mode = 0;
  Nonce nonce{};
};
std::string Encode(const Hello& m);
StatusOr<Hello> ParseHello(std::string_view m);

struct Challenge {
  uint8_t mode = 0;
  Nonce nonce{};
  Mac proof{};
};
std::string Encode(const Challenge& m);
StatusOr<Challenge> ParseChallenge(std::string_view m);

struct Proof {
  Mac proof{};
};
std::string Encode(const Proof& m);
StatusOr<Proof> ParseProof(std::string_view m);

// SEALED: counter, ciphertext, tag (the cipher is session.h's).
struct Sealed {
  uint64_t counter = 0;
  std::string_view ciphertext;
  std::string_view tag;
};
StatusOr<Sealed> ParseSealed(std::string_view m);

}  // namespace wsync::exchange::wire
