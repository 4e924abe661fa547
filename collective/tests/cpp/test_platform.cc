// The platform layer (src/meshccl/platform.h) on whatever this build selected: sockets made
// close-on-exec and non-blocking (and SO_NOSIGPIPE where the system has it), a send to a closed
// peer is EPIPE and never a SIGPIPE (checked in a child whose SIGPIPE has its default action,
// beside a control that dies of it), shared-memory names within macOS's shm_open limit, single
// copy where it is built and a clear refusal where it is not, and what the build reports
// (build_info, the C ABI, a communicator's transport). `make meshccl-portable` runs the suite on
// the macOS code paths (MESHCCL_PORTABLE), `make meshccl-cpp` on Linux's own.

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cerrno>
#include <cstring>
#include <functional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "harness.h"
#include "meshccl/collectives.h"
#include "meshccl/meshccl.h"
#include "meshccl/platform.h"
#include "meshccl/shm.h"
#include "meshccl/socket.h"

namespace meshccl {
namespace {

#define EXPECT_HAS(text, part) \
  EXPECT_NE(std::string(text).find(part), std::string::npos) << "'" << (text) << "' lacks '" << (part) << "'"

// --- what the build selected -----------------------------------------------------------------

TEST(Platform, TheBuildSaysWhichPathsItTakes) {
  const platform::BuildInfo& b = platform::buildInfo();
  const std::string text = platform::buildInfoText();
  EXPECT_EQ(b.shmNameMax, 30u);
  EXPECT_HAS(text, "shm_name_max=30");
  EXPECT_EQ(b.portable, MESHCCL_PORTABLE_FORCED != 0);
  EXPECT_HAS(text, std::string(" portable=") + (b.portable ? "1" : "0"));
  EXPECT_HAS(text, std::string(" single_copy=") + (b.singleCopy ? "1" : "0"));
#if defined(__linux__)
  EXPECT_STREQ(b.system, "linux");
  EXPECT_STREQ(b.shmReserve, "posix_fallocate");
  if (b.portable) {
    // The macOS column, as far as Linux can take it.
    EXPECT_FALSE(b.singleCopy);
    EXPECT_STREQ(b.sockets, "fcntl");
    EXPECT_STREQ(b.sigpipe, "sigmask");
    EXPECT_EQ(platform::kSendFlags, 0);
  } else {
    EXPECT_TRUE(b.singleCopy);
    EXPECT_STREQ(b.sockets, "accept4");
    EXPECT_STREQ(b.sigpipe, "MSG_NOSIGNAL");
    EXPECT_EQ(platform::kSendFlags, MSG_NOSIGNAL);
  }
#elif defined(__APPLE__)
  EXPECT_STREQ(b.system, "macos");
  EXPECT_FALSE(b.singleCopy);
  EXPECT_STREQ(b.sockets, "fcntl");
  EXPECT_STREQ(b.sigpipe, b.portable ? "SO_NOSIGPIPE" : "SO_NOSIGPIPE+MSG_NOSIGNAL");
  EXPECT_STREQ(b.shmReserve, "ftruncate");
#endif
  // The C ABI says the same.
  EXPECT_EQ(meshccl_abi_version(), MESHCCL_ABI_VERSION);
  EXPECT_EQ(MESHCCL_ABI_VERSION, 3);
  EXPECT_EQ(std::string(meshccl_build_info()), text);
}

// --- sockets ---------------------------------------------------------------------------------

bool closeOnExec(int fd) { return (::fcntl(fd, F_GETFD) & FD_CLOEXEC) != 0; }
bool nonBlocking(int fd) { return (::fcntl(fd, F_GETFL) & O_NONBLOCK) != 0; }
bool noSigpipeOption(int fd) {
#if defined(SO_NOSIGPIPE)
  int on = 0;
  socklen_t len = sizeof(on);
  return ::getsockopt(fd, SOL_SOCKET, SO_NOSIGPIPE, &on, &len) == 0 && on != 0;
#else
  (void)fd;
  return true;  // nothing to set: MSG_NOSIGNAL or the signal mask keeps SIGPIPE off
#endif
}

// A listener on a free loopback port, and a connection to it (both ends non-blocking).
struct Loopback {
  Fd listener;
  Fd client;
  Fd server;
};

Loopback connectLoopback() {
  Loopback lb;
  const int port = test::freePorts(1)[0];
  lb.listener = listenOn(parseAddress("127.0.0.1", port, "test listener"));
  int err = 0;
  lb.client = startConnect(parseAddress("127.0.0.1", port, "test peer"), &err);
  if (!lb.client || err != 0) throw std::runtime_error(std::string("connect: ") + std::strerror(err));
  for (int i = 0; i < 500 && !lb.server; ++i) {
    pollfd p{lb.listener.get(), POLLIN, 0};
    ::poll(&p, 1, 10);
    sockaddr_storage from{};
    socklen_t len = sizeof(from);
    const int fd = acceptNonBlocking(lb.listener.get(), &from, &len);
    if (fd >= 0) lb.server = Fd(fd);
  }
  if (!lb.server) throw std::runtime_error("no connection accepted within 5 s");
  pollfd p{lb.client.get(), POLLOUT, 0};
  ::poll(&p, 1, 5000);
  return lb;
}

TEST(Platform, EverySocketIsCloseOnExecNonBlockingAndSigpipeFree) {
  Loopback lb = connectLoopback();
  struct Case {
    const char* what;
    int fd;
  };
  for (const Case c : {Case{"listener", lb.listener.get()}, Case{"connecting", lb.client.get()},
                       Case{"accepted", lb.server.get()}}) {
    EXPECT_TRUE(closeOnExec(c.fd)) << c.what;
    EXPECT_TRUE(nonBlocking(c.fd)) << c.what;
    EXPECT_TRUE(noSigpipeOption(c.fd)) << c.what;
  }
  // A blocking one for the listener before listen(): close-on-exec only.
  const int fd = platform::openStream(AF_INET, false);
  ASSERT_GE(fd, 0) << std::strerror(errno);
  EXPECT_TRUE(closeOnExec(fd));
  EXPECT_FALSE(nonBlocking(fd));
  EXPECT_TRUE(noSigpipeOption(fd));
  ::close(fd);
  // accept() on an empty backlog: -1 with EAGAIN, nothing leaked.
  sockaddr_storage from{};
  socklen_t len = sizeof(from);
  errno = 0;
  EXPECT_EQ(acceptNonBlocking(lb.listener.get(), &from, &len), -1);
  EXPECT_TRUE(errno == EAGAIN || errno == EWOULDBLOCK) << std::strerror(errno);
}

// Runs `body` in a child whose SIGPIPE has its default action (the process dies of it) and
// returns how the child ended: "exit N" or "signal NAME".
std::string inChild(const std::function<int()>& body) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::signal(SIGPIPE, SIG_DFL);
    sigset_t none;
    sigemptyset(&none);
    ::pthread_sigmask(SIG_SETMASK, &none, nullptr);
    ::_exit(body());
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  if (WIFSIGNALED(status)) {
    return std::string("signal ") + (WTERMSIG(status) == SIGPIPE ? "SIGPIPE" : std::to_string(WTERMSIG(status)));
  }
  return "exit " + std::to_string(WEXITSTATUS(status));
}

// Sends on `fd` (whose peer has closed) with `sendOnce` until EPIPE: 0 when EPIPE came, 3 when
// the deadline passed without it.
int sendUntilEpipe(int fd, const std::function<ssize_t(int, const char*, size_t)>& sendOnce) {
  const char buf[4096] = {};
  for (int i = 0; i < 2000; ++i) {
    const ssize_t n = sendOnce(fd, buf, sizeof(buf));
    if (n < 0 && errno == EPIPE) return 0;
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != ECONNRESET && errno != EINTR) return 4;
    pollfd p{fd, POLLOUT, 0};
    ::poll(&p, 1, 1);
  }
  return 3;
}

bool sigpipePending() {
  sigset_t pending;
  sigemptyset(&pending);
  return ::sigpending(&pending) == 0 && sigismember(&pending, SIGPIPE) == 1;
}

bool sigpipeBlocked() {
  sigset_t mask;
  sigemptyset(&mask);
  return ::pthread_sigmask(SIG_BLOCK, nullptr, &mask) == 0 && sigismember(&mask, SIGPIPE) == 1;
}

TEST(Platform, ASendToAPeerThatClosedIsEpipeNeverSigpipe) {
  // The control: a plain send without MSG_NOSIGNAL on a plain socket kills the child, so the
  // setup does raise SIGPIPE and the cases below would die of it if the platform let it through.
  const std::string control = inChild([] {
    Loopback lb;
    try {
      lb = connectLoopback();
    } catch (...) {
      return 10;
    }
    // A socket with nothing set, connected to the same listener; its peer closes at once.
    const int raw = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    socklen_t len = sizeof(a);
    ::getsockname(lb.listener.get(), reinterpret_cast<sockaddr*>(&a), &len);
    if (::connect(raw, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) return 11;
    pollfd p{lb.listener.get(), POLLIN, 0};
    ::poll(&p, 1, 5000);
    sockaddr_storage from{};
    socklen_t fromLen = sizeof(from);
    const int accepted = ::accept(lb.listener.get(), reinterpret_cast<sockaddr*>(&from), &fromLen);
    if (accepted < 0) return 12;
    ::close(accepted);
    return sendUntilEpipe(raw, [](int fd, const char* b, size_t n) { return ::send(fd, b, n, 0); });
  });
  EXPECT_EQ(control, "signal SIGPIPE");

  struct Case {
    const char* what;
    std::function<ssize_t(int, const char*, size_t)> send;
  };
  const std::vector<Case> cases = {
      {"platform::send", [](int fd, const char* b, size_t n) { return platform::send(fd, b, n, MSG_DONTWAIT); }},
      {"platform::sendMsg", [](int fd, const char* b, size_t n) {
         iovec iov{const_cast<char*>(b), n};
         msghdr msg{};
         msg.msg_iov = &iov;
         msg.msg_iovlen = 1;
         return platform::sendMsg(fd, &msg, MSG_DONTWAIT);
       }}};
  for (const Case& c : cases) {
    const std::string ended = inChild([&] {
      Loopback lb;
      try {
        lb = connectLoopback();
      } catch (...) {
        return 10;
      }
      lb.server.reset();
      const int rc = sendUntilEpipe(lb.client.get(), c.send);
      if (rc != 0) return rc;
      // Nothing left behind: no SIGPIPE pending, the signal mask as it was.
      if (sigpipePending()) return 5;
      if (sigpipeBlocked()) return 6;
      return 0;
    });
    EXPECT_EQ(ended, "exit 0") << c.what << " (3: no EPIPE, 4: another error, 5: a SIGPIPE left pending, "
                                             "6: SIGPIPE left blocked)";
  }

  // A SIGPIPE the caller already had pending (blocked) is the caller's: it stays pending.
  const std::string kept = inChild([&] {
    Loopback lb;
    try {
      lb = connectLoopback();
    } catch (...) {
      return 10;
    }
    sigset_t pipe;
    sigemptyset(&pipe);
    sigaddset(&pipe, SIGPIPE);
    ::pthread_sigmask(SIG_BLOCK, &pipe, nullptr);
    ::pthread_kill(::pthread_self(), SIGPIPE);
    if (!sigpipePending()) return 7;
    lb.server.reset();
    const int rc = sendUntilEpipe(lb.client.get(), cases[0].send);
    if (rc != 0) return rc;
    if (!sigpipePending()) return 8;
    if (!sigpipeBlocked()) return 9;
    return 0;
  });
  EXPECT_EQ(kept, "exit 0") << "7: raise did not pend, 8: the caller's SIGPIPE was taken, 9: the mask was changed";
}

// --- shared-memory names ---------------------------------------------------------------------

TEST(Platform, SharedMemoryNamesFitMacosAndDifferForEveryJobPairAndConnection) {
  const std::string prefix = "/mccl." + std::to_string(::getpid()) + ".";
  std::set<std::string> names;
  std::vector<std::unique_ptr<ShmLink>> links;
  // As connect.cc tags them (job id, this rank, the peer, the connection); the last two alike.
  auto tag = [](const char* job, int conn) { return cat(job, '\0', 0, '\0', 1, '\0', conn); };
  for (const std::string& t : {tag("job-a", 0), tag("job-a", 1), tag("job-b", 0), tag("job-b", 1), tag("job-b", 1)}) {
    std::string name;
    std::string error;
    auto link = ShmLink::create(4096, &name, &error, t);
    ASSERT_TRUE(link) << error;
    EXPECT_EQ(name.size(), platform::kShmNameMax) << name;
    EXPECT_EQ(name.rfind(prefix, 0), 0u) << name;
    EXPECT_EQ(name.find_first_not_of("0123456789abcdef", prefix.size()), std::string::npos) << name;
    EXPECT_GE(name.size() - prefix.size(), 16u) << name;
    EXPECT_TRUE(names.insert(name).second) << "a name came twice: " << name;
    // The peer opens it by that name.
    auto opened = ShmLink::open(name, 4096, &error);
    EXPECT_TRUE(opened) << error;
    links.push_back(std::move(link));
  }
  // A longer name than macOS takes is nobody's meshccl segment.
  std::string error;
  EXPECT_FALSE(ShmLink::open("/mccl.1234567.0123456789abcdef01", 4096, &error));
  EXPECT_HAS(error, "not a meshccl segment");
}

// --- single copy -----------------------------------------------------------------------------

TEST(Platform, ReadingAnotherProcessIsSingleCopyWhereBuiltAndRefusedClearlyElsewhere) {
  const uint64_t value = 0x1122334455667788u;
  uint64_t got = 0;
  std::string error;
  const bool ok = platform::readProcessMemory(static_cast<int>(::getpid()), &got,
                                              reinterpret_cast<uintptr_t>(&value), sizeof(value), &error);
  if (platform::kSingleCopy) {
    if (!ok && error.find("Operation not permitted") != std::string::npos) GTEST_SKIP() << error;
    EXPECT_TRUE(ok) << error;
    EXPECT_EQ(got, value);
  } else {
    EXPECT_FALSE(ok);
    EXPECT_HAS(error, "this build has no single copy");
    EXPECT_EQ(got, 0u);
  }
}

// --- what a communicator reports -------------------------------------------------------------

TEST(Platform, ACommunicatorReportsItsTransportAndSingleCopy) {
  test::Topology t;
  t.hostRanks = 2;  // ranks 0, 1 on one host; 2, 3 on another
  t.connsPerLink = 2;
  test::runRanks(4, t, [](Context& ctx) {
    EXPECT_EQ(ctx.transportSummary(), "shm+tcp");
    EXPECT_FALSE(ctx.canReadPeers());
  });
  t.hostRanks = 3;  // all on one host
  test::runRanks(3, t, [](Context& ctx) {
    EXPECT_EQ(ctx.transportSummary(), "shm");
    EXPECT_EQ(ctx.canReadPeers(), platform::kSingleCopy);
    // Large calls take whichever path the build has, and are exact.
    std::vector<float> x((1u << 20) + 3, static_cast<float>(ctx.rank() + 1));
    allReduce(ctx, x.data(), x.data(), x.size(), DataType::kFloat32, RedOp::kSum);
    EXPECT_EQ(x.front(), 6.0f);
    EXPECT_EQ(x.back(), 6.0f);
  });
  t.hostRanks = 0;
  test::runRanks(2, t, [](Context& ctx) { EXPECT_EQ(ctx.transportSummary(), "tcp"); });
}

TEST(Platform, TheCAbiReportsTransportAndSingleCopy) {
  const auto ports = test::freePorts(2);
  std::vector<std::string> transports(2), overall(2), none(2);
  std::vector<int> single(2, -1), results(2, -1);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      const auto me = static_cast<size_t>(r);
      const meshccl_endpoint self{"127.0.0.1", ports[me]};
      const meshccl_endpoint other{"127.0.0.1", ports[1 - me]};
      const meshccl_peer peer{1 - r, 1, &other, -1, 1};
      meshccl_config c;
      meshccl_config_init(&c);
      c.rank = r;
      c.size = 2;
      c.token = "c-abi-token";
      c.num_listen = 1;
      c.listen = &self;
      c.num_peers = 1;
      c.peers = &peer;
      c.complete = 1;
      c.ring = 1;
      c.connect_timeout_s = 20;
      c.log_level = 0;
      meshccl_comm* comm = nullptr;
      char error[512] = "";
      results[me] = meshccl_comm_create(&c, &comm, error, sizeof(error));
      if (comm == nullptr) return;
      // Both ends stay until both are formed (each probes the other's memory while it forms).
      if (meshccl_barrier(comm) != MESHCCL_OK) results[me] = -2;
      transports[me] = meshccl_comm_transport(comm, 1 - r);
      overall[me] = meshccl_comm_transport(comm, -1);
      none[me] = meshccl_comm_transport(comm, 7);
      single[me] = meshccl_comm_single_copy(comm);
      meshccl_comm_destroy(comm);
    });
  }
  for (auto& th : threads) th.join();
  for (size_t r = 0; r < 2; ++r) {
    EXPECT_EQ(results[r], MESHCCL_OK);
    EXPECT_EQ(transports[r], "shm");
    EXPECT_EQ(overall[r], "shm");
    EXPECT_EQ(none[r], "");
    EXPECT_EQ(single[r], platform::kSingleCopy ? 1 : 0);
  }
  EXPECT_STREQ(meshccl_comm_transport(nullptr, 0), "");
  EXPECT_EQ(meshccl_comm_single_copy(nullptr), 0);
}

}  // namespace
}  // namespace meshccl
