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

class ShmLink {
 public:
  ~ShmLink();
  ShmLink(const ShmLink&) = delete;
  ShmLink& operator=(const ShmLink&) = delete;

  // Creates and maps a new segment with two rings of `ringBytes` (a power of two >= 4096);
  // `name` receives the name to hand to the peer. Returns nullptr (and `error`) on failure.
  static std::unique_ptr<ShmLink> create(size_t ringBytes, std::string* name, std::string* error);
  // Maps the peer's segment; this end writes the ring the creator reads.
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
  bool peerClosedWrite() const;

  // Single copy (Linux cross-memory attach). Each end writes into its slot of the segment
  // header its pid, the address of that slot in its own memory and a random cookie; the
  // other end then reads that address out of that pid with process_vm_readv and compares it
  // with what it sees through the shared mapping. A match proves it may read the peer's
  // memory and names the right process (not so across pid namespaces, under a ptrace policy
  // that forbids it, or off Linux). publishProcess() before the peer probes.
  void publishProcess();
  // True, with the peer's pid, when this end can read the peer's memory.
  bool probePeerProcess(int* pid, std::string* why) const;

 private:
  struct Ring;
  ShmLink() = default;
  static size_t segmentBytes(size_t ringBytes);
  bool map(int fd, size_t bytes, const std::string& name, std::string* error);  // closes fd

  void* base_ = nullptr;
  size_t mapped_ = 0;
  Ring* tx_ = nullptr;
  Ring* rx_ = nullptr;
  char* txData_ = nullptr;
  char* rxData_ = nullptr;
  size_t cap_ = 0;
  std::string name_;  // non-empty while this end still has to unlink it
  bool creator_ = false;
};

// Reads `len` bytes at `addr` in process `pid` into `dst` (process_vm_readv, looping over
// partial reads). False with `error` set when the kernel refuses or the process is gone.
bool readProcessMemory(int pid, void* dst, uint64_t addr, size_t len, std::string* error);

}  // namespace meshccl
