// Single copy between ranks of one host: a rank reads what it needs straight out of its peers'
// buffers (process_vm_readv) instead of having each byte copied into a ring by the sender and
// out of it by the receiver. Every call starts by exchanging, with every peer, the addresses of
// its input and output and whether this rank can read every peer (Context::canReadPeers); if
// any rank cannot, every rank sees that in the same flags and the call goes the usual way.
//
// all_reduce: rank r owns chunk r. It reads chunk r of every peer's input piece by piece into
//   a small scratch (which stays in cache) and reduces it into its output — own input first,
//   then the peers in rank order, so the owner alone fixes every element's value. Then a
//   barrier-like "ready" round: every chunk is final. Each rank reads every other chunk from its
//   owner's output straight into its own output, then a "done" round: nobody reads this rank's
//   buffers any more, so it may return. In place is safe: a rank overwrites chunk j only after
//   j's ready, which j sends after it has read chunk j from everyone.
// reduce_scatter: the reduce half of the above, then "done".
// all_gather / broadcast: read the blocks from their owners (the root), then "done".
// Small messages travel the rings as before (connection 0); a peer that dies makes the read
// fail (ESRCH) or the next round see its socket close, and a stopped one runs into the timeout.
// Only in builds with single copy (platform::kSingleCopy: Linux, not MESHCCL_PORTABLE); the
// others never call these (collectives.cc) and copy through the rings.

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "meshccl/algorithms.h"
#include "meshccl/platform.h"

namespace meshccl::algo {

namespace {

// Bytes read from one peer before they are reduced: small enough to stay in cache, large
// enough that the system call is a small part of it.
constexpr size_t kPieceBytes = 256 << 10;

struct Addresses {
  uint64_t src;
  uint64_t dst;
  uint32_t canRead;
  uint32_t pad;
};

// The addresses of every rank's buffers (by rank), or an empty vector when some rank cannot
// read its peers' memory (then every rank returns empty: they all see the same flags).
std::vector<Addresses> exchange(Context& ctx, const void* src, const void* dst) {
  const int n = ctx.size();
  const int me = ctx.rank();
  std::vector<Addresses> all(static_cast<size_t>(n));
  Addresses& mine = all[static_cast<size_t>(me)];
  mine.src = reinterpret_cast<uintptr_t>(src);
  mine.dst = reinterpret_cast<uintptr_t>(dst);
  mine.canRead = ctx.canReadPeers() ? 1 : 0;
  for (int j = 0; j < n; ++j) {
    if (j == me) continue;
    ctx.postSend(j, 0, &mine, sizeof(mine));
    ctx.postRecv(j, 0, &all[static_cast<size_t>(j)], sizeof(Addresses));
  }
  ctx.waitAll();
  for (const auto& a : all) {
    if (a.canRead != 1) return {};
  }
  return all;
}

// Every rank tells every other that it has reached this point, and waits for all of them.
void round(Context& ctx) {
  static const uint32_t kMark = 0x52454459;  // "REDY"
  std::vector<uint32_t> got(static_cast<size_t>(ctx.size()));
  for (int j = 0; j < ctx.size(); ++j) {
    if (j == ctx.rank()) continue;
    ctx.postSend(j, 0, &kMark, sizeof(kMark));
    ctx.postRecv(j, 0, &got[static_cast<size_t>(j)], sizeof(uint32_t));
  }
  ctx.waitAll();
}

void readPeer(Context& ctx, int peer, void* dst, uint64_t addr, size_t len) {
  if (len == 0) return;
  // The address came from the peer: the kernel checks it against the peer's memory, and a range
  // that wraps around is refused here with a clearer word than EFAULT.
  if (addr > std::numeric_limits<uint64_t>::max() - len) {
    ctx.fail(ErrorKind::kIo, cat("rank ", ctx.rank(), ": rank ", peer, " named address 0x", std::hex, addr, std::dec,
                                 " for its buffer, where ", len, " bytes cannot be (a bug in rank ", peer, "?)"));
  }
  std::string error;
  if (!platform::readProcessMemory(ctx.peerPid(peer), dst, addr, len, &error)) {
    ctx.failPeer(peer, cat("rank ", ctx.rank(), ": reading rank ", peer, "'s buffer failed (", error,
                                 "): has rank ", peer, " died?"));
  }
}

// out[0..count) = own (+) every peer's elements at their `peerOffset` bytes into their input,
// in rank order, piece by piece.
void reduceFromPeers(Context& ctx, const std::vector<Addresses>& addrs, char* out, const char* own,
                     size_t peerOffset, size_t count, DataType dtype, RedOp op) {
  const size_t esize = elementSize(dtype);
  const size_t pieceElems = std::max<size_t>(1, kPieceBytes / esize);
  char* scratch = ctx.scratch(std::min(count, pieceElems) * esize);
  for (size_t o = 0; o < count; o += pieceElems) {
    const size_t m = std::min(pieceElems, count - o);
    const char* acc = own + o * esize;
    for (int j = 0; j < ctx.size(); ++j) {
      if (j == ctx.rank()) continue;
      readPeer(ctx, j, scratch, addrs[static_cast<size_t>(j)].src + peerOffset + o * esize, m * esize);
      reduce(out + o * esize, acc, scratch, m, dtype, op);
      acc = out + o * esize;
    }
  }
}

}  // namespace

bool singleCopyAllReduce(Context& ctx, const Buffers& b) {
  const auto addrs = exchange(ctx, b.src, b.dst);
  if (addrs.empty()) return false;
  const int n = ctx.size();
  const int me = ctx.rank();
  const size_t esize = elementSize(b.dtype);
  auto start = [&](int c) { return partStart(b.count, static_cast<size_t>(n), static_cast<size_t>(c)); };
  const size_t off = start(me) * esize;
  reduceFromPeers(ctx, addrs, b.dst + off, b.src + off, off, start(me + 1) - start(me), b.dtype, b.op);
  round(ctx);  // every chunk is final
  for (int j = 0; j < n; ++j) {
    if (j == me) continue;
    const size_t o = start(j) * esize;
    readPeer(ctx, j, b.dst + o, addrs[static_cast<size_t>(j)].dst + o, (start(j + 1) - start(j)) * esize);
  }
  round(ctx);  // nobody reads this rank's buffers any more
  return true;
}

bool singleCopyReduceScatter(Context& ctx, const Buffers& b) {
  const auto addrs = exchange(ctx, b.src, b.dst);
  if (addrs.empty()) return false;
  const size_t off = static_cast<size_t>(ctx.rank()) * b.count * elementSize(b.dtype);
  reduceFromPeers(ctx, addrs, b.dst, b.src + off, off, b.count, b.dtype, b.op);
  round(ctx);
  return true;
}

bool singleCopyAllGather(Context& ctx, const Buffers& b) {
  const auto addrs = exchange(ctx, b.src, b.dst);
  if (addrs.empty()) return false;
  const size_t bytes = b.count * elementSize(b.dtype);
  for (int j = 0; j < ctx.size(); ++j) {
    char* block = b.dst + static_cast<size_t>(j) * bytes;
    if (j == ctx.rank()) {
      if (block != b.src && bytes > 0) std::memmove(block, b.src, bytes);
    } else {
      readPeer(ctx, j, block, addrs[static_cast<size_t>(j)].src, bytes);
    }
  }
  round(ctx);
  return true;
}

bool singleCopyBroadcast(Context& ctx, char* buf, size_t bytes, int root) {
  const auto addrs = exchange(ctx, buf, buf);
  if (addrs.empty()) return false;
  if (ctx.rank() != root) readPeer(ctx, root, buf, addrs[static_cast<size_t>(root)].src, bytes);
  round(ctx);
  return true;
}

}  // namespace meshccl::algo
