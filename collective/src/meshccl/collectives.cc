#include "meshccl/collectives.h"

#include <cstring>
#include <exception>

#include "meshccl/algorithms.h"
#include "meshccl/platform.h"

namespace meshccl {

namespace {

// Starts an operation on the context and ends it however the algorithm leaves.
class OpScope {
 public:
  OpScope(Context& ctx, const CallDesc& desc) : ctx_(ctx), exceptions_(std::uncaught_exceptions()) {
    ctx_.beginOp(desc);
  }
  ~OpScope() { ctx_.endOp(std::uncaught_exceptions() > exceptions_); }
  OpScope(const OpScope&) = delete;
  OpScope& operator=(const OpScope&) = delete;

 private:
  Context& ctx_;
  int exceptions_;
};

CallDesc call(Collective kind, DataType dtype, RedOp op, size_t count, int root = 0) {
  CallDesc d;
  d.kind = kind;
  d.dtype = dtype;
  d.op = op;
  d.count = count;
  d.root = static_cast<uint32_t>(root);
  return d;
}

void checkTypes(DataType dtype, RedOp op) {
  MESHCCL_ENFORCE(validDataType(static_cast<int>(dtype)), "unknown dtype ", static_cast<int>(dtype));
  MESHCCL_ENFORCE(validRedOp(static_cast<int>(op)), "unknown reduction op ", static_cast<int>(op));
}

void checkBuffer(const void* p, size_t bytes, const char* what) {
  MESHCCL_ENFORCE(p != nullptr || bytes == 0, what, " is a null pointer");
}

// True when [a, a+an) and [b, b+bn) share a byte.
bool overlaps(const void* a, size_t an, const void* b, size_t bn) {
  const auto x = reinterpret_cast<uintptr_t>(a);
  const auto y = reinterpret_cast<uintptr_t>(b);
  return an > 0 && bn > 0 && x < y + bn && y < x + an;
}

// Ring channels per direction: on two ranks, every connection of the one pair.
int ringChannels(const Context& ctx) {
  if (ctx.size() == 2) return ctx.connCount(1 - ctx.rank());
  return ctx.config().ringConns;
}

enum class Path { kSmall, kDirect, kRingSmall, kRing };

// Large calls with every rank on this host read the peers' buffers directly (if every rank
// can: the algorithm falls back otherwise). The same answer on every rank (of one build: a
// build without single copy never tries, so ranks of one host must run one build).
bool trySingleCopy(const Context& ctx, size_t bytes) {
  if constexpr (!platform::kSingleCopy) return false;
  const Config& cfg = ctx.config();
  return ctx.allOnHost() && cfg.algorithm == "auto" && cfg.singleCopyBytes > 0 && bytes >= cfg.singleCopyBytes;
}

Path choose(const Context& ctx, size_t bytes) {
  const Config& cfg = ctx.config();
  const bool small = bytes <= cfg.smallBytes;
  if (cfg.algorithm == "ring" || !cfg.complete) return small ? Path::kRingSmall : Path::kRing;
  if (cfg.algorithm == "direct") return small ? Path::kSmall : Path::kDirect;
  if (small) return Path::kSmall;
  return ctx.size() >= 3 ? Path::kDirect : Path::kRing;
}

}  // namespace

void allReduce(Context& ctx, const void* send, void* recv, size_t count, DataType dtype, RedOp op) {
  checkTypes(dtype, op);
  const size_t bytes = count * elementSize(dtype);
  checkBuffer(send, bytes, "all_reduce input");
  checkBuffer(recv, bytes, "all_reduce output");
  MESHCCL_ENFORCE(send == recv || !overlaps(send, bytes, recv, bytes),
                  "all_reduce input and output overlap without being the same buffer");
  ctx.checkHealthy();
  if (ctx.size() == 1) {
    if (send != recv && bytes > 0) std::memcpy(recv, send, bytes);
    return;
  }
  OpScope scope(ctx, call(Collective::kAllReduce, dtype, op, count));
  const algo::Buffers b{static_cast<const char*>(send), static_cast<char*>(recv), count, dtype, op};
  if (trySingleCopy(ctx, bytes) && algo::singleCopyAllReduce(ctx, b)) return;
  switch (choose(ctx, bytes)) {
    case Path::kSmall: return algo::smallAllReduce(ctx, b);
    case Path::kDirect: return algo::directAllReduce(ctx, b);
    case Path::kRingSmall: return algo::ringAllReduce(ctx, b, 1, false);
    case Path::kRing: return algo::ringAllReduce(ctx, b, ringChannels(ctx), true);
  }
}

void allGather(Context& ctx, const void* send, void* recv, size_t count, DataType dtype) {
  checkTypes(dtype, RedOp::kSum);
  const size_t bytes = count * elementSize(dtype);
  const size_t total = bytes * static_cast<size_t>(ctx.size());
  checkBuffer(send, bytes, "all_gather input");
  checkBuffer(recv, total, "all_gather output");
  const char* own = static_cast<const char*>(recv) + static_cast<size_t>(ctx.rank()) * bytes;
  MESHCCL_ENFORCE(send == own || !overlaps(send, bytes, recv, total),
                  "all_gather input overlaps the output other than at this rank's own block (in place)");
  ctx.checkHealthy();
  if (ctx.size() == 1) {
    if (send != recv && bytes > 0) std::memcpy(recv, send, bytes);
    return;
  }
  OpScope scope(ctx, call(Collective::kAllGather, dtype, RedOp::kSum, count));
  const algo::Buffers b{static_cast<const char*>(send), static_cast<char*>(recv), count, dtype, RedOp::kSum};
  if (trySingleCopy(ctx, total) && algo::singleCopyAllGather(ctx, b)) return;
  if (ctx.config().complete && ctx.config().algorithm != "ring") return algo::directAllGather(ctx, b);
  const bool small = total <= ctx.config().smallBytes;
  algo::ringAllGather(ctx, b, small ? 1 : ringChannels(ctx), !small);
}

void reduceScatter(Context& ctx, const void* send, void* recv, size_t count, DataType dtype, RedOp op) {
  checkTypes(dtype, op);
  const size_t bytes = count * elementSize(dtype);
  const size_t total = bytes * static_cast<size_t>(ctx.size());
  checkBuffer(send, total, "reduce_scatter input");
  checkBuffer(recv, bytes, "reduce_scatter output");
  const char* own = static_cast<const char*>(send) + static_cast<size_t>(ctx.rank()) * bytes;
  MESHCCL_ENFORCE(recv == own || !overlaps(send, total, recv, bytes),
                  "reduce_scatter output overlaps the input other than at this rank's own block (in place)");
  ctx.checkHealthy();
  if (ctx.size() == 1) {
    if (send != recv && bytes > 0) std::memcpy(recv, send, bytes);
    return;
  }
  OpScope scope(ctx, call(Collective::kReduceScatter, dtype, op, count));
  const algo::Buffers b{static_cast<const char*>(send), static_cast<char*>(recv), count, dtype, op};
  if (trySingleCopy(ctx, total) && algo::singleCopyReduceScatter(ctx, b)) return;
  if (ctx.config().complete && ctx.config().algorithm != "ring") return algo::directReduceScatter(ctx, b);
  const bool small = total <= ctx.config().smallBytes;
  algo::ringReduceScatter(ctx, b, small ? 1 : ringChannels(ctx), !small);
}

void broadcast(Context& ctx, void* buf, size_t count, DataType dtype, int root) {
  checkTypes(dtype, RedOp::kSum);
  const size_t bytes = count * elementSize(dtype);
  checkBuffer(buf, bytes, "broadcast buffer");
  MESHCCL_ENFORCE(root >= 0 && root < ctx.size(), "broadcast root ", root, " is not a rank (world size ", ctx.size(),
                  ")");
  ctx.checkHealthy();
  if (ctx.size() == 1) return;
  OpScope scope(ctx, call(Collective::kBroadcast, dtype, RedOp::kSum, count, root));
  if (trySingleCopy(ctx, bytes) && algo::singleCopyBroadcast(ctx, static_cast<char*>(buf), bytes, root)) return;
  if (ctx.config().complete && ctx.config().algorithm != "ring") {
    return algo::directBroadcast(ctx, static_cast<char*>(buf), bytes, root);
  }
  algo::chainBroadcast(ctx, static_cast<char*>(buf), bytes, root, bytes > ctx.config().smallBytes);
}

namespace {

void pointToPoint(Context& ctx, bool isSend, void* buf, size_t count, DataType dtype, int peer) {
  checkTypes(dtype, RedOp::kSum);
  const size_t bytes = count * elementSize(dtype);
  checkBuffer(buf, bytes, isSend ? "send buffer" : "recv buffer");
  MESHCCL_ENFORCE(peer >= 0 && peer < ctx.size() && peer != ctx.rank(), isSend ? "send to " : "recv from ", "rank ",
                  peer, ": not another rank of this world (size ", ctx.size(), ", this is rank ", ctx.rank(), ")");
  MESHCCL_ENFORCE(ctx.connected(peer), "rank ", ctx.rank(), " and rank ", peer,
                  " share no link; send/recv works between linked ranks only");
  ctx.checkHealthy();
  OpScope scope(ctx, call(Collective::kSendRecv, dtype, RedOp::kSum, count, isSend ? ctx.rank() : peer));
  algo::postSegments(ctx, isSend, peer, static_cast<char*>(buf), bytes);
  ctx.waitAll();
}

}  // namespace

void send(Context& ctx, const void* buf, size_t count, DataType dtype, int dst) {
  pointToPoint(ctx, true, const_cast<void*>(buf), count, dtype, dst);
}

void recv(Context& ctx, void* buf, size_t count, DataType dtype, int src) {
  pointToPoint(ctx, false, buf, count, dtype, src);
}

void exchange(Context& ctx, const std::vector<P2POp>& ops) {
  for (const P2POp& op : ops) {
    checkBuffer(op.buf, op.bytes, op.isSend ? "send buffer" : "recv buffer");
    MESHCCL_ENFORCE(op.peer >= 0 && op.peer < ctx.size() && op.peer != ctx.rank(), op.isSend ? "send to " : "recv from ",
                    "rank ", op.peer, ": not another rank of this world (size ", ctx.size(), ", this is rank ",
                    ctx.rank(), ")");
    MESHCCL_ENFORCE(ctx.connected(op.peer), "rank ", ctx.rank(), " and rank ", op.peer,
                    " share no link; send/recv works between linked ranks only");
  }
  ctx.checkHealthy();
  if (ops.empty()) return;
  OpScope scope(ctx, call(Collective::kBatch, DataType::kUInt8, RedOp::kSum, 0));
  for (const P2POp& op : ops) algo::postSegments(ctx, op.isSend, op.peer, static_cast<char*>(op.buf), op.bytes);
  ctx.waitAll();
}

void messages(Context& ctx, std::vector<MessageOp>& ops) {
  for (const MessageOp& op : ops) {
    checkBuffer(op.buf, op.bytes, op.isSend ? "send buffer" : "recv buffer");
    const bool any = !op.isSend && op.peer == -1;
    MESHCCL_ENFORCE(any || (op.peer >= 0 && op.peer < ctx.size() && op.peer != ctx.rank()),
                    op.isSend ? "send to " : "recv from ", "rank ", op.peer, ": not another rank of this world (size ",
                    ctx.size(), ", this is rank ", ctx.rank(), ")");
    MESHCCL_ENFORCE(any || ctx.connected(op.peer), "rank ", ctx.rank(), " and rank ", op.peer,
                    " share no link; send/recv works between linked ranks only");
    MESHCCL_ENFORCE(!any || ctx.size() > 1, "recv from any rank: rank ", ctx.rank(), " is alone in its world");
  }
  ctx.checkHealthy();
  if (ops.empty()) return;
  OpScope scope(ctx, call(Collective::kMessage, DataType::kUInt8, RedOp::kSum, 0));
  std::vector<MessageRecv> recvs(ops.size());
  for (size_t i = 0; i < ops.size(); ++i) {
    if (ops[i].isSend) ctx.postMessage(ops[i].peer, ops[i].tag, ops[i].buf, ops[i].bytes);
  }
  for (size_t i = 0; i < ops.size(); ++i) {
    recvs[i] = MessageRecv{ops[i].peer, ops[i].tag, static_cast<char*>(ops[i].buf), ops[i].bytes};
    if (!ops[i].isSend && ops[i].peer >= 0) ctx.receiveMessage(recvs[i]);
  }
  ctx.waitAll();
  for (size_t i = 0; i < ops.size(); ++i) {
    if (!ops[i].isSend && ops[i].peer < 0) ctx.receiveAnyMessage(recvs[i]);
    ops[i].source = ops[i].isSend ? ops[i].peer : recvs[i].source;
  }
  ctx.waitAll();
}

void barrier(Context& ctx) {
  ctx.checkHealthy();
  if (ctx.size() == 1) return;
  OpScope scope(ctx, call(Collective::kBarrier, DataType::kUInt8, RedOp::kMax, 1));
  uint8_t in = 1;
  uint8_t out = 0;
  const algo::Buffers b{reinterpret_cast<const char*>(&in), reinterpret_cast<char*>(&out), 1, DataType::kUInt8,
                        RedOp::kMax};
  if (ctx.config().complete) return algo::smallAllReduce(ctx, b);
  algo::ringAllReduce(ctx, b, 1, false);
}

}  // namespace meshccl
