#include "meshccl/platform.h"

#include <fcntl.h>
#include <unistd.h>
#if MESHCCL_SIGPIPE_MASK
#include <pthread.h>
#include <signal.h>
#include <time.h>
#endif
#if MESHCCL_SINGLE_COPY
#include <sys/uio.h>
#endif

#include <cerrno>
#include <cstring>

#include "meshccl/error.h"

namespace meshccl::platform {

namespace {

constexpr const char* systemName() {
#if defined(__APPLE__)
  return "macos";
#elif defined(__linux__)
  return "linux";
#elif defined(__FreeBSD__)
  return "freebsd";
#elif defined(__NetBSD__)
  return "netbsd";
#elif defined(__OpenBSD__)
  return "openbsd";
#else
  return "posix";
#endif
}

constexpr const char* sigpipeName() {
  if (kSigpipeMask) return "sigmask";
  if (kSocketNoSigpipe) return kSendFlags != 0 ? "SO_NOSIGPIPE+MSG_NOSIGNAL" : "SO_NOSIGPIPE";
  return "MSG_NOSIGNAL";
}

#if !MESHCCL_ATOMIC_SOCKET_FLAGS || MESHCCL_SOCKET_NOSIGPIPE
// What Linux sets at creation (SOCK_CLOEXEC, SOCK_NONBLOCK), set afterwards, and SIGPIPE off
// where the socket can carry that (SO_NOSIGPIPE). A failure closes the socket: -1 with errno.
int prepare(int fd, bool nonBlocking, bool flagsSet) {
  if (fd < 0) return fd;
  bool ok = true;
  if (!flagsSet) {
    ok = ::fcntl(fd, F_SETFD, FD_CLOEXEC) == 0;
    if (ok && nonBlocking) {
      const int fl = ::fcntl(fd, F_GETFL, 0);
      ok = fl >= 0 && ::fcntl(fd, F_SETFL, fl | O_NONBLOCK) == 0;
    }
  }
#if MESHCCL_SOCKET_NOSIGPIPE
  const int one = 1;
  ok = ok && ::setsockopt(fd, SOL_SOCKET, SO_NOSIGPIPE, &one, sizeof(one)) == 0;
#endif
  if (!ok) {
    const int err = errno;
    ::close(fd);
    errno = err;
    return -1;
  }
  return fd;
}
#endif

#if MESHCCL_SIGPIPE_MASK
// Runs `op` (a send) with SIGPIPE blocked in this thread; a SIGPIPE it raised (EPIPE) is taken
// back before the mask is restored, so neither the process nor a later unblock sees it. One that
// was already pending (the caller had blocked it) is left alone.
template <typename Op>
ssize_t withoutSigpipe(Op op) {
  sigset_t pipe;
  sigset_t old;
  sigemptyset(&pipe);
  sigaddset(&pipe, SIGPIPE);
  if (::pthread_sigmask(SIG_BLOCK, &pipe, &old) != 0) return op();
  sigset_t pending;
  sigemptyset(&pending);
  const bool wasPending = ::sigpending(&pending) == 0 && sigismember(&pending, SIGPIPE) == 1;
  const ssize_t n = op();
  const int err = errno;
  if (n < 0 && err == EPIPE && !wasPending) {
    const timespec zero{0, 0};
    while (::sigtimedwait(&pipe, nullptr, &zero) < 0 && errno == EINTR) {
    }
  }
  ::pthread_sigmask(SIG_SETMASK, &old, nullptr);
  errno = err;
  return n;
}
#endif

}  // namespace

const BuildInfo& buildInfo() {
  static const BuildInfo info{systemName(),
                              kPortableForced,
                              kSingleCopy,
                              kAtomicSocketFlags ? "accept4" : "fcntl",
                              sigpipeName(),
                              kShmPreallocate ? "posix_fallocate" : "ftruncate",
                              kShmNameMax};
  return info;
}

std::string buildInfoText() {
  const BuildInfo& b = buildInfo();
  return cat("system=", b.system, " portable=", b.portable ? 1 : 0, " single_copy=", b.singleCopy ? 1 : 0,
             " sockets=", b.sockets, " sigpipe=", b.sigpipe,
             " shm_reserve=", b.shmReserve, " shm_name_max=", b.shmNameMax);
}

int openStream(int family, bool nonBlocking) {
#if MESHCCL_ATOMIC_SOCKET_FLAGS
  const int fd = ::socket(family, SOCK_STREAM | SOCK_CLOEXEC | (nonBlocking ? SOCK_NONBLOCK : 0), 0);
#if MESHCCL_SOCKET_NOSIGPIPE
  return prepare(fd, nonBlocking, true);
#else
  return fd;
#endif
#else
  return prepare(::socket(family, SOCK_STREAM, 0), nonBlocking, false);
#endif
}

int acceptStream(int listenFd, sockaddr* from, socklen_t* fromLen) {
#if MESHCCL_ATOMIC_SOCKET_FLAGS
  const int fd = ::accept4(listenFd, from, fromLen, SOCK_NONBLOCK | SOCK_CLOEXEC);
#if MESHCCL_SOCKET_NOSIGPIPE
  return prepare(fd, true, true);
#else
  return fd;
#endif
#else
  return prepare(::accept(listenFd, from, fromLen), true, false);
#endif
}

#if MESHCCL_SIGPIPE_MASK
ssize_t sendMasked(int fd, const void* buf, size_t len, int flags) {
  return withoutSigpipe([&] { return ::send(fd, buf, len, flags); });
}

ssize_t sendMsgMasked(int fd, const msghdr* msg, int flags) {
  return withoutSigpipe([&] { return ::sendmsg(fd, msg, flags); });
}
#endif

int preallocate(int fd, size_t bytes) {
#if MESHCCL_SHM_PREALLOCATE
  int rc = EINTR;
  for (int tries = 0; rc == EINTR && tries < 100; ++tries) {  // a signal interrupts it: it gives back what it took
    rc = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));  // returns the error; errno is not set
  }
  return rc;
#else
  (void)fd;
  (void)bytes;
  return ENOSYS;
#endif
}

bool readProcessMemory(int pid, void* dst, uint64_t addr, size_t len, std::string* error) {
#if MESHCCL_SINGLE_COPY
  size_t done = 0;
  while (done < len) {
    iovec local{static_cast<char*>(dst) + done, len - done};
    iovec remote{reinterpret_cast<void*>(static_cast<uintptr_t>(addr + done)), len - done};
    const ssize_t n = ::process_vm_readv(pid, &local, 1, &remote, 1, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      *error = cat("process_vm_readv from pid ", pid, ": ", n < 0 ? std::strerror(errno) : "no bytes read");
      return false;
    }
    done += static_cast<size_t>(n);
  }
  return true;
#else
  (void)pid;
  (void)dst;
  (void)addr;
  (void)len;
  *error = kPortableForced ? "this build has no single copy (MESHCCL_PORTABLE leaves process_vm_readv out)"
                           : "this build has no single copy (process_vm_readv is Linux's)";
  return false;
#endif
}

}  // namespace meshccl::platform
