// The connect phase: every rank listens on its planned addresses only; the higher rank of each
// pair connects to the lower one, once per link and connection. Both ends of every connection
// prove they hold the job token without sending it (handshake.h: HMAC-SHA256 over both sides'
// fresh nonces, the job id, the ranks and the connection's place); a peer that cannot is
// dropped and logged, and the phase goes on. Connects are retried with backoff until the
// connect deadline, so ranks can start in any order.
//
// The accept side stays up whatever arrives: each pending handshake has a deadline and their
// number is capped (a new one drops the oldest); anything malformed is rejected, never thrown;
// accept() failing for want of descriptors pauses listening with a growing backoff (and drops
// the oldest pending handshake to free one) instead of spinning. Rejection lines are rate
// limited.

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <memory>

#include "meshccl/context.h"
#include "meshccl/handshake.h"
#include "meshccl/platform.h"

namespace meshccl {

namespace {

using handshake::Acceptor;
using handshake::Connector;

constexpr double kAcceptBackoffMin = 0.01;
constexpr double kAcceptBackoffMax = 1.0;
constexpr int kAcceptsPerRound = 64;  // per listener and poll round: a flood cannot starve the rest

struct Outgoing {
  int peer = -1;
  int index = 0;
  SockAddr addr;
  Fd fd;
  enum class State { kIdle, kConnecting, kHandshake, kDone } state = State::kIdle;
  double retryAt = 0;
  double backoff = 0.05;
  double attemptDeadline = 0;  // TCP connect + handshake of this attempt
  int attempts = 0;
  std::string lastError = "no attempt yet";
  std::unique_ptr<Connector> hs;
};

struct Incoming {
  Fd fd;
  std::string from;
  double deadline = 0;
  std::unique_ptr<Acceptor> hs;
};

// Sends a handshake message whole on a non-blocking socket (a few dozen bytes on a fresh
// connection: it fits in the send buffer or the connection is no good).
bool sendAll(int fd, const std::vector<uint8_t>& bytes) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = platform::send(fd, bytes.data() + done, bytes.size() - done, MSG_DONTWAIT);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

enum class Pump { kWaiting, kFinished, kClosed };

// Moves bytes between the socket and a handshake machine until it needs bytes that have not
// arrived, or has nothing more to read. Reads no more than the machine asks for (the job's data
// follows the handshake on the same stream). *why: what ended the connection (kClosed).
template <typename Machine>
Pump pump(int fd, Machine& m, std::string* why) {
  for (;;) {
    if (!sendAll(fd, m.takeOutput())) {
      *why = cat("sending failed: ", std::strerror(errno != 0 ? errno : EPIPE));
      return Pump::kClosed;
    }
    const size_t want = m.need();
    if (want == 0) return Pump::kFinished;
    uint8_t buf[64];
    const ssize_t n = ::recv(fd, buf, std::min(want, sizeof(buf)), MSG_DONTWAIT);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return Pump::kWaiting;
    if (n <= 0) {
      *why = n == 0 ? "the other end closed the connection during the handshake" : std::strerror(errno);
      return Pump::kClosed;
    }
    m.feed(buf, static_cast<size_t>(n));
  }
}

// Closes a refused connection after reading what the peer already sent (closing with unread
// bytes resets the connection, which could discard the refusal before the peer reads it).
void closeRefused(Fd& fd) {
  char sink[4096];
  (void)::recv(fd.get(), sink, sizeof(sink), MSG_DONTWAIT);
  fd.reset();
}

bool outOfDescriptors(int err) { return err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM; }

}  // namespace

void Context::connectAll() {
  const int me = rank();
  for (const auto& ep : config_.listen) {
    listeners_.push_back(listenOn(parseAddress(ep.address, ep.port, cat("rank ", me, " listen address"))));
  }
  const int perLink = config_.connsPerLink;
  std::vector<Outgoing> out;
  std::vector<int> expectedIn(static_cast<size_t>(size()), 0);
  std::vector<uint32_t> acceptsFrom(static_cast<size_t>(size()), 0);  // what the handshake expects, per rank
  for (const auto& p : config_.peers) {
    const int count = static_cast<int>(p.links.size()) * perLink;
    pairs_[p.rank]->conns.resize(static_cast<size_t>(count));
    const bool connectsOut = p.initiate < 0 ? p.rank < me : p.initiate == 1;
    if (connectsOut) {
      for (int l = 0; l < static_cast<int>(p.links.size()); ++l) {
        const SockAddr addr = parseAddress(p.links[l].address, p.links[l].port, cat("rank ", me, ": address of rank ", p.rank));
        for (int k = 0; k < perLink; ++k) {
          Outgoing o;
          o.peer = p.rank;
          o.index = l * perLink + k;
          o.addr = addr;
          out.push_back(std::move(o));
        }
      }
    } else {
      expectedIn[p.rank] = count;
      acceptsFrom[p.rank] = static_cast<uint32_t>(count);
      if (config_.listen.empty()) {
        raise(ErrorKind::kBootstrap, cat("rank ", me, " must accept connections from rank ", p.rank,
                                         " but has no listen address"));
      }
    }
  }
  int missingIn = 0;
  for (int v : expectedIn) missingIn += v;
  std::vector<Incoming> in;
  const double deadline = monotonicSeconds() + config_.connectTimeoutSeconds;
  const double handshakeSeconds = std::min(config_.handshakeTimeoutSeconds, config_.connectTimeoutSeconds);
  const size_t maxPending = static_cast<size_t>(config_.maxPendingHandshakes);
  const auto usize = static_cast<uint32_t>(size());
  ConnectStats& stats = connectStats_;
  handshake::LogLimiter limiter;
  double acceptPausedUntil = 0;
  double acceptBackoff = kAcceptBackoffMin;

  // Rejected, dropped and refused connections: logged, at most 10 lines per 10 s.
  auto note = [&](const std::string& line) {
    if (limiter.admit(monotonicSeconds())) {
      log(1, line);
    } else {
      ++stats.logsSuppressed;
    }
  };
  auto reportSuppressed = [&](bool flush) {
    const size_t n = limiter.takeSuppressed(monotonicSeconds(), flush);
    if (n > 0) log(1, cat(n, " more connection(s) rejected or dropped (not logged one by one)"));
  };
  auto dropOldestPending = [&](const char* why) -> bool {
    for (auto& inc : in) {
      if (!inc.fd) continue;
      note(cat("dropped the pending handshake from ", inc.from, ": ", why));
      inc.fd.reset();
      ++stats.evicted;
      return true;
    }
    return false;
  };

  auto install = [&](int peer, int index, Fd fd, const std::string& remote) {
    tuneSocket(fd.get(), config_.socketBufferBytes);
    auto c = std::make_unique<Connection>();
    c->link = std::make_unique<TcpLink>(std::move(fd));
    c->peer = peer;
    c->index = index;
    c->remote = remote;
    pairs_[peer]->conns[static_cast<size_t>(index)] = std::move(c);
  };

  // An outgoing connection's handshake ended without proof either way.
  auto connectFailed = [&](const Outgoing& o) {
    const Connector& h = *o.hs;
    const std::string who = cat("rank ", me, ": the process at ", o.addr.text);
    switch (h.failure()) {
      case Connector::Failure::kForged:
        raise(ErrorKind::kAuth, cat(who, " answered as rank ", o.peer, " but could not prove the job token: it is not "
                                    "rank ", o.peer, " of this job (another job, or someone else, holds that port)"));
      case Connector::Failure::kWrongRank:
        raise(ErrorKind::kBootstrap, cat(who, " says it is rank ", h.claimedRank(), ", not rank ", o.peer,
                                         ": do all ranks read the same hostfile?"));
      case Connector::Failure::kNotMeshccl:
        raise(ErrorKind::kBootstrap, cat(who, " is not a meshccl rank of protocol version ", kProtocolVersion,
                                         " (it answered version ", h.peerVersion(), " or something else): is it rank ",
                                         o.peer, " of this job?"));
      default:
        break;
    }
    switch (static_cast<handshake::Status>(h.status())) {
      case handshake::Status::kBadToken:
        raise(ErrorKind::kAuth, cat("rank ", me, ": rank ", o.peer, " at ", o.addr.text,
                                    " refused this rank's proof of the job token: the ranks were started with "
                                    "different MESHCCL_TOKEN values or job ids (or another job listens there)"));
      case handshake::Status::kBadVersion:
        raise(ErrorKind::kBootstrap, cat("rank ", me, ": rank ", o.peer, " at ", o.addr.text,
                                         " runs another meshccl protocol version (this rank speaks ", kProtocolVersion,
                                         "): install the same meshccl on every host"));
      case handshake::Status::kBadRank:
        raise(ErrorKind::kBootstrap, cat(who, " does not expect this rank's connection ", o.index, " (is it rank ",
                                         o.peer, " of this job? do the hostfiles agree?)"));
      case handshake::Status::kDuplicate:
        raise(ErrorKind::kBootstrap, cat(who, " (rank ", o.peer, ") already has this rank's connection ", o.index,
                                         ": are two processes running as rank ", me, "?"));
      default:
        raise(ErrorKind::kBootstrap, cat(who, " is not a meshccl rank (it answered ",
                                         handshake::statusName(h.status()), "): is it rank ", o.peer, " of this job?"));
    }
  };

  for (;;) {
    double now = monotonicSeconds();
    reportSuppressed(false);
    size_t pendingOut = 0;
    for (auto& o : out) {
      if (o.state == Outgoing::State::kDone) continue;
      ++pendingOut;
      auto retryLater = [&](const std::string& why) {
        o.lastError = why;
        o.fd.reset();
        o.hs.reset();
        o.state = Outgoing::State::kIdle;
        o.retryAt = now + o.backoff;
        o.backoff = std::min(o.backoff * 2, 1.0);
        log(2, cat("connect to rank ", o.peer, " at ", o.addr.text, ": ", why, ", retry ", o.attempts));
      };
      if (o.state != Outgoing::State::kIdle && now >= o.attemptDeadline) {
        retryLater(cat("no complete handshake within ", handshakeSeconds, " s"));
      }
      if (o.state == Outgoing::State::kIdle && now >= o.retryAt) {
        int err = 0;
        ++o.attempts;
        o.fd = startConnect(o.addr, &err);
        if (err != 0) {
          retryLater(std::strerror(err));
        } else {
          o.state = Outgoing::State::kConnecting;
          o.attemptDeadline = now + handshakeSeconds;
        }
      }
    }
    for (auto& inc : in) {
      if (inc.fd && now >= inc.deadline) {
        note(cat("dropped the connection from ", inc.from, ": no complete handshake within ", handshakeSeconds, " s"));
        inc.fd.reset();
        ++stats.timedOut;
      }
    }
    if (pendingOut == 0 && missingIn == 0) break;
    if (now >= deadline) {
      reportSuppressed(true);
      std::string what;
      for (auto& o : out) {
        if (o.state == Outgoing::State::kDone) continue;
        what += cat("\n  rank ", me, " could not reach rank ", o.peer, " at ", o.addr.text, ": ", o.lastError, " (",
                    o.attempts, " attempts)");
      }
      for (int r = 0; r < size(); ++r) {
        if (expectedIn[r] > 0) {
          std::string addrs;
          for (const auto& ep : config_.listen) addrs += cat(addrs.empty() ? "" : ", ", ep.address, ":", ep.port);
          what += cat("\n  rank ", r, " did not connect to rank ", me, " (listening on ", addrs, "; ", expectedIn[r],
                      " connection(s) missing)");
        }
      }
      raise(ErrorKind::kTimeout, cat("rank ", me, ": connecting the job timed out after ", config_.connectTimeoutSeconds,
                                     " s:", what, "\n  Are all ranks started with the same hostfile, and are the links up?"));
    }

    std::vector<pollfd> fds;
    enum class Kind { kListener, kOut, kIn };
    std::vector<std::pair<Kind, size_t>> owners;
    double wakeAt = std::min(deadline, now + 0.05);  // outgoing retries are looked at every 50 ms at most
    if (now >= acceptPausedUntil) {
      for (size_t i = 0; i < listeners_.size(); ++i) {
        fds.push_back({listeners_[i].get(), POLLIN, 0});
        owners.emplace_back(Kind::kListener, i);
      }
    } else {
      wakeAt = std::min(wakeAt, acceptPausedUntil);
    }
    for (size_t i = 0; i < out.size(); ++i) {
      if (out[i].state == Outgoing::State::kConnecting) fds.push_back({out[i].fd.get(), POLLOUT, 0});
      else if (out[i].state == Outgoing::State::kHandshake) fds.push_back({out[i].fd.get(), POLLIN, 0});
      else continue;
      owners.emplace_back(Kind::kOut, i);
      wakeAt = std::min(wakeAt, out[i].attemptDeadline);
    }
    for (size_t i = 0; i < in.size(); ++i) {
      if (!in[i].fd) continue;
      fds.push_back({in[i].fd.get(), POLLIN, 0});
      owners.emplace_back(Kind::kIn, i);
      wakeAt = std::min(wakeAt, in[i].deadline);
    }
    const int ms = static_cast<int>(std::clamp(std::ceil((wakeAt - now) * 1000), 1.0, 50.0));
    ++stats.pollRounds;
    const int n = ::poll(fds.data(), fds.size(), ms);
    if (n < 0 && errno != EINTR) raise(ErrorKind::kIo, cat("rank ", me, ": poll(): ", std::strerror(errno)));
    if (n <= 0) continue;
    now = monotonicSeconds();

    bool paused = false;
    for (size_t f = 0; f < fds.size(); ++f) {
      if (fds[f].revents == 0) continue;
      const auto [kind, i] = owners[f];
      if (kind == Kind::kListener) {
        if (paused) continue;
        for (int k = 0; k < kAcceptsPerRound; ++k) {
          sockaddr_storage from{};
          socklen_t fromLen = sizeof(from);
          const int fd = acceptNonBlocking(listeners_[i].get(), &from, &fromLen);
          if (fd < 0) {
            const int err = errno;
            if (err == EINTR) continue;
            if (err == EAGAIN || err == EWOULDBLOCK) break;
            if (outOfDescriptors(err)) {
              // Stop looking at the listeners for a while (poll would report them readable at
              // once, forever) and free a descriptor for the next try.
              ++stats.acceptBackoffs;
              acceptPausedUntil = now + acceptBackoff;
              note(cat("cannot accept connections on ", config_.listen[i].address, ":", config_.listen[i].port, ": ",
                       std::strerror(err), "; not accepting for ", std::lround(acceptBackoff * 1000), " ms"));
              acceptBackoff = std::min(acceptBackoff * 2, kAcceptBackoffMax);
              dropOldestPending("this rank is out of descriptors and needs one for the next connection");
              paused = true;
              break;
            }
            // An error of one queued connection (ECONNABORTED, EPROTO, a network error Linux
            // passes on): that connection is gone, the next may be fine.
            note(cat("accept on ", config_.listen[i].address, ":", config_.listen[i].port, ": ", std::strerror(err)));
            continue;
          }
          acceptBackoff = kAcceptBackoffMin;
          ++stats.accepted;
          size_t live = 0;
          for (const auto& x : in) live += x.fd ? 1 : 0;
          if (live >= maxPending) dropOldestPending(cat(maxPending, " handshakes are pending, the cap").c_str());
          Incoming inc;
          inc.fd = Fd(fd);
          inc.from = describePeer(from);
          inc.deadline = now + handshakeSeconds;
          inc.hs = std::make_unique<Acceptor>(static_cast<uint32_t>(me), usize, config_.token, config_.jobId,
                                              acceptsFrom, handshake::freshNonce());
          in.push_back(std::move(inc));
        }
      } else if (kind == Kind::kOut) {
        Outgoing& o = out[i];
        auto retry = [&](const std::string& why) {
          o.lastError = why;
          o.fd.reset();
          o.hs.reset();
          o.state = Outgoing::State::kIdle;
          o.retryAt = monotonicSeconds() + o.backoff;
          o.backoff = std::min(o.backoff * 2, 1.0);
          log(2, cat("connect to rank ", o.peer, " at ", o.addr.text, ": ", why, ", retry ", o.attempts));
        };
        if (o.state == Outgoing::State::kConnecting) {
          const int err = socketError(o.fd.get());
          if (err != 0) {
            retry(std::strerror(err));
            continue;
          }
          o.hs = std::make_unique<Connector>(config_.token, config_.jobId, static_cast<uint32_t>(me),
                                             static_cast<uint32_t>(o.peer), usize, static_cast<uint32_t>(o.index),
                                             static_cast<uint32_t>(pairs_[o.peer]->conns.size()),
                                             handshake::freshNonce());
          o.state = Outgoing::State::kHandshake;
        }
        std::string why;
        const Pump p = pump(o.fd.get(), *o.hs, &why);
        if (o.hs->state() == Connector::State::kFailed) connectFailed(o);
        if (p == Pump::kClosed) {
          retry(why);
          continue;
        }
        if (o.hs->state() == Connector::State::kDone) {
          o.state = Outgoing::State::kDone;
          o.hs.reset();
          install(o.peer, o.index, std::move(o.fd), o.addr.text);
          log(2, cat("connected to rank ", o.peer, " at ", o.addr.text, " (connection ", o.index, ")"));
        }
      } else {
        Incoming& inc = in[i];
        if (!inc.fd) continue;  // dropped earlier in this round
        Acceptor& hs = *inc.hs;
        std::string why;
        Pump p = pump(inc.fd.get(), hs, &why);
        if (hs.state() == Acceptor::State::kProven) {
          const auto peer = static_cast<int>(hs.hello().rank);
          const auto index = static_cast<size_t>(hs.hello().connIndex);
          if (pairs_[peer]->conns[index] != nullptr) {
            hs.refuseDuplicate();
          } else {
            hs.accept();
          }
          p = pump(inc.fd.get(), hs, &why);
          if (hs.state() == Acceptor::State::kDone && p != Pump::kClosed) {
            install(peer, static_cast<int>(index), std::move(inc.fd), inc.from);
            --expectedIn[peer];
            --missingIn;
            log(2, cat("accepted rank ", peer, " from ", inc.from, " (connection ", index, ")"));
            continue;
          }
        }
        if (hs.state() == Acceptor::State::kRejected) {
          ++stats.rejected;
          note(cat("rejected a connection from ", inc.from, ": ", hs.reason()));
          closeRefused(inc.fd);
        } else if (p == Pump::kClosed) {
          ++stats.closedEarly;
          if (hs.helloParsed()) {
            note(cat("the connection from ", inc.from, " (claiming rank ", hs.hello().rank, ") ended before its "
                     "handshake finished: ", why));
          } else {
            note(cat("the connection from ", inc.from, " ended before its handshake finished: ", why));
          }
          inc.fd.reset();
        }
      }
    }
    in.erase(std::remove_if(in.begin(), in.end(), [](const Incoming& x) { return !x.fd; }), in.end());
  }
  reportSuppressed(true);
  listeners_.clear();  // nobody else may connect once the job is wired
  for (auto* pr : pairs_) {
    if (pr == nullptr) continue;
    for (auto& c : pr->conns) allConns_.push_back(c.get());
  }
  setupSharedMemory();
  for (auto* c : allConns_) spin_ = spin_ || c->link->mustSpin();
}

namespace {

constexpr uint32_t kShmOfferMagic = 0x4d43534fu;  // "MCSO"

#pragma pack(push, 1)
struct ShmOffer {
  uint32_t magic;
  uint32_t offered;  // 0: this end uses TCP (transport tcp, or creating the segment failed)
  uint64_t ringBytes;
  char name[48];
};
#pragma pack(pop)

// The connection's rings, if it moves its data through shared memory.
const ShmLink* ringsOf(const Connection& c) {
  const auto* link = dynamic_cast<const SharedMemoryLink*>(c.link.get());
  return link != nullptr ? &link->rings() : nullptr;
}

// Whole-buffer I/O on a non-blocking socket during the handshake, bounded by `deadline`.
bool exchange(int fd, char* buf, size_t len, bool write, double deadline) {
  size_t done = 0;
  while (done < len) {
    const ssize_t n = write ? platform::send(fd, buf + done, len - done, MSG_DONTWAIT)
                            : ::recv(fd, buf + done, len - done, MSG_DONTWAIT);
    if (n > 0) {
      done += static_cast<size_t>(n);
      continue;
    }
    if (n == 0 && !write) return false;
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return false;
    const double left = deadline - monotonicSeconds();
    if (left <= 0) return false;
    pollfd p{fd, static_cast<short>(write ? POLLOUT : POLLIN), 0};
    ::poll(&p, 1, static_cast<int>(std::ceil(left * 1000)));
  }
  return true;
}

}  // namespace

// Same-host pairs move their data through shared memory. On each of the pair's connections
// the lower rank offers a segment (or declines), the higher rank maps it and answers, the lower
// rank unlinks the name. Offers go out before any answer is awaited, so no rank waits on one
// that waits on it. Where either end cannot (or, with transport=tcp, will not) use it, that
// connection stays TCP and the job goes on.
void Context::setupSharedMemory() {
  const double deadline = monotonicSeconds() + config_.connectTimeoutSeconds;
  const bool want = config_.transport == "auto";
  const int me = rank();
  auto lost = [&](const Connection& c, const char* what) {
    raise(ErrorKind::kBootstrap, cat("rank ", me, ": rank ", c.peer, " (", c.remote, ") did not ", what,
                                     " the shared-memory handshake within the connect timeout"));
  };
  std::vector<std::pair<Connection*, std::unique_ptr<ShmLink>>> offered;
  for (auto* pr : pairs_) {
    if (pr == nullptr || !pr->sameHost || pr->peer < me) continue;
    for (auto& c : pr->conns) {
      ShmOffer o{};
      o.magic = kShmOfferMagic;
      o.ringBytes = config_.shmRingBytes;
      std::unique_ptr<ShmLink> link;
      if (want) {
        std::string name, error;
        link = ShmLink::create(config_.shmRingBytes, &name, &error,
                               cat(config_.jobId, '\0', me, '\0', pr->peer, '\0', c->index));
        if (link) {
          link->publishProcess();
          o.offered = 1;
          std::strncpy(o.name, name.c_str(), sizeof(o.name) - 1);
        } else {
          log(1, cat("shared memory with rank ", pr->peer, " unavailable, using TCP: ", error));
        }
      }
      if (!exchange(c->link->fd(), reinterpret_cast<char*>(&o), sizeof(o), true, deadline)) lost(*c, "take part in");
      offered.emplace_back(c.get(), std::move(link));
    }
  }
  for (auto* pr : pairs_) {
    if (pr == nullptr || !pr->sameHost || pr->peer > me) continue;
    for (auto& c : pr->conns) {
      ShmOffer o{};
      if (!exchange(c->link->fd(), reinterpret_cast<char*>(&o), sizeof(o), false, deadline)) lost(*c, "start");
      if (o.magic != kShmOfferMagic) {
        raise(ErrorKind::kBootstrap, cat("rank ", me, ": rank ", pr->peer, " (", c->remote,
                                         ") sent no shared-memory offer: do both ranks read the same hostfile?"));
      }
      o.name[sizeof(o.name) - 1] = '\0';
      uint32_t accepted = 0;
      std::unique_ptr<ShmLink> rings;
      if (want && o.offered == 1) {
        std::string error;
        rings = ShmLink::open(o.name, static_cast<size_t>(o.ringBytes), &error);
        if (rings) {
          rings->publishProcess();
          accepted = 1;
        } else {
          log(1, cat("shared memory with rank ", pr->peer, " unavailable, using TCP: ", error));
        }
      }
      if (!exchange(c->link->fd(), reinterpret_cast<char*>(&accepted), sizeof(accepted), true, deadline)) {
        lost(*c, "finish");
      }
      if (rings) c->link = std::make_unique<SharedMemoryLink>(c->link->takeSocket(), std::move(rings));
    }
  }
  for (auto& [c, link] : offered) {
    uint32_t accepted = 0;
    if (!exchange(c->link->fd(), reinterpret_cast<char*>(&accepted), sizeof(accepted), false, deadline)) {
      lost(*c, "finish");
    }
    if (link) link->unlink();
    if (accepted == 1 && link) c->link = std::make_unique<SharedMemoryLink>(c->link->takeSocket(), std::move(link));
  }
  bool shared = false;
  for (auto* c : allConns_) {
    if (ringsOf(*c) == nullptr) continue;
    shared = true;
    log(2, cat("rank ", c->peer, " connection ", c->index, ": shared memory"));
  }
  // Single copy needs a build with it, every rank on this host, every pair on shared memory,
  // every peer readable.
  canReadPeers_ = platform::kSingleCopy && allOnHost_ && config_.singleCopyBytes > 0;
  if (!platform::kSingleCopy && allOnHost_ && shared) {
    log(2, cat("rank ", me, ": this build has no single copy (", platform::buildInfoText(),
               "): large calls copy through shared memory"));
  }
  for (auto* pr : pairs_) {
    if (pr == nullptr || !canReadPeers_) continue;
    std::string why = "not all of its connections use shared memory";
    bool readable = true;
    for (auto& c : pr->conns) readable = readable && ringsOf(*c) != nullptr;
    readable = readable && ringsOf(*pr->conns.front())->probePeerProcess(&pr->pid, &why);
    if (!readable) {
      log(1, cat("rank ", me, ": cannot read rank ", pr->peer, "'s memory, large calls copy through shared memory: ",
                 why));
    }
    canReadPeers_ = readable;
  }
  if (canReadPeers_) log(2, cat("rank ", me, ": single copy from every peer"));
}

}  // namespace meshccl
