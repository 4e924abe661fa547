#pragma once

// The algorithms, as functions over a Context (no state outside it). The public entry points
// in collectives.h validate arguments, start the operation and pick one of these.
//
//   ring      chunked, pipelined reduce-scatter + all-gather around the rank ring, one channel
//             per (direction, connection): both directions of every link at once, the buffer
//             striped over all channels. 2(n-1) steps, 2(n-1)/n * S bytes per rank each way.
//   direct    for a complete graph (a full mesh of cables, two ranks, ranks on one host):
//             reduce-scatter and all-gather straight to every peer at once, so all of a host's
//             cables carry data together. 2 steps, the same bytes as the ring, spread over
//             n-1 links instead of 2.
//   small     latency-optimised (complete graph, small messages): every rank sends its whole
//             vector to every peer and reduces all of them in rank order — one step; every rank
//             computes the identical result because the order is the same everywhere.
//   chain     broadcast along the ring, both directions, pipelined.
//   single copy  every rank on one host: read the peers' buffers straight out of their memory
//             (process_vm_readv), one copy per byte instead of two through a ring.

#include <cstddef>

#include "meshccl/context.h"

namespace meshccl::algo {

struct Buffers {
  const char* src;  // this rank's input
  char* dst;        // this rank's output (may equal src: in place)
  size_t count;     // elements
  DataType dtype;
  RedOp op;
};

// all_reduce
void ringAllReduce(Context& ctx, const Buffers& b, int channelsPerDirection, bool bothDirections);
void directAllReduce(Context& ctx, const Buffers& b);
void smallAllReduce(Context& ctx, const Buffers& b);

// all_gather: src holds `count` elements, dst size*count.
void ringAllGather(Context& ctx, const Buffers& b, int channelsPerDirection, bool bothDirections);
void directAllGather(Context& ctx, const Buffers& b);

// reduce_scatter: src holds size*count elements, dst count.
void ringReduceScatter(Context& ctx, const Buffers& b, int channelsPerDirection, bool bothDirections);
void directReduceScatter(Context& ctx, const Buffers& b);

// broadcast of dst (count elements) from root.
void chainBroadcast(Context& ctx, char* buf, size_t bytes, int root, bool bothDirections);
void directBroadcast(Context& ctx, char* buf, size_t bytes, int root);

// Single copy (every rank on this host, Context::allOnHost): false, on every rank alike, when
// some rank cannot read its peers' memory; the caller then takes another algorithm.
bool singleCopyAllReduce(Context& ctx, const Buffers& b);
bool singleCopyReduceScatter(Context& ctx, const Buffers& b);
bool singleCopyAllGather(Context& ctx, const Buffers& b);
bool singleCopyBroadcast(Context& ctx, char* buf, size_t bytes, int root);

// Posts a send (or receive) of `bytes` at `data` with `peer`, cut into segments striped over
// the pair's connections; both ends cut the same way.
void postSegments(Context& ctx, bool send, int peer, char* data, size_t bytes);

// Splits `total` elements into `parts` nearly equal parts; returns the start of `part`.
inline size_t partStart(size_t total, size_t parts, size_t part) {
  const size_t base = total / parts;
  const size_t extra = total % parts;
  return part * base + (part < extra ? part : extra);
}

}  // namespace meshccl::algo
