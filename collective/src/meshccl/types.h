#pragma once

// Element types, reduction operators and the reduction kernels.

#include <cstddef>
#include <cstdint>
#include <string>

namespace meshccl {

// Values are part of the wire format (the per-frame call descriptor) and of the C ABI.
enum class DataType : uint8_t {
  kFloat32 = 0,
  kFloat64 = 1,
  kFloat16 = 2,
  kBFloat16 = 3,
  kInt8 = 4,
  kInt32 = 5,
  kInt64 = 6,
  kUInt8 = 7,
};
constexpr int kNumDataTypes = 8;

enum class RedOp : uint8_t { kSum = 0, kProd = 1, kMin = 2, kMax = 3 };
constexpr int kNumRedOps = 4;

size_t elementSize(DataType dtype);
const char* dtypeName(DataType dtype);
const char* redopName(RedOp op);
bool validDataType(int value);
bool validRedOp(int value);

// out[i] = a[i] (op) b[i] for i < count. `out` may alias `a` or `b`; no other overlap.
void reduce(void* out, const void* a, const void* b, size_t count, DataType dtype, RedOp op);

// Half-precision conversions (round to nearest even), exposed for tests.
float halfToFloat(uint16_t h);
uint16_t floatToHalf(float f);
float bfloat16ToFloat(uint16_t h);
uint16_t floatToBFloat16(float f);

}  // namespace meshccl
