#pragma once

// Wire format. Every message is one frame: a 32-byte header, then `len` payload bytes.
// Hosts are little-endian (x86-64, arm64); the header is sent as laid out in memory.
//
// The header carries the call the frame belongs to, so a receiver can tell that the sender is
// in another collective, or the same collective with another dtype, op, count or root, and
// raise a MismatchError instead of reducing bytes that mean something else. `pairOp` counts
// the operations this pair of ranks has run together: a rank that skipped or added a call is
// caught even when the calls look alike.

#include <cstdint>
#include <string>

#include "meshccl/types.h"

namespace meshccl {

constexpr uint32_t kFrameMagic = 0x4d430000u;  // "MC" in the high half, frame type in the low
constexpr uint32_t kFrameData = 1;
constexpr uint32_t kFrameAbort = 2;

// The connect handshake (protocol version 2, mutual proof of the job token) is in handshake.h.
constexpr uint16_t kProtocolVersion = 2;
// The token is an HMAC key and never travels; the bound only keeps configurations sane.
constexpr size_t kMaxTokenBytes = 256;

enum class Collective : uint8_t {
  kNone = 0,
  kAllReduce = 1,
  kAllGather = 2,
  kReduceScatter = 3,
  kBroadcast = 4,
  kSendRecv = 5,
  kBarrier = 6,
  kBatch = 7,  // a batch of sends and receives (exchange): its frames match only another batch
  // A tagged message (messages()). Its frames carry the tag in `root`, the message's size in
  // `count`, the sender's message number to this peer in `pairOp` and the segment's index in
  // `dtype` (low byte) and `op` (high byte).
  kMessage = 8,
};

const char* collectiveName(Collective c);

struct CallDesc {
  Collective kind = Collective::kNone;
  DataType dtype = DataType::kFloat32;
  RedOp op = RedOp::kSum;
  uint32_t root = 0;   // broadcast root; send/recv: the sending rank
  uint64_t count = 0;  // elements per rank as the caller gave them

  bool operator==(const CallDesc& o) const {
    return kind == o.kind && dtype == o.dtype && op == o.op && root == o.root && count == o.count;
  }
  bool operator!=(const CallDesc& o) const { return !(*this == o); }
};

std::string describe(const CallDesc& d);

#pragma pack(push, 1)
struct FrameHeader {
  uint32_t magic;
  uint32_t pairOp;
  uint8_t kind;
  uint8_t dtype;
  uint8_t op;
  uint8_t errKind;  // ABORT frames: the ErrorKind being propagated
  uint32_t root;
  uint64_t count;
  uint64_t len;
};
#pragma pack(pop)
static_assert(sizeof(FrameHeader) == 32, "frame header is 32 bytes on the wire");

}  // namespace meshccl
