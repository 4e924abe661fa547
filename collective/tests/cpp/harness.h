#pragma once

// Ranks as threads: every rank gets its own Context on loopback, as in a real job, and the
// test body runs on each; the first exception of any rank is rethrown on the test thread.

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <exception>
#include <functional>
#include <mutex>
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

// Ports the kernel just handed out (and took back): free unless someone grabs them meanwhile.
inline std::vector<int> freePorts(int n) {
  std::vector<int> fds;
  std::vector<int> ports;
  for (int i = 0; i < n; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
    socklen_t len = sizeof(a);
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
    ports.push_back(ntohs(a.sin_port));
    fds.push_back(fd);
  }
  for (int fd : fds) ::close(fd);
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

}  // namespace meshccl::test
