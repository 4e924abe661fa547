#pragma once

// A connection's byte stream, as the progress engine (context.h) drives it. The engine moves
// bytes, polls, sleeps and fails through this one interface and never asks which kind of link it
// holds:
//
//   TcpLink           the socket is the stream.
//   SharedMemoryLink  ShmLink's rings (shm.h) carry the bytes; the pair's TCP socket stays as the
//                     liveness signal (a dead peer closes it) and the doorbell channel (a byte
//                     wakes a peer asleep in poll() on a ring this end moved).
//
// Every link has a socket: the TCP connection the handshake authenticated. poll() watches it for
// what pollEvents() says. Context::close() swaps every link for a TcpLink without one, on which
// every move fails as on a closed socket.
//
// The hot path (Context::ioPass -> doSend/doRecv) makes one indirect call per byte move: send()
// and recv() are the only virtual calls per move, and the classes below are final.

#include <sys/types.h>
#include <sys/uio.h>

#include <memory>
#include <string>

#include "meshccl/shm.h"
#include "meshccl/socket.h"

namespace meshccl {

class Link {
 public:
  virtual ~Link() = default;
  Link(const Link&) = delete;
  Link& operator=(const Link&) = delete;

  // "tcp" or "shm" (Context::transport()).
  virtual const char* transport() const = 0;
  // The socket; -1 once closed.
  int fd() const { return fd_.get(); }
  bool open() const { return static_cast<bool>(fd_); }
  // Hands the socket over (the connect phase moves it into the link that replaces this one).
  Fd takeSocket() { return std::move(fd_); }
  // poll() cannot see this link's bytes move: the engine spins on it before it sleeps, and
  // sleeps only after prepareSleep() (Context::progress()).
  bool mustSpin() const { return mustSpin_; }

  // --- byte moves: like sendmsg/recvmsg on a non-blocking socket --------------------------------
  // The count moved, or -1 with errno: EAGAIN / EWOULDBLOCK (nothing can move now), EINTR, or an
  // error (failure() says why); recv() and peek(): 0 at the end of the stream.
  virtual ssize_t send(const iovec* iov, int n) = 0;
  virtual ssize_t recv(const iovec* iov, int n) = 0;
  // Up to `len` bytes without consuming them.
  virtual ssize_t peek(void* dst, size_t len) = 0;
  // Consumes `len` bytes peek() showed.
  virtual void discard(size_t len) = 0;
  // A frame's last bytes went to send(): have them leave now (TCP autocorking would hold a
  // small tail until earlier data has left the host).
  virtual void endFrame() = 0;
  // End of the stream for the peer once it has read what was sent (shutdown(SHUT_WR)); this end
  // still reads.
  virtual void closeWrite() = 0;
  // Why the last move failed, from errno as it left it: the text of an I/O error.
  virtual std::string failure() const = 0;

  // --- waiting --------------------------------------------------------------------------------
  // What poll() watches the socket for while the engine waits (0: leave it out): `reading` /
  // `writing`, requests wait to move that way; `watchIdle`, neither does but the stream should
  // still be watched (an ABORT, or a dead peer, while this rank waits on someone else).
  virtual short pollEvents(bool reading, bool writing, bool watchIdle) const = 0;
  // The engine is about to block in poll() until this link moves the way it waits. A link that
  // must be spun on rings its doorbells; false: sleeping is wrong (the link moved meanwhile, or
  // the peer closed). awake() after the poll() undoes it.
  virtual bool prepareSleep(bool reading, bool writing) = 0;
  virtual void awake() = 0;
  // poll() found the socket readable. True when an idle connection should peek at the stream (an
  // ABORT, or its end, may be there): TCP always; a link whose socket is not its stream takes
  // what is there (doorbell bytes) and answers checkPeer().
  virtual bool onReadable() = 0;
  // Looks, without waiting, whether the peer is gone in a way only the socket tells: true for a
  // link whose socket is not its stream when it closed (the stream may still hold an ABORT);
  // TCP: false (its stream says so itself).
  virtual bool checkPeer() = 0;
  // Waits briefly, at most `ms`, for the stream to be ready for `events` (POLLIN / POLLOUT); a
  // link poll() cannot see yields the core once instead. Failure paths only.
  virtual void waitBriefly(short events, int ms) = 0;

 protected:
  Link(Fd fd, bool mustSpin) : fd_(std::move(fd)), mustSpin_(mustSpin) {}
  // The text of an I/O error from errno.
  static std::string errnoFailure();

  Fd fd_;

 private:
  bool mustSpin_;
};

class TcpLink final : public Link {
 public:
  explicit TcpLink(Fd socket) : Link(std::move(socket), false) {}
  const char* transport() const override { return "tcp"; }
  ssize_t send(const iovec* iov, int n) override;
  ssize_t recv(const iovec* iov, int n) override;
  ssize_t peek(void* dst, size_t len) override;
  void discard(size_t len) override;
  void endFrame() override;
  void closeWrite() override;
  std::string failure() const override { return errnoFailure(); }
  short pollEvents(bool reading, bool writing, bool watchIdle) const override;
  bool prepareSleep(bool /*reading*/, bool /*writing*/) override { return true; }
  void awake() override {}
  bool onReadable() override { return true; }
  bool checkPeer() override { return false; }
  void waitBriefly(short events, int ms) override;
};

class SharedMemoryLink final : public Link {
 public:
  SharedMemoryLink(Fd socket, std::unique_ptr<ShmLink> rings)
      : Link(std::move(socket), true), rings_(std::move(rings)) {}
  const char* transport() const override { return "shm"; }
  const ShmLink& rings() const { return *rings_; }
  ssize_t send(const iovec* iov, int n) override;
  ssize_t recv(const iovec* iov, int n) override;
  ssize_t peek(void* dst, size_t len) override;
  void discard(size_t len) override { rings_->discard(len); }
  void endFrame() override {}
  void closeWrite() override;
  // A broken ring's reason (the peer broke the rings' protocol), else errno's.
  std::string failure() const override;
  // POLLIN: the end of the socket, or a doorbell's byte; nothing once the socket closed.
  short pollEvents(bool reading, bool writing, bool watchIdle) const override;
  bool prepareSleep(bool reading, bool writing) override;
  void awake() override { rings_->awake(); }
  bool onReadable() override { return checkPeer(); }
  // Drains the doorbell bytes: true once the socket has closed.
  bool checkPeer() override;
  void waitBriefly(short events, int ms) override;

 private:
  // Wakes the peer asleep in poll() on a ring this end just moved: one byte on the socket.
  void ringPeer();

  std::unique_ptr<ShmLink> rings_;
  bool peerGone_ = false;  // the peer closed its socket (what is in the ring is still read)
};

}  // namespace meshccl
