#pragma once

// The few cryptographic primitives the connect handshake needs, from the platform's own
// well-kept library (never hand-written): OpenSSL's libcrypto on Linux, CommonCrypto and the
// system's random source on macOS.

#include <array>
#include <cstddef>
#include <cstdint>

namespace meshccl::crypto {

constexpr size_t kMacBytes = 32;  // HMAC-SHA256
using Mac = std::array<uint8_t, kMacBytes>;

// HMAC-SHA256 of `data` under `key` (any length, empty included).
Mac hmacSha256(const void* key, size_t keyLen, const void* data, size_t dataLen);

// Cryptographically strong random bytes; raises ErrorKind::kIo when the system cannot give them.
void randomBytes(void* out, size_t len);

// a[0..len) == b[0..len), in time that depends on len only.
bool equalConstantTime(const void* a, const void* b, size_t len);

// The library behind these functions, for messages and diagnostics ("OpenSSL 3.0.x", "CommonCrypto").
const char* providerName();

}  // namespace meshccl::crypto
