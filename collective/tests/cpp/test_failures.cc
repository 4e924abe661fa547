// Failures every rank must see: mismatched calls, a rank that never calls (timeout), a peer
// with the wrong job token or job id, a tokenless job, a poisoned context. Dead processes are
// tested from Python with real processes (SIGKILL / SIGSTOP).

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "harness.h"
#include "meshccl/collectives.h"

namespace meshccl {
namespace {

using test::Topology;

// Runs body on n ranks; returns each rank's error kind and message (kind 0: no error).
struct Outcome {
  std::vector<int> kinds;
  std::vector<std::string> messages;
  std::vector<double> seconds;
};

Outcome runExpectingErrors(int n, const Topology& t, const std::function<void(Context&)>& body,
                           const std::function<void(Config&)>& tweak = nullptr) {
  Outcome out;
  out.kinds.assign(static_cast<size_t>(n), 0);
  out.messages.assign(static_cast<size_t>(n), "");
  out.seconds.assign(static_cast<size_t>(n), 0);
  test::runRanks(
      n, t,
      [&](Context& ctx) {
        const auto start = std::chrono::steady_clock::now();
        try {
          body(ctx);
        } catch (const Error& e) {
          out.kinds[ctx.rank()] = static_cast<int>(e.kind());
          out.messages[ctx.rank()] = e.what();
        }
        out.seconds[ctx.rank()] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      },
      tweak);
  return out;
}

class Layouts : public ::testing::TestWithParam<Topology> {};

TEST_P(Layouts, DtypeMismatchRaisesOnEveryRank) {
  const int n = 4;
  const auto out = runExpectingErrors(n, GetParam(), [](Context& ctx) {
    std::vector<char> buf(4 * 1024);
    const DataType t = ctx.rank() == 2 ? DataType::kInt32 : DataType::kFloat32;
    allReduce(ctx, buf.data(), buf.data(), 1024, t, RedOp::kSum);
  });
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(out.kinds[r], static_cast<int>(ErrorKind::kMismatch)) << "rank " << r << ": " << out.messages[r];
    EXPECT_NE(out.messages[r].find("int32"), std::string::npos) << out.messages[r];
    EXPECT_NE(out.messages[r].find("float32"), std::string::npos) << out.messages[r];
  }
}

TEST_P(Layouts, DifferentCollectivesRaiseOnEveryRank) {
  constexpr int n = 3;
  const auto out = runExpectingErrors(n, GetParam(), [](Context& ctx) {
    std::vector<float> buf(300 * n, 1.0f), gathered(300 * n);
    if (ctx.rank() == 1) {
      allGather(ctx, buf.data(), gathered.data(), 300, DataType::kFloat32);
    } else {
      allReduce(ctx, buf.data(), buf.data(), 300, DataType::kFloat32, RedOp::kSum);
    }
  });
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(out.kinds[r], static_cast<int>(ErrorKind::kMismatch)) << "rank " << r << ": " << out.messages[r];
    EXPECT_NE(out.messages[r].find("all_gather"), std::string::npos) << out.messages[r];
  }
}

TEST_P(Layouts, ARankThatNeverCallsTimesOutEveryOtherRank) {
  const int n = 4;
  Topology t = GetParam();
  t.timeout = 1.0;
  const auto out = runExpectingErrors(n, t, [](Context& ctx) {
    std::vector<float> buf(1 << 16, 1.0f);
    if (ctx.rank() == 3) {
      std::this_thread::sleep_for(std::chrono::milliseconds(3000));  // alive, silent
      return;
    }
    allReduce(ctx, buf.data(), buf.data(), buf.size(), DataType::kFloat32, RedOp::kSum);
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(out.kinds[r], static_cast<int>(ErrorKind::kTimeout)) << "rank " << r << ": " << out.messages[r];
    EXPECT_LT(out.seconds[r], 2.9) << "rank " << r << " took " << out.seconds[r] << " s";
    EXPECT_NE(out.messages[r].find("timed out"), std::string::npos) << out.messages[r];
  }
}

INSTANTIATE_TEST_SUITE_P(Failures, Layouts,
                         ::testing::Values(Topology{}, Topology{true, 2, "auto", 4096, 1024, 3, 30.0},
                                           Topology{false, 1, "auto", 4096, 1024, 3, 30.0, 8},
                                           Topology{true, 2, "ring", 4096, 1024, 3, 30.0, 2}),
                         [](const ::testing::TestParamInfo<Topology>& param) { return param.param.name(); });

TEST(Failures, PoisonedContextRaisesTheSameErrorAgain) {
  const auto out = runExpectingErrors(2, Topology{}, [](Context& ctx) {
    std::vector<float> buf(16, 1.0f);
    try {
      allReduce(ctx, buf.data(), buf.data(), ctx.rank() == 0 ? 16 : 8, DataType::kFloat32, RedOp::kSum);
    } catch (const Error& first) {
      try {
        barrier(ctx);
      } catch (const Error& again) {
        EXPECT_STREQ(first.what(), again.what());
        throw;
      }
      ADD_FAILURE() << "a poisoned context accepted another call";
    }
  });
  EXPECT_EQ(out.kinds[0], static_cast<int>(ErrorKind::kMismatch)) << out.messages[0];
  EXPECT_EQ(out.kinds[1], static_cast<int>(ErrorKind::kMismatch)) << out.messages[1];
}

TEST(Failures, WrongTokenRaisesAuthOnTheStrangerAndTimesOutTheOther) {
  const auto ports = test::freePorts(2);
  std::vector<int> kinds(2, 0);
  std::vector<std::string> messages(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      Config c = test::makeConfig(r, 2, ports, Topology{});
      c.connectTimeoutSeconds = 2.0;
      if (r == 1) c.token = "not-the-token";
      try {
        Context ctx(std::move(c));
      } catch (const Error& e) {
        kinds[r] = static_cast<int>(e.kind());
        messages[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(kinds[1], static_cast<int>(ErrorKind::kAuth)) << messages[1];
  EXPECT_EQ(messages[1].find("not-the-token"), std::string::npos) << "the token leaked into a message";
  EXPECT_EQ(kinds[0], static_cast<int>(ErrorKind::kTimeout)) << messages[0];
  EXPECT_NE(messages[0].find("rank 1 did not connect"), std::string::npos) << messages[0];
}

// Rank 1 differs from rank 0 by `change`; returns what each rank raised (rank 0 waits 1.5 s).
std::vector<std::pair<int, std::string>> connectWithDifference(const std::function<void(Config&)>& change) {
  const auto ports = test::freePorts(2);
  std::vector<std::pair<int, std::string>> out(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      Config c = test::makeConfig(r, 2, ports, Topology{});
      c.connectTimeoutSeconds = 1.5;
      c.jobId = "job-a";
      if (r == 1) change(c);
      try {
        Context ctx(std::move(c));
      } catch (const Error& e) {
        out[r] = {static_cast<int>(e.kind()), e.what()};
      }
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

TEST(Failures, AnotherJobIdIsRefusedLikeAnotherToken) {
  // The same token, another job: the proofs bind the job id, so neither side accepts the other.
  const auto out = connectWithDifference([](Config& c) { c.jobId = "job-b"; });
  EXPECT_EQ(out[1].first, static_cast<int>(ErrorKind::kAuth)) << out[1].second;
  EXPECT_NE(out[1].second.find("different MESHCCL_TOKEN values or job ids"), std::string::npos) << out[1].second;
  EXPECT_EQ(out[0].first, static_cast<int>(ErrorKind::kTimeout)) << out[0].second;
}

TEST(Failures, ARankWithoutATokenCannotJoinAJobWithOne) {
  const auto out = connectWithDifference([](Config& c) {
    c.token = "";
    c.allowNoToken = true;
  });
  EXPECT_EQ(out[1].first, static_cast<int>(ErrorKind::kAuth)) << out[1].second;
  EXPECT_EQ(out[0].first, static_cast<int>(ErrorKind::kTimeout)) << out[0].second;
}

TEST(Failures, ATokenlessJobIsRefusedWithTheWayOut) {
  Config c = test::makeConfig(0, 2, test::freePorts(2), Topology{});
  c.token = "";
  try {
    Context ctx(std::move(c));
    FAIL() << "a job of two ranks formed without a token";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kAuth);
    EXPECT_NE(std::string(e.what()).find("MESHCCL_TOKEN"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("MESHCCL_ALLOW_NO_TOKEN=1"), std::string::npos) << e.what();
  }
}

TEST(Failures, ATokenlessJobRunsWithTheOptOutAndSaysSo) {
  testing::internal::CaptureStderr();
  std::atomic<int> good{0};
  test::runRanks(
      2, Topology{},
      [&](Context& ctx) {
        std::vector<float> buf(64, 1.0f);
        allReduce(ctx, buf.data(), buf.data(), buf.size(), DataType::kFloat32, RedOp::kSum);
        if (buf[0] == 2.0f && buf[63] == 2.0f) ++good;
      },
      [](Config& c) {
        c.token = "";
        c.allowNoToken = true;
        c.logLevel = 1;
      });
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_EQ(good.load(), 2);
  EXPECT_NE(log.find("running WITHOUT a job token (opted out)"), std::string::npos) << log;
}

TEST(Failures, UnreachablePeerIsNamedWithItsAddress) {
  Config c = test::makeConfig(1, 2, test::freePorts(2), Topology{});
  c.connectTimeoutSeconds = 0.5;
  try {
    Context ctx(std::move(c));
    FAIL() << "connected to nobody";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kTimeout);
    EXPECT_NE(std::string(e.what()).find("could not reach rank 0 at 127.0.0.1:"), std::string::npos) << e.what();
  }
}

TEST(Failures, BadAddressIsABootstrapError) {
  Config c = test::makeConfig(0, 2, test::freePorts(2), Topology{});
  c.listen = {{"not-an-address", 1234}};
  try {
    Context ctx(std::move(c));
    FAIL() << "accepted a bad address";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kBootstrap);
    EXPECT_NE(std::string(e.what()).find("'not-an-address' is not a numeric"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace meshccl
