// Fuzz target: every byte a process on a rank's planned port can answer a connecting rank with
// (a squatter, another program, another job), fed to the connector's side of the handshake
// (see targets.h for the input layout).

#include <string_view>
#include <vector>

#include "fuzz_util.h"
#include "meshccl/handshake.h"
#include "targets.h"

namespace meshccl::fuzz {

namespace {

namespace hs = handshake;

constexpr std::string_view kToken = "fuzz-job-token-9d2c41";
constexpr std::string_view kJob = "fuzz-job";
constexpr uint32_t kMe = 2;
constexpr uint32_t kPeer = 1;
constexpr uint32_t kSize = 4;
constexpr uint32_t kIndex = 1;
constexpr uint32_t kCount = 2;

hs::Binding bindingFor(const hs::Nonce& nonceC, const hs::Nonce& nonceA) {
  hs::Binding b;
  b.jobId = kJob;
  b.nonceC = nonceC;
  b.nonceA = nonceA;
  b.connectorRank = kMe;
  b.acceptorRank = kPeer;
  b.size = kSize;
  b.connIndex = kIndex;
  b.connCount = kCount;
  return b;
}

}  // namespace

int connectorTarget(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const bool honest = (data[0] & 1) != 0;
  Chunker chunks(static_cast<uint8_t>(data[0] >> 2));
  hs::Nonce nonceC;
  nonceC.fill(0x3c);
  hs::Connector c(kToken, kJob, kMe, kPeer, kSize, kIndex, kCount, nonceC);
  std::vector<uint8_t> sent = c.takeOutput();
  MESHCCL_FUZZ_CHECK(sent.size() == hs::kHelloBytes);
  const hs::Hello hello = hs::parseHello(sent.data());
  MESHCCL_FUZZ_CHECK(hello.magic == hs::kMagic && hello.version == hs::kVersion && hello.rank == kMe &&
                     hello.size == kSize && hello.connIndex == kIndex && hello.connCount == kCount &&
                     hello.nonce == nonceC);
  std::vector<uint8_t> received;  // what the connector consumed, in order
  bool oracleUsed = false;
  size_t at = 1;

  auto collect = [&] {
    const auto out = c.takeOutput();
    sent.insert(sent.end(), out.begin(), out.end());
  };

  for (int guard = 0; guard < 1 << 20; ++guard) {
    if (honest && !oracleUsed && c.state() == hs::Connector::State::kVerdictMac && c.need() == crypto::kMacBytes) {
      // The honest acceptor's proof, over the nonce the (fuzzed) challenge carried.
      MESHCCL_FUZZ_CHECK(received.size() == hs::kChallengeBytes + hs::kStatusBytes);
      const hs::Challenge ch = hs::parseChallenge(received.data());
      const crypto::Mac mac = hs::acceptorMac(kToken, bindingFor(nonceC, ch.nonce));
      oracleUsed = true;
      for (size_t i = 0; i < mac.size();) {
        const size_t n = chunks.next(mac.size() - i);
        MESHCCL_FUZZ_CHECK(c.feed(mac.data() + i, n) == n);
        received.insert(received.end(), mac.data() + i, mac.data() + i + n);
        i += n;
        collect();
      }
      at += std::min(mac.size(), size - at);
      continue;
    }
    if (at >= size) break;
    size_t n = chunks.next(size - at);
    if (honest && !oracleUsed && c.need() > 0) n = std::min(n, c.need());  // stop where the mac is due
    const size_t need = c.need();
    const size_t took = c.feed(data + at, n);
    MESHCCL_FUZZ_CHECK(took <= n);
    MESHCCL_FUZZ_CHECK(need > 0 || took == 0);
    if (took < n) MESHCCL_FUZZ_CHECK(c.need() == 0);
    received.insert(received.end(), data + at, data + at + took);
    at += n;
    collect();
  }

  MESHCCL_FUZZ_CHECK(!containsBytes(sent, kToken));
  using S = hs::Connector::State;
  using F = hs::Connector::Failure;
  const bool challengeOk = received.size() >= hs::kChallengeBytes && hs::parseChallenge(received.data()).status == 0 &&
                           hs::parseChallenge(received.data()).magic == hs::kMagic &&
                           hs::parseChallenge(received.data()).version == hs::kVersion &&
                           hs::parseChallenge(received.data()).flags == 0 &&
                           hs::parseChallenge(received.data()).rank == kPeer;
  // The proof goes out only after a well-formed "go on" from the right rank, and it is the right one.
  if (sent.size() > hs::kHelloBytes) {
    MESHCCL_FUZZ_CHECK(challengeOk);
    MESHCCL_FUZZ_CHECK(sent.size() == hs::kHelloBytes + hs::kProofBytes);
    const crypto::Mac proof = hs::connectorMac(kToken, bindingFor(nonceC, hs::parseChallenge(received.data()).nonce));
    MESHCCL_FUZZ_CHECK(std::equal(proof.begin(), proof.end(), sent.begin() + hs::kHelloBytes));
  }
  switch (c.state()) {
    case S::kChallengeStatus:
    case S::kChallengeRest:
      MESHCCL_FUZZ_CHECK(sent.size() == hs::kHelloBytes);
      break;
    case S::kVerdictStatus:
    case S::kVerdictMac:
      MESHCCL_FUZZ_CHECK(sent.size() == hs::kHelloBytes + hs::kProofBytes);
      break;
    case S::kDone:
      MESHCCL_FUZZ_CHECK(oracleUsed);  // no fuzzed bytes make a proof the connector accepts
      MESHCCL_FUZZ_CHECK(received.size() == hs::kChallengeBytes + hs::kVerdictBytes);
      MESHCCL_FUZZ_CHECK(hs::parseVerdict(received.data() + hs::kChallengeBytes).status == 0);
      break;
    case S::kFailed:
      switch (c.failure()) {
        case F::kNone:
          MESHCCL_FUZZ_CHECK(false);
          break;
        case F::kRefused:
          MESHCCL_FUZZ_CHECK(c.status() != 0);
          MESHCCL_FUZZ_CHECK(received.size() == (c.inVerdict() ? hs::kChallengeBytes + hs::kStatusBytes
                                                                 : hs::kStatusBytes));
          break;
        case F::kNotMeshccl:
        case F::kWrongRank:
          MESHCCL_FUZZ_CHECK(!challengeOk);
          MESHCCL_FUZZ_CHECK(received.size() == hs::kChallengeBytes);
          break;
        case F::kForged:
          MESHCCL_FUZZ_CHECK(!oracleUsed);
          MESHCCL_FUZZ_CHECK(received.size() == hs::kChallengeBytes + hs::kVerdictBytes);
          break;
      }
      break;
  }
  return 0;
}

}  // namespace meshccl::fuzz

#if defined(MESHCCL_LIBFUZZER)
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return meshccl::fuzz::connectorTarget(data, size);
}
#endif
