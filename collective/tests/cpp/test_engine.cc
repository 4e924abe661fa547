// The engine (engine.h): several threads calling one communicator, queued calls, batched sends
// and receives, abort() and close() from another thread. Ranks are threads, each with its own
// Engine on loopback; the suite also runs under AddressSanitizer/UBSan (make meshccl-sanitize).

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "harness.h"
#include "meshccl/collectives.h"
#include "meshccl/engine.h"

namespace meshccl {
namespace {

using test::Topology;

// Runs body(rank, engine) on n threads, each with its own Engine; rethrows the first failure.
void runEngines(int n, const Topology& t, const std::function<void(int, Engine&)>& body) {
  const auto ports = test::freePorts(n);
  std::vector<std::thread> threads;
  std::mutex mu;
  std::exception_ptr first;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        Engine engine(test::makeConfig(r, n, ports, t));
        body(r, engine);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!first) first = std::current_exception();
      }
    });
  }
  for (auto& th : threads) th.join();
  if (first) std::rethrow_exception(first);
}

Topology tcp() { return Topology{}; }
Topology shm() {
  Topology t;
  t.hostRanks = 8;
  return t;
}

void expectSum(const std::vector<int32_t>& v, int32_t want, const std::string& what) {
  for (size_t i = 0; i < v.size(); ++i) {
    ASSERT_EQ(v[i], want) << what << ": element " << i;
  }
}

class EngineTest : public ::testing::TestWithParam<bool> {
 protected:
  Topology topo() const { return GetParam() ? shm() : tcp(); }
};

TEST_P(EngineTest, ThreadsSharingOneCommunicatorEachGetExactResults) {
  constexpr int kRanks = 3, kThreads = 4, kCalls = 30;
  runEngines(kRanks, topo(), [&](int r, Engine& e) {
    std::vector<std::thread> callers;
    std::atomic<int> wrong{0};
    for (int t = 0; t < kThreads; ++t) {
      callers.emplace_back([&, t] {
        for (int i = 0; i < kCalls; ++i) {
          std::vector<int32_t> v(50'000, r + 1);  // every call alike: any interleaving matches
          if ((i + t) % 2 == 0) {
            e.run([&](Context& c) { allReduce(c, v.data(), v.data(), v.size(), DataType::kInt32, RedOp::kSum); });
          } else {
            e.submit([&](Context& c) { allReduce(c, v.data(), v.data(), v.size(), DataType::kInt32, RedOp::kSum); })
                ->get();
          }
          for (int32_t x : v) wrong += x != 6 ? 1 : 0;
        }
      });
    }
    for (auto& c : callers) c.join();
    EXPECT_EQ(wrong.load(), 0) << "rank " << r;
    EXPECT_EQ(e.pending(), 0u);
  });
}

TEST_P(EngineTest, QueuedCallsRunInSubmissionOrder) {
  runEngines(3, topo(), [&](int r, Engine& e) {
    std::vector<std::vector<int32_t>> bufs;
    for (int k = 0; k < 8; ++k) bufs.emplace_back(static_cast<size_t>(1000 + 37'000 * k), (r + 1) * (k + 1));
    std::vector<std::shared_ptr<Work>> works;
    for (auto& b : bufs) {
      works.push_back(e.submit([&b](Context& c) {
        allReduce(c, b.data(), b.data(), b.size(), DataType::kInt32, RedOp::kSum);  // sizes differ: order matters
      }));
    }
    for (auto it = works.rbegin(); it != works.rend(); ++it) (*it)->get();
    for (int k = 0; k < 8; ++k) expectSum(bufs[static_cast<size_t>(k)], 6 * (k + 1), "call " + std::to_string(k));
  });
}

TEST_P(EngineTest, ARingShiftInOneExchangeDoesNotDeadlock) {
  runEngines(3, topo(), [&](int r, Engine& e) {
    const int right = (r + 1) % 3, left = (r + 2) % 3;
    std::vector<int32_t> out(4 << 20, r), in(4 << 20, -1);  // 16 MiB each way: far beyond socket buffers
    e.run([&](Context& c) {
      exchange(c, {{true, out.data(), out.size() * 4, right}, {false, in.data(), in.size() * 4, left}});
    });
    expectSum(in, left, "received from the left");
  });
}

// Rank 1 stays out; ranks 0 and 2 block in an all-reduce; another thread of rank 0 ends it with
// `end`. Both must fail with kAborted naming `reason`, well before the 30 s call timeout.
void blockedThenEnded(const Topology& t, const std::function<void(Engine&)>& end, const std::string& reason) {
  std::atomic<int> done{0};
  std::vector<int> kinds(3, 0);
  std::vector<std::string> messages(3);
  runEngines(3, t, [&](int r, Engine& e) {
    std::vector<float> v(4 << 20, 1.0f);
    if (r == 1) {
      while (done.load() < 2) std::this_thread::sleep_for(std::chrono::milliseconds(5));  // until both reported
      return;  // never calls: its engine closes with the others' ABORTs unread
    }
    std::thread ender;
    if (r == 0) {
      ender = std::thread([&] {
        while (e.pending() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));  // the call started
        std::this_thread::sleep_for(std::chrono::milliseconds(200));  // let it block on rank 1
        end(e);
      });
    }
    const auto t0 = std::chrono::steady_clock::now();
    try {
      e.run([&](Context& c) { allReduce(c, v.data(), v.data(), v.size(), DataType::kFloat32, RedOp::kSum); });
    } catch (const Error& x) {
      kinds[static_cast<size_t>(r)] = static_cast<int>(x.kind());
      messages[static_cast<size_t>(r)] = x.what();
    }
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 20.0) << "rank " << r;
    ++done;
    if (ender.joinable()) ender.join();
  });
  for (int r : {0, 2}) {
    EXPECT_EQ(kinds[static_cast<size_t>(r)], static_cast<int>(ErrorKind::kAborted)) << messages[static_cast<size_t>(r)];
    EXPECT_NE(messages[static_cast<size_t>(r)].find(reason), std::string::npos) << messages[static_cast<size_t>(r)];
  }
}

TEST_P(EngineTest, AbortFromAnotherThreadEndsABlockedCallOnEveryRank) {
  Topology t = topo();
  t.timeout = 30;
  blockedThenEnded(t, [](Engine& e) { e.abort("the test aborts"); }, "the test aborts");
}

TEST_P(EngineTest, CloseFromAnotherThreadDuringACallIsSafe) {
  Topology t = topo();
  t.timeout = 30;
  blockedThenEnded(t, [](Engine& e) { e.close(); }, "closed during a call");
}

TEST_P(EngineTest, AbortBetweenCallsPoisonsAndTellsThePeers) {
  runEngines(2, topo(), [&](int r, Engine& e) {
    std::vector<int32_t> v(1000, 1);
    e.run([&](Context& c) { allReduce(c, v.data(), v.data(), v.size(), DataType::kInt32, RedOp::kSum); });
    if (r == 0) e.abort("stop now");
    try {
      e.run([&](Context& c) { allReduce(c, v.data(), v.data(), v.size(), DataType::kInt32, RedOp::kSum); });
      ADD_FAILURE() << "rank " << r << ": the call after the abort returned";
    } catch (const Error& x) {
      EXPECT_EQ(x.kind(), ErrorKind::kAborted) << x.what();
      EXPECT_NE(std::string(x.what()).find("stop now"), std::string::npos) << x.what();
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Transports, EngineTest, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& param) {
                           return param.param ? std::string("shm") : std::string("tcp");
                         });

}  // namespace
}  // namespace meshccl
