#pragma once

// The collectives. Every rank of the context must make the same calls in the same order with
// the same dtype, op, count and root; a rank that does not makes every rank raise a
// MismatchError. Buffers are the caller's; in place is allowed where noted, any other overlap
// between input and output is refused.

#include <cstddef>
#include <vector>

#include "meshccl/context.h"

namespace meshccl {

// recv[i] = op over ranks of send[i], count elements. In place: send == recv.
void allReduce(Context& ctx, const void* send, void* recv, size_t count, DataType dtype, RedOp op);
// recv (size * count) = every rank's send (count), in rank order. In place: send == recv + rank * count.
void allGather(Context& ctx, const void* send, void* recv, size_t count, DataType dtype);
// recv (count) = op over ranks of block `rank` of send (size * count). In place: recv == send + rank * count.
void reduceScatter(Context& ctx, const void* send, void* recv, size_t count, DataType dtype, RedOp op);
// buf (count) on every rank = buf on root.
void broadcast(Context& ctx, void* buf, size_t count, DataType dtype, int root);
// Point to point between ranks that share a link.
void send(Context& ctx, const void* buf, size_t count, DataType dtype, int dst);
void recv(Context& ctx, void* buf, size_t count, DataType dtype, int src);
// One send or receive of a batch: `bytes` at `buf` to or from `peer` (linked to this rank).
struct P2POp {
  bool isSend = false;
  void* buf = nullptr;
  size_t bytes = 0;
  int peer = -1;
};
// A batch of sends and receives posted together and finished together, so exchanges that
// depend on each other (a ring shift: send right, receive left) cannot deadlock. A batch is one
// operation on every pair it names; the other end must take part in a batch too, naming this
// rank in the same order and with the same sizes (a size that differs raises MismatchError).
void exchange(Context& ctx, const std::vector<P2POp>& ops);
// Returns on every rank once every rank has entered it.
void barrier(Context& ctx);

}  // namespace meshccl
