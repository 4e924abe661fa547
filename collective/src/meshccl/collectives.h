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
// Tagged messages, as MPI and torch.distributed pass them: a send names its peer and a tag; a
// receive takes the oldest message from its peer (or from any linked rank, peer -1) with its
// tag, whatever else that peer sent first: messages that arrive before their receive wait in
// the context's stash (any size, kept across calls). Messages are not operations of the pair:
// they may be sent in one call and received in a later one, but a rank's messages must all be
// received before the pair runs a collective (a collective that meets one raises
// MismatchError). Sizes must agree (MismatchError). `source` is set for each receive.
struct MessageOp {
  bool isSend = false;
  void* buf = nullptr;
  size_t bytes = 0;
  int peer = -1;  // receive: -1 any linked rank
  uint32_t tag = 0;
  int source = -1;
};
// Sends, then receives from named ranks, are posted together and finished together (a ring
// shift cannot deadlock); then each receive from any rank, in order.
void messages(Context& ctx, std::vector<MessageOp>& ops);
// Returns on every rank once every rank has entered it.
void barrier(Context& ctx);

}  // namespace meshccl
