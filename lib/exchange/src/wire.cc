#include "wire.h"

#include "wsync/util/bytes.h"
#include "wsync/util/text.h"

namespace wsync::exchange::wire {
namespace {

constexpr uint8_t kLastStatus = static_cast<uint8_t>(StatusCode::kUnauthenticated);

const char* Name(ExchangeMessage type) {
  switch (type) {
    case ExchangeMessage::kPull: return "PULL";
    case ExchangeMessage::kHeader: return "HEADER";
    case ExchangeMessage::kChunk: return "CHUNK";
    case ExchangeMessage::kRefetch: return "REFETCH";
    case ExchangeMessage::kCancel: return "CANCEL";
    case ExchangeMessage::kAbort: return "ABORT";
    case ExchangeMessage::kHello: return "HELLO";
    case ExchangeMessage::kChallenge: return "CHALLENGE";
    case ExchangeMessage::kProof: return "PROOF";
    case ExchangeMessage::kDenied: return "DENIED";
    case ExchangeMessage::kSealed: return "SEALED";
    case ExchangeMessage::kEnd: return "END";
  }
  return "message";
}

std::string Start(ExchangeMessage type) { return std::string(1, static_cast<char>(type)); }

// A reader past the type byte, which must be `type`.
StatusOr<ByteReader> Open(std::string_view m, ExchangeMessage type) {
  if (m.empty() || static_cast<uint8_t>(m[0]) != static_cast<uint8_t>(type)) {
    return DataLossError(std::string(Name(type)) + ": type byte " +
                         (m.empty() ? std::string("missing") : std::to_string(static_cast<uint8_t>(m[0]))));
  }
  return ByteReader(m.substr(1), Name(type));
}

// Fails unless every byte was read.
Status End(const ByteReader& r, ExchangeMessage type) {
  if (!r.ok()) return r.status();
  if (r.remaining() != 0) {
    return DataLossError(std::string(Name(type)) + ": " + std::to_string(r.remaining()) + " unexpected trailing bytes");
  }
  return Status::Ok();
}

bool ReadStatus(ByteReader& r, StatusCode* code, const char* field) {
  uint8_t c = 0;
  if (!r.U8(&c, field)) return false;
  if (c > kLastStatus) return r.Fail(field, std::to_string(c) + " is not a status code");
  *code = static_cast<StatusCode>(c);
  return true;
}

template <size_t N>
bool ReadArray(ByteReader& r, std::array<uint8_t, N>* out, const char* field) {
  std::string_view b;
  if (!r.Bytes(N, &b, field)) return false;
  std::copy(b.begin(), b.end(), out->begin());
  return true;
}

template <size_t N>
void WriteArray(ByteWriter& w, const std::array<uint8_t, N>& a) {
  w.Bytes(std::string_view(reinterpret_cast<const char*>(a.data()), N));
}

// The rest of the message as a printable text, at most kMaxErrorText.
std::string RestAsText(ByteReader& r) {
  std::string_view rest;
  (void)r.Bytes(r.remaining(), &rest, "text");
  return Quoted(rest, kMaxErrorText);
}

}  // namespace

std::string Encode(const Pull& m) {
  std::string out = Start(ExchangeMessage::kPull);
  ByteWriter w(&out);
  w.U64(m.from);
  w.U64(m.to);
  w.U64(m.layout);
  w.U32(m.part);
  return out;
}

StatusOr<Pull> ParsePull(std::string_view m) {
  WSYNC_ASSIGN_OR_RETURN(ByteReader r, Open(m, ExchangeMessage::kPull));
  Pull p;
  r.U64(&p.from, "from") && r.U64(&p.to, "to") && r.U64(&p.layout, "layout") && r.U32(&p.part, "part");
  WSYNC_RETURN_IF_ERROR(End(r, ExchangeMessage::kPull));
  if (p.to == 0) return DataLossError("PULL: to: version 0 does not exist");
  if (p.from >= p.to) {
    return DataLossError("PULL: from " + std::to_string(p.from) + " is not before to " + std::to_string(p.to));
  }
  return p;
}

std::string Encode(const Header& m) {
  std::string out = Start(ExchangeMessage::kHeader);
  ByteWriter w(&out);
  w.U8(static_cast<uint8_t>(m.code));
  w.U8(m.code == StatusCode::kOk ? static_cast<uint8_t>(m.kind) : 0);
  w.U64(m.from);
  w.U64(m.to);
  w.U64(m.code == StatusCode::kOk ? m.total : 0);
  w.U32(m.code == StatusCode::kOk ? m.chunk : 0);
  if (m.code != StatusCode::kOk) w.Bytes(std::string_view(m.error).substr(0, kMaxErrorText));
  return out;
}

StatusOr<Header> ParseHeader(std::string_view m) {
  WSYNC_ASSIGN_OR_RETURN(ByteReader r, Open(m, ExchangeMessage::kHeader));
  Header h;
  uint8_t kind = 0;
  ReadStatus(r, &h.code, "status") && r.U8(&kind, "kind") && r.U64(&h.from, "from") && r.U64(&h.to, "to") &&
      r.U64(&h.total, "total") && r.U32(&h.chunk, "chunk");
  if (!r.ok()) return r.status();
  if (h.code != StatusCode::kOk) {
    h.error = RestAsText(r);
    return h;
  }
  WSYNC_RETURN_IF_ERROR(End(r, ExchangeMessage::kHeader));
  if (kind != static_cast<uint8_t>(codec::PatchKind::kPatch) && kind != static_cast<uint8_t>(codec::PatchKind::kKeyframe)) {
    return DataLossError("HEADER: kind " + std::to_string(kind) + " is neither a patch (1) nor a keyframe (2)");
  }
  h.kind = static_cast<codec::PatchKind>(kind);
  WSYNC_RETURN_IF_ERROR(CheckStreamShape(h.total, h.chunk));
  return h;
}

std::string EncodeChunk(std::string_view bytes) {
  std::string out;
  out.reserve(1 + bytes.size());
  out = Start(ExchangeMessage::kChunk);
  out.append(bytes);
  return out;
}

StatusOr<std::string_view> ParseChunk(std::string_view m) {
  WSYNC_ASSIGN_OR_RETURN(ByteReader r, Open(m, ExchangeMessage::kChunk));
  if (r.remaining() > kMaxChunkBytes) {
    return DataLossError("CHUNK: " + std::to_string(r.remaining()) + " bytes, more than the largest chunk (" +
                         std::to_string(kMaxChunkBytes) + ")");
  }
  return m.substr(1);
}

std::string EncodeEnd(uint64_t total) {
  std::string out = Start(ExchangeMessage::kEnd);
  ByteWriter w(&out);
  w.U64(total);
  return out;
}

StatusOr<uint64_t> ParseEnd(std::string_view m) {
  WSYNC_ASSIGN_OR_RETURN(ByteReader r, Open(m, ExchangeMessage::kEnd));
  uint64_t total = 0;
  r.U64(&total, "total");
  if (!r.ok()) return r.status();
  WSYNC_RETURN_IF_ERROR(End(r, ExchangeMessage::kEnd));
  if (total == kUnknownTotal) return DataLossError("END: the total is the unknown total");
  return total;
}

std::string EncodeBare(ExchangeMessage type) { return Start(type); }

Status ParseBare(std::string_view m, ExchangeMessage type) {
  WSYNC_ASSIGN_OR_RETURN(ByteReader r, Open(m, type));
  return End(r, type);
}

std::string Encode(ExchangeMessage type, const Refusal& m) {
  std::string out = Start(type);
  ByteWriter w(&out);
  w.U8(static_cast<uint8_t>(m.code == StatusCode::kOk ? StatusCode::kUnknown : m.code));
  w.Bytes(std::string_view(m.text).substr(0, kMaxErrorText));
  return out;
}

StatusOr<Refusal> ParseRefusal(std::string_view m, ExchangeMessage type) {
  WSYNC_ASSIGN_OR_RETURN(ByteReader r, Open(m, type));
  Refusal f;
  if (!ReadStatus(r, &f.code, "status")) return r.status();
  if (f.code == StatusCode::kOk) return DataLossError(std::string(Name(type)) + ": status: 0 (ok) is not a refusal");
  f.text = RestAsText(r);
  return f;
}

std::string Encode(const Hello& m) {
  std::string out = Start(ExchangeMessage::kHello);
  ByteWriter w(&out);
  w.U8(m.version);
  w.U8(m.mode);
  WriteArray(w, m.nonce);
  return out;
}

StatusOr<Hello> ParseHello(std::string_view m) {
  WSYNC_ASSIGN_OR_RETURN(ByteReader r, Open(m, ExchangeMessage::kHello));
  Hello h;
  r.U8(&h.version, "version") && r.U8(&h.mode, "mode") && ReadArray(r, &h.nonce, "nonce");
  WSYNC_RETURN_IF_ERROR(End(r, ExchangeMessage::kHello));
  if (h.version != kProtocolVersion) {
    return DataLossError("HELLO: version " + std::to_string(h.version) + ", this daemon speaks " +
                         std::to_string(kProtocolVersion));
  }
  return h;
}

std::string Encode(const Challenge& m) {
  std::string out = Start(ExchangeMessage::kChallenge);
  ByteWriter w(&out);
  w.U8(m.mode);
  WriteArray(w, m.nonce);
  WriteArray(w, m.proof);
  return out;
}

StatusOr<Challenge> ParseChallenge(std::string_view m) {
  WSYNC_ASSIGN_OR_RETURN(ByteReader r, Open(m, ExchangeMessage::kChallenge));
  Challenge c;
  r.U8(&c.mode, "mode") && ReadArray(r, &c.nonce, "nonce") && ReadArray(r, &c.proof, "proof");
  WSYNC_RETURN_IF_ERROR(End(r, ExchangeMessage::kChallenge));
  return c;
}

std::string Encode(const Proof& m) {
  std::string out = Start(ExchangeMessage::kProof);
  ByteWriter w(&out);
  WriteArray(w, m.proof);
  return out;
}

StatusOr<Proof> ParseProof(std::string_view m) {
  WSYNC_ASSIGN_OR_RETURN(ByteReader r, Open(m, ExchangeMessage::kProof));
  Proof p;
  ReadArray(r, &p.proof, "proof");
  WSYNC_RETURN_IF_ERROR(End(r, ExchangeMessage::kProof));
  return p;
}

StatusOr<Sealed> ParseSealed(std::string_view m) {
  WSYNC_ASSIGN_OR_RETURN(ByteReader r, Open(m, ExchangeMessage::kSealed));
  Sealed s;
  if (!r.U64(&s.counter, "counter")) return r.status();
  if (r.remaining() < 16) return DataLossError("SEALED: " + std::to_string(r.remaining()) + " bytes, shorter than its tag");
  s.ciphertext = m.substr(9, r.remaining() - 16);
  s.tag = m.substr(m.size() - 16);
  return s;
}

}  // namespace wsync::exchange::wire
