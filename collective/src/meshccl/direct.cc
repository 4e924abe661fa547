// Algorithms for a complete connection graph: every rank has a link to every other (a full
// mesh of cables, two ranks, ranks on one host). Data goes straight to the rank that needs it,
// on all links at once, instead of around a ring — so a host with three cables drives all
// three in both directions.
//
// direct all_reduce = direct reduce-scatter, then direct all-gather:
//   reduce-scatter: rank r sends segment k of chunk j to rank j, for every j and k; it receives
//     segment k of its own chunk r from every peer into scratch slots (D per peer) and reduces
//     them into the output in a fixed order: its own input, then the peers in rank order (a
//     contribution that arrives early waits in its slot for those before it). When a segment has
//     all n-1 contributions it is final and goes to every peer at once (all-gather), which
//     receives it in place.
//   A rank computes only its own chunk, always in the same order, so every rank ends with the
//   same values even for floating point, and so does every run: bit-identical results.
// On a pair with several connections, segment k travels on connection k mod K. Both ends post
// in segment order per connection, so frames match FIFO: segments can become final out of
// order (their contributions arrive at different times), so the all-gather sends are posted in
// segment order, each once it and every segment before it are final. An all-gather receive
// lands where, in place, this rank's reduce-scatter data for that peer was read from: it is
// posted once that send has completed.

#include <algorithm>
#include <cstring>
#include <vector>

#include "meshccl/algorithms.h"

namespace meshccl::algo {

namespace {

constexpr size_t kMinSplitBytes = 16 << 10;

size_t segCap(const Config& cfg, size_t esize) { return std::max<size_t>(1, cfg.segmentBytes / esize); }

class DirectReduceScatter final : public Req::Handler {
 public:
  // chunkSrc(j): this rank's contribution to chunk j; out: where chunk `me` is reduced to.
  // allGather: also send the final segments to every peer and receive theirs into gatherDst(j).
  DirectReduceScatter(Context& ctx, std::vector<const char*> chunkSrc, std::vector<size_t> chunkElems, char* out,
                      std::vector<char*> gatherDst, DataType dtype, RedOp op)
      : ctx_(ctx),
        me_(ctx.rank()),
        n_(ctx.size()),
        src_(std::move(chunkSrc)),
        elems_(std::move(chunkElems)),
        out_(out),
        gather_(std::move(gatherDst)),
        dtype_(dtype),
        op_(op),
        esize_(elementSize(dtype)),
        depth_(static_cast<size_t>(std::max(2, ctx.config().pipelineDepth))) {
    size_t maxElems = 0;
    for (size_t e : elems_) maxElems = std::max(maxElems, e);
    const size_t cap = segCap(ctx.config(), esize_);
    segs_ = std::max<size_t>(1, (maxElems + cap - 1) / cap);
    // At least one segment per connection of a link, so a chunk smaller than a segment still
    // travels on all of them at once (not below kMinSplitBytes per segment).
    const size_t spread = std::min<size_t>(static_cast<size_t>(ctx.config().connsPerLink),
                                           maxElems * esize_ / kMinSplitBytes);
    segs_ = std::max(segs_, spread);
    slotBytes_ = std::min(cap, std::max<size_t>(maxElems, 1)) * esize_;
    scratch_ = ctx.scratch(static_cast<size_t>(n_) * depth_ * slotBytes_);
    contributions_.assign(segs_, 0);
    arrived_.assign(static_cast<size_t>(n_) * segs_, false);
    final_.assign(segs_, false);
    for (int j = 0; j < n_; ++j) {
      if (j != me_) order_.push_back(j);  // the peers in rank order, after this rank's own input
    }
    rsRecvNext_.assign(static_cast<size_t>(n_), 0);
    rsSent_.assign(static_cast<size_t>(n_) * segs_, false);
    agRecvNext_.assign(static_cast<size_t>(n_), 0);
    slotBusy_.assign(static_cast<size_t>(n_) * depth_, false);
    for (int j = 0; j < n_; ++j) {
      if (j == me_) continue;
      for (size_t k = 0; k < segs_; ++k) {
        ctx_.postSend(j, static_cast<int>(k), src_[j] + off(j, k) * esize_, len(j, k) * esize_, this, tag(kRsSend, j, k));
        ++pending_;
      }
      pending_ += segs_;  // reduce-scatter receives from j
      if (!gather_.empty()) pending_ += 2 * segs_;  // all-gather sends to and receives from j
    }
  }

  bool done() const { return pending_ == 0; }

  void pump() {
    for (int j = 0; j < n_; ++j) {
      if (j == me_) continue;
      auto& next = rsRecvNext_[j];
      while (next < segs_ && !slotBusy_[slot(j, next)]) {
        slotBusy_[slot(j, next)] = true;
        ctx_.postRecv(j, static_cast<int>(next), scratch_ + slot(j, next) * slotBytes_, len(me_, next) * esize_, this,
                      tag(kRsRecv, j, next));
        ++next;
      }
      if (gather_.empty() || next < segs_) continue;
      // All-gather receives follow the reduce-scatter ones on each connection; in place, the
      // segment they land on must have left this rank first.
      auto& ag = agRecvNext_[j];
      while (ag < segs_ && rsSent_[static_cast<size_t>(j) * segs_ + ag]) {
        ctx_.postRecv(j, static_cast<int>(ag), gather_[j] + off(j, ag) * esize_, len(j, ag) * esize_, this,
                      tag(kAgRecv, j, ag));
        ++ag;
      }
    }
  }

  void onComplete(Req& r) override {
    --pending_;
    const int kind = static_cast<int>(r.tag >> 56);
    const int j = static_cast<int>((r.tag >> 32) & 0xffffff);
    const size_t k = r.tag & 0xffffffffu;
    if (kind == kRsSend) {
      rsSent_[static_cast<size_t>(j) * segs_ + k] = true;
      return;
    }
    if (kind != kRsRecv) return;
    arrived_[static_cast<size_t>(j) * segs_ + k] = true;
    // Reduce what can be reduced in order: the next peer's contribution, while it is here.
    char* o = out_ + off(me_, k) * esize_;
    while (contributions_[k] < n_ - 1) {
      const int p = order_[static_cast<size_t>(contributions_[k])];
      if (!arrived_[static_cast<size_t>(p) * segs_ + k]) return;
      const char* a = contributions_[k] == 0 ? src_[me_] + off(me_, k) * esize_ : o;
      reduce(o, a, scratch_ + slot(p, k) * slotBytes_, len(me_, k), dtype_, op_);
      slotBusy_[slot(p, k)] = false;
      ++contributions_[k];
    }
    final_[k] = true;
    while (nextFinal_ < segs_ && final_[nextFinal_]) finalize(nextFinal_++);
  }

 private:
  static constexpr int kRsSend = 1, kRsRecv = 2, kAgSend = 3, kAgRecv = 4;
  static uint64_t tag(int kind, int j, size_t k) {
    return (static_cast<uint64_t>(kind) << 56) | (static_cast<uint64_t>(j) << 32) | static_cast<uint64_t>(k);
  }
  size_t off(int c, size_t k) const { return partStart(elems_[c], segs_, k); }
  size_t len(int c, size_t k) const { return partStart(elems_[c], segs_, k + 1) - partStart(elems_[c], segs_, k); }
  size_t slot(int j, size_t k) const { return static_cast<size_t>(j) * depth_ + k % depth_; }

  void finalize(size_t k) {
    if (gather_.empty()) return;
    for (int j = 0; j < n_; ++j) {
      if (j == me_) continue;
      ctx_.postSend(j, static_cast<int>(k), out_ + off(me_, k) * esize_, len(me_, k) * esize_, this,
                    tag(kAgSend, j, k));
    }
  }

  Context& ctx_;
  int me_, n_;
  std::vector<const char*> src_;
  std::vector<size_t> elems_;
  char* out_;
  std::vector<char*> gather_;
  DataType dtype_;
  RedOp op_;
  size_t esize_;
  size_t depth_;
  size_t segs_ = 1;
  size_t slotBytes_ = 0;
  char* scratch_ = nullptr;
  size_t pending_ = 0;
  std::vector<int> contributions_;  // per segment: peers reduced into it so far (in order_)
  std::vector<int> order_;          // the peers, in the order their contributions are reduced
  std::vector<bool> arrived_;       // per (peer, segment): the contribution is in its slot
  std::vector<bool> final_;         // per segment: every contribution reduced
  size_t nextFinal_ = 0;            // segments before it have had their all-gather sends posted
  std::vector<size_t> rsRecvNext_, agRecvNext_;
  std::vector<bool> rsSent_;  // per (peer, segment): the reduce-scatter send has left
  std::vector<bool> slotBusy_;
};

void run(Context& ctx, DirectReduceScatter& alg) {
  for (;;) {
    alg.pump();
    if (alg.done()) return;
    ctx.progress();
  }
}

}  // namespace

// Sends `bytes` at `data` to `peer` (or receives them), cut into segments striped over the
// pair's connections.
void postSegments(Context& ctx, bool send, int peer, char* data, size_t bytes) {
  const size_t cap = ctx.config().segmentBytes;
  const size_t segs = std::max<size_t>(1, (bytes + cap - 1) / cap);
  for (size_t k = 0; k < segs; ++k) {
    const size_t o = partStart(bytes, segs, k);
    const size_t l = partStart(bytes, segs, k + 1) - o;
    if (send) {
      ctx.postSend(peer, static_cast<int>(k), data + o, l);
    } else {
      ctx.postRecv(peer, static_cast<int>(k), data + o, l);
    }
  }
}

void directAllReduce(Context& ctx, const Buffers& b) {
  const int n = ctx.size();
  const size_t esize = elementSize(b.dtype);
  std::vector<const char*> src(static_cast<size_t>(n));
  std::vector<char*> dst(static_cast<size_t>(n));
  std::vector<size_t> elems(static_cast<size_t>(n));
  for (int c = 0; c < n; ++c) {
    const size_t o = partStart(b.count, static_cast<size_t>(n), static_cast<size_t>(c));
    elems[c] = partStart(b.count, static_cast<size_t>(n), static_cast<size_t>(c) + 1) - o;
    src[c] = b.src + o * esize;
    dst[c] = b.dst + o * esize;
  }
  DirectReduceScatter alg(ctx, src, elems, dst[ctx.rank()], dst, b.dtype, b.op);
  run(ctx, alg);
}

void directReduceScatter(Context& ctx, const Buffers& b) {
  const int n = ctx.size();
  const size_t esize = elementSize(b.dtype);
  std::vector<const char*> src(static_cast<size_t>(n));
  std::vector<size_t> elems(static_cast<size_t>(n), b.count);
  for (int c = 0; c < n; ++c) src[c] = b.src + static_cast<size_t>(c) * b.count * esize;
  DirectReduceScatter alg(ctx, src, elems, b.dst, {}, b.dtype, b.op);
  run(ctx, alg);
}

void directAllGather(Context& ctx, const Buffers& b) {
  const int n = ctx.size();
  const size_t bytes = b.count * elementSize(b.dtype);
  char* own = b.dst + static_cast<size_t>(ctx.rank()) * bytes;
  for (int j = 0; j < n; ++j) {
    if (j == ctx.rank()) continue;
    postSegments(ctx, true, j, const_cast<char*>(b.src), bytes);
    postSegments(ctx, false, j, b.dst + static_cast<size_t>(j) * bytes, bytes);
  }
  if (own != b.src && bytes > 0) std::memmove(own, b.src, bytes);
  ctx.waitAll();
}

void directBroadcast(Context& ctx, char* buf, size_t bytes, int root) {
  if (ctx.rank() == root) {
    for (int j = 0; j < ctx.size(); ++j) {
      if (j != root) postSegments(ctx, true, j, buf, bytes);
    }
  } else {
    postSegments(ctx, false, root, buf, bytes);
  }
  ctx.waitAll();
}

// One step: every rank's whole vector to every peer; each rank then reduces all n vectors in
// rank order, so all ranks compute bit-identical results. Scratch: n * bytes (small only).
void smallAllReduce(Context& ctx, const Buffers& b) {
  const int n = ctx.size();
  const int me = ctx.rank();
  const size_t bytes = b.count * elementSize(b.dtype);
  char* scratch = ctx.scratch(std::max<size_t>(static_cast<size_t>(n) * bytes, 1));
  char* acc = scratch + static_cast<size_t>(me) * bytes;  // slot `me` is free: it is the accumulator
  for (int j = 0; j < n; ++j) {
    if (j == me) continue;
    ctx.postSend(j, 0, b.src, bytes);
    ctx.postRecv(j, 0, scratch + static_cast<size_t>(j) * bytes, bytes);
  }
  ctx.waitAll();
  auto operand = [&](int j) -> const char* { return j == me ? b.src : scratch + static_cast<size_t>(j) * bytes; };
  if (n == 1) {
    std::memcpy(acc, b.src, bytes);
  } else {
    reduce(acc, operand(0), operand(1), b.count, b.dtype, b.op);
    for (int j = 2; j < n; ++j) reduce(acc, acc, operand(j), b.count, b.dtype, b.op);
  }
  if (bytes > 0) std::memcpy(b.dst, acc, bytes);
}

}  // namespace meshccl::algo
