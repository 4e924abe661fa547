#include "meshccl/shm.h"

#include <fcntl.h>
#include <sys/mman.h>
#if defined(__linux__)
#include <sys/uio.h>
#endif
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <new>
#include <random>

#include "meshccl/error.h"

namespace meshccl {

static_assert(std::atomic<uint64_t>::is_always_lock_free, "ring positions must be lock-free to share them");

// Positions count bytes since the start (never wrap in practice: 2^64 bytes).
struct ShmLink::Ring {
  alignas(64) std::atomic<uint64_t> head;  // written by the producer
  alignas(64) std::atomic<uint64_t> tail;  // written by the consumer
  alignas(64) std::atomic<uint32_t> closed;
};

namespace {

constexpr uint32_t kSegmentMagic = 0x4d435348u;  // "MCSH"
constexpr uint32_t kSegmentVersion = 1;
constexpr size_t kHeaderBytes = 4096;  // segment header + both rings' positions

struct SegmentHeader {
  uint32_t magic;
  uint32_t version;
  uint64_t ringBytes;
};

// Where each end says who it is, for single copy (after the rings' positions at 256..767).
struct ProcessSlot {
  uint64_t pid;
  uint64_t address;  // of this slot, in the publishing process
  uint64_t cookie;
};
constexpr size_t kCreatorSlot = 1024;
constexpr size_t kOpenerSlot = 1536;

size_t iovTotal(const iovec* iov, int n) {
  size_t t = 0;
  for (int i = 0; i < n; ++i) t += iov[i].iov_len;
  return t;
}

// Copies `len` bytes between the flat stream position `pos` of a ring and a buffer.
void ringCopyOut(const char* ring, size_t cap, uint64_t pos, char* dst, size_t len) {
  const size_t at = static_cast<size_t>(pos & (cap - 1));
  const size_t first = std::min(len, cap - at);
  std::memcpy(dst, ring + at, first);
  if (len > first) std::memcpy(dst + first, ring, len - first);
}

void ringCopyIn(char* ring, size_t cap, uint64_t pos, const char* src, size_t len) {
  const size_t at = static_cast<size_t>(pos & (cap - 1));
  const size_t first = std::min(len, cap - at);
  std::memcpy(ring + at, src, first);
  if (len > first) std::memcpy(ring, src + first, len - first);
}

}  // namespace

size_t ShmLink::segmentBytes(size_t ringBytes) { return kHeaderBytes + 2 * ringBytes; }

bool ShmLink::map(int fd, size_t bytes, const std::string& name, std::string* error) {
  void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);  // the mapping keeps the segment
  if (base == MAP_FAILED) {
    *error = cat("mapping shared memory ", name, ": ", std::strerror(errno));
    return false;
  }
  base_ = base;
  mapped_ = bytes;
  return true;
}

ShmLink::~ShmLink() {
  unlink();
  if (base_ != nullptr) ::munmap(base_, mapped_);
}

void ShmLink::unlink() {
  if (!name_.empty()) ::shm_unlink(name_.c_str());
  name_.clear();
}

std::unique_ptr<ShmLink> ShmLink::create(size_t ringBytes, std::string* name, std::string* error) {
  if (ringBytes < 4096 || (ringBytes & (ringBytes - 1)) != 0) {
    *error = cat("shared memory ring size ", ringBytes, " is not a power of two >= 4096");
    return nullptr;
  }
  // Short names: macOS allows 31 characters.
  static std::atomic<uint32_t> counter{0};
  std::random_device rd;
  const std::string n = cat("/mccl.", ::getpid(), ".", counter++, ".", rd() % 1000000);
  const int fd = ::shm_open(n.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    *error = cat("shm_open(", n, "): ", std::strerror(errno));
    return nullptr;
  }
  std::unique_ptr<ShmLink> link(new ShmLink());
  link->name_ = n;  // unlinked by the destructor unless handed over
  const size_t bytes = segmentBytes(ringBytes);
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    *error = cat("sizing shared memory ", n, " to ", bytes, " bytes: ", std::strerror(errno));
    ::close(fd);
    return nullptr;
  }
  if (!link->map(fd, bytes, n, error)) return nullptr;
  void* base = link->base_;
  auto* hdr = static_cast<SegmentHeader*>(base);
  hdr->magic = kSegmentMagic;
  hdr->version = kSegmentVersion;
  hdr->ringBytes = ringBytes;
  char* b = static_cast<char*>(base);
  auto* ringA = new (b + 256) Ring{};  // creator -> opener
  auto* ringB = new (b + 512) Ring{};  // opener -> creator
  link->creator_ = true;
  link->tx_ = ringA;
  link->rx_ = ringB;
  link->txData_ = b + kHeaderBytes;
  link->rxData_ = b + kHeaderBytes + ringBytes;
  link->cap_ = ringBytes;
  *name = n;
  return link;
}

std::unique_ptr<ShmLink> ShmLink::open(const std::string& name, size_t ringBytes, std::string* error) {
  const int fd = ::shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) {
    *error = cat("shm_open(", name, "): ", std::strerror(errno));
    return nullptr;
  }
  struct stat st {};
  const size_t bytes = segmentBytes(ringBytes);
  if (::fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != bytes) {
    *error = cat("shared memory ", name, " has ", st.st_size, " bytes, expected ", bytes);
    ::close(fd);
    return nullptr;
  }
  std::unique_ptr<ShmLink> link(new ShmLink());
  if (!link->map(fd, bytes, name, error)) return nullptr;
  void* base = link->base_;
  const auto* hdr = static_cast<const SegmentHeader*>(base);
  if (hdr->magic != kSegmentMagic || hdr->version != kSegmentVersion || hdr->ringBytes != ringBytes) {
    *error = cat("shared memory ", name, " is not a meshccl segment of this version and size");
    return nullptr;
  }
  char* b = static_cast<char*>(base);
  link->tx_ = std::launder(reinterpret_cast<Ring*>(b + 512));
  link->rx_ = std::launder(reinterpret_cast<Ring*>(b + 256));
  link->txData_ = b + kHeaderBytes + ringBytes;
  link->rxData_ = b + kHeaderBytes;
  link->cap_ = ringBytes;
  return link;
}

size_t ShmLink::write(const iovec* iov, int iovcnt) {
  const uint64_t head = tx_->head.load(std::memory_order_relaxed);
  const uint64_t tail = tx_->tail.load(std::memory_order_acquire);
  const size_t room = cap_ - static_cast<size_t>(head - tail);
  const size_t n = std::min(room, iovTotal(iov, iovcnt));
  if (n == 0) return 0;
  size_t done = 0;
  for (int i = 0; i < iovcnt && done < n; ++i) {
    const size_t k = std::min(iov[i].iov_len, n - done);
    ringCopyIn(txData_, cap_, head + done, static_cast<const char*>(iov[i].iov_base), k);
    done += k;
  }
  tx_->head.store(head + n, std::memory_order_release);
  return n;
}

size_t ShmLink::readable() const {
  return static_cast<size_t>(rx_->head.load(std::memory_order_acquire) - rx_->tail.load(std::memory_order_relaxed));
}

size_t ShmLink::read(const iovec* iov, int iovcnt) {
  const uint64_t tail = rx_->tail.load(std::memory_order_relaxed);
  const uint64_t head = rx_->head.load(std::memory_order_acquire);
  const size_t n = std::min(static_cast<size_t>(head - tail), iovTotal(iov, iovcnt));
  if (n == 0) return 0;
  size_t done = 0;
  for (int i = 0; i < iovcnt && done < n; ++i) {
    const size_t k = std::min(iov[i].iov_len, n - done);
    ringCopyOut(rxData_, cap_, tail + done, static_cast<char*>(iov[i].iov_base), k);
    done += k;
  }
  rx_->tail.store(tail + n, std::memory_order_release);
  return n;
}

size_t ShmLink::peek(void* dst, size_t len) const {
  const uint64_t tail = rx_->tail.load(std::memory_order_relaxed);
  const size_t n = std::min(readable(), len);
  ringCopyOut(rxData_, cap_, tail, static_cast<char*>(dst), n);
  return n;
}

void ShmLink::discard(size_t len) {
  const uint64_t tail = rx_->tail.load(std::memory_order_relaxed);
  rx_->tail.store(tail + std::min(len, readable()), std::memory_order_release);
}

void ShmLink::closeWrite() { tx_->closed.store(1, std::memory_order_release); }

bool ShmLink::peerClosedWrite() const { return rx_->closed.load(std::memory_order_acquire) != 0; }

void ShmLink::publishProcess() {
  char* b = static_cast<char*>(base_);
  auto* slot = reinterpret_cast<ProcessSlot*>(b + (creator_ ? kCreatorSlot : kOpenerSlot));
  std::random_device rd;
  slot->pid = static_cast<uint64_t>(::getpid());
  slot->address = reinterpret_cast<uintptr_t>(slot);
  slot->cookie = (static_cast<uint64_t>(rd()) << 32) | rd() | 1;  // never 0: 0 is "not published"
}

bool ShmLink::probePeerProcess(int* pid, std::string* why) const {
  const char* b = static_cast<const char*>(base_);
  ProcessSlot theirs{};
  std::memcpy(&theirs, b + (creator_ ? kOpenerSlot : kCreatorSlot), sizeof(theirs));
  if (theirs.cookie == 0) {
    *why = "the peer did not publish its process";
    return false;
  }
  ProcessSlot read{};
  if (!readProcessMemory(static_cast<int>(theirs.pid), &read, theirs.address, sizeof(read), why)) return false;
  if (std::memcmp(&read, &theirs, sizeof(read)) != 0) {
    *why = cat("pid ", theirs.pid, " is not the peer from here (another pid namespace?)");
    return false;
  }
  *pid = static_cast<int>(theirs.pid);
  return true;
}

bool readProcessMemory(int pid, void* dst, uint64_t addr, size_t len, std::string* error) {
#if defined(__linux__)
  size_t done = 0;
  while (done < len) {
    iovec local{static_cast<char*>(dst) + done, len - done};
    iovec remote{reinterpret_cast<void*>(static_cast<uintptr_t>(addr + done)), len - done};
    const ssize_t n = ::process_vm_readv(pid, &local, 1, &remote, 1, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      *error = cat("process_vm_readv from pid ", pid, ": ", n < 0 ? std::strerror(errno) : "no bytes read");
      return false;
    }
    done += static_cast<size_t>(n);
  }
  return true;
#else
  (void)pid;
  (void)dst;
  (void)addr;
  (void)len;
  *error = "single copy needs Linux (process_vm_readv)";
  return false;
#endif
}

}  // namespace meshccl
