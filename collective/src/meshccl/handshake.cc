#include "meshccl/handshake.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "meshccl/error.h"

namespace meshccl::handshake {

namespace {

constexpr std::string_view kConnectLabel = "meshccl/2 connect";
constexpr std::string_view kAcceptLabel = "meshccl/2 accept";

void put16(uint8_t* p, uint16_t v) {
  p[0] = static_cast<uint8_t>(v);
  p[1] = static_cast<uint8_t>(v >> 8);
}

void put32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}

uint16_t get16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }

uint32_t get32(const uint8_t* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

void append32(std::vector<uint8_t>& out, uint32_t v) {
  uint8_t b[4];
  put32(b, v);
  out.insert(out.end(), b, b + 4);
}

template <size_t N>
void append(std::vector<uint8_t>& out, const std::array<uint8_t, N>& a) {
  out.insert(out.end(), a.begin(), a.end());
}

}  // namespace

std::string statusName(uint32_t status) {
  switch (static_cast<Status>(status)) {
    case Status::kOk: return "ok";
    case Status::kBadToken: return "bad-token";
    case Status::kBadRank: return "bad-rank";
    case Status::kDuplicate: return "duplicate";
    case Status::kBadVersion: return "bad-version";
  }
  return cat("unknown status ", status);
}

Nonce freshNonce() {
  Nonce n{};
  crypto::randomBytes(n.data(), n.size());
  return n;
}

std::array<uint8_t, kHelloBytes> encodeHello(const Hello& h) {
  std::array<uint8_t, kHelloBytes> b{};
  put32(&b[0], h.magic);
  put16(&b[4], h.version);
  put16(&b[6], h.flags);
  put32(&b[8], h.rank);
  put32(&b[12], h.size);
  put32(&b[16], h.connIndex);
  put32(&b[20], h.connCount);
  std::memcpy(&b[24], h.nonce.data(), kNonceBytes);
  return b;
}

Hello parseHello(const uint8_t* p) {
  Hello h;
  h.magic = get32(p);
  h.version = get16(p + 4);
  h.flags = get16(p + 6);
  h.rank = get32(p + 8);
  h.size = get32(p + 12);
  h.connIndex = get32(p + 16);
  h.connCount = get32(p + 20);
  std::memcpy(h.nonce.data(), p + 24, kNonceBytes);
  return h;
}

std::array<uint8_t, kChallengeBytes> encodeChallenge(const Challenge& c) {
  std::array<uint8_t, kChallengeBytes> b{};
  put32(&b[0], c.status);
  put32(&b[4], c.magic);
  put16(&b[8], c.version);
  put16(&b[10], c.flags);
  put32(&b[12], c.rank);
  std::memcpy(&b[16], c.nonce.data(), kNonceBytes);
  return b;
}

Challenge parseChallenge(const uint8_t* p) {
  Challenge c;
  c.status = get32(p);
  c.magic = get32(p + 4);
  c.version = get16(p + 8);
  c.flags = get16(p + 10);
  c.rank = get32(p + 12);
  std::memcpy(c.nonce.data(), p + 16, kNonceBytes);
  return c;
}

std::array<uint8_t, kVerdictBytes> encodeVerdict(const Verdict& v) {
  std::array<uint8_t, kVerdictBytes> b{};
  put32(&b[0], v.status);
  std::memcpy(&b[4], v.mac.data(), v.mac.size());
  return b;
}

Verdict parseVerdict(const uint8_t* p) {
  Verdict v;
  v.status = get32(p);
  std::memcpy(v.mac.data(), p + 4, v.mac.size());
  return v;
}

std::vector<uint8_t> macInput(std::string_view label, const Binding& b) {
  std::vector<uint8_t> m;
  m.reserve(label.size() + 4 + b.jobId.size() + 2 * kNonceBytes + 5 * 4);
  m.insert(m.end(), label.begin(), label.end());
  append32(m, static_cast<uint32_t>(b.jobId.size()));
  m.insert(m.end(), b.jobId.begin(), b.jobId.end());
  append(m, b.nonceC);
  append(m, b.nonceA);
  append32(m, b.connectorRank);
  append32(m, b.acceptorRank);
  append32(m, b.size);
  append32(m, b.connIndex);
  append32(m, b.connCount);
  return m;
}

crypto::Mac connectorMac(std::string_view token, const Binding& b) {
  const auto m = macInput(kConnectLabel, b);
  return crypto::hmacSha256(token.data(), token.size(), m.data(), m.size());
}

crypto::Mac acceptorMac(std::string_view token, const Binding& b) {
  const auto m = macInput(kAcceptLabel, b);
  return crypto::hmacSha256(token.data(), token.size(), m.data(), m.size());
}

// --- acceptor ------------------------------------------------------------------------------

Acceptor::Acceptor(uint32_t myRank, uint32_t size, std::string_view token, std::string_view jobId,
                   std::vector<uint32_t> expectedConns, const Nonce& nonceA)
    : me_(myRank), size_(size), token_(token), jobId_(jobId), expected_(std::move(expectedConns)), nonceA_(nonceA) {}

size_t Acceptor::need() const {
  switch (state_) {
    case State::kHelloHead: return kHelloHeadBytes - got_;
    case State::kHelloRest: return kHelloBytes - got_;
    case State::kProof: return kProofBytes - got_;
    default: return 0;
  }
}

std::vector<uint8_t> Acceptor::takeOutput() { return std::exchange(out_, {}); }

void Acceptor::reject(Status status, std::string why, bool challengePhase) {
  refusal_ = status;
  reason_ = std::move(why);
  state_ = State::kRejected;
  if (challengePhase) {
    Challenge c;
    c.status = static_cast<uint32_t>(status);
    c.rank = me_;
    const auto b = encodeChallenge(c);
    out_.insert(out_.end(), b.begin(), b.end());
  } else {
    Verdict v;
    v.status = static_cast<uint32_t>(status);
    const auto b = encodeVerdict(v);
    out_.insert(out_.end(), b.begin(), b.end());
  }
}

size_t Acceptor::feed(const uint8_t* data, size_t len) {
  size_t total = 0;
  while (total < len) {
    const size_t took = step(data + total, len - total);
    if (took == 0) break;
    total += took;
  }
  return total;
}

size_t Acceptor::step(const uint8_t* data, size_t len) {
  const size_t take = std::min(len, need());
  if (take == 0) return 0;
  std::memcpy(buf_.data() + got_, data, take);
  got_ += take;
  if (need() > 0) return take;
  switch (state_) {
    case State::kHelloHead: {
      const uint32_t magic = get32(buf_.data());
      const uint16_t version = get16(buf_.data() + 4);
      if (magic != kMagic) {
        reject(Status::kBadVersion, "not a meshccl connection (no meshccl hello)", true);
      } else if (version != kVersion) {
        reject(Status::kBadVersion, cat("meshccl protocol version ", version, ", this rank speaks ", kVersion), true);
      } else {
        state_ = State::kHelloRest;
      }
      break;
    }
    case State::kHelloRest: {
      hello_ = parseHello(buf_.data());
      helloParsed_ = true;
      got_ = 0;
      const Hello& h = hello_;
      const std::string claim =
          cat("rank ", h.rank, " of a world of ", h.size, " (connection ", h.connIndex, " of ", h.connCount, ")");
      if (h.flags != 0) {
        reject(Status::kBadVersion, cat("unknown hello flags ", h.flags), true);
      } else if (h.size != size_) {
        reject(Status::kBadRank, cat(claim, ": this job has ", size_, " ranks (do the hostfiles differ?)"), true);
      } else if (h.rank >= size_ || h.rank == me_ || expected_.size() != size_ || expected_[h.rank] == 0) {
        reject(Status::kBadRank, cat(claim, ": that rank does not connect to rank ", me_, " (do the hostfiles differ?)"),
               true);
      } else if (h.connCount != expected_[h.rank] || h.connIndex >= h.connCount) {
        reject(Status::kBadRank,
               cat(claim, ": rank ", me_, " expects ", expected_[h.rank], " connection(s) from it (do the hostfiles "
                   "or connections per link differ?)"),
               true);
      } else {
        Challenge c;
        c.status = static_cast<uint32_t>(Status::kOk);
        c.rank = me_;
        c.nonce = nonceA_;
        const auto b = encodeChallenge(c);
        out_.insert(out_.end(), b.begin(), b.end());
        state_ = State::kProof;
      }
      break;
    }
    case State::kProof: {
      const crypto::Mac want = connectorMac(token_, binding());
      got_ = 0;
      if (crypto::equalConstantTime(want.data(), buf_.data(), kProofBytes)) {
        state_ = State::kProven;
      } else {
        reject(Status::kBadToken,
               cat("claims to be rank ", hello_.rank, " but could not prove the job token (another job, a different "
                   "MESHCCL_TOKEN or job id, or a stranger)"),
               false);
      }
      break;
    }
    default:
      break;
  }
  return take;
}

Binding Acceptor::binding() const {
  Binding b;
  b.jobId = jobId_;
  b.nonceC = hello_.nonce;
  b.nonceA = nonceA_;
  b.connectorRank = hello_.rank;
  b.acceptorRank = me_;
  b.size = size_;
  b.connIndex = hello_.connIndex;
  b.connCount = hello_.connCount;
  return b;
}

void Acceptor::accept() {
  if (state_ != State::kProven) return;
  Verdict v;
  v.status = static_cast<uint32_t>(Status::kOk);
  v.mac = acceptorMac(token_, binding());
  const auto bytes = encodeVerdict(v);
  out_.insert(out_.end(), bytes.begin(), bytes.end());
  state_ = State::kDone;
}

void Acceptor::refuseDuplicate() {
  if (state_ != State::kProven) return;
  reject(Status::kDuplicate,
         cat("rank ", hello_.rank, " proved the token but its connection ", hello_.connIndex,
             " is already established (a second claim of the same connection)"),
         false);
}

// --- connector -----------------------------------------------------------------------------

Connector::Connector(std::string_view token, std::string_view jobId, uint32_t myRank, uint32_t peerRank, uint32_t size,
                     uint32_t connIndex, uint32_t connCount, const Nonce& nonceC)
    : token_(token) {
  binding_.jobId = jobId;
  binding_.nonceC = nonceC;
  binding_.connectorRank = myRank;
  binding_.acceptorRank = peerRank;
  binding_.size = size;
  binding_.connIndex = connIndex;
  binding_.connCount = connCount;
  Hello h;
  h.rank = myRank;
  h.size = size;
  h.connIndex = connIndex;
  h.connCount = connCount;
  h.nonce = nonceC;
  const auto b = encodeHello(h);
  out_.assign(b.begin(), b.end());
}

size_t Connector::need() const {
  switch (state_) {
    case State::kChallengeStatus: return kStatusBytes - got_;
    case State::kChallengeRest: return kChallengeBytes - got_;
    case State::kVerdictStatus: return kStatusBytes - got_;
    case State::kVerdictMac: return kVerdictBytes - got_;
    default: return 0;
  }
}

std::vector<uint8_t> Connector::takeOutput() { return std::exchange(out_, {}); }

size_t Connector::feed(const uint8_t* data, size_t len) {
  size_t total = 0;
  while (total < len) {
    const size_t took = step(data + total, len - total);
    if (took == 0) break;
    total += took;
  }
  return total;
}

size_t Connector::step(const uint8_t* data, size_t len) {
  const size_t take = std::min(len, need());
  if (take == 0) return 0;
  std::memcpy(buf_.data() + got_, data, take);
  got_ += take;
  if (need() > 0) return take;
  switch (state_) {
    case State::kChallengeStatus:
    case State::kVerdictStatus: {
      status_ = get32(buf_.data());
      inVerdict_ = state_ == State::kVerdictStatus;
      if (status_ != static_cast<uint32_t>(Status::kOk)) {
        fail(Failure::kRefused);
      } else {
        state_ = inVerdict_ ? State::kVerdictMac : State::kChallengeRest;
      }
      break;
    }
    case State::kChallengeRest: {
      const Challenge c = parseChallenge(buf_.data());
      got_ = 0;
      peerVersion_ = c.version;
      claimedRank_ = c.rank;
      if (c.magic != kMagic || c.version != kVersion || c.flags != 0) {
        fail(Failure::kNotMeshccl);
      } else if (c.rank != binding_.acceptorRank) {
        fail(Failure::kWrongRank);
      } else {
        binding_.nonceA = c.nonce;
        const crypto::Mac proof = connectorMac(token_, binding_);
        out_.assign(proof.begin(), proof.end());
        state_ = State::kVerdictStatus;
      }
      break;
    }
    case State::kVerdictMac: {
      const Verdict v = parseVerdict(buf_.data());
      got_ = 0;
      const crypto::Mac want = acceptorMac(token_, binding_);
      if (crypto::equalConstantTime(want.data(), v.mac.data(), want.size())) {
        state_ = State::kDone;
      } else {
        fail(Failure::kForged);
      }
      break;
    }
    default:
      break;
  }
  return take;
}

// --- rejection log limit -------------------------------------------------------------------

void LogLimiter::roll(double now) {
  if (start_ < 0 || now >= start_ + window_) {
    ended_ += suppressed_;
    suppressed_ = 0;
    lines_ = 0;
    start_ = now;
  }
}

bool LogLimiter::admit(double now) {
  roll(now);
  if (lines_ < max_) {
    ++lines_;
    return true;
  }
  ++suppressed_;
  return false;
}

size_t LogLimiter::takeSuppressed(double now, bool flush) {
  if (start_ >= 0 && now >= start_ + window_) roll(now);
  if (flush) {
    ended_ += suppressed_;
    suppressed_ = 0;
  }
  return std::exchange(ended_, 0);
}

}  // namespace meshccl::handshake
