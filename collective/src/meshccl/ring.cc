// Ring reduce-scatter / all-gather, chunked and pipelined, over several channels at once.
//
// A channel is one ring through all ranks in one direction over one connection index. Its
// ranks, in the channel's order, are order[0..n-1]; this rank sits at position p and sends to
// order[p+1], receives from order[p-1]. The channel's region is cut into n chunks; chunk c
// belongs to rank c (it ends reduce-scatter holding the reduced chunk c). Each chunk is cut
// into S segments of at most segmentBytes, so one segment is on the wire while another is
// being reduced. Steps (indices mod n):
//
//   reduce-scatter step s = 0..n-2:  send chunk order[p-s-1], receive chunk order[p-s-2]
//                                    and reduce it with this rank's own contribution;
//                                    after step n-2 this rank holds chunk order[p] = itself.
//   all-gather step t = 0..n-2:      send chunk order[p-t], receive chunk order[p-t-1].
//
// The region is cut into S slices (each chunk into S segments: slice k = segment k of every
// chunk); units are numbered u = k * T + step, slice-major, over the T steps the mode runs.
// Every rank does step s of slice k at the same time, so each link carries one segment per
// step and the next slice follows right behind; a received segment is reduced and forwarded
// at once, so a scratch slot is busy only for one hop. The send of unit u needs the receive
// of unit u-1 (the same slice one step earlier); step 0 sends the rank's own data. Receives
// land in D scratch slots (D >= 2) during reduce-scatter — bounded memory whatever the size
// — and straight in the output during all-gather. In place, the first all-gather receive of a
// slice lands where this rank's step-0 data was read from, so it waits for that send.
// Both ends post in unit order on one connection per direction, so frames match FIFO.

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "meshccl/algorithms.h"

namespace meshccl::algo {

namespace {

enum class Mode { kAllReduce, kReduceScatter, kAllGather };

class RingChannel final : public Req::Handler {
 public:
  // chunkSrc/chunkDst/chunkElems are indexed by chunk id (= owning rank).
  RingChannel(Context& ctx, Mode mode, std::vector<int> order, int conn, std::vector<const char*> chunkSrc,
              std::vector<char*> chunkDst, std::vector<size_t> chunkElems, DataType dtype, RedOp op, char* scratch,
              size_t slotStride)
      : ctx_(ctx),
        mode_(mode),
        order_(std::move(order)),
        conn_(conn),
        src_(std::move(chunkSrc)),
        dst_(std::move(chunkDst)),
        elems_(std::move(chunkElems)),
        dtype_(dtype),
        op_(op),
        esize_(elementSize(dtype)),
        n_(static_cast<int>(order_.size())),
        depth_(std::max<size_t>(2, static_cast<size_t>(ctx.config().pipelineDepth))),
        scratch_(scratch),
        slotStride_(slotStride) {
    for (int i = 0; i < n_; ++i) {
      if (order_[i] == ctx.rank()) p_ = i;
    }
    right_ = order_[(p_ + 1) % n_];
    left_ = order_[(p_ + n_ - 1) % n_];
    size_t maxElems = 0;
    for (size_t e : elems_) maxElems = std::max(maxElems, e);
    segs_ = std::max<size_t>(1, (maxElems + segCap(ctx.config(), dtype) - 1) / segCap(ctx.config(), dtype));
    steps_ = mode_ == Mode::kAllReduce ? 2 * (n_ - 1) : n_ - 1;
    units_ = static_cast<size_t>(steps_) * segs_;
    slotBusy_.assign(depth_, false);
  }

  // Largest segment, in elements.
  static size_t segCap(const Config& cfg, DataType dtype) {
    return std::max<size_t>(1, cfg.segmentBytes / elementSize(dtype));
  }
  // Bytes of one scratch slot, and of the D slots of one channel.
  static size_t slotBytes(size_t maxChunkElems, DataType dtype, const Config& cfg) {
    return std::min(segCap(cfg, dtype), std::max<size_t>(maxChunkElems, 1)) * elementSize(dtype);
  }
  static size_t scratchBytes(Mode mode, size_t maxChunkElems, DataType dtype, const Config& cfg) {
    if (mode == Mode::kAllGather) return 0;
    return std::max<size_t>(2, static_cast<size_t>(cfg.pipelineDepth)) * slotBytes(maxChunkElems, dtype, cfg);
  }

  bool done() const { return sendDone_ == units_ && recvDone_ == units_; }

  void pump() {
    while (sendNext_ < units_ && sendReady(sendNext_)) postSendUnit(sendNext_++);
    while (recvNext_ < units_ && recvNext_ < recvDone_ + depth_ && recvPostable(recvNext_)) postRecvUnit(recvNext_++);
  }

  void onComplete(Req& req) override {
    const size_t u = req.tag;
    const size_t s = stepOf(u);
    if (req.isSend) {
      ++sendDone_;
      // An intermediate reduce-scatter send went out of the slot its data was received in.
      if (isReduceStep(s) && s > 0) slotBusy_[slotOf(u - 1)] = false;
      return;
    }
    ++recvDone_;
    if (!isReduceStep(s)) return;  // all-gather data landed in place
    const size_t k = sliceOf(u);
    const int c = recvChunk(s);
    char* slot = scratch_ + slotOf(u) * slotStride_;
    const size_t elems = segElems(c, k);
    const char* own = src_[c] + segOffset(c, k) * esize_;
    if (static_cast<int>(s) == n_ - 2) {
      // Last reduce-scatter step: the chunk is complete, it goes to the output.
      reduce(dst_[c] + segOffset(c, k) * esize_, slot, own, elems, dtype_, op_);
      slotBusy_[slotOf(u)] = false;
    } else {
      reduce(slot, slot, own, elems, dtype_, op_);  // forwarded from the slot by send u + 1
    }
  }

 private:
  size_t stepOf(size_t u) const { return u % static_cast<size_t>(steps_); }
  size_t sliceOf(size_t u) const { return u / static_cast<size_t>(steps_); }
  bool isReduceStep(size_t s) const { return mode_ != Mode::kAllGather && static_cast<int>(s) < n_ - 1; }
  int at(long pos) const { return order_[static_cast<size_t>(((pos % n_) + n_) % n_)]; }
  long agStep(size_t s) const {
    return mode_ == Mode::kAllGather ? static_cast<long>(s) : static_cast<long>(s) - (n_ - 1);
  }
  // Chunk sent / received at step s (reduce-scatter steps first, then all-gather).
  int sendChunk(size_t s) const {
    return isReduceStep(s) ? at(p_ - static_cast<long>(s) - 1) : at(p_ - agStep(s));
  }
  int recvChunk(size_t s) const {
    return isReduceStep(s) ? at(p_ - static_cast<long>(s) - 2) : at(p_ - agStep(s) - 1);
  }
  size_t segOffset(int c, size_t k) const { return partStart(elems_[c], segs_, k); }
  size_t segElems(int c, size_t k) const { return partStart(elems_[c], segs_, k + 1) - partStart(elems_[c], segs_, k); }
  size_t slotOf(size_t u) const { return u % depth_; }

  bool sendReady(size_t u) const { return stepOf(u) == 0 || recvDone_ >= u; }

  bool recvPostable(size_t u) const {
    const size_t s = stepOf(u);
    if (isReduceStep(s)) return !slotBusy_[slotOf(u)];
    // In place, the first all-gather receive overwrites what step 0 of this slice sent.
    if (mode_ == Mode::kAllReduce && static_cast<int>(s) == n_ - 1) return sendDone_ > u - s;
    return true;
  }

  void postSendUnit(size_t u) {
    const size_t s = stepOf(u);
    const size_t k = sliceOf(u);
    const int c = sendChunk(s);
    const char* data;
    if (s == 0) {
      data = src_[c] + segOffset(c, k) * esize_;  // this rank's own data
    } else if (isReduceStep(s)) {
      data = scratch_ + slotOf(u - 1) * slotStride_;  // the partial received one step earlier
    } else {
      data = dst_[c] + segOffset(c, k) * esize_;
    }
    ctx_.postSend(right_, conn_, data, segElems(c, k) * esize_, this, u);
  }

  void postRecvUnit(size_t u) {
    const size_t s = stepOf(u);
    const size_t k = sliceOf(u);
    const int c = recvChunk(s);
    char* target;
    if (isReduceStep(s)) {
      slotBusy_[slotOf(u)] = true;
      target = scratch_ + slotOf(u) * slotStride_;
    } else {
      target = dst_[c] + segOffset(c, k) * esize_;
    }
    ctx_.postRecv(left_, conn_, target, segElems(c, k) * esize_, this, u);
  }

  Context& ctx_;
  Mode mode_;
  std::vector<int> order_;
  int conn_;
  std::vector<const char*> src_;
  std::vector<char*> dst_;
  std::vector<size_t> elems_;
  DataType dtype_;
  RedOp op_;
  size_t esize_;
  int n_;
  int p_ = 0;
  int right_ = 0;
  int left_ = 0;
  size_t depth_;
  char* scratch_;
  size_t slotStride_;
  size_t segs_ = 1;
  int steps_ = 0;
  size_t units_ = 0;
  size_t sendNext_ = 0, recvNext_ = 0, sendDone_ = 0, recvDone_ = 0;
  std::vector<bool> slotBusy_;
};

std::vector<int> ringOrder(int n, int direction) {
  std::vector<int> order(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) order[static_cast<size_t>(i)] = direction > 0 ? i : (n - i) % n;
  return order;
}

void runChannels(Context& ctx, std::vector<std::unique_ptr<RingChannel>>& channels) {
  for (;;) {
    bool all = true;
    for (auto& ch : channels) {
      ch->pump();
      all = all && ch->done();
    }
    if (all) return;
    ctx.progress();
  }
}

// Channel c: direction (+1 for even c when both directions run) and connection index.
struct ChannelSpec {
  int direction;
  int conn;
};

std::vector<ChannelSpec> channelSpecs(int n, int perDirection, bool bothDirections) {
  std::vector<ChannelSpec> out;
  // Two ranks: "left" and "right" are the same peer, and one ring already uses both
  // directions of each connection; a second direction would put two channels on one stream.
  const bool both = bothDirections && n > 2;
  for (int k = 0; k < perDirection; ++k) {
    out.push_back({+1, k});
    if (both) out.push_back({-1, k});
  }
  return out;
}

void runRing(Context& ctx, Mode mode, const Buffers& b, int perDirection, bool bothDirections) {
  const int n = ctx.size();
  const size_t esize = elementSize(b.dtype);
  const auto specs = channelSpecs(n, perDirection, bothDirections);
  const size_t nch = specs.size();
  // The elements each rank's chunk holds, split over the channels: for all_reduce the region
  // is the whole buffer; for reduce_scatter / all_gather the per-rank block (count elements).
  const size_t perRank = mode == Mode::kAllReduce ? 0 : b.count;
  size_t maxChunk = 0;
  for (size_t ch = 0; ch < nch; ++ch) {
    if (mode == Mode::kAllReduce) {
      const size_t region = partStart(b.count, nch, ch + 1) - partStart(b.count, nch, ch);
      maxChunk = std::max(maxChunk, (region + n - 1) / static_cast<size_t>(n));
    } else {
      maxChunk = std::max(maxChunk, partStart(perRank, nch, ch + 1) - partStart(perRank, nch, ch));
    }
  }
  const size_t chBytes = RingChannel::scratchBytes(mode, maxChunk, b.dtype, ctx.config());
  const size_t stride = RingChannel::slotBytes(maxChunk, b.dtype, ctx.config());
  char* scratch = ctx.scratch(std::max<size_t>(chBytes * nch, 1));
  std::vector<std::unique_ptr<RingChannel>> channels;
  for (size_t ch = 0; ch < nch; ++ch) {
    std::vector<const char*> src(static_cast<size_t>(n));
    std::vector<char*> dst(static_cast<size_t>(n));
    std::vector<size_t> elems(static_cast<size_t>(n));
    for (int c = 0; c < n; ++c) {
      if (mode == Mode::kAllReduce) {
        const size_t r0 = partStart(b.count, nch, ch);
        const size_t region = partStart(b.count, nch, ch + 1) - r0;
        const size_t off = r0 + partStart(region, static_cast<size_t>(n), static_cast<size_t>(c));
        elems[c] = partStart(region, static_cast<size_t>(n), static_cast<size_t>(c) + 1) -
                   partStart(region, static_cast<size_t>(n), static_cast<size_t>(c));
        src[c] = b.src + off * esize;
        dst[c] = b.dst + off * esize;
      } else {
        const size_t off = partStart(perRank, nch, ch);
        elems[c] = partStart(perRank, nch, ch + 1) - off;
        if (mode == Mode::kReduceScatter) {
          src[c] = b.src + (static_cast<size_t>(c) * perRank + off) * esize;
          dst[c] = b.dst + off * esize;  // only this rank's own chunk is written
        } else {
          src[c] = b.src + off * esize;  // only this rank's own block is read
          dst[c] = b.dst + (static_cast<size_t>(c) * perRank + off) * esize;
        }
      }
    }
    channels.push_back(std::make_unique<RingChannel>(ctx, mode, ringOrder(n, specs[ch].direction), specs[ch].conn,
                                                     std::move(src), std::move(dst), std::move(elems), b.dtype, b.op,
                                                     scratch + ch * chBytes, stride));
  }
  runChannels(ctx, channels);
}

}  // namespace

void ringAllReduce(Context& ctx, const Buffers& b, int perDirection, bool bothDirections) {
  runRing(ctx, Mode::kAllReduce, b, perDirection, bothDirections);
}

void ringReduceScatter(Context& ctx, const Buffers& b, int perDirection, bool bothDirections) {
  runRing(ctx, Mode::kReduceScatter, b, perDirection, bothDirections);
}

void ringAllGather(Context& ctx, const Buffers& b, int perDirection, bool bothDirections) {
  const size_t bytes = b.count * elementSize(b.dtype);
  char* own = b.dst + static_cast<size_t>(ctx.rank()) * bytes;
  if (own != b.src && bytes > 0) std::memmove(own, b.src, bytes);
  runRing(ctx, Mode::kAllGather, b, perDirection, bothDirections);
}

// Broadcast along the ring from the root: chain d visits root, root+d, root+2d, ...; each rank
// receives a segment from its predecessor and forwards it to its successor. With both
// directions the buffer is halved and each half travels one way, so each link carries data in
// both directions at once.
void chainBroadcast(Context& ctx, char* buf, size_t bytes, int root, bool bothDirections) {
  const int n = ctx.size();
  const int me = ctx.rank();
  const bool both = bothDirections && n > 2;
  const size_t chains = both ? 2 : 1;
  const size_t segBytes = ctx.config().segmentBytes;

  struct Chain final : Req::Handler {
    Context* ctx = nullptr;
    char* base = nullptr;
    size_t bytes = 0, segs = 1;
    int prev = -1, next = -1;
    size_t recvNext = 0, recvDone = 0, sendNext = 0, sendDone = 0;
    size_t depth = 4;
    size_t off(size_t k) const { return partStart(bytes, segs, k); }
    size_t len(size_t k) const { return off(k + 1) - off(k); }
    void onComplete(Req& r) override { (r.isSend ? sendDone : recvDone)++; }
    bool done() const { return (prev < 0 || recvDone == segs) && (next < 0 || sendDone == segs); }
    void pump() {
      if (prev >= 0) {
        while (recvNext < segs && recvNext < recvDone + depth) {
          ctx->postRecv(prev, 0, base + off(recvNext), len(recvNext), this, recvNext);
          ++recvNext;
        }
      }
      if (next >= 0) {
        while (sendNext < segs && (prev < 0 || sendNext < recvDone)) {
          ctx->postSend(next, 0, base + off(sendNext), len(sendNext), this, sendNext);
          ++sendNext;
        }
      }
    }
  };

  std::vector<Chain> cs(chains);
  for (size_t i = 0; i < chains; ++i) {
    const int d = i == 0 ? +1 : -1;
    Chain& c = cs[i];
    c.ctx = &ctx;
    const size_t start = partStart(bytes, chains, i);
    c.base = buf + start;
    c.bytes = partStart(bytes, chains, i + 1) - start;
    c.segs = std::max<size_t>(1, (c.bytes + segBytes - 1) / segBytes);
    c.depth = static_cast<size_t>(ctx.config().pipelineDepth);
    const int pos = (((me - root) * d) % n + n) % n;  // hops from the root along this chain
    c.prev = pos == 0 ? -1 : ((me - d) % n + n) % n;
    c.next = pos == n - 1 ? -1 : ((me + d) % n + n) % n;
  }
  for (;;) {
    bool all = true;
    for (auto& c : cs) {
      c.pump();
      all = all && c.done();
    }
    if (all) return;
    ctx.progress();
  }
}

}  // namespace meshccl::algo
