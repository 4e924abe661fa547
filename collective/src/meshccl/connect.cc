// The connect phase: every rank listens on its planned addresses only; the higher rank of each
// pair connects to the lower one, once per link and connection, and presents a hello with its
// rank, the connection's index and the job token. The acceptor answers with a status; a peer
// without the token (or not a rank that should connect here) is refused and logged, and the
// phase goes on. Connects are retried with backoff until the connect deadline, so ranks can
// start in any order.

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>

#include "meshccl/context.h"

namespace meshccl {

namespace {

bool tokensEqual(const std::string& a, const char* b, size_t blen) {
  if (a.size() != blen) return false;
  // Constant time in the token's content: a stranger learns nothing from the reply's timing.
  unsigned char diff = 0;
  for (size_t i = 0; i < blen; ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

struct Outgoing {
  int peer = -1;
  int index = 0;
  SockAddr addr;
  Fd fd;
  enum class State { kIdle, kConnecting, kAwaitStatus, kDone } state = State::kIdle;
  double retryAt = 0;
  double backoff = 0.05;
  int attempts = 0;
  std::string lastError = "no attempt yet";
  uint32_t status = 0;
  size_t statusGot = 0;
};

struct Incoming {
  Fd fd;
  std::string from;
  char buf[sizeof(Hello) + kMaxTokenBytes] = {};
  size_t got = 0;
};

}  // namespace

void Context::connectAll() {
  const int me = rank();
  for (const auto& ep : config_.listen) {
    listeners_.push_back(listenOn(parseAddress(ep.address, ep.port, cat("rank ", me, " listen address"))));
  }
  const int perLink = config_.connsPerLink;
  std::vector<Outgoing> out;
  std::vector<int> expectedIn(static_cast<size_t>(size()), 0);
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

  auto install = [&](int peer, int index, Fd fd, const std::string& remote) {
    tuneSocket(fd.get(), config_.socketBufferBytes);
    auto c = std::make_unique<Connection>();
    c->fd = std::move(fd);
    c->peer = peer;
    c->index = index;
    c->remote = remote;
    pairs_[peer]->conns[static_cast<size_t>(index)] = std::move(c);
  };

  for (;;) {
    const double now = monotonicSeconds();
    size_t pendingOut = 0;
    for (auto& o : out) {
      if (o.state == Outgoing::State::kDone) continue;
      ++pendingOut;
      if (o.state == Outgoing::State::kIdle && now >= o.retryAt) {
        int err = 0;
        ++o.attempts;
        o.fd = startConnect(o.addr, &err);
        if (err != 0) {
          o.lastError = std::strerror(err);
          o.fd.reset();
          o.retryAt = now + o.backoff;
          o.backoff = std::min(o.backoff * 2, 1.0);
          log(2, cat("connect to rank ", o.peer, " at ", o.addr.text, " failed (", o.lastError, "), retry ", o.attempts));
        } else {
          o.state = Outgoing::State::kConnecting;
        }
      }
    }
    if (pendingOut == 0 && missingIn == 0) break;
    if (now >= deadline) {
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
    for (size_t i = 0; i < listeners_.size(); ++i) {
      fds.push_back({listeners_[i].get(), POLLIN, 0});
      owners.emplace_back(Kind::kListener, i);
    }
    for (size_t i = 0; i < out.size(); ++i) {
      if (out[i].state == Outgoing::State::kConnecting) fds.push_back({out[i].fd.get(), POLLOUT, 0});
      else if (out[i].state == Outgoing::State::kAwaitStatus) fds.push_back({out[i].fd.get(), POLLIN, 0});
      else continue;
      owners.emplace_back(Kind::kOut, i);
    }
    for (size_t i = 0; i < in.size(); ++i) {
      if (!in[i].fd) continue;
      fds.push_back({in[i].fd.get(), POLLIN, 0});
      owners.emplace_back(Kind::kIn, i);
    }
    const int ms = static_cast<int>(std::clamp(std::ceil((deadline - now) * 1000), 1.0, 50.0));
    const int n = ::poll(fds.data(), fds.size(), ms);
    if (n < 0 && errno != EINTR) raise(ErrorKind::kIo, cat("rank ", me, ": poll(): ", std::strerror(errno)));
    if (n <= 0) continue;

    for (size_t f = 0; f < fds.size(); ++f) {
      if (fds[f].revents == 0) continue;
      const auto [kind, i] = owners[f];
      if (kind == Kind::kListener) {
        for (;;) {
          sockaddr_storage from{};
          socklen_t fromLen = sizeof(from);
          const int fd = ::accept4(listeners_[i].get(), reinterpret_cast<sockaddr*>(&from), &fromLen,
                                   SOCK_NONBLOCK | SOCK_CLOEXEC);
          if (fd < 0) break;
          Incoming inc;
          inc.fd = Fd(fd);
          inc.from = describePeer(from);
          in.push_back(std::move(inc));
        }
      } else if (kind == Kind::kOut) {
        Outgoing& o = out[i];
        auto retry = [&](const std::string& why) {
          o.lastError = why;
          o.fd.reset();
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
          char hello[sizeof(Hello) + kMaxTokenBytes];
          Hello h{};
          h.magic = kHelloMagic;
          h.version = kProtocolVersion;
          h.tokenLen = static_cast<uint16_t>(config_.token.size());
          h.rank = static_cast<uint32_t>(me);
          h.size = static_cast<uint32_t>(size());
          h.connIndex = static_cast<uint32_t>(o.index);
          h.connCount = static_cast<uint32_t>(pairs_[o.peer]->conns.size());
          std::memcpy(hello, &h, sizeof(h));
          std::memcpy(hello + sizeof(h), config_.token.data(), config_.token.size());
          const size_t len = sizeof(h) + config_.token.size();
          const ssize_t sent = ::send(o.fd.get(), hello, len, MSG_NOSIGNAL);
          if (sent != static_cast<ssize_t>(len)) {
            retry(sent < 0 ? std::strerror(errno) : "short write of the hello");
            continue;
          }
          o.state = Outgoing::State::kAwaitStatus;
        } else {
          const ssize_t got = ::recv(o.fd.get(), reinterpret_cast<char*>(&o.status) + o.statusGot,
                                     sizeof(o.status) - o.statusGot, MSG_DONTWAIT);
          if (got < 0 && (errno == EAGAIN || errno == EINTR)) continue;
          if (got <= 0) {
            retry(got == 0 ? "the peer closed the connection before answering" : std::strerror(errno));
            continue;
          }
          o.statusGot += static_cast<size_t>(got);
          if (o.statusGot < sizeof(o.status)) continue;
          switch (static_cast<HelloStatus>(o.status)) {
            case HelloStatus::kOk:
              o.state = Outgoing::State::kDone;
              install(o.peer, o.index, std::move(o.fd), o.addr.text);
              log(2, cat("connected to rank ", o.peer, " at ", o.addr.text, " (connection ", o.index, ")"));
              break;
            case HelloStatus::kBadToken:
              raise(ErrorKind::kAuth, cat("rank ", me, ": rank ", o.peer, " at ", o.addr.text,
                                          " refused this rank's job token: the ranks were started with different "
                                          "MESHCCL_TOKEN values (or another job listens there)"));
            case HelloStatus::kBadVersion:
              raise(ErrorKind::kBootstrap, cat("rank ", me, ": rank ", o.peer, " at ", o.addr.text,
                                               " runs another meshccl protocol version"));
            default:
              raise(ErrorKind::kBootstrap, cat("rank ", me, ": the process at ", o.addr.text,
                                               " does not expect this rank's connection ", o.index,
                                               " (is it rank ", o.peer, " of this job? do the hostfiles agree?)"));
          }
        }
      } else {
        Incoming& inc = in[i];
        const size_t want = inc.got < sizeof(Hello)
                                ? sizeof(Hello)
                                : sizeof(Hello) + reinterpret_cast<const Hello*>(inc.buf)->tokenLen;
        const ssize_t got = ::recv(inc.fd.get(), inc.buf + inc.got, want - inc.got, MSG_DONTWAIT);
        if (got < 0 && (errno == EAGAIN || errno == EINTR)) continue;
        if (got <= 0) {
          inc.fd.reset();
          continue;
        }
        inc.got += static_cast<size_t>(got);
        if (inc.got < sizeof(Hello)) continue;
        Hello h;
        std::memcpy(&h, inc.buf, sizeof(h));
        auto refuse = [&](HelloStatus st, const std::string& why) {
          log(1, cat("rejected a connection from ", inc.from, ": ", why));
          const auto code = static_cast<uint32_t>(st);
          ::send(inc.fd.get(), &code, sizeof(code), MSG_NOSIGNAL | MSG_DONTWAIT);
          inc.fd.reset();
        };
        if (h.magic != kHelloMagic) {
          refuse(HelloStatus::kBadVersion, "not a meshccl peer");
          continue;
        }
        if (h.version != kProtocolVersion) {
          refuse(HelloStatus::kBadVersion, cat("protocol version ", h.version, ", this rank speaks ", kProtocolVersion));
          continue;
        }
        if (h.tokenLen > kMaxTokenBytes) {
          refuse(HelloStatus::kBadToken, "wrong job token");
          continue;
        }
        if (inc.got < sizeof(Hello) + h.tokenLen) continue;
        if (!tokensEqual(config_.token, inc.buf + sizeof(Hello), h.tokenLen)) {
          refuse(HelloStatus::kBadToken, cat("claims to be rank ", h.rank, " but has the wrong job token"));
          continue;
        }
        const int peer = static_cast<int>(h.rank);
        if (static_cast<int>(h.size) != size() || peer < 0 || peer >= size() || peer == me || pairs_[peer] == nullptr ||
            expectedIn[peer] == 0 || h.connCount != pairs_[peer]->conns.size() ||
            h.connIndex >= pairs_[peer]->conns.size()) {
          refuse(HelloStatus::kBadRank, cat("rank ", h.rank, " of a world of ", h.size, " (connection ", h.connIndex,
                                            " of ", h.connCount, ") is not expected here: the hostfiles differ?"));
          continue;
        }
        if (pairs_[peer]->conns[h.connIndex] != nullptr) {
          refuse(HelloStatus::kDuplicate, cat("rank ", peer, " connected twice as connection ", h.connIndex));
          continue;
        }
        const uint32_t ok = static_cast<uint32_t>(HelloStatus::kOk);
        if (::send(inc.fd.get(), &ok, sizeof(ok), MSG_NOSIGNAL) != sizeof(ok)) {
          inc.fd.reset();
          continue;
        }
        install(peer, static_cast<int>(h.connIndex), std::move(inc.fd), inc.from);
        --expectedIn[peer];
        --missingIn;
        log(2, cat("accepted rank ", peer, " from ", inc.from, " (connection ", h.connIndex, ")"));
      }
    }
    in.erase(std::remove_if(in.begin(), in.end(), [](const Incoming& x) { return !x.fd; }), in.end());
  }
  listeners_.clear();  // nobody else may connect once the job is wired
  for (auto* pr : pairs_) {
    if (pr == nullptr) continue;
    for (auto& c : pr->conns) allConns_.push_back(c.get());
  }
  setupSharedMemory();
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

// Whole-buffer I/O on a non-blocking socket during the handshake, bounded by `deadline`.
bool exchange(int fd, char* buf, size_t len, bool write, double deadline) {
  size_t done = 0;
  while (done < len) {
    const ssize_t n = write ? ::send(fd, buf + done, len - done, MSG_NOSIGNAL | MSG_DONTWAIT)
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
        link = ShmLink::create(config_.shmRingBytes, &name, &error);
        if (link) {
          link->publishProcess();
          o.offered = 1;
          std::strncpy(o.name, name.c_str(), sizeof(o.name) - 1);
        } else {
          log(1, cat("shared memory with rank ", pr->peer, " unavailable, using TCP: ", error));
        }
      }
      if (!exchange(c->fd.get(), reinterpret_cast<char*>(&o), sizeof(o), true, deadline)) lost(*c, "take part in");
      offered.emplace_back(c.get(), std::move(link));
    }
  }
  for (auto* pr : pairs_) {
    if (pr == nullptr || !pr->sameHost || pr->peer > me) continue;
    for (auto& c : pr->conns) {
      ShmOffer o{};
      if (!exchange(c->fd.get(), reinterpret_cast<char*>(&o), sizeof(o), false, deadline)) lost(*c, "start");
      if (o.magic != kShmOfferMagic) {
        raise(ErrorKind::kBootstrap, cat("rank ", me, ": rank ", pr->peer, " (", c->remote,
                                         ") sent no shared-memory offer: do both ranks read the same hostfile?"));
      }
      o.name[sizeof(o.name) - 1] = '\0';
      uint32_t accepted = 0;
      if (want && o.offered == 1) {
        std::string error;
        c->shm = ShmLink::open(o.name, static_cast<size_t>(o.ringBytes), &error);
        if (c->shm) {
          c->shm->publishProcess();
          accepted = 1;
        } else {
          log(1, cat("shared memory with rank ", pr->peer, " unavailable, using TCP: ", error));
        }
      }
      if (!exchange(c->fd.get(), reinterpret_cast<char*>(&accepted), sizeof(accepted), true, deadline)) {
        lost(*c, "finish");
      }
    }
  }
  for (auto& [c, link] : offered) {
    uint32_t accepted = 0;
    if (!exchange(c->fd.get(), reinterpret_cast<char*>(&accepted), sizeof(accepted), false, deadline)) {
      lost(*c, "finish");
    }
    if (link) link->unlink();
    if (accepted == 1 && link) c->shm = std::move(link);
  }
  for (auto* c : allConns_) {
    if (!c->shm) continue;
    hasShm_ = true;
    log(2, cat("rank ", c->peer, " connection ", c->index, ": shared memory"));
  }
  // Single copy needs every rank on this host, every pair on shared memory, every peer readable.
  canReadPeers_ = allOnHost_ && config_.singleCopyBytes > 0;
  for (auto* pr : pairs_) {
    if (pr == nullptr || !canReadPeers_) continue;
    std::string why = "not all of its connections use shared memory";
    bool readable = true;
    for (auto& c : pr->conns) readable = readable && c->shm != nullptr;
    readable = readable && pr->conns.front()->shm->probePeerProcess(&pr->pid, &why);
    if (!readable) {
      log(1, cat("rank ", me, ": cannot read rank ", pr->peer, "'s memory, large calls copy through shared memory: ",
                 why));
    }
    canReadPeers_ = readable;
  }
  if (canReadPeers_) log(2, cat("rank ", me, ": single copy from every peer"));
}

}  // namespace meshccl
