#pragma once

// Shared by the fuzz targets: network-like chunking and invariant checks.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string_view>
#include <vector>

namespace meshccl::fuzz {

// A violated invariant: report and abort (a crash for libFuzzer and for the corpus replay).
#define MESHCCL_FUZZ_CHECK(cond)                                                            \
  do {                                                                                      \
    if (!(cond)) {                                                                          \
      std::fprintf(stderr, "meshccl fuzz invariant failed: %s (%s:%d)\n", #cond, __FILE__, __LINE__); \
      std::abort();                                                                         \
    }                                                                                       \
  } while (0)

// Pseudo-random chunk sizes from a seed: mostly small (a byte at a time, split headers),
// sometimes everything at once.
class Chunker {
 public:
  explicit Chunker(uint8_t seed) : state_(0x9e3779b9u ^ (static_cast<uint32_t>(seed) * 0x85ebca6bu)) {}
  size_t next(size_t left) {
    state_ ^= state_ << 13;
    state_ ^= state_ >> 17;
    state_ ^= state_ << 5;
    const uint32_t r = state_ % 16;
    const size_t n = r == 0 ? left : r < 8 ? 1 + state_ % 4 : 1 + state_ % 64;
    return std::min(std::max<size_t>(n, 1), left);
  }

 private:
  uint32_t state_;
};

inline bool containsBytes(const std::vector<uint8_t>& hay, std::string_view needle) {
  return !needle.empty() && std::search(hay.begin(), hay.end(), needle.begin(), needle.end()) != hay.end();
}

}  // namespace meshccl::fuzz
