#pragma once

// meshccl's platform layer: every call whose form depends on the operating system is made here,
// and which form this build makes is fixed when it is compiled (build_info() reports it):
//
//                       Linux (default build)              macOS; other POSIX systems; Linux with MESHCCL_PORTABLE
//   a new socket        socket(SOCK_CLOEXEC|SOCK_NONBLOCK)  socket(), then fcntl FD_CLOEXEC (and O_NONBLOCK)
//   an accepted one     accept4(SOCK_CLOEXEC|SOCK_NONBLOCK) accept(), then the same fcntl calls
//   no SIGPIPE          MSG_NOSIGNAL on every send          SO_NOSIGPIPE on every socket, and MSG_NOSIGNAL on
//                                                           every send where the headers have it (macOS does);
//                                                           with neither: SIGPIPE blocked around each send and
//                                                           the one it raised taken back (sigtimedwait)
//   single copy         process_vm_readv                    not built: same-host calls copy through the rings
//   reserving shm       posix_fallocate, then ftruncate     ftruncate
//   shm names           "/mccl.<pid>.<hex>", kShmNameMax characters on every system (macOS allows 31)
//
// MESHCCL_PORTABLE (the CMake option, OFF by default) puts a Linux build on the right-hand column
// wherever Linux can take it, so that the code macOS runs is run and tested without a Mac:
// socket()/accept() + fcntl, sends without MSG_NOSIGNAL (Linux has no SO_NOSIGPIPE: the
// signal-mask way keeps SIGPIPE off), no single copy. It keeps posix_fallocate: that guards
// against a Linux hazard (a full tmpfs /dev/shm kills the writer with SIGBUS) macOS does not have.
//
// The hot path stays what it was: send/sendMsg are inline and, outside the signal-mask way, one
// system call with the flags folded in at compile time.

#include <sys/socket.h>
#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string>

#if defined(MESHCCL_PORTABLE) && MESHCCL_PORTABLE
#define MESHCCL_PORTABLE_FORCED 1
#else
#define MESHCCL_PORTABLE_FORCED 0
#endif

// socket()/accept4() take SOCK_CLOEXEC | SOCK_NONBLOCK (atomic: no window for a fork+exec to
// inherit the descriptor).
#if defined(__linux__) && !MESHCCL_PORTABLE_FORCED
#define MESHCCL_ATOMIC_SOCKET_FLAGS 1
#else
#define MESHCCL_ATOMIC_SOCKET_FLAGS 0
#endif

// Single copy between ranks of one host: read the peer's memory (process_vm_readv).
#if defined(__linux__) && !MESHCCL_PORTABLE_FORCED
#define MESHCCL_SINGLE_COPY 1
#else
#define MESHCCL_SINGLE_COPY 0
#endif

// posix_fallocate for shared memory (Linux's /dev/shm is a tmpfs of bounded size).
#if defined(__linux__)
#define MESHCCL_SHM_PREALLOCATE 1
#else
#define MESHCCL_SHM_PREALLOCATE 0
#endif

// How SIGPIPE is kept off: MSG_NOSIGNAL on sends, SO_NOSIGPIPE on sockets, or (neither) the mask.
// (glibc's MSG_NOSIGNAL names an enumerator: the preprocessor cannot compare it, hence _HAVE_.)
#if defined(MSG_NOSIGNAL) && !MESHCCL_PORTABLE_FORCED
#define MESHCCL_HAVE_SEND_NOSIGNAL 1
#define MESHCCL_SEND_NOSIGNAL MSG_NOSIGNAL
#else
#define MESHCCL_HAVE_SEND_NOSIGNAL 0
#define MESHCCL_SEND_NOSIGNAL 0
#endif
#if defined(SO_NOSIGPIPE)
#define MESHCCL_SOCKET_NOSIGPIPE 1
#else
#define MESHCCL_SOCKET_NOSIGPIPE 0
#endif
#if !MESHCCL_HAVE_SEND_NOSIGNAL && !MESHCCL_SOCKET_NOSIGPIPE
#define MESHCCL_SIGPIPE_MASK 1
#else
#define MESHCCL_SIGPIPE_MASK 0
#endif

namespace meshccl::platform {

inline constexpr bool kPortableForced = MESHCCL_PORTABLE_FORCED != 0;
inline constexpr bool kAtomicSocketFlags = MESHCCL_ATOMIC_SOCKET_FLAGS != 0;
inline constexpr bool kSingleCopy = MESHCCL_SINGLE_COPY != 0;
inline constexpr bool kShmPreallocate = MESHCCL_SHM_PREALLOCATE != 0;
inline constexpr bool kSocketNoSigpipe = MESHCCL_SOCKET_NOSIGPIPE != 0;
inline constexpr bool kSigpipeMask = MESHCCL_SIGPIPE_MASK != 0;
inline constexpr int kSendFlags = MESHCCL_SEND_NOSIGNAL;

// The longest shared-memory name meshccl makes, the leading '/' included: macOS's shm_open
// refuses names longer than 31 (PSHMNAMLEN); one under it, the same on every system.
inline constexpr size_t kShmNameMax = 30;

// What this build selected, for build_info() and logs.
struct BuildInfo {
  const char* system;        // "linux", "macos", "freebsd", ... (the system it was compiled for)
  bool portable;             // MESHCCL_PORTABLE: a Linux build on the macOS code paths
  bool singleCopy;           // process_vm_readv compiled in
  const char* sockets;       // "accept4" (SOCK_CLOEXEC|SOCK_NONBLOCK) or "fcntl"
  const char* sigpipe;       // "MSG_NOSIGNAL", "SO_NOSIGPIPE+MSG_NOSIGNAL", "SO_NOSIGPIPE" or "sigmask"
  const char* shmReserve;    // "posix_fallocate" or "ftruncate"
  size_t shmNameMax;         // kShmNameMax
};
const BuildInfo& buildInfo();
// "system=linux portable=0 single_copy=1 sockets=accept4 sigpipe=MSG_NOSIGNAL shm_reserve=posix_fallocate
// shm_name_max=30": one line, key=value, for the C ABI and logs.
std::string buildInfoText();

// A stream socket of `family`, close-on-exec, SIGPIPE off, non-blocking when asked; -1 with
// errno as socket() (or fcntl) sets it.
int openStream(int family, bool nonBlocking);
// Takes one pending connection as a non-blocking, close-on-exec socket with SIGPIPE off; -1 with
// errno as accept() (or fcntl) sets it.
int acceptStream(int listenFd, sockaddr* from, socklen_t* fromLen);

#if MESHCCL_SIGPIPE_MASK
ssize_t sendMasked(int fd, const void* buf, size_t len, int flags);
ssize_t sendMsgMasked(int fd, const msghdr* msg, int flags);
#endif

// send(2) / sendmsg(2) that never raise SIGPIPE: a peer that closed is EPIPE (or ECONNRESET).
inline ssize_t send(int fd, const void* buf, size_t len, int flags) {
#if MESHCCL_SIGPIPE_MASK
  return sendMasked(fd, buf, len, flags);
#else
  return ::send(fd, buf, len, flags | kSendFlags);
#endif
}

inline ssize_t sendMsg(int fd, const msghdr* msg, int flags) {
#if MESHCCL_SIGPIPE_MASK
  return sendMsgMasked(fd, msg, flags);
#else
  return ::sendmsg(fd, msg, flags | kSendFlags);
#endif
}

// Reserves `bytes` of the file behind `fd` (posix_fallocate, retried when a signal interrupts
// it): 0, or the error it returned. Where kShmPreallocate is false: ENOSYS, nothing done.
int preallocate(int fd, size_t bytes);

// Reads `len` bytes at `addr` in process `pid` into `dst` (process_vm_readv, looping over
// partial reads). False with `error` set when the kernel refuses, the process is gone, or this
// build has no single copy (kSingleCopy false).
bool readProcessMemory(int pid, void* dst, uint64_t addr, size_t len, std::string* error);

}  // namespace meshccl::platform
