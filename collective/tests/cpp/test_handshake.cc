// The connect handshake (protocol version 2): the crypto binding against published vectors, the
// pure encode/parse/MAC functions and both state machines, then the connect phase against what
// a stranger can do: know the port but not the token, squat a rank's port, flood it with idle
// connections and garbage, exhaust its descriptors. The real job must form and compute right,
// the token must never be sent, and nothing a stranger sends may stop or spin a rank.

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <dirent.h>
#include <string>
#include <thread>
#include <vector>

#include "harness.h"
#include "meshccl/collectives.h"
#include "meshccl/crypto.h"
#include "meshccl/handshake.h"
#include "meshccl/meshccl.h"

namespace meshccl {
namespace {

namespace hs = handshake;
using test::Job;
using test::Topology;

#define EXPECT_HAS(text, part) \
  EXPECT_NE(std::string(text).find(part), std::string::npos) << "'" << (text) << "' lacks '" << (part) << "'"
#define EXPECT_HAS_NOT(text, part) \
  EXPECT_EQ(std::string(text).find(part), std::string::npos) << "'" << (text) << "' has '" << (part) << "'"

std::string hex(const uint8_t* p, size_t n) {
  static const char* digits = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < n; ++i) {
    s += digits[p[i] >> 4];
    s += digits[p[i] & 15];
  }
  return s;
}

std::string hex(const crypto::Mac& m) { return hex(m.data(), m.size()); }

crypto::Mac hmac(const std::string& key, const std::string& data) {
  return crypto::hmacSha256(key.data(), key.size(), data.data(), data.size());
}

bool contains(const std::vector<uint8_t>& hay, const std::string& needle) {
  return std::search(hay.begin(), hay.end(), needle.begin(), needle.end()) != hay.end();
}

// --- the crypto binding --------------------------------------------------------------------

TEST(Crypto, HmacSha256MatchesRfc4231) {
  // RFC 4231, test case 2: key "Jefe".
  EXPECT_EQ(hex(hmac("Jefe", "what do ya want for nothing?")),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  // Test case 1: 20 bytes of 0x0b.
  EXPECT_EQ(hex(hmac(std::string(20, '\x0b'), "Hi There")),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
  // Test case 6: a key longer than the block (131 bytes of 0xaa), hashed first.
  EXPECT_EQ(hex(hmac(std::string(131, '\xaa'), "Test Using Larger Than Block-Size Key - Hash Key First")),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
  // The empty key (a job run with the explicit no-token opt-out) and empty data.
  EXPECT_EQ(hex(hmac("", "")), "b613679a0814d9ec772f95d778c35fc5ff1697c493715653c6c712144292c5ad");
}

TEST(Crypto, RandomBytesAndConstantTimeCompare) {
  const hs::Nonce a = hs::freshNonce();
  const hs::Nonce b = hs::freshNonce();
  EXPECT_NE(a, b);
  EXPECT_NE(a, hs::Nonce{});
  EXPECT_TRUE(crypto::equalConstantTime(a.data(), a.data(), a.size()));
  hs::Nonce c = a;
  c[31] ^= 1;
  EXPECT_FALSE(crypto::equalConstantTime(a.data(), c.data(), a.size()));
  c = a;
  c[0] ^= 0x80;
  EXPECT_FALSE(crypto::equalConstantTime(a.data(), c.data(), a.size()));
  EXPECT_NE(std::string(crypto::providerName()), "");
}

// --- messages --------------------------------------------------------------------------------

hs::Nonce nonceOf(uint8_t seed) {
  hs::Nonce n{};
  for (size_t i = 0; i < n.size(); ++i) n[i] = static_cast<uint8_t>(seed + i);
  return n;
}

TEST(Handshake, MessagesHaveAFixedLittleEndianLayout) {
  hs::Hello h;
  h.rank = 3;
  h.size = 0x01020304;
  h.connIndex = 1;
  h.connCount = 2;
  h.nonce = nonceOf(7);
  const auto b = hs::encodeHello(h);
  ASSERT_EQ(b.size(), 56u);
  // "MCCL" as version 1 sent it, then version 2: a version-1 rank reads these six bytes as before.
  EXPECT_EQ(hex(b.data(), 8), "4c43434d02000000");
  EXPECT_EQ(hex(b.data() + 8, 16), "03000000040302010100000002000000");
  EXPECT_EQ(b[24], 7);
  EXPECT_EQ(b[55], 7 + 31);
  const hs::Hello back = hs::parseHello(b.data());
  EXPECT_EQ(back.magic, hs::kMagic);
  EXPECT_EQ(back.version, 2);
  EXPECT_EQ(back.rank, 3u);
  EXPECT_EQ(back.size, 0x01020304u);
  EXPECT_EQ(back.connIndex, 1u);
  EXPECT_EQ(back.connCount, 2u);
  EXPECT_EQ(back.nonce, h.nonce);

  hs::Challenge c;
  c.status = 4;
  c.rank = 9;
  c.nonce = nonceOf(1);
  const auto cb = hs::encodeChallenge(c);
  ASSERT_EQ(cb.size(), 48u);
  // The status first: where version 1's 4-byte answer was.
  EXPECT_EQ(hex(cb.data(), 16), "040000004c43434d0200000009000000");
  const hs::Challenge cback = hs::parseChallenge(cb.data());
  EXPECT_EQ(cback.status, 4u);
  EXPECT_EQ(cback.rank, 9u);
  EXPECT_EQ(cback.nonce, c.nonce);

  hs::Verdict v;
  v.status = 0;
  v.mac.fill(0xab);
  const auto vb = hs::encodeVerdict(v);
  ASSERT_EQ(vb.size(), 36u);
  EXPECT_EQ(hex(vb.data(), 6), "00000000abab");
  EXPECT_EQ(hs::parseVerdict(vb.data()).mac, v.mac);
  EXPECT_EQ(hs::statusName(3), "duplicate");
  EXPECT_EQ(hs::statusName(77), "unknown status 77");
}

hs::Binding sampleBinding() {
  hs::Binding b;
  b.jobId = "job-7";
  b.nonceC = nonceOf(0x10);
  b.nonceA = nonceOf(0x80);
  b.connectorRank = 2;
  b.acceptorRank = 1;
  b.size = 4;
  b.connIndex = 1;
  b.connCount = 2;
  return b;
}

TEST(Handshake, MacInputIsTheLabelThenTheLengthPrefixedBinding) {
  const hs::Binding b = sampleBinding();
  const auto m = hs::macInput("meshccl/2 connect", b);
  const std::string label = "meshccl/2 connect";
  ASSERT_EQ(m.size(), label.size() + 4 + 5 + 32 + 32 + 5 * 4);
  EXPECT_EQ(std::string(m.begin(), m.begin() + static_cast<long>(label.size())), label);
  size_t at = label.size();
  EXPECT_EQ(hex(&m[at], 4), "05000000");
  EXPECT_EQ(std::string(m.begin() + static_cast<long>(at) + 4, m.begin() + static_cast<long>(at) + 9), "job-7");
  at += 9;
  EXPECT_EQ(m[at], 0x10);
  EXPECT_EQ(m[at + 32], 0x80);
  at += 64;
  EXPECT_EQ(hex(&m[at], 20), "0200000001000000040000000100000002000000");
  // The proof is exactly HMAC-SHA256(token, that input).
  const std::string token = "t0k3n";
  EXPECT_EQ(hs::connectorMac(token, b), crypto::hmacSha256(token.data(), token.size(), m.data(), m.size()));
}

TEST(Handshake, EveryBoundFieldChangesBothProofs) {
  const std::string token = "the-token";
  const hs::Binding base = sampleBinding();
  const crypto::Mac c0 = hs::connectorMac(token, base);
  const crypto::Mac a0 = hs::acceptorMac(token, base);
  EXPECT_NE(c0, a0) << "the two directions must not share a proof (reflection)";
  EXPECT_NE(c0, hs::connectorMac("the-tokeN", base));
  EXPECT_NE(c0, hs::connectorMac("", base));
  std::vector<std::function<void(hs::Binding&)>> changes = {
      [](hs::Binding& b) { b.jobId = "job-8"; },
      [](hs::Binding& b) { b.jobId = ""; },
      [](hs::Binding& b) { b.nonceC[5] ^= 1; },
      [](hs::Binding& b) { b.nonceA[31] ^= 1; },
      [](hs::Binding& b) { std::swap(b.nonceA, b.nonceC); },
      [](hs::Binding& b) { b.connectorRank = 3; },
      [](hs::Binding& b) { b.acceptorRank = 0; },
      [](hs::Binding& b) { std::swap(b.connectorRank, b.acceptorRank); },
      [](hs::Binding& b) { b.size = 5; },
      [](hs::Binding& b) { b.connIndex = 0; },
      [](hs::Binding& b) { b.connCount = 3; },
  };
  for (size_t i = 0; i < changes.size(); ++i) {
    hs::Binding b = base;
    changes[i](b);
    EXPECT_NE(hs::connectorMac(token, b), c0) << "change " << i;
    EXPECT_NE(hs::acceptorMac(token, b), a0) << "change " << i;
  }
}

// --- the state machines, fed directly ---------------------------------------------------------

// Moves bytes between a connector and an acceptor until neither has more to say; `chunk` bytes
// at a time (1: byte by byte).
void converse(hs::Connector& c, hs::Acceptor& a, size_t chunk, std::vector<uint8_t>* toAcceptor = nullptr,
              bool takeSlot = true) {
  for (int round = 0; round < 16; ++round) {
    auto fromC = c.takeOutput();
    if (toAcceptor != nullptr) toAcceptor->insert(toAcceptor->end(), fromC.begin(), fromC.end());
    for (size_t i = 0; i < fromC.size();) {
      const size_t n = std::min(chunk, fromC.size() - i);
      const size_t took = a.feed(fromC.data() + i, n);
      if (took == 0) break;
      i += took;
    }
    if (a.state() == hs::Acceptor::State::kProven) {
      if (takeSlot) {
        a.accept();
      } else {
        a.refuseDuplicate();
      }
    }
    auto fromA = a.takeOutput();
    for (size_t i = 0; i < fromA.size();) {
      const size_t n = std::min(chunk, fromA.size() - i);
      const size_t took = c.feed(fromA.data() + i, n);
      if (took == 0) break;
      i += took;
    }
    if (fromC.empty() && fromA.empty()) return;
  }
}

std::vector<uint32_t> expectFrom(uint32_t size, uint32_t rank, uint32_t count) {
  std::vector<uint32_t> e(size, 0);
  e[rank] = count;
  return e;
}

TEST(Handshake, BothSidesProveTheTokenInAnyChunking) {
  for (size_t chunk : {1, 3, 7, 64}) {
    const hs::Nonce nc = hs::freshNonce();
    hs::Connector c("secret", "job", 2, 0, 3, 1, 2, nc);
    hs::Acceptor a(0, 3, "secret", "job", expectFrom(3, 2, 2), hs::freshNonce());
    std::vector<uint8_t> sent;
    converse(c, a, chunk, &sent);
    EXPECT_EQ(c.state(), hs::Connector::State::kDone) << "chunk " << chunk;
    EXPECT_EQ(a.state(), hs::Acceptor::State::kDone) << "chunk " << chunk;
    EXPECT_EQ(a.hello().rank, 2u);
    EXPECT_EQ(a.hello().connIndex, 1u);
    EXPECT_EQ(a.hello().nonce, nc);
    EXPECT_EQ(sent.size(), hs::kHelloBytes + hs::kProofBytes);
    EXPECT_FALSE(contains(sent, "secret"));
  }
  // The opt-out (no token): the same exchange with an empty key.
  hs::Connector c("", "", 1, 0, 2, 0, 1, hs::freshNonce());
  hs::Acceptor a(0, 2, "", "", expectFrom(2, 1, 1), hs::freshNonce());
  converse(c, a, 5);
  EXPECT_EQ(c.state(), hs::Connector::State::kDone);
  EXPECT_EQ(a.state(), hs::Acceptor::State::kDone);
}

TEST(Handshake, AWrongTokenOrJobIdIsRefusedBeforeTheSlotIsTaken) {
  struct Case {
    const char* token;
    const char* job;
  };
  for (const Case& k : {Case{"secreT", "job"}, Case{"secret", "job2"}, Case{"", "job"}}) {
    hs::Connector c(k.token, k.job, 1, 0, 2, 0, 1, hs::freshNonce());
    hs::Acceptor a(0, 2, "secret", "job", expectFrom(2, 1, 1), hs::freshNonce());
    converse(c, a, 64);
    EXPECT_EQ(a.state(), hs::Acceptor::State::kRejected);
    EXPECT_EQ(a.refusal(), hs::Status::kBadToken);
    EXPECT_HAS(a.reason(), "could not prove the job token");
    EXPECT_HAS_NOT(a.reason(), "secret");
    EXPECT_EQ(c.state(), hs::Connector::State::kFailed);
    EXPECT_EQ(c.failure(), hs::Connector::Failure::kRefused);
    EXPECT_TRUE(c.inVerdict());
    EXPECT_EQ(c.status(), static_cast<uint32_t>(hs::Status::kBadToken));
  }
}

TEST(Handshake, AnAcceptorWithoutTheTokenIsCaughtByTheConnector) {
  // A squatter that plays along and says "ok" cannot make the acceptor's proof.
  hs::Connector c("secret", "job", 1, 0, 2, 0, 1, hs::freshNonce());
  hs::Acceptor fake(0, 2, "guess", "job", expectFrom(2, 1, 1), hs::freshNonce());
  auto hello = c.takeOutput();
  fake.feed(hello.data(), hello.size());
  auto challenge = fake.takeOutput();
  c.feed(challenge.data(), challenge.size());
  auto proof = c.takeOutput();
  ASSERT_EQ(proof.size(), hs::kProofBytes);
  hs::Verdict v;  // "ok" with a made-up proof
  v.mac.fill(0x5a);
  const auto vb = hs::encodeVerdict(v);
  c.feed(vb.data(), vb.size());
  EXPECT_EQ(c.state(), hs::Connector::State::kFailed);
  EXPECT_EQ(c.failure(), hs::Connector::Failure::kForged);
}

TEST(Handshake, AProofIsGoodForOneConnectionOnly) {
  // Capture a real exchange, then replay the connector's messages to a fresh acceptor.
  hs::Connector c("secret", "job", 1, 0, 2, 0, 1, hs::freshNonce());
  hs::Acceptor a(0, 2, "secret", "job", expectFrom(2, 1, 1), hs::freshNonce());
  std::vector<uint8_t> sent;
  converse(c, a, 64, &sent);
  ASSERT_EQ(a.state(), hs::Acceptor::State::kDone);
  hs::Acceptor again(0, 2, "secret", "job", expectFrom(2, 1, 1), hs::freshNonce());
  again.feed(sent.data(), hs::kHelloBytes);
  (void)again.takeOutput();
  again.feed(sent.data() + hs::kHelloBytes, hs::kProofBytes);
  EXPECT_EQ(again.state(), hs::Acceptor::State::kRejected);
  EXPECT_EQ(again.refusal(), hs::Status::kBadToken);
}

TEST(Handshake, ASecondProvenClaimOfASlotIsADuplicate) {
  hs::Connector c("secret", "", 1, 0, 2, 0, 1, hs::freshNonce());
  hs::Acceptor a(0, 2, "secret", "", expectFrom(2, 1, 1), hs::freshNonce());
  converse(c, a, 64, nullptr, false);
  EXPECT_EQ(a.state(), hs::Acceptor::State::kRejected);
  EXPECT_EQ(a.refusal(), hs::Status::kDuplicate);
  EXPECT_EQ(c.failure(), hs::Connector::Failure::kRefused);
  EXPECT_EQ(c.status(), static_cast<uint32_t>(hs::Status::kDuplicate));
}

// The acceptor's verdict on one HELLO; the CHALLENGE it sent must carry the same status.
hs::Status helloVerdict(const std::vector<uint8_t>& bytes, std::string* reason = nullptr) {
  hs::Acceptor a(0, 4, "secret", "", {0, 2, 0, 0}, hs::freshNonce());  // rank 0 of 4 accepts 2 conns from rank 1
  size_t at = 0;
  while (at < bytes.size()) {
    const size_t took = a.feed(bytes.data() + at, bytes.size() - at);
    if (took == 0) break;
    at += took;
  }
  const auto out = a.takeOutput();
  if (reason != nullptr) *reason = a.reason();
  if (a.state() == hs::Acceptor::State::kProof) {
    EXPECT_EQ(out.size(), hs::kChallengeBytes);
    return hs::Status::kOk;
  }
  EXPECT_EQ(a.state(), hs::Acceptor::State::kRejected);
  EXPECT_EQ(out.size(), hs::kChallengeBytes);
  if (out.size() == hs::kChallengeBytes) {
    EXPECT_EQ(hs::parseChallenge(out.data()).status, static_cast<uint32_t>(a.refusal()));
    EXPECT_EQ(hs::parseChallenge(out.data()).nonce, hs::Nonce{}) << "a refusal carries no nonce";
  }
  return a.refusal();
}

std::vector<uint8_t> helloBytes(uint32_t rank, uint32_t size, uint32_t index, uint32_t count, uint16_t version = 2,
                                uint16_t flags = 0) {
  hs::Hello h;
  h.rank = rank;
  h.size = size;
  h.connIndex = index;
  h.connCount = count;
  h.version = version;
  h.flags = flags;
  const auto b = hs::encodeHello(h);
  return {b.begin(), b.end()};
}

TEST(Handshake, TheAcceptorRefusesEveryMalformedOrUnexpectedHello) {
  std::string why;
  EXPECT_EQ(helloVerdict(helloBytes(1, 4, 0, 2)), hs::Status::kOk);
  EXPECT_EQ(helloVerdict(helloBytes(1, 4, 1, 2)), hs::Status::kOk);
  EXPECT_EQ(helloVerdict(helloBytes(1, 5, 0, 2), &why), hs::Status::kBadRank);  // another world size
  EXPECT_HAS(why, "this job has 4 ranks");
  EXPECT_EQ(helloVerdict(helloBytes(4, 4, 0, 2)), hs::Status::kBadRank);           // out of range
  EXPECT_EQ(helloVerdict(helloBytes(0xffffffffu, 4, 0, 2)), hs::Status::kBadRank);  // far out of range
  EXPECT_EQ(helloVerdict(helloBytes(0, 4, 0, 2)), hs::Status::kBadRank);           // this rank itself
  EXPECT_EQ(helloVerdict(helloBytes(2, 4, 0, 2)), hs::Status::kBadRank);           // a rank that does not connect here
  EXPECT_EQ(helloVerdict(helloBytes(1, 4, 2, 2)), hs::Status::kBadRank);           // index out of range
  EXPECT_EQ(helloVerdict(helloBytes(1, 4, 0, 3)), hs::Status::kBadRank);           // another connection count
  EXPECT_EQ(helloVerdict(helloBytes(1, 4, 7, 0xffffffffu)), hs::Status::kBadRank);
  EXPECT_EQ(helloVerdict(helloBytes(1, 4, 0, 2, 2, 1)), hs::Status::kBadVersion);  // unknown flags
  EXPECT_EQ(helloVerdict(helloBytes(1, 4, 0, 2, 3), &why), hs::Status::kBadVersion);
  EXPECT_HAS(why, "protocol version 3");
  // A version-1 hello: judged on its first six bytes (it may be shorter than a version-2 one).
  std::vector<uint8_t> v1 = helloBytes(1, 4, 0, 2, 1);
  v1.resize(24);
  const std::string oldToken = "secret";
  v1.insert(v1.end(), oldToken.begin(), oldToken.end());
  EXPECT_EQ(helloVerdict({v1.begin(), v1.begin() + 6}), hs::Status::kBadVersion);
  EXPECT_EQ(helloVerdict({'G', 'E', 'T', ' ', '/', ' ', 'H', 'T', 'T', 'P'}, &why), hs::Status::kBadVersion);
  EXPECT_HAS(why, "not a meshccl connection");
  // Short input is no verdict yet, never a crash.
  hs::Acceptor a(0, 4, "secret", "", {0, 2, 0, 0}, hs::freshNonce());
  const auto b = helloBytes(1, 4, 0, 2);
  a.feed(b.data(), 30);
  EXPECT_EQ(a.state(), hs::Acceptor::State::kHelloRest);
  EXPECT_EQ(a.need(), 26u);
  EXPECT_TRUE(a.takeOutput().empty());
}

TEST(Handshake, TheConnectorTellsRefusalsNonMeshcclAndWrongRanksApart) {
  auto run = [](const std::vector<uint8_t>& answer) {
    hs::Connector c("secret", "", 1, 0, 2, 0, 1, hs::freshNonce());
    (void)c.takeOutput();
    size_t at = 0;
    while (at < answer.size()) {
      const size_t took = c.feed(answer.data() + at, answer.size() - at);
      if (took == 0) break;
      at += took;
    }
    return c;
  };
  // A version-1 acceptor answers a version-2 hello with its 4-byte "bad version" and closes.
  const hs::Connector v1 = run({4, 0, 0, 0});
  EXPECT_EQ(v1.failure(), hs::Connector::Failure::kRefused);
  EXPECT_EQ(v1.status(), static_cast<uint32_t>(hs::Status::kBadVersion));
  EXPECT_FALSE(v1.inVerdict());
  // "ok" in version 1's sense is only the start of a challenge: nothing is decided on it.
  const hs::Connector v1ok = run({0, 0, 0, 0});
  EXPECT_EQ(v1ok.state(), hs::Connector::State::kChallengeRest);
  hs::Challenge ch;
  ch.rank = 0;
  ch.magic = 0x50545448;  // "HTTP"
  auto chb = hs::encodeChallenge(ch);
  const hs::Connector notUs = run({chb.begin(), chb.end()});
  EXPECT_EQ(notUs.failure(), hs::Connector::Failure::kNotMeshccl);
  ch.magic = hs::kMagic;
  ch.rank = 1;
  chb = hs::encodeChallenge(ch);
  const hs::Connector wrong = run({chb.begin(), chb.end()});
  EXPECT_EQ(wrong.failure(), hs::Connector::Failure::kWrongRank);
  EXPECT_EQ(wrong.claimedRank(), 1u);
  const hs::Connector garbage = run({'H', 'T', 'T', 'P', '/', '1'});
  EXPECT_EQ(garbage.failure(), hs::Connector::Failure::kRefused);
  EXPECT_EQ(hs::statusName(garbage.status()), "unknown status 1347703880");
}

TEST(Handshake, RejectionLogIsRateLimited) {
  hs::LogLimiter lim(10, 10.0);
  int written = 0;
  for (int i = 0; i < 25; ++i) written += lim.admit(100.0 + i * 0.01) ? 1 : 0;
  EXPECT_EQ(written, 10);
  EXPECT_EQ(lim.takeSuppressed(105.0), 0u);  // the window is still open
  EXPECT_EQ(lim.takeSuppressed(110.5), 15u);
  EXPECT_EQ(lim.takeSuppressed(111.0), 0u);
  EXPECT_TRUE(lim.admit(111.0));  // a new window
  for (int i = 0; i < 12; ++i) lim.admit(111.5);
  EXPECT_EQ(lim.takeSuppressed(112.0, true), 3u);  // flushed at the end of the connect phase
}

// --- the connect phase against strangers --------------------------------------------------

// Each rank contributes rank+1 everywhere: the sum over n ranks is n(n+1)/2.
std::function<void(Context&)> checkedAllReduce(std::atomic<int>* good) {
  return [good](Context& ctx) {
    const int n = ctx.size();
    std::vector<float> buf(4096, static_cast<float>(ctx.rank() + 1));
    allReduce(ctx, buf.data(), buf.data(), buf.size(), DataType::kFloat32, RedOp::kSum);
    const float want = static_cast<float>(n * (n + 1) / 2);
    if (std::all_of(buf.begin(), buf.end(), [&](float v) { return v == want; })) ++*good;
  };
}

void loud(Config& c) { c.logLevel = 1; }

// A stranger speaking the protocol over a raw socket: its messages, whatever it holds as token.
hs::Connector speak(int fd, const std::string& token, uint32_t rank, uint32_t peer, uint32_t size, uint32_t index,
                    uint32_t count) {
  hs::Connector c(token, "", rank, peer, size, index, count, hs::freshNonce());
  for (int step = 0; step < 8 && c.state() != hs::Connector::State::kDone && c.state() != hs::Connector::State::kFailed;
       ++step) {
    const auto bytes = c.takeOutput();
    if (!bytes.empty() && ::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(bytes.size())) {
      break;
    }
    std::vector<uint8_t> in(c.need());
    if (in.empty() || test::readFor(fd, in.data(), in.size(), 10.0) != in.size()) break;
    c.feed(in.data(), in.size());
  }
  return c;
}

TEST(ConnectPhase, StrangersWithoutTheTokenCannotJoinAndTheJobCompletes) {
  const int n = 3;
  Job job(n);
  std::atomic<int> good{0};
  testing::internal::CaptureStderr();
  // Rank 0 accepts ranks 1 and 2. A long handshake deadline: the idle stranger below is still
  // pending when the job forms (timedOut stays 0), so it provably held nothing up.
  job.start(0, checkedAllReduce(&good), [](Config& c) {
    loud(c);
    c.handshakeTimeoutSeconds = 30;
  });

  // A stranger that knows the protocol and claims rank 1, with a wrong token: refused, closed.
  const int s1 = test::connectLoopback(job.port(0));
  ASSERT_GE(s1, 0);
  const hs::Connector r1 = speak(s1, "a-guessed-token", 1, 0, n, 0, 1);
  EXPECT_EQ(r1.failure(), hs::Connector::Failure::kRefused);
  EXPECT_EQ(r1.status(), static_cast<uint32_t>(hs::Status::kBadToken));
  EXPECT_TRUE(test::closedWithin(s1, 10.0));
  ::close(s1);
  // Garbage: a refusal, then the connection closes.
  const int s2 = test::connectLoopback(job.port(0));
  const std::string junk = "GET / HTTP/1.1\r\nHost: x\r\n\r\n\x01\x02\x03\xff\xfe garbage garbage garbage garbage";
  ASSERT_EQ(::send(s2, junk.data(), junk.size(), MSG_NOSIGNAL), static_cast<ssize_t>(junk.size()));
  uint8_t refusal[hs::kChallengeBytes];
  ASSERT_EQ(test::readFor(s2, refusal, sizeof(refusal), 10.0), sizeof(refusal));
  EXPECT_EQ(hs::parseChallenge(refusal).status, static_cast<uint32_t>(hs::Status::kBadVersion));
  EXPECT_TRUE(test::closedWithin(s2, 10.0));
  ::close(s2);
  // A stranger that sends a well-formed hello as rank 2 and then nothing: it holds no slot.
  const int s3 = test::connectLoopback(job.port(0));
  const auto hello = helloBytes(2, n, 0, 1);
  ASSERT_EQ(::send(s3, hello.data(), hello.size(), MSG_NOSIGNAL), static_cast<ssize_t>(hello.size()));
  uint8_t challenge[hs::kChallengeBytes];
  ASSERT_EQ(test::readFor(s3, challenge, sizeof(challenge), 10.0), sizeof(challenge));
  EXPECT_EQ(hs::parseChallenge(challenge).status, 0u);

  job.start(1, checkedAllReduce(&good), loud);
  job.start(2, checkedAllReduce(&good), loud);
  job.join();
  ::close(s3);
  const std::string log = testing::internal::GetCapturedStderr();
  for (int r = 0; r < n; ++r) EXPECT_EQ(job.result(r).kind, 0) << "rank " << r << ": " << job.result(r).message;
  EXPECT_EQ(good.load(), n) << "the all_reduce is wrong";
  EXPECT_HAS(log, "rejected a connection from 127.0.0.1:");
  EXPECT_HAS(log, "claims to be rank 1 but could not prove the job token");
  EXPECT_HAS(log, "not a meshccl connection");
  EXPECT_HAS_NOT(log, "test-token");
  EXPECT_GE(job.result(0).stats.rejected, 2u);
  EXPECT_EQ(job.result(0).stats.timedOut, 0u) << "the job formed while the idle stranger was pending";
}

// A listener squatting on rank 0's planned port, recording every byte it is sent.
struct Squatter {
  enum class Mode { kPlayAlong, kSayOkV1 };
  explicit Squatter(int port, Mode m) : mode(m) {
    fd = ::socket(AF_INET, SOCK_STREAM, 0);
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bound = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 && ::listen(fd, 16) == 0;
    if (bound) th = std::thread([this] { serve(); });
  }
  ~Squatter() {
    stop = true;
    if (th.joinable()) th.join();
    ::close(fd);
  }
  void serve() {
    while (!stop) {
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 20) <= 0) continue;
      const int c = ::accept(fd, nullptr, nullptr);
      if (c < 0) continue;
      ++connections;
      uint8_t buf[hs::kHelloBytes];
      const size_t got = test::readFor(c, buf, sizeof(buf), 5.0);
      received.insert(received.end(), buf, buf + got);
      if (got == sizeof(buf)) {
        if (mode == Mode::kPlayAlong) {
          hs::Challenge ch;  // "I am rank 0, go on"
          ch.rank = 0;
          ch.nonce = hs::freshNonce();
          const auto cb = hs::encodeChallenge(ch);
          ::send(c, cb.data(), cb.size(), MSG_NOSIGNAL);
          uint8_t proof[hs::kProofBytes];
          const size_t pg = test::readFor(c, proof, sizeof(proof), 5.0);
          received.insert(received.end(), proof, proof + pg);
          hs::Verdict v;  // "ok", with a proof it cannot make
          v.mac.fill(0x42);
          const auto vb = hs::encodeVerdict(v);
          ::send(c, vb.data(), vb.size(), MSG_NOSIGNAL);
        } else {
          const uint32_t ok = 0;  // what a version-1 acceptor said to let a rank in
          ::send(c, &ok, sizeof(ok), MSG_NOSIGNAL);
        }
      }
      std::string rest;  // everything until the connector hangs up
      test::closedWithin(c, 10.0, &rest);
      received.insert(received.end(), rest.begin(), rest.end());
      ::close(c);
    }
  }
  Mode mode;
  int fd = -1;
  bool bound = false;
  std::atomic<bool> stop{false};
  std::atomic<int> connections{0};
  std::vector<uint8_t> received;  // read after the thread is joined
  std::thread th;
};

TEST(ConnectPhase, ASquatterNeverReceivesTheTokenAndIsRefusedAsAFake) {
  const std::string token = "squatter-must-never-see-this-token-7f3a9c";
  const auto ports = test::freePorts(2);
  Squatter squatter(ports[0], Squatter::Mode::kPlayAlong);
  ASSERT_TRUE(squatter.bound);
  Config c = test::makeConfig(1, 2, ports, Topology{});
  c.token = token;
  c.connectTimeoutSeconds = 10;
  int kind = 0;
  std::string message;
  try {
    Context ctx(std::move(c));
  } catch (const Error& e) {
    kind = static_cast<int>(e.kind());
    message = e.what();
  }
  squatter.stop = true;
  squatter.th.join();  // `received` is complete: the rank closed its connection
  EXPECT_EQ(kind, static_cast<int>(ErrorKind::kAuth)) << message;
  EXPECT_HAS(message, "rank 1: the process at 127.0.0.1:" + std::to_string(ports[0]) +
                          " answered as rank 0 but could not prove the job token: it is not rank 0 of this job");
  EXPECT_HAS_NOT(message, token);
  const auto& got = squatter.received;
  EXPECT_EQ(squatter.connections.load(), 1) << "a forged proof is final, not retried";
  EXPECT_EQ(got.size(), hs::kHelloBytes + hs::kProofBytes) << "a hello and a proof, nothing after";
  EXPECT_FALSE(contains(got, token)) << "the token's bytes reached the squatter";
  for (size_t cut : {6, 8, 12}) EXPECT_FALSE(contains(got, token.substr(0, cut)));
}

TEST(ConnectPhase, AVersionOneOkFromASquatterLetsNothingThrough) {
  const std::string token = "squatter-must-never-see-this-token-7f3a9c";
  const auto ports = test::freePorts(2);
  Squatter squatter(ports[0], Squatter::Mode::kSayOkV1);
  ASSERT_TRUE(squatter.bound);
  Config c = test::makeConfig(1, 2, ports, Topology{});
  c.token = token;
  c.connectTimeoutSeconds = 1.5;
  c.handshakeTimeoutSeconds = 0.5;
  try {
    Context ctx(std::move(c));
    ADD_FAILURE() << "a rank joined a squatter";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kTimeout) << e.what();
    EXPECT_HAS(e.what(), "no complete handshake within 0.5 s");
  }
  squatter.stop = true;
  squatter.th.join();
  EXPECT_GE(squatter.connections.load(), 2) << "the connector retries a handshake that never finishes";
  EXPECT_FALSE(contains(squatter.received, token));
}

void raiseNoFileLimit(rlim_t want) {
  rlimit lim{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &lim), 0);
  if (lim.rlim_cur < want) {
    lim.rlim_cur = std::min(want, lim.rlim_max);
    ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &lim), 0);
  }
  ASSERT_GE(lim.rlim_cur, want) << "this test needs " << want << " descriptors (ulimit -n)";
}

TEST(ConnectPhase, TwoHundredIdleConnectionsAndGarbageDoNotStopTheJob) {
  raiseNoFileLimit(1024);
  const int n = 3;
  Job job(n);
  std::atomic<int> good{0};
  testing::internal::CaptureStderr();
  // No handshake deadline passes during the test: only the cap of 64 pending makes room.
  job.start(0, checkedAllReduce(&good), [](Config& c) {
    loud(c);
    c.handshakeTimeoutSeconds = 30;
  });
  std::vector<int> idle;
  for (int i = 0; i < 200; ++i) {
    // A burst faster than rank 0 accepts can fill its listen queue (128): the kernel then drops
    // a SYN and that client retries after a second. Slow, not a failure.
    const int fd = test::connectLoopback(job.port(0));
    ASSERT_GE(fd, 0) << "idle connection " << i;
    idle.push_back(fd);
  }
  const int g = test::connectLoopback(job.port(0));
  const auto garbage = std::vector<uint8_t>(hs::kHelloBytes, 0xee);
  ASSERT_EQ(::send(g, garbage.data(), garbage.size(), MSG_NOSIGNAL), static_cast<ssize_t>(garbage.size()));
  job.start(1, checkedAllReduce(&good));
  job.start(2, checkedAllReduce(&good));
  job.join();
  const std::string log = testing::internal::GetCapturedStderr();
  for (int r = 0; r < n; ++r) EXPECT_EQ(job.result(r).kind, 0) << "rank " << r << ": " << job.result(r).message;
  EXPECT_EQ(good.load(), n);
  // 137+ dropped or rejected connections, at most 10 lines about them, then one that counts the rest.
  size_t lines = 0;
  for (size_t at = log.find("meshccl[rank 0]: "); at != std::string::npos; at = log.find("meshccl[rank 0]: ", at + 1)) {
    ++lines;
  }
  EXPECT_LE(lines, 11u) << log;
  EXPECT_HAS(log, "more connection(s) rejected or dropped (not logged one by one)");
  const ConnectStats& s = job.result(0).stats;
  EXPECT_GE(s.accepted, 201u + 2u);
  EXPECT_GE(s.evicted, 200u - 64u) << "at most 64 handshakes are pending";
  EXPECT_GE(s.rejected, 1u) << "the garbage hello";
  EXPECT_EQ(s.timedOut, 0u) << "the job formed while the idle connections were pending";
  // The evicted idle connections were closed by rank 0.
  size_t closed = 0;
  for (int fd : idle) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 0) == 1) ++closed;
    ::close(fd);
  }
  EXPECT_GE(closed, 200u - 64u);
  ::close(g);
}

TEST(ConnectPhase, AnIdleConnectionIsDroppedAtItsHandshakeDeadline) {
  Job job(2);
  std::atomic<int> good{0};
  const auto quick = [](Config& c) { c.handshakeTimeoutSeconds = 0.3; };
  job.start(0, checkedAllReduce(&good), quick);
  const int fd = test::connectLoopback(job.port(0));
  ASSERT_GE(fd, 0);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(test::closedWithin(fd, 10.0));
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_GE(waited, 0.25);
  EXPECT_LT(waited, 3.0);
  ::close(fd);
  job.start(1, checkedAllReduce(&good), quick);
  job.join();
  EXPECT_EQ(job.result(0).kind, 0) << job.result(0).message;
  EXPECT_EQ(job.result(1).kind, 0) << job.result(1).message;
  EXPECT_EQ(good.load(), 2);
  EXPECT_GE(job.result(0).stats.timedOut, 1u);
}

// --- the C ABI carries the token, the job id and the opt-out -------------------------------

TEST(CApi, DefaultsAndATokenlessJobIsRefusedWithTheWayOut) {
  meshccl_config c;
  meshccl_config_init(&c);
  EXPECT_STREQ(c.token, "");
  EXPECT_STREQ(c.job_id, "");
  EXPECT_EQ(c.allow_no_token, 0);
  EXPECT_EQ(c.handshake_timeout_s, Config{}.handshakeTimeoutSeconds);
  c.size = 2;
  meshccl_comm* comm = nullptr;
  char error[512] = "";
  EXPECT_EQ(meshccl_comm_create(&c, &comm, error, sizeof(error)), MESHCCL_ERR_AUTH);
  EXPECT_EQ(comm, nullptr);
  EXPECT_HAS(error, "MESHCCL_ALLOW_NO_TOKEN=1");
}

struct CJob {
  std::vector<int> results = std::vector<int>(2, -1);
  std::vector<float> sums = std::vector<float>(2, 0);
  std::vector<std::string> errors = std::vector<std::string>(2);
};

// Two ranks through the C ABI; rank 1 gets job id `job1`.
CJob runCJob(const char* job1, double connectTimeout) {
  CJob out;
  const auto ports = test::freePorts(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      const auto me = static_cast<size_t>(r);
      const meshccl_endpoint self{"127.0.0.1", ports[me]};
      const meshccl_endpoint other{"127.0.0.1", ports[1 - me]};
      const meshccl_peer peer{1 - r, 1, &other, -1, 0};
      meshccl_config c;
      meshccl_config_init(&c);
      c.rank = r;
      c.size = 2;
      c.token = "c-abi-token";
      c.job_id = r == 1 ? job1 : "c-abi-job";
      c.num_listen = 1;
      c.listen = &self;
      c.num_peers = 1;
      c.peers = &peer;
      c.complete = 1;
      c.ring = 1;
      c.connect_timeout_s = connectTimeout;
      c.log_level = 0;
      meshccl_comm* comm = nullptr;
      char error[512] = "";
      out.results[me] = meshccl_comm_create(&c, &comm, error, sizeof(error));
      out.errors[me] = error;
      if (comm == nullptr) return;
      float v = static_cast<float>(r + 1);
      if (meshccl_all_reduce(comm, &v, &v, 1, MESHCCL_FLOAT32, MESHCCL_SUM) == MESHCCL_OK) out.sums[me] = v;
      meshccl_comm_destroy(comm);
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

TEST(CApi, RanksWithTheSameTokenAndJobIdFormAJob) {
  const CJob same = runCJob("c-abi-job", 20);
  EXPECT_EQ(same.results[0], MESHCCL_OK) << same.errors[0];
  EXPECT_EQ(same.results[1], MESHCCL_OK) << same.errors[1];
  EXPECT_EQ(same.sums[0], 3.0f);
  EXPECT_EQ(same.sums[1], 3.0f);
  // The job id travels through the C ABI into the proofs: another one is refused.
  const CJob other = runCJob("another-job", 1.5);
  EXPECT_EQ(other.results[1], MESHCCL_ERR_AUTH) << other.errors[1];
  EXPECT_EQ(other.results[0], MESHCCL_ERR_TIMEOUT) << other.errors[0];
}

#if defined(__linux__)  // RUSAGE_THREAD, /proc/self/fd
// --- out of descriptors --------------------------------------------------------------------

int countOpenFds() {
  int count = 0;
  DIR* d = ::opendir("/proc/self/fd");
  if (d == nullptr) return -1;
  while (const dirent* e = ::readdir(d)) count += e->d_name[0] != '.' ? 1 : 0;
  ::closedir(d);
  return count - 1;  // the directory's own descriptor
}

// Rank 0 runs in a child process whose descriptor limit leaves it none for accept(): the
// connections wait in the listen queue, accept() fails with EMFILE. The parent lets the child
// free its spare descriptors only after the child has logged several refused accepts; the job
// must then form and compute right, and the child must have waited without spinning (its CPU
// time while connecting is a small part of the wall time, its poll loop ran few rounds).
// idleFirst: the parent first opens idle connections, which the child's pending handshakes take
// and its backoff drops (oldest first) to make room; no descriptor is freed from outside.
void emfileScenario(bool idleFirst) {
  const auto ports = test::freePorts(2);
  int errPipe[2], goPipe[2], resultPipe[2];
  ASSERT_EQ(::pipe(errPipe), 0);
  ASSERT_EQ(::pipe(goPipe), 0);
  ASSERT_EQ(::pipe(resultPipe), 0);
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::dup2(errPipe[1], 2);
    ::close(errPipe[0]);
    ::close(errPipe[1]);
    ::close(goPipe[1]);
    ::close(resultPipe[0]);
    // Everything the connect phase needs before the limit bites: OpenSSL set up; UBSan's cache
    // of checked dynamic types holding what connecting uses (a miss makes UBSan test memory
    // through a pipe, which fails without descriptors: a false "invalid vptr" report).
    (void)handshake::freshNonce();
    (void)hmac("warm", "up");
    (void)cat("rank ", 0, " warm ", 1.5, ' ', std::string("up"), static_cast<size_t>(1), 2L, 3u);
    std::vector<int> spare;
    // No thread may end while descriptors are short: the sanitizers' own checks need one (UBSan
    // tests memory through a pipe and reports a false "invalid vptr" without it).
    std::thread freer;
    if (!idleFirst) {
      freer = std::thread([&] {
        char go = 0;
        if (::read(goPipe[0], &go, 1) == 1) {
          for (int fd : spare) ::close(fd);
        }
      });
    }
    // Fill every descriptor number below the new limit, then give back one for the listener.
    rlimit lim{};
    ::getrlimit(RLIMIT_NOFILE, &lim);
    lim.rlim_cur = static_cast<rlim_t>(countOpenFds() + 64);
    if (::setrlimit(RLIMIT_NOFILE, &lim) != 0) ::_exit(90);
    for (;;) {
      const int fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
      if (fd < 0) break;
      spare.push_back(fd);
    }
    if (spare.size() < 4) ::_exit(91);
    const int room = idleFirst ? 3 : 1;  // idleFirst: the listener and two pending handshakes
    for (int i = 0; i < room; ++i) {
      ::close(spare.back());
      spare.pop_back();
    }
    int rc = 0;
    char report[256] = "";
    try {
      Config c = test::makeConfig(0, 2, ports, Topology{});
      c.logLevel = 1;
      c.transport = "tcp";
      rusage before{}, after{};
      ::getrusage(RUSAGE_THREAD, &before);
      const auto t0 = std::chrono::steady_clock::now();
      Context ctx(std::move(c));
      const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      ::getrusage(RUSAGE_THREAD, &after);
      auto secs = [](const timeval& t) { return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_usec) / 1e6; };
      const double cpu = secs(after.ru_utime) - secs(before.ru_utime) + secs(after.ru_stime) - secs(before.ru_stime);
      std::vector<float> buf(4096, 1.0f);  // as checkedAllReduce on rank 1
      allReduce(ctx, buf.data(), buf.data(), buf.size(), DataType::kFloat32, RedOp::kSum);
      const bool right = std::all_of(buf.begin(), buf.end(), [](float v) { return v == 3.0f; });
      const ConnectStats& s = ctx.connectStats();
      std::snprintf(report, sizeof(report), "%d %.4f %.4f %llu %llu %llu", right ? 1 : 0, cpu, wall,
                    static_cast<unsigned long long>(s.pollRounds), static_cast<unsigned long long>(s.acceptBackoffs),
                    static_cast<unsigned long long>(s.evicted));
    } catch (const std::exception& e) {
      std::snprintf(report, sizeof(report), "error %s", e.what());
      rc = 1;
    }
    (void)::write(resultPipe[1], report, std::strlen(report));
    ::close(resultPipe[1]);
    if (freer.joinable()) freer.detach();  // done, or waiting for a signal that did not come
    ::_exit(rc);
  }
  ::close(errPipe[1]);
  ::close(goPipe[0]);
  ::close(resultPipe[1]);

  std::vector<int> idle;
  if (idleFirst) {
    for (int i = 0; i < 10; ++i) {
      const int fd = test::connectLoopback(ports[0]);
      ASSERT_GE(fd, 0);
      idle.push_back(fd);
    }
  }
  std::atomic<int> good{0};
  int kind = 0;
  std::string message;
  std::thread rank1([&] {
    try {
      Config c = test::makeConfig(1, 2, ports, Topology{});
      c.transport = "tcp";
      Context ctx(std::move(c));
      checkedAllReduce(&good)(ctx);
    } catch (const Error& e) {
      kind = static_cast<int>(e.kind());
      message = e.what();
    }
  });
  // Read the child's log; in the first scenario, free its descriptors after six refused accepts.
  std::string log;
  int emfile = 0;
  bool sent = false;
  for (;;) {
    char buf[4096];
    const ssize_t got = ::read(errPipe[0], buf, sizeof(buf));
    if (got <= 0) break;
    log.append(buf, static_cast<size_t>(got));
    emfile = 0;
    for (size_t at = log.find("Too many open files"); at != std::string::npos;
         at = log.find("Too many open files", at + 1)) {
      ++emfile;
    }
    if (!idleFirst && !sent && emfile >= 6) {
      sent = ::write(goPipe[1], "g", 1) == 1;
    }
  }
  ::close(goPipe[1]);
  ::close(errPipe[0]);
  rank1.join();
  std::string result;
  char buf[512];
  for (ssize_t got; (got = ::read(resultPipe[0], buf, sizeof(buf))) > 0;) result.append(buf, static_cast<size_t>(got));
  ::close(resultPipe[0]);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  for (int fd : idle) ::close(fd);
  ASSERT_TRUE(WIFEXITED(status)) << "the rank died: " << log;
  ASSERT_EQ(WEXITSTATUS(status), 0) << result << "\n" << log;
  EXPECT_EQ(kind, 0) << message;
  EXPECT_EQ(good.load(), 1);
  int right = 0;
  double cpu = 0, wall = 0;
  unsigned long long rounds = 0, backoffs = 0, evicted = 0;
  ASSERT_EQ(std::sscanf(result.c_str(), "%d %lf %lf %llu %llu %llu", &right, &cpu, &wall, &rounds, &backoffs, &evicted),
            6)
      << result;
  EXPECT_EQ(right, 1);
  EXPECT_GE(backoffs, idleFirst ? 1u : 6u) << log;
  EXPECT_GE(emfile, 1) << "accept never failed: the scenario did not happen\n" << log;
  if (idleFirst) {
    EXPECT_GE(evicted, 1u) << "the oldest pending handshake is dropped to free a descriptor";
  }
  // Spinning on a listener that cannot be accepted from burns the whole wall time in CPU.
  EXPECT_LT(cpu, 0.25 * wall + 0.05) << "cpu " << cpu << " s of " << wall << " s connecting";
  EXPECT_LT(rounds, 40 * wall + 60) << rounds << " poll rounds in " << wall << " s";
  std::printf("    EMFILE (%s): %d refused accepts logged, %llu backoffs, %llu dropped, %.3f s CPU in %.3f s, "
              "%llu poll rounds\n",
              idleFirst ? "idle connections first" : "descriptors freed later", emfile, backoffs, evicted, cpu, wall,
              rounds);
}

TEST(ConnectPhase, OutOfDescriptorsTheRankBacksOffAndFormsOnceFreed) { emfileScenario(false); }

TEST(ConnectPhase, OutOfDescriptorsTheRankDropsTheOldestIdleHandshake) { emfileScenario(true); }
#endif

}  // namespace
}  // namespace meshccl
