#include "meshccl/crypto.h"

#include "meshccl/error.h"

#if defined(__APPLE__)
#include <CommonCrypto/CommonHMAC.h>
#include <stdlib.h>  // arc4random_buf
#else
#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/opensslv.h>
#include <openssl/rand.h>
#endif

#include <climits>

namespace meshccl::crypto {

#if defined(__APPLE__)

Mac hmacSha256(const void* key, size_t keyLen, const void* data, size_t dataLen) {
  static const unsigned char kEmpty = 0;
  Mac out{};
  CCHmac(kCCHmacAlgSHA256, keyLen > 0 ? key : &kEmpty, keyLen, dataLen > 0 ? data : &kEmpty, dataLen, out.data());
  return out;
}

void randomBytes(void* out, size_t len) { arc4random_buf(out, len); }  // cannot fail

bool equalConstantTime(const void* a, const void* b, size_t len) {
  const volatile unsigned char* x = static_cast<const volatile unsigned char*>(a);
  const volatile unsigned char* y = static_cast<const volatile unsigned char*>(b);
  unsigned char diff = 0;
  for (size_t i = 0; i < len; ++i) diff = static_cast<unsigned char>(diff | (x[i] ^ y[i]));
  return diff == 0;
}

const char* providerName() { return "CommonCrypto"; }

#else

Mac hmacSha256(const void* key, size_t keyLen, const void* data, size_t dataLen) {
  // A non-null key pointer even for an empty key: OpenSSL 3 treats a null key as "keep the
  // previous key" and fails on a fresh context.
  static const unsigned char kEmpty = 0;
  if (keyLen > static_cast<size_t>(INT_MAX)) raise(ErrorKind::kInvalidArgument, "HMAC key too long");
  Mac out{};
  unsigned int outLen = 0;
  const unsigned char* result =
      HMAC(EVP_sha256(), keyLen > 0 ? key : &kEmpty, static_cast<int>(keyLen),
           dataLen > 0 ? static_cast<const unsigned char*>(data) : &kEmpty, dataLen, out.data(), &outLen);
  if (result == nullptr || outLen != kMacBytes) {
    const unsigned long err = ERR_get_error();
    char text[256] = "unknown error";
    if (err != 0) ERR_error_string_n(err, text, sizeof(text));
    raise(ErrorKind::kIo, cat("HMAC-SHA256 failed in OpenSSL: ", text));
  }
  return out;
}

void randomBytes(void* out, size_t len) {
  auto* p = static_cast<unsigned char*>(out);
  while (len > 0) {
    const int n = len > static_cast<size_t>(INT_MAX) ? INT_MAX : static_cast<int>(len);
    if (RAND_bytes(p, n) != 1) {
      const unsigned long err = ERR_get_error();
      char text[256] = "unknown error";
      if (err != 0) ERR_error_string_n(err, text, sizeof(text));
      raise(ErrorKind::kIo, cat("no random bytes from OpenSSL (RAND_bytes): ", text));
    }
    p += n;
    len -= static_cast<size_t>(n);
  }
}

bool equalConstantTime(const void* a, const void* b, size_t len) { return CRYPTO_memcmp(a, b, len) == 0; }

const char* providerName() { return OPENSSL_VERSION_TEXT; }

#endif

}  // namespace meshccl::crypto
