// Shared-memory links: segments reserved up front (a /dev/shm too small is an error, not a
// SIGBUS), and every value the peer can write — the offered name and ring size, the segment's
// size and header, the ring positions, the single-copy slot — checked before it is used. The
// "peer" here is a third mapping of the segment through which the test writes what a broken or
// hostile peer process would; the suite also runs under ASan + UBSan, where any out-of-bounds
// copy these values could cause would stop it.

#include <fcntl.h>
#include <sched.h>
#include <dirent.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#if defined(__linux__)
#include <sys/mount.h>
#endif

#include <gtest/gtest.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "harness.h"
#include "meshccl/collectives.h"
#include "meshccl/error.h"
#include "meshccl/platform.h"
#include "meshccl/shm.h"

namespace meshccl {
namespace {

// EXPECT that `text` contains `part` (the suite links gtest without gmock's matchers).
#define EXPECT_HAS(text, part) \
  EXPECT_NE(std::string(text).find(part), std::string::npos) << "'" << (text) << "' lacks '" << (part) << "'"
#define EXPECT_HAS_NOT(text, part) \
  EXPECT_EQ(std::string(text).find(part), std::string::npos) << "'" << (text) << "' has '" << (part) << "'"

// The segment as the peer process sees it: a mapping of its own, written behind the link's back.
class RawSegment {
 public:
  RawSegment(const std::string& name, size_t bytes) : bytes_(bytes) {
    const int fd = ::shm_open(name.c_str(), O_RDWR, 0);
    if (fd < 0) throw std::runtime_error("shm_open " + name + ": " + std::strerror(errno));
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ::close(fd);
    if (p == MAP_FAILED) throw std::runtime_error("mmap " + name + ": " + std::strerror(errno));
    base_ = static_cast<char*>(p);
  }
  ~RawSegment() { ::munmap(base_, bytes_); }
  RawSegment(const RawSegment&) = delete;
  RawSegment& operator=(const RawSegment&) = delete;

  std::atomic<uint64_t>& at(size_t offset) {
    return *std::launder(reinterpret_cast<std::atomic<uint64_t>*>(base_ + offset));
  }
  // The creator -> opener ring's positions: head written by the creator, tail by the opener.
  std::atomic<uint64_t>& toOpenerHead() { return at(ShmLayout::kCreatorToOpener + ShmLayout::kHeadOffset); }
  std::atomic<uint64_t>& toOpenerTail() { return at(ShmLayout::kCreatorToOpener + ShmLayout::kTailOffset); }
  std::atomic<uint64_t>& toCreatorHead() { return at(ShmLayout::kOpenerToCreator + ShmLayout::kHeadOffset); }
  std::atomic<uint64_t>& toCreatorTail() { return at(ShmLayout::kOpenerToCreator + ShmLayout::kTailOffset); }
  char* base() { return base_; }

 private:
  char* base_ = nullptr;
  size_t bytes_ = 0;
};

struct Pair {
  std::unique_ptr<ShmLink> creator;
  std::unique_ptr<ShmLink> opener;
  std::unique_ptr<RawSegment> raw;
  std::string name;
};

// A linked pair with rings of `ringBytes`, and the test's own mapping of their segment.
Pair makePair(size_t ringBytes = 4096) {
  Pair p;
  std::string error;
  p.creator = ShmLink::create(ringBytes, &p.name, &error);
  if (!p.creator) throw std::runtime_error("create: " + error);
  p.opener = ShmLink::open(p.name, ringBytes, &error);
  if (!p.opener) throw std::runtime_error("open: " + error);
  p.raw = std::make_unique<RawSegment>(p.name, ShmLink::segmentBytes(ringBytes));
  p.creator->unlink();
  return p;
}

size_t writeAll(ShmLink& link, const std::vector<char>& data) {
  iovec iov{const_cast<char*>(data.data()), data.size()};
  return link.write(&iov, 1);
}

size_t readInto(ShmLink& link, std::vector<char>* out) {
  iovec iov{out->data(), out->size()};
  return link.read(&iov, 1);
}

std::vector<char> pattern(size_t n, int seed) {
  std::vector<char> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<char>((i * 31 + static_cast<size_t>(seed)) & 0xff);
  return v;
}

// A scratch segment of `bytes` with a name meshccl would use, written by `fill`.
struct ForgedSegment {
  std::string name;
  explicit ForgedSegment(size_t bytes, const std::function<void(char*)>& fill = {}) {
    static int counter = 0;
    name = "/mccl.test." + std::to_string(::getpid()) + "." + std::to_string(counter++);
    const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) throw std::runtime_error("shm_open " + name + ": " + std::strerror(errno));
    if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) throw std::runtime_error("ftruncate");
    if (fill) {
      void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      if (p == MAP_FAILED) throw std::runtime_error("mmap");
      fill(static_cast<char*>(p));
      ::munmap(p, bytes);
    }
    ::close(fd);
  }
  ~ForgedSegment() { ::shm_unlink(name.c_str()); }
};

void writeHeader(char* b, uint32_t magic, uint32_t version, uint64_t ringBytes) {
  std::memcpy(b, &magic, 4);
  std::memcpy(b + 4, &version, 4);
  std::memcpy(b + 8, &ringBytes, 8);
}

constexpr uint32_t kMagic = 0x4d435348u;  // "MCSH", as shm.cc writes it

// --- the link works -------------------------------------------------------------------------

TEST(ShmLink, BytesGoBothWaysAcrossTheRingsEnd) {
  Pair p = makePair(4096);
  // Several rounds of 3000 bytes: every round after the first wraps around the 4096-byte ring.
  for (int round = 0; round < 6; ++round) {
    const auto there = pattern(3000, round);
    ASSERT_EQ(writeAll(*p.creator, there), 3000u);
    EXPECT_EQ(p.opener->readable(), 3000u);
    char first[8];
    ASSERT_EQ(p.opener->peek(first, sizeof(first)), sizeof(first));
    EXPECT_EQ(std::memcmp(first, there.data(), sizeof(first)), 0);
    std::vector<char> got(3000);
    ASSERT_EQ(readInto(*p.opener, &got), 3000u);
    EXPECT_EQ(got, there);
    const auto back = pattern(3000, 100 + round);
    ASSERT_EQ(writeAll(*p.opener, back), 3000u);
    p.creator->discard(1000);
    std::vector<char> rest(2000);
    ASSERT_EQ(readInto(*p.creator, &rest), 2000u);
    EXPECT_EQ(std::memcmp(rest.data(), back.data() + 1000, 2000), 0);
  }
  // A full ring takes no more.
  ASSERT_EQ(writeAll(*p.creator, pattern(5000, 7)), 4096u);
  EXPECT_EQ(writeAll(*p.creator, pattern(1, 7)), 0u);
  EXPECT_FALSE(p.creator->corrupt() || p.opener->corrupt());
  EXPECT_FALSE(p.opener->peerClosedWrite());
  p.creator->closeWrite();
  EXPECT_TRUE(p.opener->peerClosedWrite());
}

// --- doorbells: sleeping on a ring ---------------------------------------------------------

TEST(ShmLink, ADoorbellIsAnsweredOnceByTheMoveItWaitsFor) {
  Pair p = makePair(4096);
  // Nothing rung: moving the ring wakes no one.
  ASSERT_EQ(writeAll(*p.creator, pattern(10, 1)), 10u);
  EXPECT_FALSE(p.creator->peerWaiting());
  std::vector<char> ten(10);
  ASSERT_EQ(readInto(*p.opener, &ten), 10u);
  EXPECT_FALSE(p.opener->peerWaiting());
  // The reader sleeps on an empty ring: the next write answers the doorbell, once.
  EXPECT_TRUE(p.opener->sleepUntilReadable());
  ASSERT_EQ(writeAll(*p.creator, pattern(10, 2)), 10u);
  EXPECT_TRUE(p.creator->peerWaiting());
  EXPECT_FALSE(p.creator->peerWaiting()) << "a doorbell is answered once";
  // Bytes already there, or a closed peer: sleeping would wait for nothing.
  EXPECT_FALSE(p.opener->sleepUntilReadable());
  p.opener->awake();
  ASSERT_EQ(readInto(*p.opener, &ten), 10u);
  // Woken for another reason (awake): a later write rings nothing.
  EXPECT_TRUE(p.opener->sleepUntilReadable());
  p.opener->awake();
  ASSERT_EQ(writeAll(*p.creator, pattern(10, 3)), 10u);
  EXPECT_FALSE(p.creator->peerWaiting());
  ASSERT_EQ(readInto(*p.opener, &ten), 10u);
  // The writer sleeps on a full ring: the reader's read answers, as does a discard.
  ASSERT_EQ(writeAll(*p.creator, pattern(4096, 4)), 4096u);
  EXPECT_TRUE(p.creator->sleepUntilWritable());
  ASSERT_EQ(readInto(*p.opener, &ten), 10u);
  EXPECT_TRUE(p.opener->peerWaiting());
  EXPECT_FALSE(p.creator->sleepUntilWritable()) << "there is room again";
  p.creator->awake();
  ASSERT_EQ(writeAll(*p.creator, pattern(10, 5)), 10u);
  EXPECT_TRUE(p.creator->sleepUntilWritable());
  p.opener->discard(1);
  EXPECT_TRUE(p.opener->peerWaiting());
  // Each end's doorbell is its own: the writer waiting for room is not woken by its own write
  // (the other direction), nor the reader by a byte it sends back.
  p.opener->discard(4096);
  EXPECT_TRUE(p.opener->sleepUntilReadable());
  ASSERT_EQ(writeAll(*p.opener, pattern(10, 6)), 10u);
  EXPECT_FALSE(p.opener->peerWaiting());
  p.creator->closeWrite();
  EXPECT_FALSE(p.opener->sleepUntilReadable()) << "the peer closed: nothing to sleep for";
}

#if defined(__linux__)
TEST(ShmLink, TheSegmentsMemoryIsReservedWhenItIsCreated) {
  // ftruncate alone leaves the segment sparse (a full /dev/shm is then a SIGBUS at some later
  // write); reserved, every block is there before a byte is written.
  std::string name;
  std::string error;
  auto link = ShmLink::create(256 << 10, &name, &error);
  ASSERT_TRUE(link) << error;
  const int fd = ::shm_open(name.c_str(), O_RDONLY, 0);
  ASSERT_GE(fd, 0);
  struct stat st {};
  ASSERT_EQ(::fstat(fd, &st), 0);
  ::close(fd);
  EXPECT_EQ(static_cast<size_t>(st.st_size), ShmLink::segmentBytes(256 << 10));
  EXPECT_GE(static_cast<size_t>(st.st_blocks) * 512, ShmLink::segmentBytes(256 << 10));
}

// Runs `body` in a child process with its own mount namespace, where /dev/shm is a tmpfs of
// `size` (needs root or CAP_SYS_ADMIN); returns what the child wrote, or "SKIP: why".
std::string inTinyDevShm(const char* size, const std::function<std::string()>& body) {
  int fds[2];
  if (::pipe(fds) != 0) return "SKIP: pipe";
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    std::string out;
    if (::unshare(CLONE_NEWNS) != 0) {
      out = std::string("SKIP: unshare(CLONE_NEWNS): ") + std::strerror(errno);
    } else if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) {
      out = std::string("SKIP: making / private: ") + std::strerror(errno);
    } else if (::mount("tmpfs", "/dev/shm", "tmpfs", 0, (std::string("size=") + size).c_str()) != 0) {
      out = std::string("SKIP: mounting a tmpfs on /dev/shm: ") + std::strerror(errno);
    } else {
      out = body();
    }
    const ssize_t w = ::write(fds[1], out.data(), out.size());
    ::_exit(w == static_cast<ssize_t>(out.size()) ? 0 : 1);
  }
  ::close(fds[1]);
  std::string got;
  char buf[4096];
  ssize_t n;
  while ((n = ::read(fds[0], buf, sizeof(buf))) > 0) got.append(buf, static_cast<size_t>(n));
  ::close(fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return "child died with status " + std::to_string(status);
  return got;
}

TEST(ShmLink, ATooSmallDevShmIsAClearErrorNotASignal) {
  // 256 KiB of /dev/shm, a 516 KiB segment: create() fails, names the sizes and what to do,
  // and leaves nothing behind. Then a ring that fits works.
  const std::string out = inTinyDevShm("256k", [] {
    std::string name;
    std::string error;
    auto link = ShmLink::create(256 << 10, &name, &error);
    if (link) return std::string("created a 516 KiB segment in a 256 KiB /dev/shm");
    std::string result = error;
    if (DIR* d = ::opendir("/dev/shm")) {
      while (const dirent* e = ::readdir(d)) {
        if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) result += " [LEFT A FILE]";
      }
      ::closedir(d);
    }
    auto small = ShmLink::create(16 << 10, &name, &error);  // 36 KiB
    if (!small) return result + " [16 KiB rings failed too: " + error + "]";
    const auto data = pattern(20000, 3);
    iovec iov{const_cast<char*>(data.data()), data.size()};
    return result + (small->write(&iov, 1) == 16384 ? " [16 KiB rings: ok]" : " [16 KiB rings: short write]");
  });
  if (out.rfind("SKIP: ", 0) == 0) GTEST_SKIP() << out;
  EXPECT_HAS(out, "/dev/shm has too little space for a 516 KiB segment (posix_fallocate: No space left on device; ");
  EXPECT_HAS(out, " free of 256 KiB): give the container a larger /dev/shm (docker run --shm-size=1g) or set "
                  "MESHCCL_SHM_RING_BYTES lower");
  EXPECT_HAS(out, "[16 KiB rings: ok]");
  EXPECT_HAS_NOT(out, "LEFT A FILE");
}
#endif

// --- what the peer offers --------------------------------------------------------------------

TEST(ShmLink, OpenRefusesNamesThatAreNotMeshcclSegments) {
  for (const std::string name : {"/etc", "/mccl", "mccl.1.2.3", "/mccl.1/../../x", ""}) {
    std::string error;
    EXPECT_FALSE(ShmLink::open(name, 4096, &error)) << name;
    EXPECT_HAS(error, "not a meshccl segment") << name;
  }
}

TEST(ShmLink, OpenRefusesRingSizesOutOfRange) {
  // A real segment: only the offered size is wrong.
  std::string name;
  std::string error;
  auto link = ShmLink::create(4096, &name, &error);
  ASSERT_TRUE(link) << error;
  for (const uint64_t ring : {uint64_t{0}, uint64_t{1}, uint64_t{2048}, uint64_t{4097}, uint64_t{3} << 12,
                              uint64_t{2} << 30, uint64_t{1} << 40, std::numeric_limits<uint64_t>::max()}) {
    error.clear();
    EXPECT_FALSE(ShmLink::open(name, static_cast<size_t>(ring), &error)) << ring;
    EXPECT_HAS(error, "not a power of two from 4096 to 1073741824") << ring;
  }
  EXPECT_FALSE(ShmLink::validRingBytes(uint64_t{1} << 31));
  EXPECT_TRUE(ShmLink::validRingBytes(uint64_t{1} << 30));
  EXPECT_TRUE(ShmLink::validRingBytes(4096));
  // create() holds itself to the same range.
  EXPECT_FALSE(ShmLink::create(size_t{2} << 30, &name, &error));
  EXPECT_HAS(error, "MESHCCL_SHM_RING_BYTES");
}

TEST(ShmLink, OpenRefusesASegmentSmallerThanItsRingsNeed) {
  // A segment with a true-looking header but only 8 KiB: mapping the 12 KiB that rings of 4096
  // need would put the rings past its end (SIGBUS at the first copy).
  ForgedSegment seg(8192, [](char* b) { writeHeader(b, kMagic, ShmLayout::kVersion, 4096); });
  std::string error;
  EXPECT_FALSE(ShmLink::open(seg.name, 4096, &error));
  EXPECT_HAS(error, "has 8192 bytes, too few for rings of 4096 bytes (12288 needed)");
  // The same with a real segment offered as having larger rings.
  std::string name;
  auto link = ShmLink::create(4096, &name, &error);
  ASSERT_TRUE(link) << error;
  EXPECT_FALSE(ShmLink::open(name, 1 << 20, &error));
  EXPECT_HAS(error, "too few for rings of 1048576 bytes");
}

TEST(ShmLink, OpenRefusesAHeaderThatDisagreesWithTheOffer) {
  struct Case {
    uint32_t magic;
    uint32_t version;
    uint64_t ring;
  };
  const uint32_t v = ShmLayout::kVersion;
  // Version 1 (before the doorbells): its peer would sleep on a ring nobody wakes it for.
  for (const Case c : {Case{0, v, 4096}, Case{kMagic, 1, 4096}, Case{kMagic, v + 1, 4096}, Case{kMagic, v, 8192},
                       Case{kMagic, v, 1 << 30}}) {
    // Large enough for the header's ring size too: only the header is wrong.
    ForgedSegment seg(ShmLink::segmentBytes(8192), [&](char* b) { writeHeader(b, c.magic, c.version, c.ring); });
    std::string error;
    EXPECT_FALSE(ShmLink::open(seg.name, 4096, &error)) << c.magic << " " << c.version << " " << c.ring;
    EXPECT_HAS(error, ::meshccl::cat("is not a meshccl segment of version ", v, " with rings of 4096 bytes"));
  }
}

TEST(ShmLink, OpenRefusesASegmentWhoseRingsAlreadyMoved) {
  for (size_t offset : {ShmLayout::kCreatorToOpener + ShmLayout::kHeadOffset,
                        ShmLayout::kOpenerToCreator + ShmLayout::kTailOffset,
                        ShmLayout::kCreatorToOpener + ShmLayout::kClosedOffset,
                        ShmLayout::kOpenerToCreator + ShmLayout::kWaitsOffset}) {
    ForgedSegment seg(ShmLink::segmentBytes(4096), [&](char* b) {
      writeHeader(b, kMagic, ShmLayout::kVersion, 4096);
      const uint32_t v = 1;  // closed is 32 bits wide
      std::memcpy(b + offset, &v, sizeof(v));
    });
    std::string error;
    EXPECT_FALSE(ShmLink::open(seg.name, 4096, &error)) << offset;
    EXPECT_HAS(error, "is not fresh") << offset;
  }
}

// --- ring positions written by the peer --------------------------------------------------------

TEST(ShmLink, AHeadFarAheadOfTheTailIsReportedNeverCopied) {
  Pair p = makePair(4096);
  ASSERT_EQ(writeAll(*p.opener, pattern(100, 1)), 100u);
  EXPECT_EQ(p.creator->readable(), 100u);
  // The opener's head claims a terabyte in a 4 KiB ring: copying that much would run far off
  // the end of the mapping and of the reader's buffer.
  p.raw->toCreatorHead().store(uint64_t{1} << 40);
  std::vector<char> got(1 << 20);
  EXPECT_EQ(readInto(*p.creator, &got), 0u);
  EXPECT_TRUE(p.creator->corrupt());
  EXPECT_HAS(p.creator->corruptReason(), "ring write position 1099511627776 written by the peer is outside "
                                                    "100..4096");
  EXPECT_HAS(p.creator->corruptReason(), "the peer broke the ring protocol");
  // Stays corrupt, moves nothing in, and reads as an ended stream.
  p.raw->toCreatorHead().store(100);
  char b[16];
  EXPECT_EQ(p.creator->peek(b, sizeof(b)), 0u);
  EXPECT_EQ(p.creator->readable(), 0u);
  EXPECT_EQ(readInto(*p.creator, &got), 0u);
  p.creator->discard(50);
  EXPECT_TRUE(p.creator->peerClosedWrite());
  // The other direction still carries bytes (an ABORT saying why).
  EXPECT_EQ(writeAll(*p.creator, pattern(10, 2)), 10u);
  EXPECT_EQ(p.opener->readable(), 10u);
  EXPECT_FALSE(p.opener->corrupt());
}

TEST(ShmLink, AHeadOneRingPastTheTailIsAFullRingAndOneMoreIsCorrupt) {
  Pair p = makePair(4096);
  p.raw->toCreatorHead().store(4096);  // the whole ring: legal (garbage bytes are the framing's business)
  std::vector<char> got(8192);
  EXPECT_EQ(readInto(*p.creator, &got), 4096u);
  EXPECT_FALSE(p.creator->corrupt());
  p.raw->toCreatorHead().store(4096 + 4097);
  EXPECT_EQ(p.creator->readable(), 0u);
  EXPECT_TRUE(p.creator->corrupt());
}

TEST(ShmLink, AHeadThatWrapsBelowTheTailIsCorrupt) {
  Pair p = makePair(4096);
  ASSERT_EQ(writeAll(*p.creator, pattern(200, 1)), 200u);
  std::vector<char> got(200);
  ASSERT_EQ(readInto(*p.opener, &got), 200u);
  p.raw->toOpenerHead().store(199);  // "minus one byte": 2^64 - 1 ahead, as unsigned arithmetic sees it
  char b[8];
  EXPECT_EQ(p.opener->peek(b, sizeof(b)), 0u);
  EXPECT_TRUE(p.opener->corrupt());
  EXPECT_HAS(p.opener->corruptReason(), "ring write position 199");
}

TEST(ShmLink, AHeadMovingBackwardsIsCorrupt) {
  Pair p = makePair(4096);
  ASSERT_EQ(writeAll(*p.opener, pattern(300, 1)), 300u);
  EXPECT_EQ(p.creator->readable(), 300u);
  p.raw->toCreatorHead().store(100);  // takes back bytes it had given
  std::vector<char> got(300);
  EXPECT_EQ(readInto(*p.creator, &got), 0u);
  EXPECT_TRUE(p.creator->corrupt());
  EXPECT_HAS(p.creator->corruptReason(), "ring write position 100 written by the peer is outside 300..");
}

TEST(ShmLink, ATailAheadOfWhatWasWrittenIsCorrupt) {
  Pair p = makePair(4096);
  ASSERT_EQ(writeAll(*p.creator, pattern(100, 1)), 100u);
  // The reader claims to have read 5000 bytes of 100: the writer would compute a negative
  // fill (free room past the ring's size) and copy over the other ring and past the mapping.
  p.raw->toOpenerTail().store(5000);
  EXPECT_EQ(writeAll(*p.creator, pattern(1 << 16, 2)), 0u);
  EXPECT_TRUE(p.creator->corrupt());
  EXPECT_HAS(p.creator->corruptReason(), "ring read position 5000 written by the peer is outside 0..100");
  EXPECT_EQ(writeAll(*p.creator, pattern(1, 2)), 0u);  // stays refused
  // The incoming direction is still sound.
  EXPECT_FALSE(p.creator->peerClosedWrite());
  ASSERT_EQ(writeAll(*p.opener, pattern(10, 3)), 10u);
  EXPECT_EQ(p.creator->readable(), 10u);
}

TEST(ShmLink, ATailMovingBackwardsIsCorrupt) {
  Pair p = makePair(4096);
  ASSERT_EQ(writeAll(*p.opener, pattern(4096, 1)), 4096u);
  std::vector<char> got(4096);
  ASSERT_EQ(readInto(*p.creator, &got), 4096u);
  ASSERT_EQ(writeAll(*p.opener, pattern(10, 1)), 10u);  // sees tail 4096
  p.raw->toCreatorTail().store(0);                        // "unreads" a ring's worth
  EXPECT_EQ(writeAll(*p.opener, pattern(10, 1)), 0u);
  EXPECT_TRUE(p.opener->corrupt());
  EXPECT_HAS(p.opener->corruptReason(), "ring read position 0 written by the peer is outside 4096..4106");
}

TEST(ShmLink, TheLinksOwnPositionsInTheSegmentAreNeverReadBack) {
  // The peer overwrites the positions this end writes (its head as writer, its tail as reader):
  // this end keeps its own, so nothing it copies depends on them.
  Pair p = makePair(4096);
  const auto data = pattern(1000, 9);
  ASSERT_EQ(writeAll(*p.creator, data), 1000u);
  p.raw->toOpenerHead().store(~uint64_t{0});  // the creator's own head
  p.raw->toCreatorTail().store(~uint64_t{0});  // the creator's own tail
  ASSERT_EQ(writeAll(*p.creator, data), 1000u);  // stores its own head (2000) again
  EXPECT_FALSE(p.creator->corrupt());
  EXPECT_EQ(p.creator->readable(), 0u);
  std::vector<char> got(2000);
  ASSERT_EQ(readInto(*p.opener, &got), 2000u);
  EXPECT_EQ(std::memcmp(got.data() + 1000, data.data(), 1000), 0);
  // The opener sees the creator's head as the peer's, and garbage there is corruption.
  p.raw->toOpenerHead().store(~uint64_t{0});
  EXPECT_EQ(readInto(*p.opener, &got), 0u);
  EXPECT_TRUE(p.opener->corrupt());
}

// --- the engine over a corrupt link ----------------------------------------------------------

// Where this process maps meshccl segments (the ranks of these tests are its threads).
std::vector<char*> mappedSegments() {
  std::vector<char*> out;
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    if (line.find("/dev/shm/mccl.") == std::string::npos && line.find("/mccl.") == std::string::npos) continue;
    out.push_back(reinterpret_cast<char*>(std::stoull(line.substr(0, line.find('-')), nullptr, 16)));
  }
  return out;
}

// Both ranks reach it before either goes on.
class Rendezvous {
 public:
  void arrive(int n) {
    std::unique_lock<std::mutex> lock(mu_);
    const int round = arrived_ / n;
    if (++arrived_ % n == 0) {
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return arrived_ / n > round; });
    }
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
};

struct Outcome {
  bool raised = false;
  ErrorKind kind = ErrorKind::kInvalidArgument;
  std::string message;
  double seconds = 0;
};

// Two ranks on one host, one shared-memory connection: a first all_reduce works; then,
// between calls, `scribble` writes into the segment what a broken peer would; then `second`
// runs on each rank. Returns how each rank's second call ended.
std::vector<Outcome> corruptBetweenCalls(double timeout, const std::function<void(char* segment)>& scribble,
                                         const std::function<void(Context&)>& second) {
  test::Topology t;
  t.hostRanks = 2;
  t.connsPerLink = 1;
  t.singleCopyBytes = 0;
  t.timeout = timeout;
  Rendezvous between;
  std::vector<Outcome> outcomes(2);
  test::runRanks(2, t, [&](Context& ctx) {
    ASSERT_EQ(ctx.transport(1 - ctx.rank()), "shm");
    std::vector<float> x(1000, 1.0f);
    allReduce(ctx, x.data(), x.data(), x.size(), DataType::kFloat32, RedOp::kSum);
    EXPECT_EQ(x[999], 2.0f);
    between.arrive(2);
    if (ctx.rank() == 0) {
      const auto segments = mappedSegments();
      ASSERT_EQ(segments.size(), 2u) << "the segment, mapped by each rank";
      scribble(segments[0]);
    }
    between.arrive(2);
    Outcome& o = outcomes[static_cast<size_t>(ctx.rank())];
    const auto start = std::chrono::steady_clock::now();
    try {
      second(ctx);
    } catch (const Error& e) {
      o.raised = true;
      o.kind = e.kind();
      o.message = e.what();
    }
    o.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  });
  for (size_t r = 0; r < outcomes.size(); ++r) {
    ::testing::Test::RecordProperty("rank" + std::to_string(r), outcomes[r].message);
  }
  return outcomes;
}

std::atomic<uint64_t>& position(char* segment, size_t ring, size_t which) {
  return *std::launder(reinterpret_cast<std::atomic<uint64_t>*>(segment + ring + which));
}

TEST(ShmLink, AHeadFarPastTheRingFailsTheNextCallOnBothRanksWithoutACopy) {
#if !defined(__linux__)
  GTEST_SKIP() << "finds the segment's mapping in /proc/self/maps (Linux)";
#endif
  // Rank 1's write position in the ring rank 0 reads jumps a terabyte ahead: rank 0 must not
  // copy it (a terabyte memcpy from a 256 KiB ring), it fails the call, and rank 1 learns of
  // it; both well before the operation timeout. (A position's honest writer puts the true
  // value back with its next write: the calls are chosen so that it writes none.)
  const auto outcomes = corruptBetweenCalls(
      20.0,
      [](char* seg) {
        auto& head = position(seg, ShmLayout::kOpenerToCreator, ShmLayout::kHeadOffset);
        head.store(head.load() + (uint64_t{1} << 40));
      },
      [](Context& ctx) {
        // Each waits for the other: rank 1 writes nothing that would put the true head back.
        std::vector<float> x(1000, 1.0f);
        recv(ctx, x.data(), x.size(), DataType::kFloat32, 1 - ctx.rank());
      });
  for (int r = 0; r < 2; ++r) {
    const Outcome& o = outcomes[static_cast<size_t>(r)];
    EXPECT_TRUE(o.raised) << "rank " << r;
    EXPECT_EQ(o.kind, ErrorKind::kIo) << "rank " << r << ": " << o.message;
    EXPECT_LT(o.seconds, 10.0) << "rank " << r << ": " << o.message;
  }
  // The rank that saw the broken ring names it (not "the peer exited").
  EXPECT_NE(outcomes[0].message.find("the peer broke the ring protocol"), std::string::npos) << outcomes[0].message;
}

TEST(ShmLink, ATailPastWhatWasWrittenFailsASendInsteadOfOverwritingMemory) {
#if !defined(__linux__)
  GTEST_SKIP() << "finds the segment's mapping in /proc/self/maps (Linux)";
#endif
  // Rank 1's read position in the ring rank 0 writes claims more than was written: rank 0's
  // send must not compute room past the ring and copy over the other ring and beyond. Rank 0
  // only sends here: the engine reads corrupt() when the ring takes nothing, so it fails at
  // once, well before the operation's 2 s timeout, naming the broken ring.
  const auto outcomes = corruptBetweenCalls(
      2.0,
      [](char* seg) {
        auto& tail = position(seg, ShmLayout::kCreatorToOpener, ShmLayout::kTailOffset);
        tail.store(tail.load() + (uint64_t{1} << 20));
      },
      [](Context& ctx) {
        std::vector<float> x(100000, 1.0f);
        if (ctx.rank() == 0) {
          send(ctx, x.data(), x.size(), DataType::kFloat32, 1);
        } else {
          recv(ctx, x.data(), x.size(), DataType::kFloat32, 0);
        }
      });
  for (int r = 0; r < 2; ++r) {
    const Outcome& o = outcomes[static_cast<size_t>(r)];
    EXPECT_TRUE(o.raised) << "rank " << r;
    EXPECT_TRUE(o.kind == ErrorKind::kIo || o.kind == ErrorKind::kTimeout) << "rank " << r << ": " << o.message;
    EXPECT_LT(o.seconds, 10.0) << "rank " << r << ": " << o.message;
  }
  EXPECT_EQ(outcomes[0].kind, ErrorKind::kIo) << outcomes[0].message;
  EXPECT_LT(outcomes[0].seconds, 1.9) << "the sender must not wait for the timeout: " << outcomes[0].message;
  EXPECT_NE(outcomes[0].message.find("the peer broke the ring protocol"), std::string::npos) << outcomes[0].message;
}

// --- the single-copy slot ----------------------------------------------------------------------

TEST(ShmLink, APublishedPidOrAddressOutOfRangeIsRefused) {
  struct Case {
    uint64_t pid;
    uint64_t address;
    const char* says;
  };
  for (const Case c : {Case{0, 4096, "published pid 0"}, Case{uint64_t{1} << 32, 4096, "which is not a process id"},
                       Case{~uint64_t{0}, 4096, "which is not a process id"},
                       Case{static_cast<uint64_t>(::getpid()), 0, "published address 0x0"},
                       Case{static_cast<uint64_t>(::getpid()), ~uint64_t{0} - 8, "cannot hold its slot"}}) {
    Pair p = makePair(4096);
    p.creator->publishProcess();
    const uint64_t slot[3] = {c.pid, c.address, 12345};
    std::memcpy(p.raw->base() + ShmLayout::kOpenerSlot, slot, sizeof(slot));
    int pid = -1;
    std::string why;
    EXPECT_FALSE(p.creator->probePeerProcess(&pid, &why)) << c.pid << " " << c.address;
    EXPECT_HAS(why, c.says);
    EXPECT_EQ(pid, -1);
  }
}

TEST(ShmLink, AGenuineSlotProvesThePeerReadableWhereSingleCopyIsBuilt) {
  Pair p = makePair(4096);
  p.creator->publishProcess();
  p.opener->publishProcess();
  int pid = -1;
  std::string why;
  const bool ok = p.creator->probePeerProcess(&pid, &why);
  if (!platform::kSingleCopy) {
    EXPECT_FALSE(ok);
    EXPECT_HAS(why, "this build has no single copy");
    return;
  }
  if (!ok && why.find("Operation not permitted") != std::string::npos) GTEST_SKIP() << why;
  EXPECT_TRUE(ok) << why;
  EXPECT_EQ(pid, ::getpid());
}


// The CPU a rank's thread has used (seconds).
double threadCpuSeconds() {
  timespec ts{};
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

// A rank that waits on shared memory for a late peer sleeps after a short spin and is woken by
// the peer's write (its doorbell), instead of spinning on the rings (before: 50 ms of a core
// per wait, then a look every millisecond). `small` ring bytes and a message larger than the
// ring make the sender wait for room too. The test's own 300 ms delay stands for the late
// peer's compute: the assertions are on CPU time used while waiting, which a slow or busy
// machine only lowers, and on the call completing (a lost wake-up would end in the timeout).
void lateShmPeer(size_t messageBytes, bool sendRecv) {
  test::Topology t;
  t.hostRanks = 2;
  t.singleCopyBytes = 0;
  t.timeout = 60;
  std::vector<double> waitedCpu(2), waitedWall(2);
  test::runRanks(
      2, t,
      [&](Context& ctx) {
        ASSERT_EQ(ctx.transport(1 - ctx.rank()), "shm");
        const size_t count = messageBytes / sizeof(float);
        std::vector<float> x(count, static_cast<float>(ctx.rank() + 1));
        for (int round = 0; round < 2; ++round) {
          const int late = round;  // rank 0 waits first, then rank 1
          if (ctx.rank() == late) std::this_thread::sleep_for(std::chrono::milliseconds(300));
          const double cpu0 = threadCpuSeconds();
          const auto wall0 = std::chrono::steady_clock::now();
          if (sendRecv) {
            if (ctx.rank() == 1 - late) {
              recv(ctx, x.data(), count, DataType::kFloat32, late);
              EXPECT_EQ(x[count - 1], static_cast<float>(late + 1 + round * 10));
            } else {
              std::fill(x.begin(), x.end(), static_cast<float>(late + 1 + round * 10));
              send(ctx, x.data(), count, DataType::kFloat32, 1 - late);
            }
          } else {
            std::fill(x.begin(), x.end(), 1.0f);
            allReduce(ctx, x.data(), x.data(), count, DataType::kFloat32, RedOp::kSum);
            EXPECT_EQ(x[count - 1], 2.0f);
          }
          if (ctx.rank() != late) {
            waitedCpu[static_cast<size_t>(ctx.rank())] = threadCpuSeconds() - cpu0;
            waitedWall[static_cast<size_t>(ctx.rank())] =
                std::chrono::duration<double>(std::chrono::steady_clock::now() - wall0).count();
          }
        }
      },
      [](Config& c) { c.shmRingBytes = 64 << 10; });
  for (size_t r = 0; r < 2; ++r) {
    ::testing::Test::RecordProperty("rank" + std::to_string(r) + "_wait",
                                    cat(waitedCpu[r] * 1e3, " ms CPU in ", waitedWall[r] * 1e3, " ms"));
    EXPECT_LT(waitedCpu[r], 0.025) << "rank " << r << " used " << waitedCpu[r] * 1e3 << " ms of CPU in a "
                                   << waitedWall[r] * 1e3 << " ms wait for its late peer";
  }
}

TEST(ShmWait, ARankWaitingForALatePeerSleepsAndIsWoken) { lateShmPeer(4096, false); }
TEST(ShmWait, ASenderWaitingForRoomInAFullRingSleepsAndIsWoken) { lateShmPeer(1 << 20, true); }

}  // namespace
}  // namespace meshccl
