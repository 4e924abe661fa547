#include "meshccl/context.h"

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>

namespace meshccl {

const char* collectiveName(Collective c) {
  switch (c) {
    case Collective::kNone: return "none";
    case Collective::kAllReduce: return "all_reduce";
    case Collective::kAllGather: return "all_gather";
    case Collective::kReduceScatter: return "reduce_scatter";
    case Collective::kBroadcast: return "broadcast";
    case Collective::kSendRecv: return "send/recv";
    case Collective::kBarrier: return "barrier";
    case Collective::kBatch: return "send/recv batch";
    case Collective::kMessage: return "message";
  }
  return "unknown-collective";
}

std::string describe(const CallDesc& d) {
  switch (d.kind) {
    case Collective::kBarrier:
      return "barrier()";
    case Collective::kBatch:
      return "send/recv batch";
    case Collective::kMessage:
      return d.count == 0 && d.root == 0 ? "send/recv of tagged messages"
                                         : cat("a message (tag ", d.root, ", ", d.count, " bytes)");
    case Collective::kAllReduce:
    case Collective::kReduceScatter:
      return cat(collectiveName(d.kind), "(", dtypeName(d.dtype), ", ", redopName(d.op), ", count=", d.count, ")");
    case Collective::kBroadcast:
      return cat("broadcast(", dtypeName(d.dtype), ", count=", d.count, ", root=", d.root, ")");
    case Collective::kSendRecv:
      return cat("send/recv(", dtypeName(d.dtype), ", count=", d.count, ", from rank ", d.root, ")");
    default:
      return cat(collectiveName(d.kind), "(", dtypeName(d.dtype), ", count=", d.count, ")");
  }
}

namespace {

FrameHeader makeHeader(uint32_t type, uint32_t pairOp, const CallDesc& d, uint64_t len) {
  FrameHeader h{};
  h.magic = kFrameMagic | type;
  h.pairOp = pairOp;
  h.kind = static_cast<uint8_t>(d.kind);
  h.dtype = static_cast<uint8_t>(d.dtype);
  h.op = static_cast<uint8_t>(d.op);
  h.root = d.root;
  h.count = d.count;
  h.len = len;
  return h;
}

CallDesc descOf(const FrameHeader& h) {
  CallDesc d;
  d.kind = static_cast<Collective>(h.kind);
  d.dtype = validDataType(h.dtype) ? static_cast<DataType>(h.dtype) : DataType::kFloat32;
  d.op = validRedOp(h.op) ? static_cast<RedOp>(h.op) : RedOp::kSum;
  d.root = h.root;
  d.count = h.count;
  return d;
}

// Spinning on a ring: a pause hint to the core between looks.
inline void cpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// How long progress() spins on shared-memory rings before it rings their doorbells and sleeps
// in poll(). Far below a scheduler slice (0.75-3 ms): when every core is busy (training's
// compute threads), a rank that keeps its core while it waits holds back the rank it waits for
// by a slice per step (4 ranks, 4 KiB all_reduce, 2 spinning processes on 2 cores: 1.5 ms a
// call); a woken rank runs at once. Above an idle call (4 ranks, 4 KiB: 17 us), which then
// never sleeps (see kTcpSpinSeconds for why that matters).
constexpr double kShmSpinSeconds = 0.00005;
// How long progress() polls TCP sockets without sleeping before it blocks in poll(). A rank
// that sleeps for every short wait is woken on its peer's core by the scheduler, and two ranks
// of one host then take turns on one core (64 KiB all_reduce on loopback: 40 -> 100 us, for
// good, after the job sat idle for a second). Spinning through short waits keeps each on its own.
constexpr double kTcpSpinSeconds = 0.002;

}  // namespace

Context::Context(Config config) : config_(std::move(config)) {
  MESHCCL_ENFORCE(config_.size >= 1, "world size must be >= 1, got ", config_.size);
  MESHCCL_ENFORCE(config_.rank >= 0 && config_.rank < config_.size, "rank ", config_.rank,
                  " is outside the world (size ", config_.size, ")");
  MESHCCL_ENFORCE(config_.connsPerLink >= 1 && config_.connsPerLink <= 64, "connections per link must be 1..64, got ",
                  config_.connsPerLink);
  MESHCCL_ENFORCE(config_.timeoutSeconds > 0, "timeout must be > 0 s");
  timeout_.store(config_.timeoutSeconds, std::memory_order_relaxed);
  MESHCCL_ENFORCE(config_.connectTimeoutSeconds > 0, "connect timeout must be > 0 s");
  MESHCCL_ENFORCE(config_.handshakeTimeoutSeconds > 0, "handshake timeout must be > 0 s");
  MESHCCL_ENFORCE(config_.maxPendingHandshakes >= 1, "at least one pending handshake must be allowed, got ",
                  config_.maxPendingHandshakes);
  MESHCCL_ENFORCE(config_.token.size() <= kMaxTokenBytes, "job token longer than ", kMaxTokenBytes, " bytes");
  if (config_.token.empty() && config_.size > 1) {
    if (!config_.allowNoToken) {
      raise(ErrorKind::kAuth,
            cat("rank ", config_.rank, ": no job token: without one any process that reaches a rank's port could "
                "join this job and read or write its data. Give every rank the same secret token (meshkit launch "
                "does; by hand: MESHCCL_TOKEN in the environment, or the config's token), or opt out explicitly "
                "(MESHCCL_ALLOW_NO_TOKEN=1, or the config's allow_no_token) on a network you trust"));
    }
    log(1, cat("rank ", config_.rank, ": WARNING: running WITHOUT a job token (opted out): any process that reaches "
               "this job's ports can join it"));
  }
  MESHCCL_ENFORCE(config_.segmentBytes >= 4096, "segment size must be >= 4096 bytes");
  MESHCCL_ENFORCE(config_.pipelineDepth >= 1 && config_.pipelineDepth <= 64, "pipeline depth must be 1..64");
  MESHCCL_ENFORCE(config_.transport == "auto" || config_.transport == "tcp", "transport must be auto or tcp, got '",
                  config_.transport, "'");
  MESHCCL_ENFORCE(config_.shmRingBytes >= 4096 && config_.shmRingBytes <= (size_t{1} << 30) &&
                      (config_.shmRingBytes & (config_.shmRingBytes - 1)) == 0,
                  "shared memory ring size must be a power of two from 4096 to 1073741824, got ", config_.shmRingBytes);
  MESHCCL_ENFORCE(config_.algorithm == "auto" || config_.algorithm == "ring" || config_.algorithm == "direct",
                  "algorithm must be auto, ring or direct, got '", config_.algorithm, "'");
  // Every rank on this host: a fact every rank must agree on, since the pipeline segment below
  // follows from it and both ends of a link cut their frames alike. A rank's own neighbours are
  // not enough (two hosts of three ranks in a ring: the middle ranks see only same-host
  // neighbours, the boundary ranks do not), so it needs the complete graph, where every rank
  // is every rank's neighbour.
  allOnHost_ = config_.complete && config_.size > 1 && config_.transport == "auto" &&
               static_cast<int>(config_.peers.size()) == config_.size - 1;
  for (const auto& p : config_.peers) allOnHost_ = allOnHost_ && p.sameHost;
  if (allOnHost_ && config_.shmSegmentBytes > 0) {
    MESHCCL_ENFORCE(config_.shmSegmentBytes >= 4096, "shared-memory segment size must be >= 4096 bytes");
    config_.segmentBytes = config_.shmSegmentBytes;  // the same on every rank: all share one host
  }
  pairs_.assign(static_cast<size_t>(config_.size), nullptr);
  waiting_.resize(static_cast<size_t>(config_.size));
  for (const auto& p : config_.peers) {
    if (p.rank < 0 || p.rank >= config_.size || p.rank == config_.rank) {
      raise(ErrorKind::kBootstrap, cat("rank ", config_.rank, ": peer rank ", p.rank, " is not another rank of a world of ",
                                       config_.size));
    }
    if (pairs_[p.rank] != nullptr) {
      raise(ErrorKind::kBootstrap, cat("rank ", config_.rank, ": peer rank ", p.rank, " is listed twice"));
    }
    if (p.links.empty()) raise(ErrorKind::kBootstrap, cat("rank ", config_.rank, ": peer rank ", p.rank, " has no link"));
    auto pr = std::make_unique<Pair>();
    pr->peer = p.rank;
    pr->sameHost = p.sameHost;
    pairs_[p.rank] = pr.get();
    pairStorage_.push_back(std::move(pr));
  }
  if (config_.complete) {
    for (int r = 0; r < config_.size; ++r) {
      if (r != config_.rank && pairs_[r] == nullptr) {
        raise(ErrorKind::kBootstrap,
              cat("rank ", config_.rank, ": the graph is declared complete but rank ", r, " is not a peer"));
      }
    }
  }
  if (config_.ring && config_.size > 1) {
    const int right = (config_.rank + 1) % config_.size;
    const int left = (config_.rank + config_.size - 1) % config_.size;
    if (pairs_[right] == nullptr || pairs_[left] == nullptr) {
      raise(ErrorKind::kBootstrap, cat("rank ", config_.rank, ": a ring is declared but rank ",
                                       pairs_[right] == nullptr ? right : left, " is not a peer"));
    }
  }
  if (config_.size > 1 && config_.algorithm == "direct" && !config_.complete) {
    raise(ErrorKind::kBootstrap, "algorithm 'direct' needs a link between every pair of ranks (a full mesh)");
  }
  if (config_.size > 1 && config_.algorithm == "ring" && !config_.ring) {
    raise(ErrorKind::kBootstrap, "algorithm 'ring' needs links from every rank to the next (rank order)");
  }
  MESHCCL_ENFORCE(config_.ringConns >= 1, "ring connections must be >= 1");
  if (config_.size > 1 && !config_.complete && !config_.ring) {
    raise(ErrorKind::kBootstrap, cat("rank ", config_.rank,
                                     ": the links form neither a ring through every rank (in rank order) nor a full "
                                     "mesh; meshccl needs one of them (cable the hosts in a ring)"));
  }
  connectAll();
  // abort() from another thread wakes a rank blocked in poll() through this pipe. Without one
  // (no descriptor left) poll() waits at most 50 ms at a time instead, and looks again.
  int wake[2];
  if (::pipe(wake) == 0) {
    wakeRead_ = Fd(wake[0]);
    wakeWrite_ = Fd(wake[1]);
    for (int fd : wake) {
      ::fcntl(fd, F_SETFD, FD_CLOEXEC);
      ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
    }
  } else {
    log(2, cat("rank ", config_.rank, ": pipe(): ", std::strerror(errno), ": abort() is noticed within 50 ms"));
  }
}

Context::~Context() {
  if (poisoned_) drainAfterFailure();
}

// After a failure this rank has sent its ABORT and shut its side. Closing a socket with unread
// bytes in it makes the kernel reset the connection, and a reset can overtake the ABORT on
// its way to a peer that has not read it yet; so read and discard until every peer has closed
// its side too (each fails and shuts down once it has our ABORT), for at most two seconds.
void Context::drainAfterFailure() {
  const double until = monotonicSeconds() + 2.0;
  for (;;) {
    std::vector<pollfd> fds;
    std::vector<Connection*> owners;
    for (auto* c : allConns_) {
      if (!c->link->open() || c->eof) continue;
      fds.push_back(pollfd{c->link->fd(), POLLIN, 0});
      owners.push_back(c);
    }
    const double left = until - monotonicSeconds();
    if (fds.empty() || left <= 0) return;
    if (::poll(fds.data(), fds.size(), static_cast<int>(std::ceil(left * 1000))) <= 0) continue;
    for (size_t i = 0; i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      char sink[65536];
      const ssize_t n = ::recv(owners[i]->link->fd(), sink, sizeof(sink), MSG_DONTWAIT);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) owners[i]->eof = true;
    }
  }
}

int Context::connCount(int peer) const {
  return connected(peer) ? static_cast<int>(pairs_[peer]->conns.size()) : 0;
}

std::string Context::transport(int peer) const {
  if (!connected(peer)) return "";
  size_t shm = 0;
  for (const auto& c : pairs_[peer]->conns) shm += std::strcmp(c->link->transport(), "shm") == 0 ? 1 : 0;
  return shm == 0 ? "tcp" : shm == pairs_[peer]->conns.size() ? "shm" : "shm+tcp";
}

std::string Context::transportSummary() const {
  bool shm = false;
  bool tcp = false;
  for (int peer = 0; peer < size(); ++peer) {
    const std::string t = transport(peer);
    shm = shm || t.find("shm") != std::string::npos;
    tcp = tcp || t.find("tcp") != std::string::npos;
  }
  return shm && tcp ? "shm+tcp" : shm ? "shm" : tcp ? "tcp" : "";
}

void Context::setTimeout(double seconds) {
  MESHCCL_ENFORCE(seconds > 0, "timeout must be > 0 s, got ", seconds);
  timeout_.store(seconds, std::memory_order_relaxed);
}

void Context::log(int level, const std::string& message) const {
  if (level > config_.logLevel) return;
  std::fprintf(stderr, "meshccl[rank %d]: %s\n", config_.rank, message.c_str());
  std::fflush(stderr);
}

void Context::checkHealthy() const {
  if (poisoned_) std::rethrow_exception(poisoned_);
  if (closed_) raise(ErrorKind::kInvalidArgument, "the communicator is closed");
}

void Context::close() {
  if (poisoned_) drainAfterFailure();
  // A link with no socket in place of each: every move fails as on a closed socket.
  for (auto* c : allConns_) c->link = std::make_unique<TcpLink>(Fd());
  listeners_.clear();
  closed_ = true;
}

Pair& Context::pair(int peer) {
  if (!connected(peer)) {
    raise(ErrorKind::kInvalidArgument, cat("rank ", rank(), " has no link to rank ", peer));
  }
  return *pairs_[peer];
}

Pair& Context::pairInOp(int peer) {
  Pair& p = pair(peer);
  if (p.lastOp != opCounter_) {  // first request of this operation on this pair
    ++p.opIndex;
    p.lastOp = opCounter_;
  }
  return p;
}

char* Context::scratch(size_t bytes) {
  if (scratch_.size() < bytes) {
    scratch_.clear();
    scratch_.shrink_to_fit();
    scratch_.resize(bytes);
  }
  return scratch_.data();
}

void Context::requestAbort(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(abortMu_);
    if (abortReason_.empty()) abortReason_ = reason.empty() ? "abort() was called" : reason;
  }
  abortRequested_.store(true, std::memory_order_release);
  const char b = 1;
  if (wakeWrite_) (void)!::write(wakeWrite_.get(), &b, 1);  // full pipe: a wake-up is pending anyway
}

std::string Context::abortReason() const {
  std::lock_guard<std::mutex> lock(abortMu_);
  return abortReason_;
}

void Context::abortIfRequested() {
  if (!abortRequested() || poisoned_ || closed_) return;
  const std::string msg = cat("rank ", rank(), ": the job was aborted between calls: ", abortReason());
  poisoned_ = std::make_exception_ptr(Error(ErrorKind::kAborted, msg));
  log(1, msg);
  sendAborts(ErrorKind::kAborted, msg);
}

void Context::failAborted() {
  fail(ErrorKind::kAborted, cat("rank ", rank(), ": ", describe(desc_), " was aborted: ", abortReason()));
}

void Context::pollInterrupts() {
  const double now = monotonicSeconds();
  if (now < nextInterruptCheck_) return;
  nextInterruptCheck_ = now + 0.05;
  if (interruptCheck_()) {
    requestAbort("interrupted (Ctrl-C)");
    failAborted();
  }
}

void Context::beginOp(const CallDesc& desc) {
  checkHealthy();
  MESHCCL_ENFORCE(!inOp_, "rank ", rank(), ": a collective is already running on this communicator (calls from "
                          "several threads go through the communicator's engine, which runs one at a time)");
  desc_ = desc;
  if (abortRequested()) failAborted();
  inOp_ = true;
  ++opCounter_;
  opTimeout_ = timeout();
  deadline_ = monotonicSeconds() + opTimeout_;
  reqsUsed_ = 0;
}

void Context::endOp(bool failed) {
  inOp_ = false;
  for (auto& w : waiting_) w.clear();
  for (auto* pr : pairs_) {
    if (pr != nullptr) pr->reading = false;
  }
  if (failed && !poisoned_) {
    const std::string msg = cat("rank ", rank(), ": ", describe(desc_), " was interrupted; the communicator is unusable");
    poisoned_ = std::make_exception_ptr(Error(ErrorKind::kIo, msg));
    sendAborts(ErrorKind::kIo, msg);
  }
  abortIfRequested();  // asked for after the last wait of this call: the peers still learn of it
}

Req* Context::newReq() {
  if (reqsUsed_ == reqs_.size()) reqs_.emplace_back();
  Req* r = &reqs_[reqsUsed_++];
  *r = Req{};
  return r;
}

Req* Context::postSend(int peer, int conn, const void* data, size_t len, Req::Handler* handler, uint64_t tag) {
  Pair& p = pairInOp(peer);
  Connection& c = *p.conns[static_cast<size_t>(conn) % p.conns.size()];
  Req* r = newReq();
  r->data = const_cast<char*>(static_cast<const char*>(data));
  r->len = len;
  r->isSend = true;
  r->handler = handler;
  r->tag = tag;
  r->peer = peer;
  r->hdr = makeHeader(kFrameData, p.opIndex, desc_, len);
  c.sendq.push_back(r);
  return r;
}

Req* Context::postRecv(int peer, int conn, void* data, size_t len, Req::Handler* handler, uint64_t tag) {
  Pair& p = pairInOp(peer);
  Connection& c = *p.conns[static_cast<size_t>(conn) % p.conns.size()];
  if (c.eof) {
    failClosed(c, cat("rank ", rank(), ": rank ", peer, " (", c.remote,
                      ") closed its connection (it exited or was killed) before ", describe(desc_)));
  }
  Req* r = newReq();
  r->data = static_cast<char*>(data);
  r->len = len;
  r->isSend = false;
  r->handler = handler;
  r->tag = tag;
  r->peer = peer;
  c.recvq.push_back(r);
  return r;
}

void Context::wait(Req* req) {
  while (!req->complete) progress();
}

void Context::waitAll() {
  for (;;) {
    bool pending = false;
    for (auto* c : allConns_) pending = pending || !c->sendq.empty() || !c->recvq.empty();
    if (!pending) return;
    progress();
  }
}

void Context::progress() {
  if (abortRequested_.load(std::memory_order_relaxed)) failAborted();
  if (interruptCheck_ && (++progressCalls_ & 255) == 0) pollInterrupts();
  if (ioPass()) return;
  // Links that must be spun on (shared memory): spin for kShmSpinSeconds (pause hints, then
  // yielding the core, which oversubscribed ranks need), looking at the sockets between rounds;
  // then prepare them to sleep (ring the doorbells of the rings this rank waits on) and block in
  // poll(): the peer that moves one of them sends a byte on the pair's socket. TCP only: poll
  // without sleeping for kTcpSpinSeconds, then block until something moves.
  const double spinUntil = monotonicSeconds() + (spin_ ? kShmSpinSeconds : kTcpSpinSeconds);
  std::vector<Connection*> doorbells;
  for (;;) {
    bool spinning = monotonicSeconds() < spinUntil;
    if (spin_ && spinning) {
      for (int i = 0; i < 64; ++i) {
        if (i < 8) {
          cpuRelax();
        } else {
          sched_yield();
        }
        if (ioPass()) return;
        if ((i & 7) == 7 && monotonicSeconds() >= spinUntil) break;
      }
      spinning = monotonicSeconds() < spinUntil;
    }
    std::vector<pollfd> fds;
    std::vector<Connection*> owners;
    fds.reserve(allConns_.size());
    bool moved = false;  // a link moved while it was prepared to sleep: do not sleep
    for (auto* c : allConns_) {
      const bool reading = !c->recvq.empty();
      const bool writing = !c->sendq.empty();
      // Idle connections are watched too, so an ABORT or a dead peer is noticed while this rank
      // waits on someone else (not while a frame of a later operation sits unread: peek()).
      const short events = c->link->pollEvents(reading, writing, !c->eof && c->peekIdleOp != opCounter_);
      if (events == 0) continue;
      if (!spinning && !moved && (reading || writing)) {
        doorbells.push_back(c);
        if (!c->link->prepareSleep(reading, writing)) moved = true;
      }
      fds.push_back(pollfd{c->link->fd(), events, 0});
      owners.push_back(c);
    }
    const size_t connFds = fds.size();
    if (wakeRead_) fds.push_back(pollfd{wakeRead_.get(), POLLIN, 0});  // abort() from another thread
    if (abortRequested_.load(std::memory_order_acquire)) failAborted();
    const double now = monotonicSeconds();
    const double left = deadline_ - now;
    if (left <= 0) timeoutFail();
    int ms = static_cast<int>(std::min(std::ceil(left * 1000), 1000.0 * 3600));
    if (spinning || moved || now < spinUntil) ms = 0;
    if (interruptCheck_) pollInterrupts();
    if (interruptCheck_ || !wakeRead_) ms = std::min(ms, 50);
    const int n = ::poll(fds.data(), fds.size(), ms);
    for (auto* c : doorbells) c->link->awake();
    doorbells.clear();
    if (n < 0 && errno != EINTR) fail(ErrorKind::kIo, cat("rank ", rank(), ": poll(): ", std::strerror(errno)));
    if (n == 0 && ms == 0 && !spin_) sched_yield();
    if (abortRequested_.load(std::memory_order_acquire)) failAborted();
    if (n > 0) {
      for (size_t i = 0; i < connFds; ++i) {
        if (fds[i].revents != 0) onReadable(*owners[i]);
      }
    }
    if (ioPass()) return;
  }
}

void Context::onReadable(Connection& c) {
  if (c.link->onReadable() && c.idle()) peek(c);
}

// A link whose socket is not its stream (shared memory) learns only there that its peer is gone:
// then an ABORT may be waiting in the stream.
void Context::checkLiveness(Connection& c) {
  if (c.link->checkPeer() && c.idle()) peek(c);
}

// Blocking write of a whole buffer, bounded by `deadline`; used only to push an ABORT out
// while failing. Returns false on error or when the deadline passes.
bool Context::writeAllUntil(Connection& c, const char* data, size_t len, double deadline) {
  while (len > 0) {
    iovec iov{const_cast<char*>(data), len};
    const ssize_t n = c.link->send(&iov, 1);
    if (n > 0) {
      data += n;
      len -= static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) return false;
    const double left = deadline - monotonicSeconds();
    if (left <= 0) return false;
    checkLiveness(c);
    c.link->waitBriefly(POLLOUT, static_cast<int>(std::ceil(left * 1000)));
  }
  return true;
}

bool Context::ioPass() {
  bool moved = false;
  for (auto* c : allConns_) {
    if (!c->sendq.empty()) moved = doSend(*c) || moved;
    if (!c->recvq.empty()) moved = doRecv(*c) || moved;
  }
  return moved;
}

bool Context::doSend(Connection& c) {
  bool moved = false;
  // A frame's last bytes go out now, not when TCP autocorking releases them: Linux holds a
  // write's small tail segment until earlier data has left the host, which behind a shaped
  // or busy link stalled every step of a pipeline (64 KiB frames: 20-170 ms each).
  bool ended = false;
  auto finish = [&] {
    if (ended) c.link->endFrame();
    return moved;
  };
  while (!c.sendq.empty()) {
    Req& r = *c.sendq.front();
    iovec iov[2];
    int n = 0;
    if (r.hdrDone < sizeof(FrameHeader)) {
      iov[n++] = {reinterpret_cast<char*>(&r.hdr) + r.hdrDone, sizeof(FrameHeader) - r.hdrDone};
    }
    if (r.done < r.len) iov[n++] = {r.data + r.done, r.len - r.done};
    if (n > 0) {
      const ssize_t sent = c.link->send(iov, n);
      if (sent < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) return finish();
        if (errno == EINTR) continue;
        // A peer that failed first closes its side after its ABORT: report that, if it is here.
        failPeer(c.peer, cat("rank ", rank(), ": sending to rank ", c.peer, " (", c.remote, ") failed: ",
                             c.link->failure(), " during ", describe(desc_)));
      }
      moved = true;
      auto left = static_cast<size_t>(sent);
      const size_t h = std::min(left, sizeof(FrameHeader) - r.hdrDone);
      r.hdrDone += h;
      left -= h;
      r.done += left;
    }
    if (r.hdrDone == sizeof(FrameHeader) && r.done == r.len) {
      c.sendq.pop_front();
      r.complete = true;
      moved = true;
      ended = true;
      if (r.handler != nullptr) r.handler->onComplete(r);
    } else {
      return finish();
    }
  }
  return finish();
}

bool Context::doRecv(Connection& c) {
  bool moved = false;
  while (!c.recvq.empty()) {
    Req& r = *c.recvq.front();
    iovec iov[2];
    int n = 0;
    if (r.hdrDone < sizeof(FrameHeader)) {
      iov[n++] = {reinterpret_cast<char*>(&r.hdr) + r.hdrDone, sizeof(FrameHeader) - r.hdrDone};
      // A reader learns from the header where the payload goes: it reads the header alone.
      if (r.len > 0 && r.role != Req::Role::kReader) iov[n++] = {r.data, r.len};
    } else {
      iov[n++] = {r.data + r.done, r.len - r.done};
    }
    const ssize_t got = c.link->recv(iov, n);
    if (got < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) return moved;
      if (errno == EINTR) continue;
      fail(ErrorKind::kIo, cat("rank ", rank(), ": receiving from rank ", c.peer, " (", c.remote, ") failed: ",
                               c.link->failure(), " during ", describe(desc_)));
    }
    if (got == 0) {
      c.eof = true;
      failClosed(c, cat("rank ", rank(), ": rank ", c.peer, " (", c.remote,
                        ") closed the connection (it exited or was killed) during ", describe(desc_)));
    }
    moved = true;
    auto left = static_cast<size_t>(got);
    if (r.hdrDone < sizeof(FrameHeader)) {
      const size_t h = std::min(left, sizeof(FrameHeader) - r.hdrDone);
      r.hdrDone += h;
      left -= h;
      r.done += left;
      if (r.hdrDone == sizeof(FrameHeader)) {
        if (r.role == Req::Role::kReader) {
          takeMessageHeader(c, r);
          if (r.done < r.len) continue;  // its payload may be here already
        } else if (r.role == Req::Role::kSegment) {
          checkSegment(c, r);
        } else {
          checkHeader(c, r);
        }
      }
    } else {
      r.done += left;
    }
    if (r.hdrDone == sizeof(FrameHeader) && r.done == r.len) {
      c.recvq.pop_front();
      r.complete = true;
      if (r.role == Req::Role::kReader) messageDone(c);
      if (r.handler != nullptr) r.handler->onComplete(r);
    } else {
      return moved;
    }
  }
  return moved;
}

void Context::checkFrame(Connection& c, Req& r) {
  const FrameHeader& h = r.hdr;
  if ((h.magic & 0xffff0000u) != kFrameMagic) {
    fail(ErrorKind::kIo, cat("rank ", rank(), ": protocol error on the connection from rank ", c.peer, " (", c.remote,
                             "): not a meshccl frame"));
  }
  if ((h.magic & 0xffffu) == kFrameAbort) receiveAbort(c, h, r.data, std::min(r.done, r.len));
}

void Context::checkHeader(Connection& c, Req& r) {
  const FrameHeader& h = r.hdr;
  checkFrame(c, r);
  const CallDesc theirs = descOf(h);
  const Pair& p = *pairs_[c.peer];
  if (theirs != desc_ || h.pairOp != p.opIndex) {
    std::string what;
    if (theirs.kind == Collective::kMessage) {
      what = cat("rank ", c.peer, " sent ", describe(theirs), " that no receive on rank ", rank(), " took before it called ",
                 describe(desc_));
    } else if (theirs != desc_) {
      what = cat("rank ", c.peer, " called ", describe(theirs), " while rank ", rank(), " called ", describe(desc_));
    } else {
      what = cat("rank ", c.peer, " is at its operation #", h.pairOp, " with rank ", rank(), ", which is at #",
                 p.opIndex, " (", describe(desc_), "): one of them made an extra or a missing call");
    }
    fail(ErrorKind::kMismatch, cat("mismatched collective calls: ", what,
                                   ". Every rank must make the same calls in the same order."));
  }
  if (h.len != r.len) {
    fail(ErrorKind::kMismatch, cat("mismatched collective calls: rank ", c.peer, " sent ", h.len, " bytes for ",
                                   describe(desc_), " where rank ", rank(), " expected ", r.len,
                                   " (different world size or algorithm settings across ranks?)"));
  }
}

void Context::peek(Connection& c) {
  FrameHeader h{};
  const ssize_t got = c.link->peek(&h, sizeof(h));
  if (got == 0) {
    c.eof = true;  // an error only if this rank still needs the peer
    return;
  }
  if (got < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return;
    c.eof = true;
    return;
  }
  if (static_cast<size_t>(got) < sizeof(h)) return;  // header not complete yet
  if (h.magic == (kFrameMagic | kFrameAbort)) {
    c.link->discard(sizeof(h));
    receiveAbort(c, h, nullptr, 0);
  }
  c.peekIdleOp = opCounter_;  // a frame of a later operation: read it then
}

// --- tagged messages --------------------------------------------------------------------------

namespace {

// A message's frames: segments of at most segmentBytes (more for a message over 65535 of them,
// whose index must fit the header's 16 bits), split alike on both ends.
size_t messageSegments(size_t bytes, size_t segmentBytes) {
  const size_t cap = std::max<size_t>({segmentBytes, 1, (bytes + 65534) / 65535});
  return std::max<size_t>(1, (bytes + cap - 1) / cap);
}

size_t messagePart(size_t bytes, size_t segs, size_t k) {
  const size_t base = bytes / segs;
  const size_t extra = bytes % segs;
  return k * base + std::min(k, extra);
}

uint32_t segmentOf(const FrameHeader& h) { return static_cast<uint32_t>(h.dtype) | static_cast<uint32_t>(h.op) << 8; }

}  // namespace

void Context::postMessage(int peer, uint32_t tag, const void* data, size_t len) {
  Pair& p = pair(peer);
  const uint32_t seq = p.msgSent++;
  const size_t segs = messageSegments(len, config_.segmentBytes);
  const char* base = static_cast<const char*>(data);
  for (size_t k = 0; k < segs; ++k) {
    const size_t o = messagePart(len, segs, k);
    const size_t l = messagePart(len, segs, k + 1) - o;
    Connection& c = *p.conns[k % p.conns.size()];
    Req* r = newReq();
    r->data = const_cast<char*>(base + o);
    r->len = l;
    r->isSend = true;
    r->peer = peer;
    FrameHeader h{};
    h.magic = kFrameMagic | kFrameData;
    h.pairOp = seq;
    h.kind = static_cast<uint8_t>(Collective::kMessage);
    h.dtype = static_cast<uint8_t>(k & 0xff);
    h.op = static_cast<uint8_t>(k >> 8);
    h.root = tag;
    h.count = len;
    h.len = l;
    r->hdr = h;
    c.sendq.push_back(r);
  }
}

bool Context::takeStashed(MessageRecv& m) {
  for (auto it = stash_.begin(); it != stash_.end(); ++it) {
    if (it->tag != m.tag || (m.peer >= 0 && it->peer != m.peer)) continue;
    if (it->data.size() != m.bytes) {
      fail(ErrorKind::kMismatch, cat("mismatched send/recv: rank ", it->peer, " sent ", it->data.size(),
                                     " bytes with tag ", it->tag, " where rank ", rank(), " receives ", m.bytes,
                                     " bytes from it with that tag"));
    }
    if (m.bytes > 0) std::memcpy(m.buf, it->data.data(), m.bytes);
    m.source = it->peer;
    m.matched = true;
    stash_.erase(it);
    return true;
  }
  return false;
}

void Context::receiveMessage(MessageRecv& m) {
  MESHCCL_ENFORCE(connected(m.peer), "rank ", rank(), " and rank ", m.peer,
                  " share no link; send/recv works between linked ranks only");
  if (takeStashed(m)) return;
  waiting_[m.peer].push_back(&m);
  postReader(m.peer);
}

void Context::postReader(int peer) {
  Pair& p = pair(peer);
  if (p.reading) return;
  Connection& c = *p.conns[0];
  if (c.eof) {
    failClosed(c, cat("rank ", rank(), ": rank ", peer, " (", c.remote,
                      ") closed its connection (it exited or was killed) before ", describe(desc_)));
  }
  Req* r = newReq();
  r->peer = peer;
  r->role = Req::Role::kReader;
  c.recvq.push_back(r);
  p.reading = true;
}

void Context::takeMessageHeader(Connection& c, Req& r) {
  const FrameHeader& h = r.hdr;
  checkFrame(c, r);
  if (h.kind != static_cast<uint8_t>(Collective::kMessage)) {
    fail(ErrorKind::kMismatch, cat("mismatched calls: rank ", c.peer, " called ", describe(descOf(h)), " while rank ",
                                   rank(), " waits for a message from it. Every rank must make the same calls in the "
                                   "same order; messages are received with recv, in any order of tags."));
  }
  Pair& p = pair(c.peer);
  if (h.pairOp != p.msgReceived || segmentOf(h) != 0) {
    fail(ErrorKind::kIo, cat("rank ", rank(), ": protocol error from rank ", c.peer, ": message #", h.pairOp,
                             " segment ", segmentOf(h), " where #", p.msgReceived, " segment 0 was due"));
  }
  ++p.msgReceived;
  const size_t bytes = h.count;
  const size_t segs = messageSegments(bytes, config_.segmentBytes);
  MessageRecv* into = nullptr;
  auto& waiting = waiting_[c.peer];
  for (auto it = waiting.begin(); it != waiting.end(); ++it) {
    if (!(*it)->matched && (*it)->tag == h.root) {
      into = *it;
      waiting.erase(it);
      break;
    }
  }
  char* dest;
  if (into != nullptr) {
    if (into->bytes != bytes) {
      fail(ErrorKind::kMismatch, cat("mismatched send/recv: rank ", c.peer, " sent ", bytes, " bytes with tag ",
                                     h.root, " where rank ", rank(), " receives ", into->bytes,
                                     " bytes from it with that tag"));
    }
    into->matched = true;
    into->source = c.peer;
    dest = into->buf;
  } else {
    stash_.push_back(StashedMessage{c.peer, h.root, std::vector<char>(bytes)});
    dest = stash_.back().data.data();
    log(2, cat("rank ", rank(), ": a message from rank ", c.peer, " with tag ", h.root, " (", bytes,
               " bytes) waits for its receive"));
  }
  const size_t first = messagePart(bytes, segs, 1);
  if (h.len != first) {
    fail(ErrorKind::kIo, cat("rank ", rank(), ": protocol error from rank ", c.peer, ": a ", h.len,
                             "-byte first segment of a ", bytes, "-byte message (", first, " expected)"));
  }
  r.data = dest;
  r.len = first;
  r.done = 0;  // a reader reads the header alone
  for (size_t k = 1; k < segs; ++k) {
    const size_t o = messagePart(bytes, segs, k);
    Connection& to = *p.conns[k % p.conns.size()];
    Req* s = newReq();
    s->data = dest + o;
    s->len = messagePart(bytes, segs, k + 1) - o;
    s->peer = c.peer;
    s->role = Req::Role::kSegment;
    s->msgSeq = h.pairOp;
    s->msgSeg = static_cast<uint32_t>(k);
    to.recvq.push_back(s);
  }
}

void Context::checkSegment(Connection& c, Req& r) {
  const FrameHeader& h = r.hdr;
  checkFrame(c, r);
  if (h.kind != static_cast<uint8_t>(Collective::kMessage) || h.pairOp != r.msgSeq || segmentOf(h) != r.msgSeg ||
      h.len != r.len) {
    fail(ErrorKind::kIo, cat("rank ", rank(), ": protocol error from rank ", c.peer, ": ", describe(descOf(h)),
                             " where segment ", r.msgSeg, " of message #", r.msgSeq, " (", r.len, " bytes) was due"));
  }
}

void Context::messageDone(Connection& c) {
  Pair& p = pair(c.peer);
  p.reading = false;
  auto& waiting = waiting_[c.peer];
  // A receive from any rank waits here only for this one message; a named one keeps reading.
  waiting.erase(std::remove_if(waiting.begin(), waiting.end(), [](MessageRecv* m) { return m->peer < 0; }),
                waiting.end());
  if (!waiting.empty()) postReader(c.peer);
}

int Context::peekFrame(Connection& c, FrameHeader& h) {
  const ssize_t got = c.link->peek(&h, sizeof(h));
  if (got == 0) return -1;
  if (got < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? 0 : -1;
  return static_cast<size_t>(got) == sizeof(h) ? 1 : 0;
}

void Context::receiveAnyMessage(MessageRecv& m) {
  for (;;) {
    if (takeStashed(m)) return;
    bool pending = false;
    for (auto* c : allConns_) pending = pending || !c->sendq.empty() || !c->recvq.empty();
    if (pending) {  // this operation's sends, and segments still landing, first
      progress();
      continue;
    }
    std::vector<Connection*> quiet;
    bool again = false;
    Connection* closed = nullptr;  // a rank that sent all it had and left is no error while others may send
    for (int peer = 0; peer < size(); ++peer) {
      if (!connected(peer)) continue;
      Connection& c = *pairs_[peer]->conns[0];
      FrameHeader h{};
      const int st = peekFrame(c, h);
      if (st < 0) {
        if (!c.eof) {  // gone: a failing rank left its ABORT on one of its connections (fail with its error)
          c.eof = true;
          const double until = monotonicSeconds() + 0.5;
          for (auto& other : pairs_[peer]->conns) {
            if (other.get() != &c && other->link->open()) findAbort(*other, until);
          }
        }
        closed = &c;
        continue;
      }
      if (st == 0) {
        quiet.push_back(&c);
        continue;
      }
      const bool abortFrame = (h.magic & 0xffffu) == kFrameAbort;
      if (!abortFrame && h.kind != static_cast<uint8_t>(Collective::kMessage)) continue;  // a rank already ahead
      waiting_[peer].push_back(&m);
      postReader(peer);
      waitAll();
      if (m.matched) return;
      again = true;  // the message had another tag (stashed): look again
      break;
    }
    if (again) continue;
    if (quiet.empty() && closed != nullptr) {
      failClosed(*closed, cat("rank ", rank(), ": rank ", closed->peer, " (", closed->remote,
                              ") closed the connection (it exited or was killed) while rank ", rank(),
                              " waits for a message from any rank, and no other rank can send one"));
    }
    waitForAny(quiet);  // none quiet: every rank is ahead in a collective, and this waits for the deadline
  }
}

void Context::waitForAny(const std::vector<Connection*>& conns) {
  if (abortRequested_.load(std::memory_order_acquire)) failAborted();
  if (interruptCheck_) pollInterrupts();
  const double left = deadline_ - monotonicSeconds();
  if (left <= 0) timeoutFail();
  std::vector<pollfd> fds;
  bool moved = false;  // a link moved while it was prepared to sleep: look again at once
  for (auto* c : conns) {
    const short events = c->link->pollEvents(true, false, false);
    if (events == 0) continue;
    fds.push_back(pollfd{c->link->fd(), events, 0});
    if (!c->link->prepareSleep(true, false)) moved = true;
  }
  if (wakeRead_) fds.push_back(pollfd{wakeRead_.get(), POLLIN, 0});
  const int ms = moved ? 0 : static_cast<int>(std::min(std::ceil(left * 1000), 50.0));
  const int n = ::poll(fds.data(), fds.size(), ms);
  if (n < 0 && errno != EINTR) fail(ErrorKind::kIo, cat("rank ", rank(), ": poll(): ", std::strerror(errno)));
  for (auto* c : conns) {
    c->link->awake();
    checkLiveness(*c);
  }
}

void Context::receiveAbort(Connection& c, const FrameHeader& hdr, const char* prefix, size_t prefixLen) {
  const size_t len = std::min<uint64_t>(hdr.len, 64 << 10);
  std::string text(prefix != nullptr ? prefix : "", std::min(prefixLen, len));
  const double until = monotonicSeconds() + 2.0;
  while (text.size() < len && monotonicSeconds() < until) {
    char buf[4096];
    iovec iov{buf, std::min(sizeof(buf), len - text.size())};
    const ssize_t n = c.link->recv(&iov, 1);
    if (n > 0) {
      text.append(buf, static_cast<size_t>(n));
    } else if (n == 0) {
      break;
    } else if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
      c.link->waitBriefly(POLLIN, 100);
    } else {
      break;
    }
  }
  const auto kind = validErrorKind(hdr.errKind) ? static_cast<ErrorKind>(hdr.errKind) : ErrorKind::kIo;
  fail(kind, text);
}

void Context::sendAborts(ErrorKind kind, const std::string& message) {
  // A peer that is not reading cannot take a frame's tail nor the ABORT behind it: bounded. An
  // abort (Ctrl-C, abort(), close during a call) must return promptly, so it waits less.
  const double until = monotonicSeconds() + (kind == ErrorKind::kAborted ? 0.25 : 1.0);
  for (auto* pr : pairs_) {
    if (pr == nullptr) continue;
    // One connection per peer: prefer one with no frame half-sent; otherwise finish that frame
    // first so the peer's framing stays intact.
    Connection* pick = nullptr;
    for (auto& c : pr->conns) {
      if (!c->link->open() || c->eof) continue;
      const bool clean = c->sendq.empty() || (c->sendq.front()->hdrDone == 0 && c->sendq.front()->done == 0);
      if (clean) {
        pick = c.get();
        break;
      }
      if (pick == nullptr) pick = c.get();
    }
    if (pick == nullptr) continue;
    if (!pick->sendq.empty()) {
      Req& r = *pick->sendq.front();
      if (r.hdrDone > 0 || r.done > 0) {
        const bool ok =
            writeAllUntil(*pick, reinterpret_cast<char*>(&r.hdr) + r.hdrDone, sizeof(FrameHeader) - r.hdrDone, until) &&
            writeAllUntil(*pick, r.data + r.done, r.len - r.done, until);
        if (!ok) continue;
      }
    }
    FrameHeader h = makeHeader(kFrameAbort, pr->opIndex, desc_, message.size());
    h.errKind = static_cast<uint8_t>(kind);
    if (writeAllUntil(*pick, reinterpret_cast<const char*>(&h), sizeof(h), until)) {
      writeAllUntil(*pick, message.data(), message.size(), until);
    }
  }
  // The peers read the ABORT, then end-of-stream. The sockets stay open (closing with unread
  // bytes would reset the connection and could discard the ABORT before the peer reads it).
  for (auto* c : allConns_) {
    c->link->closeWrite();
    c->sendq.clear();
    c->recvq.clear();
  }
}

void Context::failPeer(int peer, const std::string& message) {
  if (!poisoned_ && connected(peer)) {
    const double until = monotonicSeconds() + 0.5;
    for (auto& c : pairs_[peer]->conns) {
      if (c->link->open()) findAbort(*c, until);  // throws when found
    }
  }
  fail(ErrorKind::kIo, message);
}

void Context::failClosed(Connection& c, const std::string& message) {
  if (!poisoned_ && c.peer >= 0 && static_cast<size_t>(c.peer) < pairs_.size() && pairs_[c.peer] != nullptr) {
    const double until = monotonicSeconds() + 0.5;
    for (auto& other : pairs_[c.peer]->conns) {
      if (other.get() != &c && other->link->open()) findAbort(*other, until);  // throws when found
    }
  }
  fail(ErrorKind::kIo, message);
}

// Reads on past this connection's data frames (this rank is failing: they are not needed) to an
// ABORT, and fails with it. Returns at the end of the stream, a stall past `deadline`, or a stream
// it cannot follow (a header half read).
void Context::findAbort(Connection& c, double deadline) {
  size_t skip = 0;
  if (!c.recvq.empty()) {
    const Req& r = *c.recvq.front();
    if (r.hdrDone > 0 && r.hdrDone < sizeof(FrameHeader)) return;
    if (r.hdrDone == sizeof(FrameHeader)) skip = r.len - r.done;
  }
  std::vector<char> sink(4096);
  for (int frames = 0; frames < 1024; ++frames) {
    while (skip > 0) {
      const size_t n = std::min(skip, sink.size());
      if (!readUntil(c, sink.data(), n, deadline)) return;
      skip -= n;
    }
    FrameHeader h{};
    if (!readUntil(c, reinterpret_cast<char*>(&h), sizeof(h), deadline)) return;
    if ((h.magic & 0xffff0000u) != kFrameMagic) return;
    if ((h.magic & 0xffffu) == kFrameAbort) receiveAbort(c, h, nullptr, 0);
    skip = h.len;
  }
}

bool Context::readUntil(Connection& c, char* data, size_t len, double deadline) {
  while (len > 0) {
    iovec iov{data, len};
    const ssize_t n = c.link->recv(&iov, 1);
    if (n > 0) {
      data += n;
      len -= static_cast<size_t>(n);
      continue;
    }
    if (n == 0) return false;
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return false;
    if (monotonicSeconds() > deadline) return false;
    c.link->waitBriefly(POLLIN, 20);
  }
  return true;
}

void Context::fail(ErrorKind kind, const std::string& message) {
  if (!poisoned_) {
    poisoned_ = std::make_exception_ptr(Error(kind, message));
    log(1, message);
    sendAborts(kind, message);
  }
  inOp_ = false;
  std::rethrow_exception(poisoned_);
}

std::string Context::pendingSummary() const {
  std::string out;
  for (auto* c : allConns_) {
    if (!c->recvq.empty()) {
      out += cat(out.empty() ? "" : ", ", "data from rank ", c->peer, " (", c->remote, ")");
    } else if (!c->sendq.empty()) {
      out += cat(out.empty() ? "" : ", ", "rank ", c->peer, " (", c->remote, ") to accept data");
    }
  }
  return out.empty() ? "nothing" : out;
}

void Context::timeoutFail() {
  fail(ErrorKind::kTimeout, cat("rank ", rank(), ": ", describe(desc_), " timed out after ", opTimeout_,
                                " s waiting for ", pendingSummary(),
                                " (a peer is stalled, stopped or much slower; raise the timeout with "
                                "MESHCCL_TIMEOUT if the job is just slow)"));
}

}  // namespace meshccl
