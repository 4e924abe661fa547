#pragma once

// meshccl's connect handshake, protocol version 2: mutual challenge-response on the job token.
// The token is never sent; each side proves it knows it with an HMAC-SHA256 over both sides'
// fresh nonces, the job id, both ranks and the connection's place, so a proof is good for this
// one connection only (no replay, no reflection, no reuse by another job or another rank).
//
//   connector -> acceptor  HELLO      magic "MCCL", version, rank, size, connIndex, connCount, nonceC
//   acceptor -> connector  CHALLENGE  status (kOk, or why the connection is refused), magic, version,
//                                     the acceptor's rank, nonceA
//   connector -> acceptor  PROOF      macC = HMAC(token, "meshccl/2 connect" || binding)
//   acceptor -> connector  VERDICT    status (kOk / kBadToken / kDuplicate), macA = HMAC(token,
//                                     "meshccl/2 accept" || binding) (zeros unless kOk)
//
//   binding = u32 len(jobId) || jobId || nonceC || nonceA || connector rank || acceptor rank ||
//             size || connIndex || connCount           (integers little-endian u32)
//
// Every message has a fixed size and is written byte by byte, little-endian. The first six
// bytes of HELLO (magic, version) are where version 1 had them, and CHALLENGE and VERDICT start
// with the 4-byte status version 1 answered with: a version-1 rank and a version-2 rank each
// tell the other "another protocol version" instead of waiting for bytes that never come.
//
// The two sides are pure state machines (no sockets, no clock, no exceptions on any input): the
// connect phase moves their bytes, the tests and the fuzzers feed them directly.

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "meshccl/crypto.h"
#include "meshccl/frame.h"

namespace meshccl::handshake {

constexpr uint32_t kMagic = 0x4d43434cu;  // "MCCL" (bytes 4c 43 43 4d on the wire)
constexpr uint16_t kVersion = kProtocolVersion;  // 2
constexpr size_t kNonceBytes = 32;
constexpr size_t kStatusBytes = 4;
constexpr size_t kHelloHeadBytes = 6;  // magic + version: judged before the rest is awaited
constexpr size_t kHelloBytes = 56;
constexpr size_t kChallengeBytes = 48;
constexpr size_t kProofBytes = crypto::kMacBytes;
constexpr size_t kVerdictBytes = kStatusBytes + crypto::kMacBytes;

enum class Status : uint32_t { kOk = 0, kBadToken = 1, kBadRank = 2, kDuplicate = 3, kBadVersion = 4 };
// "ok", "bad-token", ..., or "unknown status N" for anything else.
std::string statusName(uint32_t status);

using Nonce = std::array<uint8_t, kNonceBytes>;
Nonce freshNonce();  // from crypto::randomBytes

struct Hello {
  uint32_t magic = kMagic;
  uint16_t version = kVersion;
  uint16_t flags = 0;  // reserved, 0
  uint32_t rank = 0;
  uint32_t size = 0;
  uint32_t connIndex = 0;
  uint32_t connCount = 0;
  Nonce nonce{};
};

struct Challenge {
  uint32_t status = 0;
  uint32_t magic = kMagic;
  uint16_t version = kVersion;
  uint16_t flags = 0;
  uint32_t rank = 0;  // the acceptor's rank
  Nonce nonce{};
};

struct Verdict {
  uint32_t status = 0;
  crypto::Mac mac{};
};

std::array<uint8_t, kHelloBytes> encodeHello(const Hello& h);
Hello parseHello(const uint8_t* bytes);  // exactly kHelloBytes
std::array<uint8_t, kChallengeBytes> encodeChallenge(const Challenge& c);
Challenge parseChallenge(const uint8_t* bytes);  // exactly kChallengeBytes
std::array<uint8_t, kVerdictBytes> encodeVerdict(const Verdict& v);
Verdict parseVerdict(const uint8_t* bytes);  // exactly kVerdictBytes

// What both proofs are computed over.
struct Binding {
  std::string_view jobId;
  Nonce nonceC{};
  Nonce nonceA{};
  uint32_t connectorRank = 0;
  uint32_t acceptorRank = 0;
  uint32_t size = 0;
  uint32_t connIndex = 0;
  uint32_t connCount = 0;
};

// label || binding, as MACed.
std::vector<uint8_t> macInput(std::string_view label, const Binding& b);
crypto::Mac connectorMac(std::string_view token, const Binding& b);  // label "meshccl/2 connect"
crypto::Mac acceptorMac(std::string_view token, const Binding& b);   // label "meshccl/2 accept"

// The acceptor's side of one incoming connection. Feed it the bytes read from the socket (read
// no more than need(): what follows the handshake is the job's data); send what takeOutput()
// gives after every feed. Never throws on any input.
class Acceptor {
 public:
  enum class State {
    kHelloHead,  // awaiting magic + version
    kHelloRest,  // awaiting the rest of HELLO
    kProof,      // CHALLENGE is out, awaiting PROOF
    kProven,     // the peer proved the token: the caller accept()s or refuseDuplicate()s
    kDone,       // VERDICT ok is out: the connection belongs to the job
    kRejected,   // the refusal is out (or nothing is to be sent): close the connection
  };

  // expectedConns[r]: how many connections rank r opens to this rank (0: none). A copy is kept.
  Acceptor(uint32_t myRank, uint32_t size, std::string_view token, std::string_view jobId,
           std::vector<uint32_t> expectedConns, const Nonce& nonceA);

  size_t need() const;  // bytes wanted before the next step (0 when none)
  // Consumes as much of data as the handshake still expects (across messages), never more;
  // returns how many bytes it took. A socket reader asks for need() bytes at a time, so that it
  // never reads into the job's data that follows the handshake.
  size_t feed(const uint8_t* data, size_t len);
  std::vector<uint8_t> takeOutput();

  void accept();           // kProven -> kDone (VERDICT ok with this side's proof)
  void refuseDuplicate();  // kProven -> kRejected (the slot is taken by an earlier proven connection)

  State state() const { return state_; }
  const Hello& hello() const { return hello_; }  // meaningful from kProof on
  bool helloParsed() const { return helloParsed_; }
  Status refusal() const { return refusal_; }  // kRejected: the status sent
  const std::string& reason() const { return reason_; }  // kRejected: why, for the log (no secret in it)

 private:
  Binding binding() const;  // this connection's, from kProof on
  void reject(Status status, std::string why, bool challengePhase);
  size_t step(const uint8_t* data, size_t len);  // up to the end of the current message

  uint32_t me_;
  uint32_t size_;
  std::string_view token_;
  std::string_view jobId_;
  std::vector<uint32_t> expected_;
  Nonce nonceA_;
  State state_ = State::kHelloHead;
  std::array<uint8_t, kHelloBytes> buf_{};
  size_t got_ = 0;
  Hello hello_{};
  bool helloParsed_ = false;
  Status refusal_ = Status::kOk;
  std::string reason_;
  std::vector<uint8_t> out_;
};

// The connector's side of one outgoing connection. takeOutput() first gives HELLO; feed what
// the acceptor answers (no more than need()); after CHALLENGE it gives PROOF. Never throws on
// any input.
class Connector {
 public:
  enum class State {
    kChallengeStatus,  // awaiting CHALLENGE's status
    kChallengeRest,    // awaiting the rest of CHALLENGE
    kVerdictStatus,    // PROOF is out, awaiting VERDICT's status
    kVerdictMac,       // awaiting the acceptor's proof
    kDone,             // both sides proved the token
    kFailed,           // see failure()
  };
  enum class Failure {
    kNone,
    kRefused,     // the acceptor answered a status other than ok (status(), inVerdict())
    kNotMeshccl,  // CHALLENGE said ok but is not a meshccl version-2 challenge
    kWrongRank,   // the acceptor says it is another rank (claimedRank())
    kForged,      // VERDICT ok, but the acceptor's proof is wrong: it does not know the token
  };

  Connector(std::string_view token, std::string_view jobId, uint32_t myRank, uint32_t peerRank, uint32_t size,
            uint32_t connIndex, uint32_t connCount, const Nonce& nonceC);

  size_t need() const;
  size_t feed(const uint8_t* data, size_t len);  // as Acceptor::feed
  std::vector<uint8_t> takeOutput();

  State state() const { return state_; }
  Failure failure() const { return failure_; }
  uint32_t status() const { return status_; }
  bool inVerdict() const { return inVerdict_; }  // kRefused: the refusal came as VERDICT (after PROOF)
  uint32_t claimedRank() const { return claimedRank_; }
  uint16_t peerVersion() const { return peerVersion_; }  // kNotMeshccl: the version the peer named

 private:
  size_t step(const uint8_t* data, size_t len);
  void fail(Failure f) {
    failure_ = f;
    state_ = State::kFailed;
  }

  std::string_view token_;
  Binding binding_;
  State state_ = State::kChallengeStatus;
  std::array<uint8_t, kChallengeBytes> buf_{};
  size_t got_ = 0;
  Failure failure_ = Failure::kNone;
  uint32_t status_ = 0;
  bool inVerdict_ = false;
  uint32_t claimedRank_ = 0;
  uint16_t peerVersion_ = 0;
  std::vector<uint8_t> out_;
};

// Rate limit for rejection lines: at most maxLines per window; the rest are counted and
// reported as one line once the window has passed.
class LogLimiter {
 public:
  explicit LogLimiter(size_t maxLines = 10, double windowSeconds = 10.0) : max_(maxLines), window_(windowSeconds) {}
  // True: write the line now. False: it is counted instead.
  bool admit(double now);
  // Lines counted (not written) in a window that has ended by `now` (every one with flush);
  // the count starts again at zero.
  size_t takeSuppressed(double now, bool flush = false);

 private:
  void roll(double now);
  size_t max_;
  double window_;
  double start_ = -1;
  size_t lines_ = 0;
  size_t suppressed_ = 0;  // in the current window
  size_t ended_ = 0;       // in windows that have ended, not yet reported
};

}  // namespace meshccl::handshake
