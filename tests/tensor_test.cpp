// Tensor views, the owning tensor, and the exactness of dtype conversions.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <limits>

#include "qkv/qkv.hpp"

namespace {

using qkv::bf16;
using qkv::f16;

TEST(DType, F16RoundTripsEveryPattern) {
  for (std::uint32_t bits = 0; bits < 0x10000; ++bits) {
    const f16 x{static_cast<std::uint16_t>(bits)};
    const float f = qkv::to_float(x);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(qkv::to_float(qkv::to_f16(f)))) << bits;
      continue;
    }
    EXPECT_EQ(qkv::to_f16(f).bits, bits) << "f16 pattern " << bits << " -> " << f;
  }
}

TEST(DType, Bf16RoundTripsEveryPattern) {
  for (std::uint32_t bits = 0; bits < 0x10000; ++bits) {
    const bf16 x{static_cast<std::uint16_t>(bits)};
    const float f = qkv::to_float(x);
    if (std::isnan(f)) continue;
    EXPECT_EQ(qkv::to_bf16(f).bits, bits) << "bf16 pattern " << bits;
  }
}

TEST(DType, F16RoundsToNearestEven) {
  EXPECT_EQ(qkv::to_f16(1.0f).bits, 0x3c00);
  // 1 + 2^-11 is halfway between 1 and 1 + 2^-10: ties to the even 1.
  EXPECT_EQ(qkv::to_f16(1.0 + std::ldexp(1.0, -11)).bits, 0x3c00);
  // 1 + 3 * 2^-11 is halfway between 1 + 2^-10 (odd) and 1 + 2^-9: rounds up.
  EXPECT_EQ(qkv::to_f16(1.0 + 3 * std::ldexp(1.0, -11)).bits, 0x3c02);
  EXPECT_EQ(qkv::to_f16(65504.0).bits, 0x7bff);                   // largest finite
  EXPECT_EQ(qkv::to_f16(65519.0).bits, 0x7bff);                   // below the halfway point
  EXPECT_EQ(qkv::to_f16(65520.0).bits, 0x7c00);                   // halfway: rounds to even = inf
  EXPECT_EQ(qkv::to_f16(-1e6).bits, 0xfc00);                      // overflow keeps the sign
  EXPECT_EQ(qkv::to_f16(std::ldexp(1.0, -24)).bits, 0x0001);      // smallest subnormal
  EXPECT_EQ(qkv::to_f16(std::ldexp(1.0, -25)).bits, 0x0000);      // tie to even zero
  EXPECT_EQ(qkv::to_f16(3 * std::ldexp(1.0, -26)).bits, 0x0001);  // above the tie
  EXPECT_EQ(qkv::to_f16(-0.0).bits, 0x8000);
  EXPECT_EQ(qkv::to_float(f16{0x3555}), 0.333251953125f);
}

TEST(DType, Bf16RoundsToNearestEvenWithoutDoubleRounding) {
  EXPECT_EQ(qkv::to_bf16(1.0f).bits, 0x3f80);
  EXPECT_EQ(qkv::to_bf16(std::bit_cast<float>(0x3f808000u)).bits, 0x3f80);  // tie -> even
  EXPECT_EQ(qkv::to_bf16(std::bit_cast<float>(0x3f818000u)).bits, 0x3f82);  // tie -> even
  EXPECT_EQ(qkv::to_bf16(std::bit_cast<float>(0x3f808001u)).bits, 0x3f81);  // above tie
  // 1 + 2^-8 + 2^-40 rounds to float as the exact tie 1 + 2^-8; rounding the
  // double directly must see that it lies above the tie.
  EXPECT_EQ(qkv::to_bf16(1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -40)).bits, 0x3f81);
  EXPECT_EQ(qkv::to_bf16(std::numeric_limits<double>::max()).bits, 0x7f80);
  EXPECT_TRUE(std::isnan(qkv::to_float(qkv::to_bf16(std::nan("")))));
}

// Whether `got` is the 16-bit value nearest to f, ties to the even pattern,
// overflow to infinity: a check by distances in double, independent of how
// the conversion computes. `widen` maps a pattern to its value, `overflow`
// is the magnitude from which the format rounds to infinity.
template <class T, class Widen>
void expect_nearest_even(float f, T got, std::uint16_t infinity, double overflow, Widen widen) {
  const auto bits = std::bit_cast<std::uint32_t>(f);
  ASSERT_EQ((got.bits & 0x8000) != 0, (bits >> 31) != 0) << "sign of float bits " << bits;
  const std::uint16_t h = got.bits & 0x7fff;
  const double a = std::fabs(static_cast<double>(f));
  if (a >= overflow || h == infinity) {
    EXPECT_TRUE(a >= overflow && h == infinity) << "float bits " << bits << " gave " << got.bits;
    return;
  }
  const double d = std::fabs(a - widen(h));
  const double below = h > 0 ? std::fabs(a - widen(static_cast<std::uint16_t>(h - 1))) : INFINITY;
  const double above = std::fabs(a - widen(static_cast<std::uint16_t>(h + 1)));
  EXPECT_TRUE(d <= below && d <= above) << "float bits " << bits << " gave " << got.bits;
  if (d == below || d == above) {
    EXPECT_EQ(h & 1, 0) << "tie at float bits " << bits;
  }
}

// Every float near a rounding boundary of f16 or bf16 (each pattern of the
// bits above the cut, with the cut bits at 0, just below half, half, just
// above half and all ones), and the neighbours of every f16 value and of
// every midpoint between two (f16 subnormals round at other bit positions).
TEST(DType, FloatConversionsRoundToNearestEven) {
  auto check = [](std::uint32_t bits) {
    const float f = std::bit_cast<float>(bits);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(qkv::to_float(qkv::to_f16(f)))) << bits;
      EXPECT_TRUE(std::isnan(qkv::to_float(qkv::to_bf16(f)))) << bits;
      return;
    }
    expect_nearest_even(f, qkv::to_f16(f), 0x7c00, 65520.0,
                        [](std::uint16_t h) { return static_cast<double>(qkv::to_float(f16{h})); });
    expect_nearest_even(
        f, qkv::to_bf16(f), 0x7f80, std::ldexp(2.0 - std::ldexp(1.0, -8), 127),
        [](std::uint16_t h) { return static_cast<double>(qkv::to_float(bf16{h})); });
  };
  for (std::uint32_t high = 0; high < (1u << 19); ++high) {
    for (const std::uint32_t low : {0x0000u, 0x0fffu, 0x1000u, 0x1001u, 0x1fffu}) {
      check(high << 13 | low);
    }
  }
  for (std::uint32_t high = 0; high < (1u << 16); ++high) {
    for (const std::uint32_t low : {0x7fffu, 0x8000u, 0x8001u, 0xffffu}) check(high << 16 | low);
  }
  for (std::uint32_t h = 0; h < 0x7c00; ++h) {
    const double value = qkv::to_float(f16{static_cast<std::uint16_t>(h)});
    const double next = qkv::to_float(f16{static_cast<std::uint16_t>(h + 1)});
    for (const float f : {static_cast<float>(value), static_cast<float>((value + next) / 2)}) {
      const std::uint32_t bits = std::bit_cast<std::uint32_t>(f);
      for (std::uint32_t d = 0; d < 3; ++d) {
        check((bits + d) | 0x80000000u);
        check(bits + d);
        if (bits >= d) check(bits - d);
      }
    }
  }
}

TEST(DType, F16WidensEveryPatternExactly) {
  for (std::uint32_t bits = 0; bits < 0x10000; ++bits) {
    const int exponent = (bits >> 10) & 0x1f, mantissa = bits & 0x3ff;
    const float f = qkv::to_float(f16{static_cast<std::uint16_t>(bits)});
    if (exponent == 31) {
      EXPECT_EQ(std::isnan(f), mantissa != 0) << bits;
      if (mantissa == 0) {
        EXPECT_TRUE(std::isinf(f)) << bits;
      }
      continue;
    }
    const double magnitude =
        exponent == 0 ? std::ldexp(mantissa, -24) : std::ldexp(1024 + mantissa, exponent - 25);
    EXPECT_EQ(f, (bits & 0x8000) != 0 ? -magnitude : magnitude) << bits;
    EXPECT_EQ(std::signbit(f), (bits & 0x8000) != 0) << bits;
  }
}

TEST(TensorView, ContiguousStridesAndElementAccess) {
  float data[2 * 3 * 4] = {};
  qkv::TensorView t(data, {2, 3, 4});
  EXPECT_EQ(t.rank(), 3);
  EXPECT_EQ(t.stride(0), 12);
  EXPECT_EQ(t.stride(1), 4);
  EXPECT_EQ(t.stride(-1), 1);
  EXPECT_EQ(t.numel(), 24);
  EXPECT_TRUE(t.is_contiguous());
  t.set({1, 2, 3}, 7.5);
  EXPECT_EQ(data[23], 7.5f);
  EXPECT_EQ(t.get({1, 2, 3}), 7.5);
  EXPECT_THROW(t.get({2, 0, 0}), qkv::Error);
  EXPECT_THROW(t.get({0, 0}), qkv::Error);
}

TEST(TensorView, TransposeAndSliceShareMemory) {
  float data[2 * 3 * 4];
  for (int i = 0; i < 24; ++i) data[i] = static_cast<float>(i);
  const qkv::ConstTensorView t(data, {2, 3, 4});
  const qkv::ConstTensorView tt = t.transpose(1, 2);
  EXPECT_EQ(tt.size(1), 4);
  EXPECT_EQ(tt.size(2), 3);
  EXPECT_FALSE(tt.is_contiguous());
  EXPECT_EQ(tt.get({1, 3, 2}), t.get({1, 2, 3}));
  const qkv::ConstTensorView s = t.slice(1, 1, 2);
  EXPECT_EQ(s.size(1), 2);
  EXPECT_EQ(s.get({0, 0, 0}), 4.0);
  EXPECT_THROW(t.slice(1, 2, 2), qkv::Error);
  EXPECT_THROW(t.transpose(0, 3), qkv::Error);
}

TEST(TensorView, RejectsBadShapes) {
  float x = 0;
  EXPECT_THROW(qkv::TensorView(&x, {1, 1, 1, 1, 1}), qkv::Error);
  EXPECT_THROW(qkv::TensorView(&x, {1, -1}), qkv::Error);
  EXPECT_THROW(qkv::TensorView(&x, {1, 1}, {1, -1}), qkv::Error);
  EXPECT_THROW(qkv::TensorView(&x, {1, 1}, {1}), qkv::Error);
  EXPECT_FALSE(qkv::TensorView().defined());
}

TEST(Tensor, ZeroInitializedAlignedAndDeepCopied) {
  qkv::Tensor a(qkv::DType::f32, {3, 5});
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(a.data<float>()) % 64, 0u);
  for (int i = 0; i < 15; ++i) EXPECT_EQ(a.data<float>()[i], 0.0f);
  a.set({1, 2}, 4.0);
  qkv::Tensor b = a;
  b.set({1, 2}, 9.0);
  EXPECT_EQ(a.get({1, 2}), 4.0);
  EXPECT_EQ(b.get({1, 2}), 9.0);
  EXPECT_THROW(a.data<double>(), qkv::Error);
}

TEST(Tensor, MovedFromIsUndefined) {
  qkv::Tensor a(qkv::DType::f32, {2, 3});
  a.set({1, 1}, 5.0);
  const float* data = a.data<float>();
  qkv::Tensor b = std::move(a);
  EXPECT_FALSE(a.defined());  // NOLINT(bugprone-use-after-move): the state is specified
  EXPECT_EQ(b.data<float>(), data);
  qkv::Tensor c(qkv::DType::f64, {1});
  c = std::move(b);
  EXPECT_FALSE(b.defined());  // NOLINT(bugprone-use-after-move)
  EXPECT_EQ(c.get({1, 1}), 5.0);
}

TEST(Tensor, CopyConvertsAndRounds) {
  double src[3] = {1.0 + std::ldexp(1.0, -11), 0.1, -65520.0};
  const qkv::Tensor h = qkv::to_dtype(qkv::ConstTensorView(src, {3}), qkv::DType::f16);
  EXPECT_EQ(h.data<f16>()[0].bits, 0x3c00);
  EXPECT_EQ(h.data<f16>()[1].bits, qkv::to_f16(0.1).bits);
  EXPECT_EQ(h.data<f16>()[2].bits, 0xfc00);
  float strided[6] = {};
  qkv::copy(h, qkv::TensorView(strided, {3}, {2}));
  EXPECT_EQ(strided[0], 1.0f);
  EXPECT_EQ(strided[1], 0.0f);
  EXPECT_EQ(strided[2], qkv::to_float(qkv::to_f16(0.1)));
  // Copying into a broadcast (stride 0) destination would lose elements.
  EXPECT_THROW(qkv::copy(h, qkv::TensorView(strided, {3}, {0})), qkv::Error);
}

}  // namespace
