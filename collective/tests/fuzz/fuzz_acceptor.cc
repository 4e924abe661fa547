// Fuzz target: every byte a stranger can send to a rank's listener before it is authenticated,
// fed to the acceptor's side of the handshake (see targets.h for the input layout).

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
constexpr uint32_t kMe = 1;
constexpr uint32_t kSize = 4;

hs::Binding bindingFor(const hs::Hello& h, const hs::Nonce& nonceA) {
  hs::Binding b;
  b.jobId = kJob;
  b.nonceC = h.nonce;
  b.nonceA = nonceA;
  b.connectorRank = h.rank;
  b.acceptorRank = kMe;
  b.size = kSize;
  b.connIndex = h.connIndex;
  b.connCount = h.connCount;
  return b;
}

}  // namespace

int acceptorTarget(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const bool honest = (data[0] & 1) != 0;
  const bool taken = (data[0] & 2) != 0;
  Chunker chunks(static_cast<uint8_t>(data[0] >> 2));
  hs::Nonce nonceA;
  nonceA.fill(0xa5);
  // Rank 1 of 4 accepts 2 connections from rank 2 and 1 from rank 3.
  hs::Acceptor a(kMe, kSize, kToken, kJob, {0, 0, 2, 1}, nonceA);
  std::vector<uint8_t> sent;
  bool oracleUsed = false;
  size_t at = 1;

  auto afterFeed = [&] {
    const auto out = a.takeOutput();
    sent.insert(sent.end(), out.begin(), out.end());
    if (a.state() == hs::Acceptor::State::kProven) {
      MESHCCL_FUZZ_CHECK(oracleUsed);  // nothing but the right proof gets here
      if (taken) {
        a.refuseDuplicate();
      } else {
        a.accept();
      }
      const auto verdict = a.takeOutput();
      sent.insert(sent.end(), verdict.begin(), verdict.end());
    }
  };

  for (int guard = 0; guard < 1 << 20; ++guard) {
    if (honest && !oracleUsed && a.state() == hs::Acceptor::State::kProof && a.need() == hs::kProofBytes) {
      // The honest connector's proof, in chunks, in place of the next 32 input bytes.
      const crypto::Mac proof = hs::connectorMac(kToken, bindingFor(a.hello(), nonceA));
      oracleUsed = true;
      for (size_t i = 0; i < proof.size();) {
        const size_t n = chunks.next(proof.size() - i);
        MESHCCL_FUZZ_CHECK(a.feed(proof.data() + i, n) == n);
        i += n;
        afterFeed();
      }
      at += std::min(proof.size(), size - at);
      continue;
    }
    if (at >= size) break;
    size_t n = chunks.next(size - at);
    if (honest && !oracleUsed && a.need() > 0) n = std::min(n, a.need());  // stop where the proof is due
    const size_t need = a.need();
    const size_t took = a.feed(data + at, n);
    MESHCCL_FUZZ_CHECK(took <= n);
    MESHCCL_FUZZ_CHECK(need > 0 || took == 0);  // a finished machine takes nothing
    if (took < n) MESHCCL_FUZZ_CHECK(a.need() == 0);
    at += n;  // bytes past the handshake are the job's (or garbage after a refusal): not the machine's
    afterFeed();
  }

  // What went out must be exactly the protocol's messages, in order, and never the token.
  MESHCCL_FUZZ_CHECK(!containsBytes(sent, kToken));
  using S = hs::Acceptor::State;
  switch (a.state()) {
    case S::kHelloHead:
    case S::kHelloRest:
      MESHCCL_FUZZ_CHECK(sent.empty());
      break;
    case S::kProof:
      MESHCCL_FUZZ_CHECK(sent.size() == hs::kChallengeBytes);
      MESHCCL_FUZZ_CHECK(hs::parseChallenge(sent.data()).status == 0);
      MESHCCL_FUZZ_CHECK(hs::parseChallenge(sent.data()).nonce == nonceA);
      break;
    case S::kProven:
      MESHCCL_FUZZ_CHECK(false);  // always decided by afterFeed
      break;
    case S::kDone: {
      MESHCCL_FUZZ_CHECK(oracleUsed && !taken);
      MESHCCL_FUZZ_CHECK(sent.size() == hs::kChallengeBytes + hs::kVerdictBytes);
      const hs::Verdict v = hs::parseVerdict(sent.data() + hs::kChallengeBytes);
      MESHCCL_FUZZ_CHECK(v.status == 0);
      MESHCCL_FUZZ_CHECK(v.mac == hs::acceptorMac(kToken, bindingFor(a.hello(), nonceA)));
      const hs::Hello& h = a.hello();
      MESHCCL_FUZZ_CHECK(h.size == kSize && (h.rank == 2 || h.rank == 3) && h.connIndex < h.connCount);
      MESHCCL_FUZZ_CHECK(h.connCount == (h.rank == 2 ? 2u : 1u));
      break;
    }
    case S::kRejected: {
      MESHCCL_FUZZ_CHECK(a.refusal() != hs::Status::kOk);
      MESHCCL_FUZZ_CHECK(!a.reason().empty());
      MESHCCL_FUZZ_CHECK(a.reason().find(kToken) == std::string::npos);
      if (sent.size() == hs::kChallengeBytes) {  // refused at the hello
        const hs::Challenge c = hs::parseChallenge(sent.data());
        MESHCCL_FUZZ_CHECK(c.status == static_cast<uint32_t>(a.refusal()));
        MESHCCL_FUZZ_CHECK(c.nonce == hs::Nonce{});
      } else {  // refused at the proof: a wrong one, or a duplicate
        MESHCCL_FUZZ_CHECK(sent.size() == hs::kChallengeBytes + hs::kVerdictBytes);
        MESHCCL_FUZZ_CHECK(hs::parseChallenge(sent.data()).status == 0);
        const hs::Verdict v = hs::parseVerdict(sent.data() + hs::kChallengeBytes);
        MESHCCL_FUZZ_CHECK(v.status == static_cast<uint32_t>(a.refusal()));
        MESHCCL_FUZZ_CHECK(v.mac == crypto::Mac{});
        MESHCCL_FUZZ_CHECK(a.refusal() == (oracleUsed && taken ? hs::Status::kDuplicate : hs::Status::kBadToken));
      }
      break;
    }
  }
  return 0;
}

}  // namespace meshccl::fuzz

#if defined(MESHCCL_LIBFUZZER)
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return meshccl::fuzz::acceptorTarget(data, size);
}
#endif
