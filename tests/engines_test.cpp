// The bf16 tile product (cpu/engines/bf16_product.hpp): each instruction's
// pair step against its documented arithmetic (order, DAZ, FTZ); the
// emulated products against products in double within the bound of any
// summation order; and, where this CPU runs them, the instructions against
// their emulations over sizes around the vector and tile widths (rows
// around 8 and 16, columns 16 to 64, depths around 32, odd strides).
// QKV_ISA and the CPU's own families (core/isa.hpp) are checked too.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "core/isa.hpp"
#include "cpu/engines/bf16_product.hpp"
#include "cpu/engines/int8_product.hpp"
#include "qkv/dtype.hpp"
#include "qkv/error.hpp"

namespace {

using qkv::cpu::engines::bf16_product;
using qkv::cpu::engines::Bf16Engine;
using qkv::cpu::engines::Bf16Product;
using qkv::cpu::engines::dpbf16_pair;
using qkv::cpu::engines::engine_available;
using qkv::cpu::engines::tdpbf16_pair;

std::uint16_t bits(float x) { return qkv::to_bf16(x).bits; }
float value(std::uint16_t b) {
  const std::uint32_t wide = static_cast<std::uint32_t>(b) << 16;
  float x;
  std::memcpy(&x, &wide, sizeof x);
  return x;
}

TEST(Engines, PairStepsTakeTheirInstructionsOrder) {
  // 1 + 2^-24 rounds to 1 (a tie, to even): adding the odd product 2^-24
  // before the even product -1 loses it; the other order keeps it.
  const std::uint16_t half_ulp = bits(std::ldexp(1.0f, -12));
  const std::uint16_t one = bits(1.0f), minus_one = bits(-1.0f);
  EXPECT_EQ(dpbf16_pair(1.0f, minus_one, half_ulp, one, half_ulp), 0.0f);
  EXPECT_EQ(tdpbf16_pair(1.0f, minus_one, half_ulp, one, half_ulp), std::ldexp(1.0f, -24));
}

TEST(Engines, PairStepsReadSubnormalsAsZeroAndFlushThem) {
  const std::uint16_t tiny = 0x0001;  // the smallest subnormal bf16
  const std::uint16_t big = bits(std::ldexp(1.0f, 100));
  for (auto pair : {dpbf16_pair, tdpbf16_pair}) {
    EXPECT_EQ(pair(0.0f, tiny, 0, big, 0), 0.0f) << "DAZ";
    // 2^-65 squared is 2^-130, subnormal in f32: flushed to zero.
    const std::uint16_t small = bits(std::ldexp(1.0f, -65));
    EXPECT_EQ(pair(0.0f, small, 0, small, 0), 0.0f) << "FTZ";
    // NaN and infinities go through as in any f32 arithmetic.
    EXPECT_TRUE(std::isnan(pair(0.0f, bits(INFINITY), 0, 0, 0)));
    EXPECT_EQ(pair(1.0f, bits(INFINITY), 0, bits(1.0f), 0), INFINITY);
  }
}

// Operands of an m x n x k product with row strides past the data, and C
// holding values to accumulate onto.
struct Operands {
  std::int64_t m, n, k, lda, ldb, ldc;
  std::vector<std::uint16_t> a, b;
  std::vector<float> c;

  Operands(std::int64_t m_, std::int64_t n_, std::int64_t k_, std::uint32_t seed)
      : m(m_), n(n_), k(k_), lda(k_ + 6), ldb(n_ + 16), ldc(n_ + 3) {
    std::mt19937 gen(seed);
    std::normal_distribution<float> normal;
    a.resize(static_cast<std::size_t>(m * lda + 32));
    b.resize(static_cast<std::size_t>((k / 2 + 1) * 2 * ldb + 64));
    c.resize(static_cast<std::size_t>(m * ldc + 16));
    for (auto& x : a) x = bits(normal(gen));
    for (auto& x : b) x = bits(normal(gen));
    for (auto& x : c) x = normal(gen);
  }
  float a_at(std::int64_t i, std::int64_t x) const { return value(a[i * lda + x]); }
  float b_at(std::int64_t x, std::int64_t j) const {
    return value(b[(x / 2) * 2 * ldb + 2 * j + x % 2]);
  }
  Bf16Product product(std::vector<float>& out, bool accumulate) const {
    out = c;
    return {a.data(), lda, b.data(), ldb, out.data(), ldc, m, n, k, accumulate};
  }
};

constexpr std::int64_t kSizes[][3] = {{1, 16, 2},    {7, 32, 30},  {8, 48, 32},
                                      {9, 64, 34},   {15, 16, 64}, {16, 32, 64},
                                      {17, 48, 100}, {33, 64, 96}, {40, 32, 128}};

TEST(Engines, EmulationsAreProductsWithinTheBoundOfAnyOrder) {
  std::uint32_t seed = 1;
  for (const Bf16Engine e : {Bf16Engine::emulate_avx512_bf16, Bf16Engine::emulate_amx_bf16}) {
    for (const auto& s : kSizes) {
      for (const bool accumulate : {false, true}) {
        SCOPED_TRACE(testing::Message() << qkv::cpu::engines::engine_name(e) << " m" << s[0] << " n"
                                        << s[1] << " k" << s[2] << " acc" << accumulate);
        const Operands o(s[0], s[1], s[2], seed++);
        std::vector<float> got;
        bf16_product(e, o.product(got, accumulate));
        // Products are exact; k + 1 f32 additions: |error| <= (k + 1) u sum|terms|.
        const double u = std::ldexp(1.0, -24);
        for (std::int64_t i = 0; i < o.m; ++i) {
          for (std::int64_t j = 0; j < o.n; ++j) {
            double exact = accumulate ? o.c[i * o.ldc + j] : 0.0;
            double magnitude = std::abs(exact);
            for (std::int64_t x = 0; x < o.k; ++x) {
              const double t = double{o.a_at(i, x)} * o.b_at(x, j);
              exact += t;
              magnitude += std::abs(t);
            }
            ASSERT_LE(std::abs(got[i * o.ldc + j] - exact), (o.k + 1) * u * magnitude)
                << "C[" << i << "][" << j << "]";
          }
          // Past each row's n columns, C is untouched.
          for (std::int64_t j = o.n; j < o.ldc && i * o.ldc + j < o.m * o.ldc; ++j) {
            ASSERT_EQ(got[i * o.ldc + j], o.c[i * o.ldc + j]);
          }
        }
      }
    }
  }
}

// The instructions equal their emulations bit for bit (VDPBF16PS, whose
// order the SDM specifies), or stay within the bound of any order of the
// pairs' products (AMX, where only the pseudo-code gives one).
TEST(Engines, InstructionsMatchTheirEmulations) {
  int ran = 0;
  const std::pair<Bf16Engine, Bf16Engine> engines[] = {
      {Bf16Engine::avx512_bf16, Bf16Engine::emulate_avx512_bf16},
      {Bf16Engine::amx_bf16, Bf16Engine::emulate_amx_bf16}};
  for (const auto& [hardware, emulation] : engines) {
    if (!engine_available(hardware)) continue;
    ++ran;
    std::uint32_t seed = 100;
    for (const auto& s : kSizes) {
      for (const bool accumulate : {false, true}) {
        SCOPED_TRACE(testing::Message() << qkv::cpu::engines::engine_name(hardware) << " m" << s[0]
                                        << " n" << s[1] << " k" << s[2]);
        const Operands o(s[0], s[1], s[2], seed++);
        std::vector<float> got, want;
        bf16_product(hardware, o.product(got, accumulate));
        bf16_product(emulation, o.product(want, accumulate));
        if (hardware == Bf16Engine::avx512_bf16) {
          ASSERT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0);
          continue;
        }
        const double u = std::ldexp(1.0, -24);
        for (std::size_t x = 0; x < got.size(); ++x) {
          ASSERT_LE(std::abs(double{got[x]} - want[x]),
                    2 * (o.k + 1) * u * (std::abs(double{want[x]}) + o.k * 16.0))
              << x;
        }
      }
    }
  }
  if (ran == 0) {
    GTEST_SKIP() << "no bf16 engine on this CPU (or QKV_ISA caps them): emulations tested above";
  }
}

// The int8 product is exact: the emulation equals products in int64, and
// each instruction the emulation, for sizes around the tile widths (depths
// around 64, the AMX tile's), extreme values (-128 and 127) included.
TEST(Engines, Int8ProductsAreExact) {
  using qkv::cpu::engines::Int8Engine;
  const std::int64_t sizes[][3] = {{1, 16, 4},    {7, 32, 60},   {8, 48, 64},  {9, 64, 68},
                                   {16, 32, 128}, {17, 16, 132}, {33, 64, 256}};
  std::mt19937 gen(5);
  std::uniform_int_distribution<int> byte(-128, 127);
  for (const auto& s : sizes) {
    const std::int64_t m = s[0], n = s[1], k = s[2], lda = k + 8, ldb = n + 16, ldc = n + 5;
    std::vector<std::int8_t> a(static_cast<std::size_t>(m * lda)),
        b(static_cast<std::size_t>(k * ldb));
    std::vector<std::int32_t> c0(static_cast<std::size_t>(m * ldc));
    for (auto& x : a) x = static_cast<std::int8_t>(byte(gen));
    for (auto& x : b) x = static_cast<std::int8_t>(byte(gen));
    for (auto& x : c0) x = byte(gen) * 1000;
    a[0] = -128;
    b[0] = -128;
    for (const bool accumulate : {false, true}) {
      SCOPED_TRACE(testing::Message()
                   << "m" << m << " n" << n << " k" << k << " acc" << accumulate);
      auto run = [&](Int8Engine e) {
        std::vector<std::int32_t> c = c0;
        qkv::cpu::engines::int8_product(
            e, {a.data(), lda, b.data(), ldb, c.data(), ldc, m, n, k, accumulate});
        return c;
      };
      const std::vector<std::int32_t> emulated = run(Int8Engine::emulate);
      for (std::int64_t i = 0; i < m; ++i) {
        for (std::int64_t j = 0; j < ldc; ++j) {
          std::int64_t want = accumulate || j >= n ? c0[i * ldc + j] : 0;
          for (std::int64_t x = 0; j < n && x < k; ++x) {
            want += std::int64_t{a[i * lda + x]} * b[(x / 4) * 4 * ldb + 4 * j + x % 4];
          }
          ASSERT_EQ(emulated[i * ldc + j], want) << i << "," << j;
        }
      }
      for (const Int8Engine e : {Int8Engine::avx512_vnni, Int8Engine::amx_int8}) {
        if (qkv::cpu::engines::engine_available(e)) {
          EXPECT_EQ(run(e), emulated);
        }
      }
    }
  }
}

TEST(Engines, FamiliesAreUsableOnlyWhenListed) {
  for (const auto f : qkv::detail::kFamilies) {
    const auto& s = qkv::detail::family_support(f);
    SCOPED_TRACE(qkv::detail::family_name(f));
    if (!s.listed) {
      EXPECT_FALSE(s.usable);
    }
    EXPECT_EQ(s.usable, s.listed && s.reason.empty());
    if (!s.usable) {
      EXPECT_FALSE(qkv::detail::family_allowed(f));
    }
  }
  // A test cap below every family turns them all off; lifting it restores.
  qkv::detail::set_isa_limit_for_test(qkv::detail::Isa::f32);
  for (const auto f : qkv::detail::kFamilies) EXPECT_FALSE(qkv::detail::family_allowed(f));
  EXPECT_FALSE(engine_available(Bf16Engine::avx512_bf16));
  EXPECT_FALSE(engine_available(Bf16Engine::amx_bf16));
  EXPECT_TRUE(engine_available(Bf16Engine::emulate_amx_bf16));
  qkv::detail::set_isa_limit_for_test(std::nullopt);
}

TEST(Engines, UnknownIsaNamesAreRejected) {
  ASSERT_EQ(setenv("QKV_ISA", "avx1024", 1), 0);
  EXPECT_THROW(qkv::detail::isa_limit(), qkv::Error);
  ASSERT_EQ(setenv("QKV_ISA", "f32", 1), 0);
  EXPECT_EQ(qkv::detail::isa_limit(), qkv::detail::Isa::f32);
  EXPECT_FALSE(qkv::detail::has_bf16_dot());
  ASSERT_EQ(unsetenv("QKV_ISA"), 0);
}

}  // namespace
