#pragma once

// The communicator: one rank's connections to the ranks it shares a link with, and the progress
// engine every algorithm drives. No global state: many contexts can coexist in one process.
//
// Engine model. An algorithm posts sends and receives (Req) on a connection; each connection
// carries frames in FIFO order per direction, and both ends post in the same order because
// they run the same deterministic schedule. progress() moves bytes on every connection with
// work (non-blocking), blocks in poll() only when nothing can move, and calls the request's
// handler the moment a request completes — before the next frame on that connection is read —
// so an algorithm can reduce a segment before the bytes that follow it land. Every wait is
// bounded by the operation's deadline.
//
// Every frame carries the call it belongs to (collective, dtype, op, count, root) and a
// per-pair operation index: a receiver that sees another call raises a MismatchError. Any
// failure — mismatch, timeout, a peer gone — poisons the context and is sent as an ABORT frame
// to every connected peer, which forwards it: every rank raises the same named error instead
// of waiting for bytes that will never come.

#include <sys/types.h>
#include <sys/uio.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "meshccl/error.h"
#include "meshccl/frame.h"
#include "meshccl/link.h"
#include "meshccl/socket.h"
#include "meshccl/types.h"

namespace meshccl {

struct Endpoint {
  std::string address;
  int port = 0;
};

// A rank this rank shares a link with, and where to reach it (one entry per link: one per
// cable, or one for loopback / a rendezvous address).
struct PeerSpec {
  int rank = -1;
  std::vector<Endpoint> links;
  // Who opens the connections: 1 this rank (to `links`), 0 the peer (this rank accepts),
  // -1 the higher rank of the two (both ends must agree).
  int initiate = -1;
  // Both ranks run on one host (the bootstrap knows from the hostfile): with transport "auto"
  // their connections carry data through shared memory; TCP stays as the liveness signal.
  bool sameHost = false;
};

struct Config {
  int rank = 0;
  int size = 1;
  std::string token;              // job token: each end of a connection proves it; never sent, never logged
  std::string jobId;              // the job's name (not secret), mixed into every proof: other jobs' proofs fail
  bool allowNoToken = false;      // the user's explicit opt-out: an empty token is accepted (logged at start)
  std::vector<Endpoint> listen;   // the only addresses this rank listens on
  std::vector<PeerSpec> peers;    // directly connected ranks
  int connsPerLink = 2;           // TCP connections per link
  double timeoutSeconds = 300.0;  // per operation
  double connectTimeoutSeconds = 60.0;
  // Every incoming connection must finish its handshake within this time (or the connect
  // timeout, if shorter), and at most maxPendingHandshakes may be unfinished at once (a new one
  // drops the oldest): idle or slow strangers cannot hold a rank's descriptors or stall the job.
  double handshakeTimeoutSeconds = 5.0;
  int maxPendingHandshakes = 64;
  // Global facts about the connection graph, the same on every rank (computed by the bootstrap
  // from the whole hostfile): every pair of ranks connected / rank r connected to r+1 mod size.
  bool complete = false;
  bool ring = false;
  int ringConns = 1;                // connections per ring neighbour pair, the minimum over the ring
  size_t segmentBytes = 256 << 10;  // pipeline segment of the large-message algorithms
  size_t smallBytes = 64 << 10;     // up to this many bytes: the latency-optimised algorithm
  int pipelineDepth = 4;            // segments in flight per channel (bounded scratch)
  std::string algorithm = "auto";   // auto | ring | direct (tests and benchmarks force one)
  int socketBufferBytes = 0;        // 0: kernel autotuning
  std::string transport = "auto";   // auto: shared memory between same-host ranks | tcp: TCP only
  size_t shmRingBytes = 256 << 10;  // per direction and connection (power of two)
  // The pipeline segment when every rank is on this host (shared memory only): memcpy has no
  // per-frame cost worth amortising, and smaller segments pipeline finer and stay in cache.
  // 0: segmentBytes.
  size_t shmSegmentBytes = 64 << 10;
  // From this many bytes, when every rank is on this host, collectives read the peers' buffers
  // straight out of their memory (one copy, Linux process_vm_readv) instead of passing them
  // through the rings. 0: never.
  size_t singleCopyBytes = 256 << 10;
  int logLevel = 1;                 // 0 quiet, 1 rejections and failures, 2 connect progress
};

// What the connect phase saw: for diagnostics and tests (none of it is secret).
struct ConnectStats {
  uint64_t pollRounds = 0;      // waits in poll() of the connect loop
  uint64_t accepted = 0;        // connections taken from the listeners
  uint64_t rejected = 0;        // refused by the handshake: malformed hello, unexpected rank, failed proof, duplicate
  uint64_t closedEarly = 0;     // closed (or failed) by the other end before the handshake finished
  uint64_t timedOut = 0;        // dropped: no complete handshake within the handshake timeout
  uint64_t evicted = 0;         // dropped as the oldest pending handshake (cap reached, or to free a descriptor)
  uint64_t acceptBackoffs = 0;  // accept() failed for want of descriptors or memory: listening paused
  uint64_t logsSuppressed = 0;  // rejection lines not written one by one (rate limit)
};

class Context;

// One receive of a tagged message (messages(), collectives.h): `bytes` at `buf` from `peer` (-1:
// any linked rank) whose sender gave `tag`.
struct MessageRecv {
  int peer = -1;
  uint32_t tag = 0;
  char* buf = nullptr;
  size_t bytes = 0;
  int source = -1;       // the rank it came from, once matched
  bool matched = false;  // a message was given to this receive (its segments may still be landing)
};

// A message no receive wanted when it arrived: kept until one does (in arrival order).
struct StashedMessage {
  int peer = -1;
  uint32_t tag = 0;
  std::vector<char> data;
};

// One posted send or receive of one frame.
struct Req {
  struct Handler {
    virtual void onComplete(Req& req) = 0;

   protected:
    ~Handler() = default;
  };

  char* data = nullptr;
  size_t len = 0;
  size_t done = 0;  // payload bytes moved
  FrameHeader hdr{};
  size_t hdrDone = 0;
  bool isSend = false;
  bool complete = false;
  Handler* handler = nullptr;
  uint64_t tag = 0;  // the algorithm's own bookkeeping
  int peer = -1;
  // Messages: a reader takes the header of the peer's next message and then decides where its
  // payload goes (a waiting receive, or the stash); a segment is a later frame of that message.
  enum class Role : uint8_t { kFrame, kReader, kSegment };
  Role role = Role::kFrame;
  uint32_t msgSeq = 0;
  uint32_t msgSeg = 0;
};

// One connection of a pair: its byte stream (link.h) and the engine's bookkeeping of it.
struct Connection {
  std::unique_ptr<Link> link;  // TCP, or shared memory with the socket as liveness signal
  int peer = -1;
  int index = 0;
  std::string remote;  // address text for messages
  std::deque<Req*> sendq;
  std::deque<Req*> recvq;
  bool eof = false;           // the peer closed its side (fine until a request needs it)
  uint64_t peekIdleOp = 0;    // op during which a data frame of a later op sits unread here
  bool idle() const { return sendq.empty() && recvq.empty(); }
};

struct Pair {
  int peer = -1;
  std::vector<std::unique_ptr<Connection>> conns;
  uint32_t opIndex = 0;  // operations this pair has taken part in
  uint64_t lastOp = 0;   // context op counter when opIndex was last advanced
  bool sameHost = false;
  int pid = 0;           // the peer's process, when this rank can read its memory (single copy)
  // Tagged messages do not count as operations of the pair (a message may be taken long after
  // it was sent, or from the stash): each direction numbers its own, so a lost or doubled
  // frame is caught.
  uint32_t msgSent = 0;
  uint32_t msgReceived = 0;
  bool reading = false;  // a reader is posted on the first connection
};

class Context {
 public:
  // Listens, connects to every peer (bounded retry until connectTimeoutSeconds); every
  // connection proves the job token both ways (handshake.h) and strangers are dropped while the
  // job goes on forming. Raises kBootstrap / kTimeout / kAuth naming ranks and addresses.
  explicit Context(Config config);
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  int rank() const { return config_.rank; }
  int size() const { return config_.size; }
  const Config& config() const { return config_; }
  bool connected(int peer) const { return peer >= 0 && peer < size() && pairs_[peer] != nullptr; }
  int connCount(int peer) const;
  // "shm", "tcp", or "shm+tcp" (some connections fell back); "" when not linked.
  std::string transport(int peer) const;
  // Over every linked peer: "shm", "tcp" or "shm+tcp" (some peers or connections each way);
  // "" for a rank alone.
  std::string transportSummary() const;
  // Per operation; set from any thread, it applies from the next operation on.
  double timeout() const { return timeout_.load(std::memory_order_relaxed); }
  // Every peer is on this host and this rank can read its memory (see Config::singleCopyBytes);
  // never in a build without single copy (platform::kSingleCopy). Local: a call only uses
  // single copy when every rank says so.
  bool canReadPeers() const { return canReadPeers_; }
  // Every rank is on this host with shared memory allowed (the same on every rank: from the
  // hostfile and options), so large calls try single copy.
  bool allOnHost() const { return allOnHost_; }
  int peerPid(int peer) const { return pairs_[peer]->pid; }
  void setTimeout(double seconds);
  const ConnectStats& connectStats() const { return connectStats_; }

  // Raises the stored error if an earlier failure poisoned the context.
  void checkHealthy() const;

  // --- any thread ----------------------------------------------------------------------------
  // Asks the running operation (or, if none runs, the next one) to fail with kAborted naming
  // `reason`: it poisons the context and sends ABORT to every peer, whose calls end with the
  // same error. Wakes a rank blocked in poll(). The first reason given is the one reported.
  void requestAbort(const std::string& reason);
  bool abortRequested() const { return abortRequested_.load(std::memory_order_acquire); }

  // --- the thread that drives the I/O (one at a time: the Engine sees to it) -----------------
  // No operation runs: if an abort was requested and the context is healthy, poison it and
  // send the ABORTs now, so peers blocked in a call learn of it.
  void abortIfRequested();
  // Called about every 50 ms while an operation runs or waits; true fails the operation with
  // kAborted ("interrupted"). The Python binding looks for Ctrl-C here. Empty: none.
  void setInterruptCheck(std::function<bool()> check) { interruptCheck_ = std::move(check); }
  // Closes every connection; later calls raise.
  void close();

  // --- used by the algorithms --------------------------------------------------------------
  void beginOp(const CallDesc& desc);
  // failed: the operation ended by an exception; unless that already poisoned the context,
  // it does now (requests may still be queued, the peers' streams are mid-frame).
  void endOp(bool failed);
  Req* postSend(int peer, int conn, const void* data, size_t len, Req::Handler* handler = nullptr,
                uint64_t tag = 0);
  Req* postRecv(int peer, int conn, void* data, size_t len, Req::Handler* handler = nullptr, uint64_t tag = 0);
  // Moves bytes; returns once at least one request made progress (blocking in poll if needed).
  void progress();
  void wait(Req* req);
  void waitAll();  // every request of this operation
  // --- tagged messages (messages(), collectives.h); inside an operation ---------------------
  // Posts one message to `peer`: frames of kind kMessage carrying the tag and the total size,
  // striped over the pair's connections like any large transfer.
  void postMessage(int peer, uint32_t tag, const void* data, size_t len);
  // Gives `m` the oldest stashed message that fits it (true), or queues it on its peer: the
  // peer's next messages go to the first waiting receive with their tag, the others to the
  // stash. m.peer must be a rank (not -1). `m` must outlive the operation.
  void receiveMessage(MessageRecv& m);
  // A receive from any linked rank: the stash first, else the first message any peer sends
  // (messages with another tag are stashed on the way). Drives the operation's other requests.
  void receiveAnyMessage(MessageRecv& m);
  size_t stashedMessages() const { return stash_.size(); }

  // Scratch memory owned by the context, reused across operations (grown, never shrunk).
  char* scratch(size_t bytes);
  [[noreturn]] void fail(ErrorKind kind, const std::string& message);
  // `peer` is gone (its memory cannot be read): fail with the ABORT it sent before it went, if
  // one waits on any of its connections (its own error is the one to report), else with
  // kIo and `message`.
  [[noreturn]] void failPeer(int peer, const std::string& message);
  const CallDesc& currentCall() const { return desc_; }
  uint64_t opCount() const { return opCounter_; }
  void log(int level, const std::string& message) const;

 private:
  void connectAll();
  void setupSharedMemory();
  bool writeAllUntil(Connection& c, const char* data, size_t len, double deadline);
  // c's socket polled readable (onReadable), or a look whether its peer lives without one
  // (checkLiveness): an idle connection then peeks for an ABORT or the end of the stream.
  void onReadable(Connection& c);
  void checkLiveness(Connection& c);
  bool ioPass();
  bool doSend(Connection& c);
  bool doRecv(Connection& c);
  // Any frame: a meshccl frame (else kIo), and not an ABORT (else fails with the peer's error).
  void checkFrame(Connection& c, Req& r);
  void checkHeader(Connection& c, Req& r);
  void checkSegment(Connection& c, Req& r);
  void takeMessageHeader(Connection& c, Req& r);
  void messageDone(Connection& c);
  void postReader(int peer);
  bool takeStashed(MessageRecv& m);
  // The first connection's next frame: 1 a whole header in h, 0 nothing yet, -1 closed.
  int peekFrame(Connection& c, FrameHeader& h);
  void waitForAny(const std::vector<Connection*>& conns);
  void peek(Connection& c);
  [[noreturn]] void receiveAbort(Connection& c, const FrameHeader& hdr, const char* prefix, size_t prefixLen);
  void sendAborts(ErrorKind kind, const std::string& message);
  // A peer's connection ended while this rank needs it. A failing peer sends its ABORT on one
  // connection, then closes them all, so the close can be met first on another: look for that
  // ABORT on the peer's other connections (failing with the peer's own error), else fail with
  // `message`.
  [[noreturn]] void failClosed(Connection& c, const std::string& message);
  void findAbort(Connection& c, double deadline);
  bool readUntil(Connection& c, char* data, size_t len, double deadline);
  void drainAfterFailure();
  [[noreturn]] void timeoutFail();
  [[noreturn]] void failAborted();
  void pollInterrupts();
  std::string abortReason() const;
  std::string pendingSummary() const;
  Pair& pair(int peer);
  Pair& pairInOp(int peer);  // the pair, its operation index advanced once per operation
  Req* newReq();

  Config config_;
  ConnectStats connectStats_;
  std::vector<Fd> listeners_;
  std::vector<std::unique_ptr<Pair>> pairStorage_;
  std::vector<Pair*> pairs_;         // by rank; nullptr where no link
  std::vector<Connection*> allConns_;
  bool spin_ = false;  // some link must be spun on (Link::mustSpin): progress() spins before it sleeps
  bool canReadPeers_ = false;
  bool allOnHost_ = false;
  std::exception_ptr poisoned_;
  bool closed_ = false;
  bool inOp_ = false;
  CallDesc desc_{};
  uint64_t opCounter_ = 0;
  double deadline_ = 0;
  double opTimeout_ = 0;  // the timeout of the running operation
  std::deque<Req> reqs_;  // requests of the current operation (stable addresses)
  size_t reqsUsed_ = 0;
  std::vector<char> scratch_;
  std::vector<std::vector<MessageRecv*>> waiting_;  // by peer: receives of this operation not yet given a message
  std::deque<StashedMessage> stash_;
  // abort(): the flag, its reason, and a pipe whose read end is in every poll() of an operation.
  std::atomic<double> timeout_{0};
  std::atomic<bool> abortRequested_{false};
  mutable std::mutex abortMu_;
  std::string abortReason_;
  Fd wakeRead_;
  Fd wakeWrite_;
  std::function<bool()> interruptCheck_;
  double nextInterruptCheck_ = 0;
  unsigned progressCalls_ = 0;
};

}  // namespace meshccl
