// Tagged messages (collectives.h, messages()): a receive takes the oldest message from its peer
// (or from any rank) with its tag, whatever that peer sent first; messages with no receive yet
// wait in the stash, across calls. Over TCP with two connections per link (segments striped)
// and over shared memory.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "harness.h"
#include "meshccl/collectives.h"

namespace meshccl {
namespace {

using test::runRanks;
using test::Topology;

Topology topo(bool shm) {
  Topology t;
  t.connsPerLink = 2;  // a message's segments go over both connections
  if (shm) t.hostRanks = 8;
  return t;
}

// count int32s, each value `v` (the payload tells who sent what).
std::vector<int32_t> filled(size_t count, int32_t v) { return std::vector<int32_t>(count, v); }

MessageOp sendOf(std::vector<int32_t>& v, int peer, uint32_t tag) {
  return MessageOp{true, v.data(), v.size() * 4, peer, tag};
}
MessageOp recvOf(std::vector<int32_t>& v, int peer, uint32_t tag) {
  return MessageOp{false, v.data(), v.size() * 4, peer, tag};
}

void expectAll(const std::vector<int32_t>& v, int32_t want, const std::string& what) {
  const auto bad = std::find_if(v.begin(), v.end(), [&](int32_t x) { return x != want; });
  ASSERT_TRUE(bad == v.end()) << what << ": element " << (bad - v.begin()) << " is " << *bad << ", not " << want;
}

class MessagesTest : public ::testing::TestWithParam<bool> {};

TEST_P(MessagesTest, AReceiveTakesItsTagWhateverThePeerSentFirstAcrossCalls) {
  runRanks(2, topo(GetParam()), [&](Context& c) {
    // 3 sizes: one frame, a few segments, and (100003 ints) segments over both connections.
    const size_t sizes[] = {5, 3000, 100003};
    if (c.rank() == 0) {
      std::vector<std::vector<int32_t>> out;
      for (uint32_t tag = 1; tag <= 3; ++tag) out.push_back(filled(sizes[tag - 1], static_cast<int32_t>(10 * tag)));
      std::vector<MessageOp> ops;
      for (uint32_t tag = 1; tag <= 3; ++tag) ops.push_back(sendOf(out[tag - 1], 1, tag));
      messages(c, ops);  // all three in one call, tags 1, 2, 3
    } else {
      for (uint32_t tag = 3; tag >= 1; --tag) {  // received last first, one call each
        auto in = filled(sizes[tag - 1], -1);
        std::vector<MessageOp> ops{recvOf(in, 0, tag)};
        messages(c, ops);
        EXPECT_EQ(ops[0].source, 0);
        expectAll(in, static_cast<int32_t>(10 * tag), "tag " + std::to_string(tag));
      }
      EXPECT_EQ(c.stashedMessages(), 0u);
    }
    // Every message taken: the pair's collectives go on as before.
    std::vector<int32_t> v(1000, c.rank() + 1);
    allReduce(c, v.data(), v.data(), v.size(), DataType::kInt32, RedOp::kSum);
    expectAll(v, 3, "all_reduce after the messages");
  });
}

TEST_P(MessagesTest, MessagesWithOneTagArriveInTheOrderSent) {
  runRanks(2, topo(GetParam()), [&](Context& c) {
    std::vector<std::vector<int32_t>> bufs;
    for (int k = 0; k < 6; ++k) bufs.push_back(filled(2000, c.rank() == 0 ? k : -1));
    std::vector<MessageOp> ops;
    for (auto& b : bufs) ops.push_back(c.rank() == 0 ? sendOf(b, 1, 7) : recvOf(b, 0, 7));
    messages(c, ops);
    if (c.rank() == 1) {
      for (int k = 0; k < 6; ++k) expectAll(bufs[static_cast<size_t>(k)], k, "message " + std::to_string(k));
    }
  });
}

TEST_P(MessagesTest, ARingShiftOfLargeMessagesInOneCallDoesNotDeadlock) {
  runRanks(3, topo(GetParam()), [&](Context& c) {
    const int right = (c.rank() + 1) % 3, left = (c.rank() + 2) % 3;
    auto out = filled(4 << 20, c.rank());  // 16 MiB each way: far beyond socket buffers and rings
    auto in = filled(4 << 20, -1);
    std::vector<MessageOp> ops{sendOf(out, right, 5), recvOf(in, left, 5)};
    messages(c, ops);
    expectAll(in, left, "from the left");
  });
}

TEST_P(MessagesTest, AReceiveFromAnyRankTakesEachSendersMessagesAndSaysWhoSentThem) {
  runRanks(4, topo(GetParam()), [&](Context& c) {
    if (c.rank() != 0) {
      auto a = filled(3000, c.rank());
      auto b = filled(3000, 100 + c.rank());
      std::vector<MessageOp> ops{sendOf(a, 0, 0), sendOf(b, 0, 0)};
      messages(c, ops);
      return;
    }
    std::vector<int> seen;
    for (int k = 0; k < 6; ++k) {
      auto in = filled(3000, -1);
      std::vector<MessageOp> ops{recvOf(in, -1, 0)};
      messages(c, ops);
      const int from = ops[0].source;
      ASSERT_GE(from, 1);
      ASSERT_LE(from, 3);
      // A rank's two messages come in the order it sent them.
      const int before = static_cast<int>(std::count(seen.begin(), seen.end(), from));
      expectAll(in, before == 0 ? from : 100 + from, "message " + std::to_string(before) + " of rank " +
                                                         std::to_string(from));
      seen.push_back(from);
    }
    std::sort(seen.begin(), seen.end());
    EXPECT_EQ(seen, (std::vector<int>{1, 1, 2, 2, 3, 3}));
  });
}

TEST_P(MessagesTest, AReceiveFromAnyRankStashesOtherTagsForLater) {
  runRanks(2, topo(GetParam()), [&](Context& c) {
    if (c.rank() == 1) {
      auto a = filled(70000, 9);
      auto b = filled(10, 4);
      std::vector<MessageOp> ops{sendOf(a, 0, 9), sendOf(b, 0, 4)};
      messages(c, ops);
      return;
    }
    auto four = filled(10, -1);
    std::vector<MessageOp> any{recvOf(four, -1, 4)};
    messages(c, any);
    EXPECT_EQ(any[0].source, 1);
    expectAll(four, 4, "tag 4 from any rank");
    EXPECT_EQ(c.stashedMessages(), 1u);
    auto nine = filled(70000, -1);
    std::vector<MessageOp> named{recvOf(nine, 1, 9)};
    messages(c, named);
    expectAll(nine, 9, "tag 9, from the stash");
    EXPECT_EQ(c.stashedMessages(), 0u);
  });
}

TEST_P(MessagesTest, SizesThatDifferRaiseMismatchNamingBoth) {
  std::vector<std::string> errors(2);
  EXPECT_THROW(runRanks(2, topo(GetParam()), [&](Context& c) {
                 auto v = filled(c.rank() == 0 ? 100 : 50, 1);
                 std::vector<MessageOp> ops{c.rank() == 0 ? sendOf(v, 1, 3) : recvOf(v, 0, 3)};
                 try {
                   messages(c, ops);
                 } catch (const Error& e) {
                   errors[static_cast<size_t>(c.rank())] = e.what();
                   throw;
                 }
               }),
               Error);
  EXPECT_NE(errors[1].find("sent 400 bytes with tag 3"), std::string::npos) << errors[1];
  EXPECT_NE(errors[1].find("receives 200 bytes"), std::string::npos) << errors[1];
}

TEST_P(MessagesTest, ACollectiveThatMeetsAMessageNoReceiveTookRaisesMismatch) {
  std::vector<std::string> errors(2);
  EXPECT_THROW(runRanks(2, topo(GetParam()), [&](Context& c) {
                 std::vector<int32_t> v(10, 1);
                 try {
                   if (c.rank() == 0) {
                     std::vector<MessageOp> ops{sendOf(v, 1, 6)};
                     messages(c, ops);
                   }
                   allReduce(c, v.data(), v.data(), v.size(), DataType::kInt32, RedOp::kSum);
                 } catch (const Error& e) {
                   errors[static_cast<size_t>(c.rank())] = e.what();
                   throw;
                 }
               }),
               Error);
  EXPECT_NE(errors[1].find("a message (tag 6, 40 bytes) that no receive on rank 1 took"), std::string::npos)
      << errors[1];
}

TEST_P(MessagesTest, AReceiveFromAnyRankFailsWithTheErrorOfARankThatAborts) {
  std::string error;
  EXPECT_THROW(runRanks(3, topo(GetParam()), [&](Context& c) {
                 if (c.rank() == 2) {
                   c.requestAbort("rank 2 gives up");
                   c.abortIfRequested();  // its ABORTs go out now; then it leaves
                   return;
                 }
                 if (c.rank() == 1) return;  // sends nothing and leaves: no error by itself
                 auto in = filled(10, -1);
                 std::vector<MessageOp> ops{recvOf(in, -1, 0)};
                 try {
                   messages(c, ops);
                 } catch (const Error& e) {
                   error = e.what();
                   throw;
                 }
               }),
               Error);
  EXPECT_NE(error.find("rank 2 gives up"), std::string::npos) << error;
}

INSTANTIATE_TEST_SUITE_P(Links, MessagesTest, ::testing::Values(false, true),
                         [](const auto& p) { return p.param ? "shm" : "tcp"; });

}  // namespace
}  // namespace meshccl
