// Every collective x dtype x size x rank count x layout, each rank checking its own output
// against a closed form (inputs are small integers, so every dtype represents every partial
// result exactly and float reductions have one right answer; integer overflow wraps).

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "harness.h"
#include "meshccl/collectives.h"
#include "meshccl/platform.h"

namespace meshccl {
namespace {

using test::Topology;

const DataType kAllTypes[] = {DataType::kFloat32, DataType::kFloat64, DataType::kFloat16, DataType::kBFloat16,
                              DataType::kInt8,    DataType::kInt32,   DataType::kInt64,   DataType::kUInt8};

void store(DataType t, void* p, size_t i, long long v) {
  switch (t) {
    case DataType::kFloat32: static_cast<float*>(p)[i] = static_cast<float>(v); break;
    case DataType::kFloat64: static_cast<double*>(p)[i] = static_cast<double>(v); break;
    case DataType::kFloat16: static_cast<uint16_t*>(p)[i] = floatToHalf(static_cast<float>(v)); break;
    case DataType::kBFloat16: static_cast<uint16_t*>(p)[i] = floatToBFloat16(static_cast<float>(v)); break;
    case DataType::kInt8: static_cast<int8_t*>(p)[i] = static_cast<int8_t>(v); break;
    case DataType::kInt32: static_cast<int32_t*>(p)[i] = static_cast<int32_t>(v); break;
    case DataType::kInt64: static_cast<int64_t*>(p)[i] = static_cast<int64_t>(v); break;
    case DataType::kUInt8: static_cast<uint8_t*>(p)[i] = static_cast<uint8_t>(v); break;
  }
}

// The value as the dtype holds it, widened back (integers wrap as in the dtype).
long long load(DataType t, const void* p, size_t i) {
  switch (t) {
    case DataType::kFloat32: return static_cast<long long>(static_cast<const float*>(p)[i]);
    case DataType::kFloat64: return static_cast<long long>(static_cast<const double*>(p)[i]);
    case DataType::kFloat16: return static_cast<long long>(halfToFloat(static_cast<const uint16_t*>(p)[i]));
    case DataType::kBFloat16: return static_cast<long long>(bfloat16ToFloat(static_cast<const uint16_t*>(p)[i]));
    case DataType::kInt8: return static_cast<const int8_t*>(p)[i];
    case DataType::kInt32: return static_cast<const int32_t*>(p)[i];
    case DataType::kInt64: return static_cast<const int64_t*>(p)[i];
    case DataType::kUInt8: return static_cast<const uint8_t*>(p)[i];
  }
  return 0;
}

long long wrapTo(DataType t, long long v) {
  std::vector<char> tmp(8);
  store(t, tmp.data(), 0, v);
  return load(t, tmp.data(), 0);
}

long long input(RedOp op, int r, size_t i) {
  switch (op) {
    case RedOp::kSum: return (r + 1) * static_cast<long long>(1 + i % 5);
    case RedOp::kProd: return 1 + ((i + static_cast<size_t>(r)) % 3 == 0);
    default: return static_cast<long long>((i * 3 + static_cast<size_t>(r) * 5) % 17);
  }
}

long long expected(RedOp op, int n, size_t i, DataType t) {
  long long acc = input(op, 0, i);
  for (int r = 1; r < n; ++r) {
    const long long v = input(op, r, i);
    switch (op) {
      case RedOp::kSum: acc += v; break;
      case RedOp::kProd: acc *= v; break;
      case RedOp::kMin: acc = std::min(acc, v); break;
      case RedOp::kMax: acc = std::max(acc, v); break;
    }
  }
  return wrapTo(t, acc);
}

long long blockValue(int r, size_t i) { return static_cast<long long>((static_cast<size_t>(r) * 31 + i) % 100); }

[[noreturn]] void wrong(const std::string& what, int rank, size_t i, long long want, long long got) {
  throw std::runtime_error(what + ": rank " + std::to_string(rank) + " element " + std::to_string(i) + " expected " +
                           std::to_string(want) + " got " + std::to_string(got));
}

void checkAllReduce(Context& ctx, DataType t, RedOp op, size_t count, bool inPlace) {
  const size_t es = elementSize(t);
  std::vector<char> in(count * es + 1), out(count * es + 1);
  for (size_t i = 0; i < count; ++i) store(t, in.data(), i, input(op, ctx.rank(), i));
  char* dst = inPlace ? in.data() : out.data();
  allReduce(ctx, in.data(), dst, count, t, op);
  for (size_t i = 0; i < count; ++i) {
    const long long want = expected(op, ctx.size(), i, t);
    if (load(t, dst, i) != want) {
      wrong(std::string("all_reduce ") + dtypeName(t) + " " + redopName(op) + " count " + std::to_string(count) +
                (inPlace ? " in place" : ""),
            ctx.rank(), i, want, load(t, dst, i));
    }
  }
}

void checkAllGather(Context& ctx, DataType t, size_t count, bool inPlace) {
  const size_t es = elementSize(t);
  const auto n = static_cast<size_t>(ctx.size());
  std::vector<char> in(count * es + 1), out(n * count * es + 1);
  char* src = inPlace ? out.data() + static_cast<size_t>(ctx.rank()) * count * es : in.data();
  for (size_t i = 0; i < count; ++i) store(t, src, i, blockValue(ctx.rank(), i));
  allGather(ctx, src, out.data(), count, t);
  for (int r = 0; r < ctx.size(); ++r) {
    for (size_t i = 0; i < count; ++i) {
      const long long want = wrapTo(t, blockValue(r, i));
      const long long got = load(t, out.data(), static_cast<size_t>(r) * count + i);
      if (got != want) wrong(std::string("all_gather ") + dtypeName(t), ctx.rank(), r * count + i, want, got);
    }
  }
}

void checkReduceScatter(Context& ctx, DataType t, RedOp op, size_t count, bool inPlace) {
  const size_t es = elementSize(t);
  const auto n = static_cast<size_t>(ctx.size());
  std::vector<char> in(n * count * es + 1), out(count * es + 1);
  // Block b of this rank's input: the all-reduce input shifted by b*count.
  for (size_t i = 0; i < n * count; ++i) store(t, in.data(), i, input(op, ctx.rank(), i));
  char* dst = inPlace ? in.data() + static_cast<size_t>(ctx.rank()) * count * es : out.data();
  reduceScatter(ctx, in.data(), dst, count, t, op);
  for (size_t i = 0; i < count; ++i) {
    const long long want = expected(op, ctx.size(), static_cast<size_t>(ctx.rank()) * count + i, t);
    if (load(t, dst, i) != want) {
      wrong(std::string("reduce_scatter ") + dtypeName(t) + " " + redopName(op), ctx.rank(), i, want, load(t, dst, i));
    }
  }
}

void checkBroadcast(Context& ctx, DataType t, size_t count, int root) {
  std::vector<char> buf(count * elementSize(t) + 1);
  for (size_t i = 0; i < count; ++i) store(t, buf.data(), i, ctx.rank() == root ? blockValue(root, i) : 99);
  broadcast(ctx, buf.data(), count, t, root);
  for (size_t i = 0; i < count; ++i) {
    const long long want = wrapTo(t, blockValue(root, i));
    if (load(t, buf.data(), i) != want) wrong("broadcast", ctx.rank(), i, want, load(t, buf.data(), i));
  }
}

// Every rank sends to its right neighbour and receives from its left (even ranks send first,
// so blocking calls cannot deadlock; an odd world has one rank doing both in the other order).
void checkSendRecv(Context& ctx, DataType t, size_t count) {
  const int n = ctx.size();
  const int right = (ctx.rank() + 1) % n, left = (ctx.rank() + n - 1) % n;
  std::vector<char> out(count * elementSize(t) + 1), in(count * elementSize(t) + 1);
  for (size_t i = 0; i < count; ++i) store(t, out.data(), i, blockValue(ctx.rank(), i));
  if (ctx.rank() % 2 == 0) {
    send(ctx, out.data(), count, t, right);
    recv(ctx, in.data(), count, t, left);
  } else {
    recv(ctx, in.data(), count, t, left);
    send(ctx, out.data(), count, t, right);
  }
  for (size_t i = 0; i < count; ++i) {
    const long long want = wrapTo(t, blockValue(left, i));
    if (load(t, in.data(), i) != want) wrong("send/recv", ctx.rank(), i, want, load(t, in.data(), i));
  }
}

struct SweepCase {
  int ranks;
  Topology topo;
};

class Sweep : public ::testing::TestWithParam<SweepCase> {};

TEST_P(Sweep, EveryCollectiveDtypeAndSize) {
  const auto& p = GetParam();
  const int n = p.ranks;
  const std::vector<size_t> sizes{0, 1, 7, static_cast<size_t>(n) * 257 + 3, 5000};
  test::runRanks(n, p.topo, [&](Context& ctx) {
    for (DataType t : kAllTypes) {
      for (size_t count : sizes) {
        for (RedOp op : {RedOp::kSum, RedOp::kProd, RedOp::kMin, RedOp::kMax}) {
          checkAllReduce(ctx, t, op, count, false);
        }
        checkAllReduce(ctx, t, RedOp::kSum, count, true);
        checkAllGather(ctx, t, count, false);
        checkAllGather(ctx, t, count, true);
        checkReduceScatter(ctx, t, RedOp::kSum, count, false);
        checkReduceScatter(ctx, t, RedOp::kMax, count, true);
        checkBroadcast(ctx, t, count, 0);
        checkBroadcast(ctx, t, count, n - 1);
        if (n > 1) checkSendRecv(ctx, t, count);
      }
    }
    barrier(ctx);
  });
}

std::vector<SweepCase> sweepCases() {
  std::vector<SweepCase> out;
  for (int n = 1; n <= 8; ++n) {
    out.push_back({n, Topology{}});  // full mesh, automatic choice
    Topology direct;
    direct.connsPerLink = 2;
    direct.algorithm = "direct";
    out.push_back({n, direct});
    Topology ringOnly;
    ringOnly.ring = true;
    ringOnly.connsPerLink = 2;
    out.push_back({n, ringOnly});
    Topology meshRing;
    meshRing.algorithm = "ring";
    meshRing.depth = 2;
    out.push_back({n, meshRing});
    Topology shm;  // every rank on one host: shared memory everywhere
    shm.hostRanks = 8;
    shm.connsPerLink = 2;
    out.push_back({n, shm});
    Topology single = shm;  // one host, every size read straight from the peers (single copy)
    single.singleCopyBytes = 1;
    out.push_back({n, single});
    Topology mixed;  // two ranks per host: shared memory inside, TCP between, forced ring
    mixed.hostRanks = 2;
    mixed.algorithm = "ring";
    out.push_back({n, mixed});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Ranks, Sweep, ::testing::ValuesIn(sweepCases()),
                         [](const ::testing::TestParamInfo<SweepCase>& param) {
                           return "n" + std::to_string(param.param.ranks) + "_" + param.param.topo.name();
                         });

// A large buffer through the pipelined paths with realistic segments: exact float sums.
TEST(Large, FourRanksSixteenMiBEveryLayout) {
  for (int layout = 0; layout < 3; ++layout) {
    Topology t;
    t.ring = layout == 1;
    t.hostRanks = layout == 2 ? 2 : 0;
    t.connsPerLink = 2;
    t.segmentBytes = 256 << 10;
    t.smallBytes = 64 << 10;
    const size_t count = (16u << 20) / 4 + 3;
    test::runRanks(4, t, [&](Context& ctx) { checkAllReduce(ctx, DataType::kFloat32, RedOp::kSum, count, false); });
  }
}

// Same-host pairs carry their data in shared memory, the others over TCP; transport=tcp
// keeps everything on TCP.
TEST(Shm, SameHostPairsUseSharedMemory) {
  Topology t;
  t.hostRanks = 2;
  t.connsPerLink = 2;
  test::runRanks(4, t, [](Context& ctx) {
    for (int j = 0; j < 4; ++j) {
      if (j == ctx.rank()) continue;
      EXPECT_EQ(ctx.transport(j), j / 2 == ctx.rank() / 2 ? "shm" : "tcp") << ctx.rank() << " -> " << j;
    }
    checkAllReduce(ctx, DataType::kFloat32, RedOp::kSum, 100000, false);
  });
  test::runRanks(
      2, t, [](Context& ctx) { EXPECT_EQ(ctx.transport(1 - ctx.rank()), "tcp"); },
      [](Config& c) { c.transport = "tcp"; });
}

// Single copy is on where every rank shares the host (in a build that has it), and nowhere else.
TEST(Shm, SingleCopyOnlyWhenEveryRankSharesTheHost) {
  Topology t;
  t.connsPerLink = 2;
  t.hostRanks = 4;
  test::runRanks(4, t, [](Context& ctx) {
    EXPECT_TRUE(ctx.allOnHost());
    EXPECT_EQ(ctx.canReadPeers(), platform::kSingleCopy);
    checkAllReduce(ctx, DataType::kFloat32, RedOp::kSum, (1u << 20) + 5, false);
    checkAllReduce(ctx, DataType::kInt32, RedOp::kMax, (1u << 20) + 5, true);
  });
  t.hostRanks = 2;
  test::runRanks(4, t, [](Context& ctx) {
    EXPECT_FALSE(ctx.allOnHost());
    EXPECT_FALSE(ctx.canReadPeers());
  });
  t.hostRanks = 4;
  test::runRanks(
      2, t, [](Context& ctx) { EXPECT_FALSE(ctx.canReadPeers()); }, [](Config& c) { c.singleCopyBytes = 0; });
  test::runRanks(
      2, t, [](Context& ctx) { EXPECT_FALSE(ctx.allOnHost() || ctx.canReadPeers()); },
      [](Config& c) { c.transport = "tcp"; });
}

TEST(Api, MisuseRaisesInvalidArgumentAndLeavesTheContextUsable) {
  test::runRanks(2, Topology{}, [](Context& ctx) {
    std::vector<float> a(8, 1.0f);
    EXPECT_THROW(allReduce(ctx, a.data(), a.data() + 1, 4, DataType::kFloat32, RedOp::kSum), Error);
    EXPECT_THROW(broadcast(ctx, a.data(), 4, DataType::kFloat32, 2), Error);
    EXPECT_THROW(send(ctx, a.data(), 4, DataType::kFloat32, ctx.rank()), Error);
    try {
      allReduce(ctx, a.data(), a.data(), 4, static_cast<DataType>(42), RedOp::kSum);
      ADD_FAILURE() << "bad dtype accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    }
    allReduce(ctx, a.data(), a.data(), 8, DataType::kFloat32, RedOp::kSum);
    EXPECT_EQ(a[7], 2.0f);
  });
}

}  // namespace
}  // namespace meshccl
