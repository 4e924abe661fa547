#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "meshccl/types.h"

namespace meshccl {
namespace {

TEST(Half, RoundTripsEveryFiniteHalf) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const auto bits = static_cast<uint16_t>(h);
    if ((bits & 0x7c00u) == 0x7c00u) continue;  // inf / NaN checked below
    EXPECT_EQ(floatToHalf(halfToFloat(bits)), bits) << std::hex << h;
  }
}

TEST(Half, KnownValuesAndRounding) {
  EXPECT_EQ(halfToFloat(0x3c00), 1.0f);
  EXPECT_EQ(halfToFloat(0xc000), -2.0f);
  EXPECT_EQ(halfToFloat(0x7bff), 65504.0f);
  EXPECT_EQ(halfToFloat(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(floatToHalf(65520.0f), 0x7c00);                // rounds up to infinity
  EXPECT_EQ(floatToHalf(1.0f + std::ldexp(1.0f, -11)), 0x3c00);  // tie to even (down)
  EXPECT_EQ(floatToHalf(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);  // tie to even (up)
  EXPECT_TRUE(std::isinf(halfToFloat(0x7c00)));
  EXPECT_TRUE(std::isnan(halfToFloat(floatToHalf(std::nanf("")))));
}

TEST(BFloat16, KnownValuesAndRounding) {
  EXPECT_EQ(bfloat16ToFloat(0x3f80), 1.0f);
  EXPECT_EQ(floatToBFloat16(1.0f), 0x3f80);
  EXPECT_EQ(floatToBFloat16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);      // tie to even (down)
  EXPECT_EQ(floatToBFloat16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);  // tie to even (up)
  EXPECT_TRUE(std::isnan(bfloat16ToFloat(floatToBFloat16(std::nanf("")))));
}

TEST(Reduce, IntegerSumWrapsInsteadOfOverflowing) {
  std::vector<int32_t> a{INT32_MAX, -5}, b{1, 3}, out(2);
  reduce(out.data(), a.data(), b.data(), 2, DataType::kInt32, RedOp::kSum);
  EXPECT_EQ(out[0], INT32_MIN);
  EXPECT_EQ(out[1], -2);
}

TEST(Reduce, MinMaxProdInPlace) {
  std::vector<double> a{1, 5, -2}, b{3, 2, -7};
  reduce(a.data(), a.data(), b.data(), 3, DataType::kFloat64, RedOp::kMax);
  EXPECT_EQ(a, (std::vector<double>{3, 5, -2}));
  reduce(a.data(), a.data(), b.data(), 3, DataType::kFloat64, RedOp::kMin);
  EXPECT_EQ(a, (std::vector<double>{3, 2, -7}));
  std::vector<uint8_t> x{200, 3}, y{2, 4};
  reduce(x.data(), x.data(), y.data(), 2, DataType::kUInt8, RedOp::kProd);
  EXPECT_EQ(x, (std::vector<uint8_t>{144, 12}));  // 400 mod 256
}

TEST(Reduce, HalfSumRoundsOnce) {
  const uint16_t one = floatToHalf(1.0f), two = floatToHalf(2.0f);
  std::vector<uint16_t> a(1000, one), b(1000, two), out(1000);
  reduce(out.data(), a.data(), b.data(), 1000, DataType::kFloat16, RedOp::kSum);
  for (auto v : out) EXPECT_EQ(halfToFloat(v), 3.0f);
}

}  // namespace
}  // namespace meshccl
