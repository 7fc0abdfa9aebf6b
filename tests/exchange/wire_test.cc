// The pull protocol's messages and cryptography, as pure functions: every
// message round-trips, every cut or extension of one is refused naming what
// was wrong, and sealed messages open only where, when and under the key
// they were sealed.
#include "wire.h"

#include <gtest/gtest.h>

#include <random>

#include "crypto.h"

namespace wsync::exchange {
namespace {

std::vector<std::pair<std::string, std::function<Status(std::string_view)>>> Parsers() {
  return {
      {wire::Encode(wire::Pull{3, 7}), [](std::string_view m) { return wire::ParsePull(m).status(); }},
      {wire::Encode(wire::Header{StatusCode::kOk, "", codec::PatchKind::kPatch, 3, 7, 100000, 1 << 20}),
       [](std::string_view m) { return wire::ParseHeader(m).status(); }},
      {wire::Encode(wire::Hello{1, 2, {}}), [](std::string_view m) { return wire::ParseHello(m).status(); }},
      {wire::Encode(wire::Challenge{2, {}, {}}), [](std::string_view m) { return wire::ParseChallenge(m).status(); }},
      {wire::Encode(wire::Proof{}), [](std::string_view m) { return wire::ParseProof(m).status(); }},
      {wire::EncodeBare(ExchangeMessage::kCancel),
       [](std::string_view m) { return wire::ParseBare(m, ExchangeMessage::kCancel); }},
  };
}

TEST(WireTest, EveryMessageRoundTrips) {
  auto pull = wire::ParsePull(wire::Encode(wire::Pull{0, 9}));
  ASSERT_TRUE(pull.ok());
  EXPECT_EQ(pull->from, 0u);
  EXPECT_EQ(pull->to, 9u);
  wire::Header h{StatusCode::kOk, "", codec::PatchKind::kKeyframe, 0, 9, 12345678, 1 << 20};
  auto header = wire::ParseHeader(wire::Encode(h));
  ASSERT_TRUE(header.ok()) << header.status().ToString();
  EXPECT_EQ(header->kind, codec::PatchKind::kKeyframe);
  EXPECT_EQ(header->total, 12345678u);
  EXPECT_EQ(header->chunk, 1u << 20);
  auto refused = wire::ParseHeader(wire::Encode(wire::Header{StatusCode::kNotFound, "no such version"}));
  ASSERT_TRUE(refused.ok());
  EXPECT_EQ(refused->code, StatusCode::kNotFound);
  EXPECT_EQ(refused->error, "'no such version'");
  auto abort = wire::ParseRefusal(wire::Encode(ExchangeMessage::kAbort, {StatusCode::kUnavailable, "lost"}),
                                  ExchangeMessage::kAbort);
  ASSERT_TRUE(abort.ok());
  EXPECT_EQ(abort->code, StatusCode::kUnavailable);
  wire::Hello hello;
  hello.mode = 2;
  hello.nonce[5] = 42;
  auto h2 = wire::ParseHello(wire::Encode(hello));
  ASSERT_TRUE(h2.ok());
  EXPECT_EQ(h2->nonce[5], 42);
  EXPECT_EQ(h2->mode, 2);
}

// The integers are little-endian whatever the host (the grammar in
// docs/data-plane.md).
TEST(WireTest, PullBytesAreLittleEndian) {
  const std::string m = wire::Encode(wire::Pull{0x0102, 0x0304, 0x0506, 0x0708});
  ASSERT_EQ(m.size(), 29u);
  EXPECT_EQ(m[0], 1);
  EXPECT_EQ(m[1], 0x02);
  EXPECT_EQ(m[2], 0x01);
  EXPECT_EQ(m[9], 0x04);
  EXPECT_EQ(m[10], 0x03);
  EXPECT_EQ(m[17], 0x06);
  EXPECT_EQ(m[18], 0x05);
  EXPECT_EQ(m[25], 0x08);
  EXPECT_EQ(m[26], 0x07);
}

TEST(WireTest, EveryTruncationAndExtensionIsRefused) {
  for (const auto& [message, parse] : Parsers()) {
    ASSERT_TRUE(parse(message).ok()) << parse(message).ToString();
    for (size_t cut = 0; cut < message.size(); ++cut) {
      Status s = parse(message.substr(0, cut));
      EXPECT_EQ(s.code(), StatusCode::kDataLoss) << "cut at " << cut << " of type " << int(message[0]);
    }
    Status longer = parse(message + "x");
    EXPECT_EQ(longer.code(), StatusCode::kDataLoss) << "type " << int(message[0]);
    EXPECT_NE(longer.message().find("trailing"), std::string::npos) << longer.ToString();
    std::string other = message;
    other[0] = static_cast<char>(99);
    EXPECT_NE(parse(other).message().find("type byte"), std::string::npos) << parse(other).ToString();
  }
}

TEST(WireTest, FieldsOutsideTheirRangesAreNamed) {
  const struct {
    std::string message;
    const char* expect;
  } cases[] = {
      {wire::Encode(wire::Pull{7, 7}), "not before"},
      {wire::Encode(wire::Pull{0, 0}), "version 0"},
      {wire::Encode(wire::Header{StatusCode::kOk, "", codec::PatchKind::kPatch, 1, 2, uint64_t{1} << 60, 1 << 20}),
       "chunks"},
      {wire::Encode(wire::Header{StatusCode::kOk, "", codec::PatchKind::kPatch, 1, 2, 100, 16}), "chunk size"},
      {wire::Encode(wire::Header{StatusCode::kOk, "", static_cast<codec::PatchKind>(9), 1, 2, 100, 1 << 20}), "kind"},
      {wire::Encode(wire::Hello{7, 1, {}}), "version 7"},
  };
  for (const auto& c : cases) {
    Status s = c.message[0] == 1 ? wire::ParsePull(c.message).status()
               : c.message[0] == 2 ? wire::ParseHeader(c.message).status()
                                   : wire::ParseHello(c.message).status();
    EXPECT_EQ(s.code(), StatusCode::kDataLoss) << c.expect;
    EXPECT_NE(s.message().find(c.expect), std::string::npos) << s.ToString();
  }
  std::string bad_status = wire::Encode(wire::Header{StatusCode::kNotFound, "x"});
  bad_status[1] = static_cast<char>(200);
  EXPECT_NE(wire::ParseHeader(bad_status).status().message().find("not a status code"), std::string::npos);
  std::string huge_chunk = wire::EncodeChunk(std::string(kMaxChunkBytes + 1, 'x'));
  EXPECT_EQ(wire::ParseChunk(huge_chunk).status().code(), StatusCode::kDataLoss);
}

TEST(CryptoTest, SealedMessagesOpenOnlyWhereWhenAndUnderTheirKey) {
  const crypto::Key key = crypto::ClusterKey("cluster-token");
  std::mt19937_64 rng(5);
  for (size_t size : {size_t{0}, size_t{1}, size_t{17}, size_t{4096}, size_t{1} << 20}) {
    std::string plain(size, '\0');
    for (auto& c : plain) c = static_cast<char>(rng());
    crypto::Sealer sealer(key);
    crypto::Opener opener(key);
    const std::string sealed = sealer.Seal(3, 8, plain);
    EXPECT_EQ(sealed.size(), plain.size() + wire::kSealOverhead);
    if (size >= 16) {
      EXPECT_EQ(sealed.find(plain.substr(0, 16)), std::string::npos) << "plaintext visible";
    }
    EXPECT_FALSE(opener.Open(4, 8, sealed).ok()) << "another channel";
    EXPECT_FALSE(opener.Open(3, 9, sealed).ok()) << "another position";
    EXPECT_FALSE(crypto::Opener(crypto::ClusterKey("other-token")).Open(3, 8, sealed).ok()) << "another key";
    for (size_t at : {size_t{9}, sealed.size() / 2, sealed.size() - 1}) {
      std::string tampered = sealed;
      tampered[at] ^= 1;
      auto t = opener.Open(3, 8, tampered);
      EXPECT_EQ(t.status().code(), StatusCode::kDataLoss) << "byte " << at;
    }
    auto opened = opener.Open(3, 8, sealed);
    ASSERT_TRUE(opened.ok()) << opened.status().ToString();
    EXPECT_EQ(*opened, plain);
    auto replay = opener.Open(3, 8, sealed);
    EXPECT_NE(replay.status().message().find("replays"), std::string::npos) << replay.status().ToString();
  }
}

TEST(CryptoTest, ProofsBindBothNoncesTheModeAndTheSide) {
  const crypto::Key key = crypto::ClusterKey("t");
  const wire::Nonce a = crypto::RandomNonce(), b = crypto::RandomNonce();
  EXPECT_NE(a, b);
  const wire::Mac p = crypto::Prove(key, "client", a, b, 1);
  EXPECT_TRUE(crypto::SameMac(p, crypto::Prove(key, "client", a, b, 1)));
  EXPECT_FALSE(crypto::SameMac(p, crypto::Prove(key, "server", a, b, 1)));
  EXPECT_FALSE(crypto::SameMac(p, crypto::Prove(key, "client", b, a, 1)));
  EXPECT_FALSE(crypto::SameMac(p, crypto::Prove(key, "client", a, b, 2)));
  EXPECT_FALSE(crypto::SameMac(p, crypto::Prove(crypto::ClusterKey("u"), "client", a, b, 1)));
  EXPECT_NE(crypto::SessionKey(key, "client->server", a, b), crypto::SessionKey(key, "server->client", a, b));
}

}  // namespace
}  // namespace wsync::exchange
