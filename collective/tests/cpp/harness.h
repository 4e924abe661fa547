#pragma once

// Ranks as threads: every rank gets its own Context on loopback, as in a real job, and the
// test body runs on each; the first exception of any rank is rethrown on the test thread.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <exception>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "meshccl/context.h"

namespace meshccl::test {

struct Topology {
  bool ring = false;  // links only to rank +-1 (else every pair)
  int connsPerLink = 1;
  std::string algorithm = "auto";
  size_t segmentBytes = 4096;  // small: many segments even for small buffers
  size_t smallBytes = 1024;
  int depth = 3;
  double timeout = 30.0;
  // Ranks r and j are on one "host" (shared memory) when r / hostRanks == j / hostRanks;
  // 0: every rank on its own host (TCP only).
  int hostRanks = 0;
  // From this many bytes, ranks all on one host read each other's buffers (single copy).
  size_t singleCopyBytes = Config{}.singleCopyBytes;
  std::string name() const {
    return std::string(ring ? "ring" : "mesh") + "_c" + std::to_string(connsPerLink) + "_" + algorithm +
           (hostRanks > 0 ? "_shm" + std::to_string(hostRanks) : "") +
           (singleCopyBytes != Config{}.singleCopyBytes ? "_sc" + std::to_string(singleCopyBytes) : "");
  }
};

// n free loopback ports, drawn below the kernel's ephemeral range: a port from inside it (bind to
// port 0) can become the source port of another rank's outgoing connection before its own rank
// binds it, and that rank then fails with "Address already in use".
inline std::vector<int> freePorts(int n) {
  int ephemeral = 32768;
  std::ifstream range("/proc/sys/net/ipv4/ip_local_port_range");
  if (int low = 0; range >> low && low > 15000 + n) ephemeral = low;
  std::mt19937 draw(std::random_device{}());
  std::uniform_int_distribution<int> pick(15000, ephemeral - 1);
  std::vector<int> ports;
  for (int tries = 0; static_cast<int>(ports.size()) < n && tries < 10000; ++tries) {
    const int port = pick(draw);
    if (std::find(ports.begin(), ports.end(), port) != ports.end()) continue;
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(port));
    if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) ports.push_back(port);
    ::close(fd);
  }
  return ports;
}

inline Config makeConfig(int rank, int n, const std::vector<int>& ports, const Topology& t) {
  Config c;
  c.rank = rank;
  c.size = n;
  c.token = "test-token";
  c.listen = {{"127.0.0.1", ports[rank]}};
  for (int j = 0; j < n; ++j) {
    if (j == rank) continue;
    const bool linked = !t.ring || j == (rank + 1) % n || j == (rank + n - 1) % n;
    const bool sameHost = t.hostRanks > 0 && rank / t.hostRanks == j / t.hostRanks;
    if (linked) c.peers.push_back({j, {{"127.0.0.1", ports[j]}}, -1, sameHost});
  }
  c.connsPerLink = t.connsPerLink;
  c.complete = !t.ring || n <= 3;
  c.ring = true;  // rank order is a ring in both layouts
  c.ringConns = t.connsPerLink;
  c.algorithm = t.algorithm;
  c.segmentBytes = t.segmentBytes;
  c.shmSegmentBytes = t.segmentBytes;
  c.singleCopyBytes = t.singleCopyBytes;
  c.smallBytes = t.smallBytes;
  c.pipelineDepth = t.depth;
  c.timeoutSeconds = t.timeout;
  c.connectTimeoutSeconds = 20;
  c.logLevel = 0;
  return c;
}

// Runs body(rank) on n threads; each thread builds its Context from makeConfig (adjusted by
// `tweak`) and passes it to body. Rethrows the first exception (all threads are joined first).
inline void runRanks(int n, const Topology& t, const std::function<void(Context&)>& body,
                     const std::function<void(Config&)>& tweak = nullptr) {
  const auto ports = freePorts(n);
  std::vector<std::thread> threads;
  std::mutex mu;
  std::exception_ptr first;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        Config c = makeConfig(r, n, ports, t);
        if (tweak) tweak(c);
        Context ctx(std::move(c));
        body(ctx);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!first) first = std::current_exception();
      }
    });
  }
  for (auto& th : threads) th.join();
  if (first) std::rethrow_exception(first);
}

// Ranks started one by one (a test sets the stage between them): each runs on its own thread,
// builds its Context from makeConfig (adjusted by `tweak`) and runs `body`; what each rank ended
// with (error kind 0: none) is kept for the test to look at after join().
class Job {
 public:
  Job(int n, Topology t = {}) : n_(n), t_(std::move(t)), ports_(freePorts(n)), results_(static_cast<size_t>(n)) {}
  ~Job() { join(); }
  Job(const Job&) = delete;
  Job& operator=(const Job&) = delete;

  struct Result {
    bool ran = false;
    int kind = 0;  // ErrorKind of the exception, 0 when none
    std::string message;
    ConnectStats stats;  // when the Context was built
    double connectSeconds = 0;
  };

  int port(int rank) const { return ports_[static_cast<size_t>(rank)]; }
  const std::vector<int>& ports() const { return ports_; }

  void start(int rank, const std::function<void(Context&)>& body, const std::function<void(Config&)>& tweak = nullptr) {
    threads_.emplace_back([this, rank, body, tweak] {
      Result& res = results_[static_cast<size_t>(rank)];
      res.ran = true;
      try {
        Config c = makeConfig(rank, n_, ports_, t_);
        if (tweak) tweak(c);
        const auto t0 = std::chrono::steady_clock::now();
        Context ctx(std::move(c));
        res.connectSeconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        res.stats = ctx.connectStats();
        body(ctx);
      } catch (const Error& e) {
        res.kind = static_cast<int>(e.kind());
        res.message = e.what();
      } catch (const std::exception& e) {
        res.kind = -1;
        res.message = e.what();
      }
    });
  }

  void join() {
    for (auto& th : threads_) th.join();
    threads_.clear();
  }

  const Result& result(int rank) const { return results_[static_cast<size_t>(rank)]; }

 private:
  int n_;
  Topology t_;
  std::vector<int> ports_;
  std::vector<Result> results_;
  std::vector<std::thread> threads_;
};

// A blocking TCP connection to 127.0.0.1:port, retried until `seconds` pass (the rank may not
// listen yet); -1 if none.
inline int connectLoopback(int port, double seconds = 10.0) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  for (;;) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) return fd;
    ::close(fd);
    if (std::chrono::steady_clock::now() > until) return -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));  // retry interval of a connect loop, not a wait
  }
}

// Reads exactly `len` bytes within `seconds`; returns how many arrived (fewer at end of stream or timeout).
inline size_t readFor(int fd, void* data, size_t len, double seconds) {
  auto* p = static_cast<char*>(data);
  size_t got = 0;
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (got < len) {
    const auto left = std::chrono::duration<double>(until - std::chrono::steady_clock::now()).count();
    if (left <= 0) break;
    pollfd pfd{fd, POLLIN, 0};
    if (::poll(&pfd, 1, static_cast<int>(left * 1000) + 1) <= 0) continue;
    const ssize_t n = ::recv(fd, p + got, len - got, MSG_DONTWAIT);
    if (n == 0) break;
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) continue;
      break;
    }
    got += static_cast<size_t>(n);
  }
  return got;
}

// True when the other end closes the connection (end of stream or reset) within `seconds`;
// whatever arrives before is appended to *seen when given.
inline bool closedWithin(int fd, double seconds, std::string* seen = nullptr) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  for (;;) {
    const auto left = std::chrono::duration<double>(until - std::chrono::steady_clock::now()).count();
    if (left <= 0) return false;
    pollfd pfd{fd, POLLIN, 0};
    if (::poll(&pfd, 1, static_cast<int>(left * 1000) + 1) <= 0) continue;
    char buf[4096];
    const ssize_t n = ::recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (n == 0) return true;
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) continue;
      return true;
    }
    if (seen != nullptr) seen->append(buf, static_cast<size_t>(n));
  }
}

}  // namespace meshccl::test
