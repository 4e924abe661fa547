#pragma once

// Thin POSIX socket helpers: numeric addresses only (the hostfile names addresses, never names
// to resolve), non-blocking sockets, errors as meshccl::Error naming the address.

#include <netinet/in.h>
#include <sys/socket.h>

#include <string>

namespace meshccl {

struct SockAddr {
  sockaddr_storage storage{};
  socklen_t length = 0;
  std::string text;  // "a.b.c.d:port" or "[v6]:port", for messages
};

// Parses a numeric IPv4 or IPv6 address; raises kBootstrap naming `what` when it is not one.
SockAddr parseAddress(const std::string& address, int port, const std::string& what);
std::string describePeer(const sockaddr_storage& addr);

// Owns one file descriptor.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  Fd(Fd&& other) noexcept : fd_(other.release()) {}
  Fd& operator=(Fd&& other) noexcept;
  ~Fd();
  int get() const { return fd_; }
  int release();
  void reset();
  explicit operator bool() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

Fd listenOn(const SockAddr& addr);
// Takes one pending connection as a non-blocking, close-on-exec socket with SIGPIPE off
// (platform::acceptStream); -1 with errno as accept() sets it.
int acceptNonBlocking(int listenFd, sockaddr_storage* from, socklen_t* fromLen);
// Starts a non-blocking connect; returns the socket (connect in progress or done). *err is the
// errno of a connect that failed at once, or of socket() itself (then no socket is returned:
// out of descriptors, say), for the caller to retry.
Fd startConnect(const SockAddr& addr, int* err);
void setNonBlocking(int fd);
// TCP_NODELAY always; SO_SNDBUF/SO_RCVBUF when bufferBytes > 0 (0 keeps the kernel's autotuning).
void tuneSocket(int fd, int bufferBytes);
// Sends what the socket holds back now (TCP autocorking waits for earlier data to leave).
void flushSocket(int fd);
int socketError(int fd);
double monotonicSeconds();

}  // namespace meshccl
