#include "meshccl/link.h"

#include <poll.h>
#include <sched.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "meshccl/error.h"
#include "meshccl/platform.h"

namespace meshccl {

std::string Link::errnoFailure() { return cat(std::strerror(errno), " (the peer exited or was killed)"); }

// --- TCP ------------------------------------------------------------------------------------------

ssize_t TcpLink::send(const iovec* iov, int n) {
  msghdr msg{};
  msg.msg_iov = const_cast<iovec*>(iov);
  msg.msg_iovlen = static_cast<size_t>(n);
  return platform::sendMsg(fd_.get(), &msg, MSG_DONTWAIT);
}

ssize_t TcpLink::recv(const iovec* iov, int n) {
  msghdr msg{};
  msg.msg_iov = const_cast<iovec*>(iov);
  msg.msg_iovlen = static_cast<size_t>(n);
  return ::recvmsg(fd_.get(), &msg, MSG_DONTWAIT);
}

ssize_t TcpLink::peek(void* dst, size_t len) { return ::recv(fd_.get(), dst, len, MSG_PEEK | MSG_DONTWAIT); }

void TcpLink::discard(size_t len) {
  char sink[256];
  while (len > 0) {
    const ssize_t got = ::recv(fd_.get(), sink, std::min(len, sizeof(sink)), MSG_DONTWAIT);
    if (got <= 0) return;
    len -= static_cast<size_t>(got);
  }
}

void TcpLink::endFrame() { flushSocket(fd_.get()); }

void TcpLink::closeWrite() {
  if (fd_) ::shutdown(fd_.get(), SHUT_WR);
}

short TcpLink::pollEvents(bool reading, bool writing, bool watchIdle) const {
  if (!fd_) return 0;
  short events = 0;
  if (writing) events |= POLLOUT;
  if (reading) events |= POLLIN;
  if (events == 0 && watchIdle) events = POLLIN;
  return events;
}

void TcpLink::waitBriefly(short events, int ms) {
  pollfd p{fd_.get(), events, 0};
  ::poll(&p, 1, ms);
}

// --- shared memory --------------------------------------------------------------------------------

ssize_t SharedMemoryLink::send(const iovec* iov, int n) {
  if (peerGone_) {
    errno = EPIPE;
    return -1;
  }
  const size_t k = rings_->write(iov, n);
  if (k == 0) {
    errno = rings_->corrupt() ? EPROTO : EAGAIN;  // the peer broke the ring: an error, not "full"
    return -1;
  }
  if (rings_->peerWaiting()) ringPeer();
  return static_cast<ssize_t>(k);
}

ssize_t SharedMemoryLink::recv(const iovec* iov, int n) {
  // Closed is read before the ring: everything written before the close is then visible.
  const bool closed = peerGone_ || rings_->peerClosedWrite();
  const size_t k = rings_->read(iov, n);
  if (k > 0) {
    if (rings_->peerWaiting()) ringPeer();
    return static_cast<ssize_t>(k);
  }
  if (rings_->corrupt()) {  // the peer broke the ring: an error, not the end of the stream
    errno = EPROTO;
    return -1;
  }
  if (closed) return 0;
  errno = EAGAIN;
  return -1;
}

ssize_t SharedMemoryLink::peek(void* dst, size_t len) {
  const bool closed = peerGone_ || rings_->peerClosedWrite();  // before the ring, as in recv()
  const size_t k = rings_->peek(dst, len);
  if (k > 0 || closed) return static_cast<ssize_t>(k);
  errno = EAGAIN;
  return -1;
}

void SharedMemoryLink::closeWrite() {
  rings_->closeWrite();
  if (fd_) ::shutdown(fd_.get(), SHUT_WR);
}

std::string SharedMemoryLink::failure() const {
  if (rings_->corrupt()) return rings_->corruptReason();
  return errnoFailure();
}

short SharedMemoryLink::pollEvents(bool /*reading*/, bool /*writing*/, bool /*watchIdle*/) const {
  return fd_ && !peerGone_ ? POLLIN : 0;
}

bool SharedMemoryLink::prepareSleep(bool reading, bool writing) {
  bool sleep = true;
  if (reading && !rings_->sleepUntilReadable()) sleep = false;
  if (writing && !rings_->sleepUntilWritable()) sleep = false;
  return sleep;
}

// After the handshake the socket carries only doorbell bytes (ringPeer): readable and empty
// means closed.
bool SharedMemoryLink::checkPeer() {
  if (!fd_) return false;
  char b[64];
  const ssize_t got = ::recv(fd_.get(), b, sizeof(b), MSG_DONTWAIT);
  if (got > 0 || (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))) return false;
  peerGone_ = true;
  return true;
}

void SharedMemoryLink::waitBriefly(short /*events*/, int /*ms*/) { sched_yield(); }

// A peer that is gone needs no waking.
void SharedMemoryLink::ringPeer() {
  if (!fd_) return;
  const char b = 1;
  iovec iov{const_cast<char*>(&b), 1};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  (void)platform::sendMsg(fd_.get(), &msg, MSG_DONTWAIT);
}

}  // namespace meshccl
