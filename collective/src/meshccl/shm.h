#pragma once

// Shared memory between two ranks on one host: a segment with two single-producer,
// single-consumer byte rings, one per direction. A ring is a byte stream like a TCP
// connection, so the engine's framing, mismatch checks and ABORT forwarding work on it
// unchanged; it just moves bytes with memcpy instead of through the kernel.
//
// Lifetime: the lower rank of the pair creates the segment (shm_open, O_EXCL, mode 0600) and
// names it to the peer over their already authenticated TCP connection; the peer maps it and
// answers; the creator then unlinks the name, so nothing is left in /dev/shm even if a rank is
// killed later. The TCP connection stays open as the liveness signal: a rank that dies closes
// it, which the peer sees (a ring cannot tell a dead writer from a slow one).

#include <sys/uio.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace meshccl {

// Where things are in a segment. The creator writes the header once; each ring position is
// written by one end only (head by the producer, tail by the consumer); each end reads the
// other's positions and checks them before it uses them.
struct ShmLayout {
  static constexpr uint32_t kVersion = 2;            // in the header; 2: the rings' doorbells
  static constexpr size_t kHeaderBytes = 4096;       // header + both rings' positions + process slots
  static constexpr size_t kCreatorToOpener = 256;    // ring positions: head, tail, closed, doorbells
  static constexpr size_t kOpenerToCreator = 512;
  static constexpr size_t kHeadOffset = 0;           // within a ring's positions
  static constexpr size_t kTailOffset = 64;
  static constexpr size_t kClosedOffset = 128;
  static constexpr size_t kWaitsOffset = 192;        // doorbells: consumer waits, producer waits
  static constexpr size_t kCreatorSlot = 1024;       // single copy: who each end is
  static constexpr size_t kOpenerSlot = 1536;
  static constexpr size_t kMinRingBytes = 4096;
  static constexpr size_t kMaxRingBytes = size_t{1} << 30;
};

class ShmLink {
 public:
  struct Ring;  // one direction's positions and doorbells, in the segment header
  ~ShmLink();
  ShmLink(const ShmLink&) = delete;
  ShmLink& operator=(const ShmLink&) = delete;

  // A power of two from ShmLayout::kMinRingBytes to kMaxRingBytes.
  static bool validRingBytes(uint64_t ringBytes);
  // The segment's size for rings of `ringBytes`: the header and one ring per direction.
  static size_t segmentBytes(size_t ringBytes);

  // Creates a new segment with two rings of `ringBytes`, its memory reserved up front (Linux:
  // posix_fallocate, so a /dev/shm too small for it is an error here, never a SIGBUS at the
  // first write), and maps it; `name` receives the name to hand to the peer: "/mccl.<pid>.<hex>",
  // platform::kShmNameMax characters, the hex digits keyed by fresh random bytes and `tag` (the
  // job id, the pair and the connection). Returns nullptr (and `error`, saying what to do) on
  // failure: the caller then uses TCP.
  static std::unique_ptr<ShmLink> create(size_t ringBytes, std::string* name, std::string* error,
                                         const std::string& tag = "");
  // Maps the peer's segment; this end writes the ring the creator reads. `name` and
  // `ringBytes` come from the peer: nullptr (and `error`) unless the name is meshccl's, the
  // ring size valid, the segment at least as large as that size needs, and its header and
  // positions those of a fresh meshccl segment of that size. A name is meshccl's when it starts
  // with "/mccl.", has no other '/' and at most platform::kShmNameMax characters.
  static std::unique_ptr<ShmLink> open(const std::string& name, size_t ringBytes, std::string* error);
  // Removes the name (creator only; the mapping stays).
  void unlink();

  // Copies as many bytes of the iovecs as fit into the outgoing ring; returns the count.
  size_t write(const iovec* iov, int iovcnt);
  // Copies as many bytes as are available (up to the iovecs' total) out of the incoming ring.
  size_t read(const iovec* iov, int iovcnt);
  // Copies up to `len` available bytes without consuming them.
  size_t peek(void* dst, size_t len) const;
  size_t readable() const;
  void discard(size_t len);
  // End of stream for the peer once it has read what is in the ring (like shutdown(SHUT_WR)).
  void closeWrite();
  // Also true once the link is corrupt: nothing more will come from it.
  bool peerClosedWrite() const;

  // Sleeping on a ring (nothing wakes poll() when one moves). An end about to sleep rings its
  // doorbell for each ring it waits on: sleepUntilReadable() (the incoming ring) or
  // sleepUntilWritable() (the outgoing one, full) set it and answer whether sleeping is still
  // right (false: the ring has moved, or the peer closed). awake() clears this end's doorbells.
  // The other end calls peerWaiting() after every write, read and discard that moved bytes: true
  // (once per doorbell) when the peer sleeps on what it just moved and must be woken
  // (SharedMemoryLink, link.h, sends a byte on the pair's socket, which the sleeper polls).
  bool sleepUntilReadable();
  bool sleepUntilWritable();
  void awake();
  bool peerWaiting();

  // The peer broke the rings' protocol: a position it writes went backwards or out of range
  // (a head more than the ring's size ahead of this end's tail, a tail behind what it already
  // read or ahead of what was written). Nothing is copied on the strength of such a value: from
  // then on that direction moves nothing (write() for the outgoing ring; read/peek/readable,
  // with peerClosedWrite() true, for the incoming one), and corruptReason() says what the peer
  // wrote. The other direction still works, so an ABORT naming the fault can reach the peer.
  // Never throws (the engine calls these while it sends ABORTs, also from a destructor);
  // SharedMemoryLink (link.h) turns corrupt() into an I/O error.
  bool corrupt() const { return !corrupt_.empty(); }
  const std::string& corruptReason() const { return corrupt_; }

  // Single copy (Linux cross-memory attach). Each end writes into its slot of the segment
  // header its pid, the address of that slot in its own memory and a random cookie; the
  // other end then reads that address out of that pid with process_vm_readv and compares it
  // with what it sees through the shared mapping. A match proves it may read the peer's
  // memory and names the right process (not so across pid namespaces, under a ptrace policy
  // that forbids it, or in a build without single copy: platform::kSingleCopy).
  // publishProcess() before the peer probes.
  void publishProcess();
  // True, with the peer's pid, when this end can read the peer's memory. The pid and address
  // come from the peer: a pid outside 1..INT_MAX, or an address whose slot would wrap, is refused.
  bool probePeerProcess(int* pid, std::string* why) const;

 private:
  ShmLink() = default;
  bool map(int fd, size_t bytes, const std::string& name, std::string* error);  // closes fd
  // The peer's position, checked against this end's; false (and the link corrupt) if wrong.
  bool peerTail(uint64_t* tail) const;
  bool peerHead(uint64_t* head) const;
  void markCorrupt(bool tx, const std::string& why) const;

  void* base_ = nullptr;
  size_t mapped_ = 0;
  Ring* tx_ = nullptr;
  Ring* rx_ = nullptr;
  char* txData_ = nullptr;
  char* rxData_ = nullptr;
  size_t cap_ = 0;
  // This end's own positions live here (the copies in the segment are only for the peer to
  // read; they are never read back), with the peer's last seen ones, which may only grow.
  uint64_t txHead_ = 0;
  mutable uint64_t txTailSeen_ = 0;
  uint64_t rxTail_ = 0;
  mutable uint64_t rxHeadSeen_ = 0;
  mutable bool txBroken_ = false;  // the peer's tail in the outgoing ring was wrong
  mutable bool rxBroken_ = false;  // the peer's head in the incoming ring was wrong
  mutable std::string corrupt_;    // why (the first fault); empty while the link is sound
  std::string name_;  // non-empty while this end still has to unlink it
  bool creator_ = false;
};

}  // namespace meshccl
