#include "meshccl/types.h"

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "meshccl/error.h"

namespace meshccl {

size_t elementSize(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat32:
    case DataType::kInt32:
      return 4;
    case DataType::kFloat64:
    case DataType::kInt64:
      return 8;
    case DataType::kFloat16:
    case DataType::kBFloat16:
      return 2;
    case DataType::kInt8:
    case DataType::kUInt8:
      return 1;
  }
  raise(ErrorKind::kInvalidArgument, cat("unknown dtype ", static_cast<int>(dtype)));
}

const char* dtypeName(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat32: return "float32";
    case DataType::kFloat64: return "float64";
    case DataType::kFloat16: return "float16";
    case DataType::kBFloat16: return "bfloat16";
    case DataType::kInt8: return "int8";
    case DataType::kInt32: return "int32";
    case DataType::kInt64: return "int64";
    case DataType::kUInt8: return "uint8";
  }
  return "unknown-dtype";
}

const char* redopName(RedOp op) {
  switch (op) {
    case RedOp::kSum: return "sum";
    case RedOp::kProd: return "prod";
    case RedOp::kMin: return "min";
    case RedOp::kMax: return "max";
  }
  return "unknown-op";
}

bool validDataType(int value) { return value >= 0 && value < kNumDataTypes; }
bool validRedOp(int value) { return value >= 0 && value < kNumRedOps; }

namespace {

template <typename T>
T bitsAs(uint32_t bits) {
  T out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

uint32_t floatBits(float f) {
  uint32_t out;
  std::memcpy(&out, &f, sizeof(out));
  return out;
}

// Integer sums and products wrap (two's complement) instead of overflowing: computed on the
// unsigned type of the same width, so no rank hits undefined behaviour on large values.
template <typename T, bool = std::is_integral_v<T>>
struct Arith {
  static T add(T a, T b) { return a + b; }
  static T mul(T a, T b) { return a * b; }
};
template <typename T>
struct Arith<T, true> {
  // Promoted to at least unsigned int so that narrow types do not come back as signed int.
  using U = std::common_type_t<std::make_unsigned_t<T>, unsigned>;
  static T add(T a, T b) { return static_cast<T>(static_cast<U>(a) + static_cast<U>(b)); }
  static T mul(T a, T b) { return static_cast<T>(static_cast<U>(a) * static_cast<U>(b)); }
};

// Plain element loops: the compiler vectorises them (it versions the loop for the aliasing case).
template <typename T>
void reduceTyped(T* out, const T* a, const T* b, size_t n, RedOp op) {
  switch (op) {
    case RedOp::kSum:
      for (size_t i = 0; i < n; ++i) out[i] = Arith<T>::add(a[i], b[i]);
      break;
    case RedOp::kProd:
      for (size_t i = 0; i < n; ++i) out[i] = Arith<T>::mul(a[i], b[i]);
      break;
    case RedOp::kMin:
      for (size_t i = 0; i < n; ++i) out[i] = b[i] < a[i] ? b[i] : a[i];
      break;
    case RedOp::kMax:
      for (size_t i = 0; i < n; ++i) out[i] = a[i] < b[i] ? b[i] : a[i];
      break;
  }
}

// 16-bit floats: widen a block to float, reduce, narrow (round to nearest even).
template <float (*Widen)(uint16_t), uint16_t (*Narrow)(float)>
void reduceHalf(uint16_t* out, const uint16_t* a, const uint16_t* b, size_t n, RedOp op) {
  constexpr size_t kBlock = 256;
  float fa[kBlock];
  float fb[kBlock];
  for (size_t base = 0; base < n; base += kBlock) {
    const size_t m = std::min(kBlock, n - base);
    for (size_t i = 0; i < m; ++i) {
      fa[i] = Widen(a[base + i]);
      fb[i] = Widen(b[base + i]);
    }
    reduceTyped<float>(fa, fa, fb, m, op);
    for (size_t i = 0; i < m; ++i) out[base + i] = Narrow(fa[i]);
  }
}

}  // namespace

float halfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t expMant = h & 0x7fffu;
  if (expMant >= 0x7c00u) {  // infinity or NaN: keep the payload
    return bitsAs<float>(sign | 0x7f800000u | ((expMant & 0x3ffu) << 13));
  }
  // Shifted into float position the exponent is biased by 15 instead of 127; multiplying by
  // 2^112 rebiases it, and handles subnormal halves too (they become normal floats).
  const float magnitude = bitsAs<float>(expMant << 13) * 0x1p112f;
  return bitsAs<float>(sign | floatBits(magnitude));
}

uint16_t floatToHalf(float f) {
  uint32_t x = floatBits(f);
  const auto sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x >= 0x47800000u) {  // >= 65536, infinity or NaN
    return static_cast<uint16_t>(sign | (x > 0x7f800000u ? 0x7e00u : 0x7c00u));
  }
  if (x < 0x38800000u) {  // below the smallest normal half (2^-14): subnormal or zero
    // Adding 0.5 puts the half's subnormal unit (2^-24) at the float's last mantissa bit, so
    // the FPU's own round-to-nearest-even does the rounding.
    const float t = bitsAs<float>(x) + 0.5f;
    return static_cast<uint16_t>(sign | (floatBits(t) - 0x3f000000u));
  }
  const uint32_t odd = (x >> 13) & 1u;
  x += 0xc8000fffu + odd;  // rebias the exponent (-112 << 23) and round to nearest even
  return static_cast<uint16_t>(sign | (x >> 13));
}

float bfloat16ToFloat(uint16_t h) { return bitsAs<float>(static_cast<uint32_t>(h) << 16); }

uint16_t floatToBFloat16(float f) {
  uint32_t x = floatBits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // quiet NaN
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

void reduce(void* out, const void* a, const void* b, size_t count, DataType dtype, RedOp op) {
  switch (dtype) {
    case DataType::kFloat32:
      return reduceTyped(static_cast<float*>(out), static_cast<const float*>(a), static_cast<const float*>(b), count,
                         op);
    case DataType::kFloat64:
      return reduceTyped(static_cast<double*>(out), static_cast<const double*>(a), static_cast<const double*>(b),
                         count, op);
    case DataType::kFloat16:
      return reduceHalf<halfToFloat, floatToHalf>(static_cast<uint16_t*>(out), static_cast<const uint16_t*>(a),
                                                  static_cast<const uint16_t*>(b), count, op);
    case DataType::kBFloat16:
      return reduceHalf<bfloat16ToFloat, floatToBFloat16>(static_cast<uint16_t*>(out),
                                                          static_cast<const uint16_t*>(a),
                                                          static_cast<const uint16_t*>(b), count, op);
    case DataType::kInt8:
      return reduceTyped(static_cast<int8_t*>(out), static_cast<const int8_t*>(a), static_cast<const int8_t*>(b),
                         count, op);
    case DataType::kInt32:
      return reduceTyped(static_cast<int32_t*>(out), static_cast<const int32_t*>(a), static_cast<const int32_t*>(b),
                         count, op);
    case DataType::kInt64:
      return reduceTyped(static_cast<int64_t*>(out), static_cast<const int64_t*>(a), static_cast<const int64_t*>(b),
                         count, op);
    case DataType::kUInt8:
      return reduceTyped(static_cast<uint8_t*>(out), static_cast<const uint8_t*>(a), static_cast<const uint8_t*>(b),
                         count, op);
  }
  raise(ErrorKind::kInvalidArgument, cat("unknown dtype ", static_cast<int>(dtype)));
}

const char* kindName(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kInvalidArgument: return "invalid argument";
    case ErrorKind::kIo: return "I/O error";
    case ErrorKind::kTimeout: return "timeout";
    case ErrorKind::kMismatch: return "mismatched call";
    case ErrorKind::kAuth: return "authentication";
    case ErrorKind::kBootstrap: return "bootstrap";
    case ErrorKind::kAborted: return "aborted";
  }
  return "error";
}

}  // namespace meshccl
