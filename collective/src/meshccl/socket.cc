#include "meshccl/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/tcp.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>

#include "meshccl/error.h"
#include "meshccl/platform.h"

namespace meshccl {

SockAddr parseAddress(const std::string& address, int port, const std::string& what) {
  if (port <= 0 || port > 65535) {
    raise(ErrorKind::kBootstrap, cat(what, ": port ", port, " is out of range (1-65535)"));
  }
  SockAddr out;
  std::string host = address;
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  auto* v4 = reinterpret_cast<sockaddr_in*>(&out.storage);
  auto* v6 = reinterpret_cast<sockaddr_in6*>(&out.storage);
  if (inet_pton(AF_INET, host.c_str(), &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    v4->sin_port = htons(static_cast<uint16_t>(port));
    out.length = sizeof(sockaddr_in);
    out.text = cat(host, ":", port);
  } else if (inet_pton(AF_INET6, host.c_str(), &v6->sin6_addr) == 1) {
    v6->sin6_family = AF_INET6;
    v6->sin6_port = htons(static_cast<uint16_t>(port));
    out.length = sizeof(sockaddr_in6);
    out.text = cat("[", host, "]:", port);
  } else {
    raise(ErrorKind::kBootstrap, cat(what, ": '", address, "' is not a numeric IPv4 or IPv6 address"));
  }
  return out;
}

std::string describePeer(const sockaddr_storage& addr) {
  char buf[INET6_ADDRSTRLEN] = {0};
  if (addr.ss_family == AF_INET) {
    const auto* v4 = reinterpret_cast<const sockaddr_in*>(&addr);
    inet_ntop(AF_INET, &v4->sin_addr, buf, sizeof(buf));
    return cat(buf, ":", ntohs(v4->sin_port));
  }
  if (addr.ss_family == AF_INET6) {
    const auto* v6 = reinterpret_cast<const sockaddr_in6*>(&addr);
    inet_ntop(AF_INET6, &v6->sin6_addr, buf, sizeof(buf));
    return cat("[", buf, "]:", ntohs(v6->sin6_port));
  }
  return "unknown-address";
}

Fd& Fd::operator=(Fd&& other) noexcept {
  if (this != &other) {
    reset();
    fd_ = other.release();
  }
  return *this;
}

Fd::~Fd() { reset(); }

int Fd::release() {
  const int fd = fd_;
  fd_ = -1;
  return fd;
}

void Fd::reset() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

void setNonBlocking(int fd) {
  const int flags = fcntl(fd, F_GETFL, 0);
  if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) {
    raise(ErrorKind::kIo, cat("fcntl(O_NONBLOCK): ", std::strerror(errno)));
  }
}

void tuneSocket(int fd, int bufferBytes) {
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  if (bufferBytes > 0) {
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bufferBytes, sizeof(bufferBytes));
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &bufferBytes, sizeof(bufferBytes));
  }
}

void flushSocket(int fd) {
  // Setting TCP_NODELAY (again) pushes whatever is queued, corked or not.
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

int acceptNonBlocking(int listenFd, sockaddr_storage* from, socklen_t* fromLen) {
  return platform::acceptStream(listenFd, reinterpret_cast<sockaddr*>(from), fromLen);
}

Fd listenOn(const SockAddr& addr) {
  Fd fd(platform::openStream(addr.storage.ss_family, false));
  if (!fd) raise(ErrorKind::kBootstrap, cat("socket() for ", addr.text, ": ", std::strerror(errno)));
  const int one = 1;
  setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (addr.storage.ss_family == AF_INET6) setsockopt(fd.get(), IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof(one));
  if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&addr.storage), addr.length) != 0) {
    const int err = errno;
    std::string hint;
    if (err == EADDRINUSE) hint = " (another job or an earlier run still holds this port)";
    if (err == EADDRNOTAVAIL) hint = " (no interface on this host has that address: is the hostfile for this host?)";
    raise(ErrorKind::kBootstrap, cat("cannot listen on ", addr.text, ": ", std::strerror(err), hint));
  }
  if (::listen(fd.get(), 128) != 0) {
    raise(ErrorKind::kBootstrap, cat("listen() on ", addr.text, ": ", std::strerror(errno)));
  }
  setNonBlocking(fd.get());
  return fd;
}

Fd startConnect(const SockAddr& addr, int* err) {
  Fd fd(platform::openStream(addr.storage.ss_family, true));
  if (!fd) {  // out of descriptors (EMFILE) or memory, most likely: the caller retries later
    *err = errno;
    return fd;
  }
  *err = 0;
  if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr.storage), addr.length) != 0) {
    *err = errno == EINPROGRESS ? 0 : errno;
  }
  return fd;
}

int socketError(int fd) {
  int err = 0;
  socklen_t len = sizeof(err);
  if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) return errno;
  return err;
}

double monotonicSeconds() {
  using Clock = std::chrono::steady_clock;
  return std::chrono::duration<double>(Clock::now().time_since_epoch()).count();
}

}  // namespace meshccl
