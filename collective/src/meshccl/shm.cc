#include "meshccl/shm.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <limits>
#include <new>
#include <random>

#include "meshccl/crypto.h"
#include "meshccl/error.h"
#include "meshccl/platform.h"

namespace meshccl {

static_assert(std::atomic<uint64_t>::is_always_lock_free, "ring positions must be lock-free to share them");

// Positions count bytes since the start (never wrap in practice: 2^64 bytes).
struct ShmLink::Ring {
  alignas(64) std::atomic<uint64_t> head;  // written by the producer
  alignas(64) std::atomic<uint64_t> tail;  // written by the consumer
  alignas(64) std::atomic<uint32_t> closed;
  // Doorbells: set by an end about to sleep until this ring moves (the consumer waiting for
  // bytes, the producer for room); the other end takes it after it moves the ring and wakes the
  // sleeper with a byte on the pair's socket.
  alignas(64) std::atomic<uint32_t> consumerWaits;
  std::atomic<uint32_t> producerWaits;
};

namespace {

constexpr uint32_t kSegmentMagic = 0x4d435348u;  // "MCSH"
constexpr uint32_t kSegmentVersion = ShmLayout::kVersion;
constexpr size_t kHeaderBytes = ShmLayout::kHeaderBytes;
constexpr char kNamePrefix[] = "/mccl.";

struct SegmentHeader {
  uint32_t magic;
  uint32_t version;
  uint64_t ringBytes;
};

// Where each end says who it is, for single copy.
struct ProcessSlot {
  uint64_t pid;
  uint64_t address;  // of this slot, in the publishing process
  uint64_t cookie;
};
static_assert(ShmLayout::kOpenerSlot + sizeof(ProcessSlot) <= kHeaderBytes, "the process slots overflow the header");

size_t iovTotal(const iovec* iov, int n) {
  size_t t = 0;
  for (int i = 0; i < n; ++i) t += iov[i].iov_len;
  return t;
}

// Copies `len` (<= cap) bytes between the flat stream position `pos` of a ring and a buffer.
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

// "516 KiB", "2052 KiB", "64 MiB", "1.5 GiB": sizes as a person sets them, exact up to 64 MiB.
std::string sizeText(uint64_t bytes) {
  constexpr uint64_t kMiB = uint64_t{1} << 20;
  if (bytes % kMiB == 0 && bytes < (kMiB << 10)) return cat(bytes / kMiB, " MiB");
  if (bytes < 64 * kMiB) return cat((bytes + 1023) / 1024, " KiB");
  if (bytes < (kMiB << 10)) return cat((bytes + kMiB / 2) / kMiB, " MiB");
  const uint64_t tenths = (bytes * 10 + (kMiB << 9)) >> 30;
  return cat(tenths / 10, ".", tenths % 10, " GiB");
}

// "/mccl.<pid>.<hex>", exactly platform::kShmNameMax characters on every system (a Linux pid
// has at most 7 digits: 16 or more hex digits remain). The hex digits are HMAC-SHA256, under 16
// fresh random bytes, of `tag` (the job id and the pair's ranks and connection), this pid and a
// count of this process's segments: different for every job, pair and connection, even between
// concurrent jobs of one id on one host, and unguessable, so nobody else on the host can take
// the name first (O_EXCL would refuse it anyway). The pid tells whose a segment left behind is.
std::string segmentName(const std::string& tag) {
  static std::atomic<uint64_t> counter{0};
  uint8_t key[16];
  crypto::randomBytes(key, sizeof(key));
  const std::string message = cat(tag, '\0', ::getpid(), '\0', counter++);
  const crypto::Mac mac = crypto::hmacSha256(key, sizeof(key), message.data(), message.size());
  static constexpr char kHex[] = "0123456789abcdef";
  std::string n = cat(kNamePrefix, ::getpid(), ".");
  for (size_t i = 0; n.size() < platform::kShmNameMax && i < 2 * mac.size(); ++i) {
    n += kHex[(mac[i / 2] >> (i % 2 == 0 ? 4 : 0)) & 0xf];
  }
  return n;
}

// Gives the new segment `bytes` of memory now. Linux's /dev/shm is a tmpfs of bounded size
// (64 MiB in a default container): ftruncate alone makes a sparse file, and the first write to
// a page the tmpfs cannot supply kills the process with SIGBUS; posix_fallocate reserves every
// page or fails with ENOSPC. macOS has no posix_fallocate, and its POSIX shared memory is
// ordinary virtual memory with no filesystem to fill: ftruncate is what sizes it there.
bool reserve(int fd, size_t bytes, const std::string& name, std::string* error) {
  const std::string hint = "give the container a larger /dev/shm (docker run --shm-size=1g) or set "
                           "MESHCCL_SHM_RING_BYTES lower";
  if constexpr (platform::kShmPreallocate) {
    const int rc = platform::preallocate(fd, bytes);
    if (rc == 0) return true;
    if (rc == ENOSPC) {
      std::string space;
      struct statvfs fs {};
      if (::fstatvfs(fd, &fs) == 0) {
        space = cat("; ", sizeText(static_cast<uint64_t>(fs.f_bavail) * fs.f_frsize), " free of ",
                    sizeText(static_cast<uint64_t>(fs.f_blocks) * fs.f_frsize));
      }
      *error = cat("/dev/shm has too little space for a ", sizeText(bytes), " segment (posix_fallocate: ",
                   std::strerror(rc), space, "): ", hint);
      return false;
    }
    if (rc != EOPNOTSUPP && rc != ENOSYS) {
      *error = cat("reserving a ", sizeText(bytes), " shared-memory segment ", name, " failed (posix_fallocate: ",
                   std::strerror(rc), "): ", hint);
      return false;
    }
    // A /dev/shm that cannot preallocate (not a tmpfs, and a C library that does not emulate
    // it): size it as before.
  }
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    *error = cat("sizing shared memory ", name, " to ", sizeText(bytes), " failed (ftruncate: ", std::strerror(errno),
                 "): ", hint);
    return false;
  }
  return true;
}

}  // namespace

bool ShmLink::validRingBytes(uint64_t ringBytes) {
  return ringBytes >= ShmLayout::kMinRingBytes && ringBytes <= ShmLayout::kMaxRingBytes &&
         (ringBytes & (ringBytes - 1)) == 0;
}

size_t ShmLink::segmentBytes(size_t ringBytes) { return kHeaderBytes + 2 * ringBytes; }

bool ShmLink::map(int fd, size_t bytes, const std::string& name, std::string* error) {
  void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  ::close(fd);  // the mapping keeps the segment
  if (base == MAP_FAILED) {
    *error = cat("mapping shared memory ", name, ": ", std::strerror(err));
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

std::unique_ptr<ShmLink> ShmLink::create(size_t ringBytes, std::string* name, std::string* error,
                                         const std::string& tag) {
  static_assert(offsetof(Ring, head) == ShmLayout::kHeadOffset && offsetof(Ring, tail) == ShmLayout::kTailOffset &&
                    offsetof(Ring, closed) == ShmLayout::kClosedOffset &&
                    offsetof(Ring, consumerWaits) == ShmLayout::kWaitsOffset,
                "ShmLayout names the ring positions' offsets");
  static_assert(sizeof(Ring) <= ShmLayout::kOpenerToCreator - ShmLayout::kCreatorToOpener &&
                    ShmLayout::kOpenerToCreator + sizeof(Ring) <= ShmLayout::kCreatorSlot,
                "the ring positions overlap each other or the process slots");
  if (!validRingBytes(ringBytes)) {
    *error = cat("shared memory ring size ", ringBytes, " is not a power of two from ", ShmLayout::kMinRingBytes,
                 " to ", ShmLayout::kMaxRingBytes, " (MESHCCL_SHM_RING_BYTES)");
    return nullptr;
  }
  std::string n;
  int fd = -1;
  for (int attempt = 0; fd < 0 && attempt < 4; ++attempt) {  // another name if one is taken (never, in practice)
    try {
      n = segmentName(tag);
    } catch (const Error& e) {
      *error = cat("naming a shared-memory segment: ", e.what());
      return nullptr;
    }
    fd = ::shm_open(n.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd < 0) {
    *error = cat("shm_open(", n, "): ", std::strerror(errno));
    return nullptr;
  }
  std::unique_ptr<ShmLink> link(new ShmLink());
  link->name_ = n;  // unlinked by the destructor unless handed over
  const size_t bytes = segmentBytes(ringBytes);
  if (!reserve(fd, bytes, n, error)) {
    ::close(fd);
    return nullptr;  // the destructor removes the name
  }
  if (!link->map(fd, bytes, n, error)) return nullptr;
  void* base = link->base_;
  auto* hdr = static_cast<SegmentHeader*>(base);
  hdr->magic = kSegmentMagic;
  hdr->version = kSegmentVersion;
  hdr->ringBytes = ringBytes;
  char* b = static_cast<char*>(base);
  auto* ringA = new (b + ShmLayout::kCreatorToOpener) Ring{};
  auto* ringB = new (b + ShmLayout::kOpenerToCreator) Ring{};
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
  // Only ever a segment meshccl made: the name and size come from the peer.
  if (name.compare(0, sizeof(kNamePrefix) - 1, kNamePrefix) != 0 || name.find('/', 1) != std::string::npos ||
      name.size() > platform::kShmNameMax) {
    *error = cat("the peer offered shared memory named '", name, "', which is not a meshccl segment");
    return nullptr;
  }
  if (!validRingBytes(ringBytes)) {
    *error = cat("the peer offered shared memory ", name, " with rings of ", ringBytes,
                 " bytes, not a power of two from ", ShmLayout::kMinRingBytes, " to ", ShmLayout::kMaxRingBytes);
    return nullptr;
  }
  const int fd = ::shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) {
    *error = cat("shm_open(", name, "): ", std::strerror(errno));
    return nullptr;
  }
  struct stat st {};
  const size_t bytes = segmentBytes(ringBytes);
  if (::fstat(fd, &st) != 0) {
    *error = cat("fstat of shared memory ", name, ": ", std::strerror(errno));
    ::close(fd);
    return nullptr;
  }
  // At least the size (macOS reports it rounded up to whole pages).
  if (st.st_size < 0 || static_cast<uint64_t>(st.st_size) < bytes) {
    *error = cat("shared memory ", name, " has ", st.st_size, " bytes, too few for rings of ", ringBytes, " bytes (",
                 bytes, " needed)");
    ::close(fd);
    return nullptr;
  }
  std::unique_ptr<ShmLink> link(new ShmLink());
  if (!link->map(fd, bytes, name, error)) return nullptr;
  char* b = static_cast<char*>(link->base_);
  SegmentHeader hdr{};
  std::memcpy(&hdr, b, sizeof(hdr));
  if (hdr.magic != kSegmentMagic || hdr.version != kSegmentVersion || hdr.ringBytes != ringBytes) {
    *error = cat("shared memory ", name, " is not a meshccl segment of version ", kSegmentVersion, " with rings of ",
                 ringBytes, " bytes (its header says magic 0x", std::hex, hdr.magic, std::dec, ", version ",
                 hdr.version, ", rings of ", hdr.ringBytes, " bytes)");
    return nullptr;
  }
  link->tx_ = std::launder(reinterpret_cast<Ring*>(b + ShmLayout::kOpenerToCreator));
  link->rx_ = std::launder(reinterpret_cast<Ring*>(b + ShmLayout::kCreatorToOpener));
  // Nothing has moved yet: the creator waits for this end's answer before it writes.
  for (const Ring* r : {link->tx_, link->rx_}) {
    if (r->head.load(std::memory_order_acquire) != 0 || r->tail.load(std::memory_order_acquire) != 0 ||
        r->closed.load(std::memory_order_acquire) != 0 || r->consumerWaits.load(std::memory_order_acquire) != 0 ||
        r->producerWaits.load(std::memory_order_acquire) != 0) {
      *error = cat("shared memory ", name, " is not fresh: its rings already hold positions");
      return nullptr;
    }
  }
  link->txData_ = b + kHeaderBytes + ringBytes;
  link->rxData_ = b + kHeaderBytes;
  link->cap_ = ringBytes;
  return link;
}

void ShmLink::markCorrupt(bool tx, const std::string& why) const {
  (tx ? txBroken_ : rxBroken_) = true;
  if (corrupt_.empty()) corrupt_ = cat("shared memory ", why, ": the peer broke the ring protocol (a bug or memory "
                                       "corruption in the peer process)");
}

// The peer's tail may only grow, and never past what this end wrote: then
// txHead_ - tail <= cap_ follows from the same holding for txTailSeen_.
bool ShmLink::peerTail(uint64_t* tail) const {
  if (txBroken_) return false;
  const uint64_t t = tx_->tail.load(std::memory_order_acquire);
  if (t < txTailSeen_ || t > txHead_) {
    markCorrupt(true, cat("ring read position ", t, " written by the peer is outside ", txTailSeen_, "..", txHead_,
                          " (what it had read .. what was written)"));
    return false;
  }
  txTailSeen_ = t;
  *tail = t;
  return true;
}

// The peer's head may only grow, and never more than the ring's size past this end's tail.
bool ShmLink::peerHead(uint64_t* head) const {
  if (rxBroken_) return false;
  const uint64_t h = rx_->head.load(std::memory_order_acquire);
  if (h < rxHeadSeen_ || h - rxTail_ > cap_) {
    markCorrupt(false, cat("ring write position ", h, " written by the peer is outside ", rxHeadSeen_, "..",
                           rxTail_ + cap_, " (what it had written .. this end's read position + the ring's ", cap_,
                           " bytes)"));
    return false;
  }
  rxHeadSeen_ = h;
  *head = h;
  return true;
}

size_t ShmLink::write(const iovec* iov, int iovcnt) {
  uint64_t tail = 0;
  if (!peerTail(&tail)) return 0;
  const size_t room = cap_ - static_cast<size_t>(txHead_ - tail);
  const size_t n = std::min(room, iovTotal(iov, iovcnt));
  if (n == 0) return 0;
  size_t done = 0;
  for (int i = 0; i < iovcnt && done < n; ++i) {
    const size_t k = std::min(iov[i].iov_len, n - done);
    ringCopyIn(txData_, cap_, txHead_ + done, static_cast<const char*>(iov[i].iov_base), k);
    done += k;
  }
  txHead_ += n;
  tx_->head.store(txHead_, std::memory_order_seq_cst);  // a full barrier before peerWaiting()'s look
  return n;
}

size_t ShmLink::readable() const {
  uint64_t head = 0;
  return peerHead(&head) ? static_cast<size_t>(head - rxTail_) : 0;
}

size_t ShmLink::read(const iovec* iov, int iovcnt) {
  const size_t n = std::min(readable(), iovTotal(iov, iovcnt));
  if (n == 0) return 0;
  size_t done = 0;
  for (int i = 0; i < iovcnt && done < n; ++i) {
    const size_t k = std::min(iov[i].iov_len, n - done);
    ringCopyOut(rxData_, cap_, rxTail_ + done, static_cast<char*>(iov[i].iov_base), k);
    done += k;
  }
  rxTail_ += n;
  rx_->tail.store(rxTail_, std::memory_order_seq_cst);  // a full barrier before peerWaiting()'s look
  return n;
}

size_t ShmLink::peek(void* dst, size_t len) const {
  const size_t n = std::min(readable(), len);
  if (n > 0) ringCopyOut(rxData_, cap_, rxTail_, static_cast<char*>(dst), n);
  return n;
}

void ShmLink::discard(size_t len) {
  rxTail_ += std::min(len, readable());
  rx_->tail.store(rxTail_, std::memory_order_seq_cst);
}

void ShmLink::closeWrite() { tx_->closed.store(1, std::memory_order_release); }

// The sleeper's store of its doorbell and this end's store of a position (seq_cst in write,
// read and discard: a full barrier, one instruction on x86) each come before the other's load:
// so either the sleeper sees the move and does not sleep, or this end sees the doorbell and
// wakes it (no wake-up is lost).
bool ShmLink::peerWaiting() {
  bool ring = false;
  // seq_cst loads (a plain load on x86): ordered after the position's seq_cst store on every
  // architecture (a relaxed one could pass it on aarch64).
  if (tx_->consumerWaits.load(std::memory_order_seq_cst) != 0) ring = tx_->consumerWaits.exchange(0) != 0;
  if (rx_->producerWaits.load(std::memory_order_seq_cst) != 0) ring = (rx_->producerWaits.exchange(0) != 0) || ring;
  return ring;
}

bool ShmLink::sleepUntilReadable() {
  rx_->consumerWaits.store(1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  return readable() == 0 && !peerClosedWrite();
}

bool ShmLink::sleepUntilWritable() {
  tx_->producerWaits.store(1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  uint64_t tail = 0;
  return peerTail(&tail) && txHead_ - tail == cap_;
}

void ShmLink::awake() {
  rx_->consumerWaits.store(0, std::memory_order_relaxed);
  tx_->producerWaits.store(0, std::memory_order_relaxed);
}

bool ShmLink::peerClosedWrite() const {
  return rxBroken_ || rx_->closed.load(std::memory_order_acquire) != 0;
}

void ShmLink::publishProcess() {
  char* b = static_cast<char*>(base_);
  auto* slot = reinterpret_cast<ProcessSlot*>(b + (creator_ ? ShmLayout::kCreatorSlot : ShmLayout::kOpenerSlot));
  std::random_device rd;
  slot->pid = static_cast<uint64_t>(::getpid());
  slot->address = reinterpret_cast<uintptr_t>(slot);
  slot->cookie = (static_cast<uint64_t>(rd()) << 32) | rd() | 1;  // never 0: 0 is "not published"
}

bool ShmLink::probePeerProcess(int* pid, std::string* why) const {
  const char* b = static_cast<const char*>(base_);
  ProcessSlot theirs{};
  std::memcpy(&theirs, b + (creator_ ? ShmLayout::kOpenerSlot : ShmLayout::kCreatorSlot), sizeof(theirs));
  if (theirs.cookie == 0) {
    *why = "the peer did not publish its process";
    return false;
  }
  // Its own pid is fine: ranks may be threads of one process (the C++ tests are).
  if (theirs.pid == 0 || theirs.pid > static_cast<uint64_t>(std::numeric_limits<int>::max())) {
    *why = cat("the peer published pid ", theirs.pid, ", which is not a process id");
    return false;
  }
  if (theirs.address == 0 || theirs.address > std::numeric_limits<uint64_t>::max() - sizeof(ProcessSlot)) {
    *why = cat("the peer published address 0x", std::hex, theirs.address, std::dec, ", which cannot hold its slot");
    return false;
  }
  ProcessSlot read{};
  if (!platform::readProcessMemory(static_cast<int>(theirs.pid), &read, theirs.address, sizeof(read), why)) {
    return false;
  }
  if (std::memcmp(&read, &theirs, sizeof(read)) != 0) {
    *why = cat("pid ", theirs.pid, " is not the peer from here (another pid namespace?)");
    return false;
  }
  *pid = static_cast<int>(theirs.pid);
  return true;
}

}  // namespace meshccl
