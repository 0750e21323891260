// The bf16 tile product on each engine (bf16_product.hpp): the portable
// emulations, the reference that the instructions are tested against, and
// the instructions themselves in functions of their own target attribute
// (Highway 1.0.3 has neither), compiled on every x86-64 build and called
// only where core/isa.hpp allows the family.
#include "cpu/engines/bf16_product.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/isa.hpp"
#include "cpu/engines/amx_tiles.hpp"
#include "cpu/engines/engine_table.hpp"
#include "cpu/engines/strips.hpp"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define QKV_ENGINES_X86 1
#include <immintrin.h>
#else
#define QKV_ENGINES_X86 0
#endif

namespace qkv::cpu::engines {
namespace {

// A bf16 value as f32, subnormals read as zero (DAZ).
float widen_daz(std::uint16_t bits) {
  if ((bits & 0x7F80U) == 0) bits &= 0x8000U;
  const std::uint32_t wide = static_cast<std::uint32_t>(bits) << 16;
  float x;
  std::memcpy(&x, &wide, sizeof x);
  return x;
}

// acc + a b with one rounding (the product is exact), subnormal results
// flushed to a zero of their sign (FTZ).
float fma_ftz(float a, float b, float acc) {
  const float r = std::fma(a, b, acc);
  return std::fpclassify(r) == FP_SUBNORMAL ? std::copysign(0.0f, r) : r;
}

// The product through one pair step (dpbf16_pair or tdpbf16_pair), element
// by element in order of x: what each instruction computes, whatever its
// blocking.
template <float (*kPair)(float, std::uint16_t, std::uint16_t, std::uint16_t, std::uint16_t)>
void emulate(const Bf16Product& p) {
  for (std::int64_t i = 0; i < p.m; ++i) {
    const std::uint16_t* a = p.a + i * p.lda;
    for (std::int64_t j = 0; j < p.n; ++j) {
      float acc = p.accumulate ? p.c[i * p.ldc + j] : 0.0f;
      for (std::int64_t x = 0; x < p.k; x += 2) {
        const std::uint16_t* b = p.b + (x / 2) * 2 * p.ldb + 2 * j;
        acc = kPair(acc, a[x], a[x + 1], b[0], b[1]);
      }
      p.c[i * p.ldc + j] = acc;
    }
  }
}

#if QKV_ENGINES_X86
#define QKV_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// C rows [i0, i0 + R) and vectors [j0, j0 + 16 kVecs) of the product:
// kVecs x R accumulators, A's pair broadcast against kVecs vectors of B.
template <int R, int kVecs>
QKV_AVX512_BF16 void avx512_micro(const Bf16Product& p, std::int64_t i0, std::int64_t j0) {
  __m512 acc[R][kVecs];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < kVecs; ++v) {
      acc[r][v] = p.accumulate ? _mm512_loadu_ps(p.c + (i0 + r) * p.ldc + j0 + 16 * v)
                               : _mm512_setzero_ps();
    }
  }
  for (std::int64_t x = 0; x < p.k; x += 2) {
    const std::uint16_t* b = p.b + (x / 2) * 2 * p.ldb + 2 * j0;
    __m512i bv[kVecs];
    for (int v = 0; v < kVecs; ++v) bv[v] = _mm512_loadu_si512(b + 32 * v);
    for (int r = 0; r < R; ++r) {
      std::uint32_t pair;
      std::memcpy(&pair, p.a + (i0 + r) * p.lda + x, sizeof pair);
      const __m512i av = _mm512_set1_epi32(static_cast<int>(pair));
      for (int v = 0; v < kVecs; ++v) {
        acc[r][v] = _mm512_dpbf16_ps(acc[r][v], (__m512bh)bv[v], (__m512bh)av);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < kVecs; ++v) {
      _mm512_storeu_ps(p.c + (i0 + r) * p.ldc + j0 + 16 * v, acc[r][v]);
    }
  }
}

void product_avx512_bf16(const Bf16Product& p) {
  for_each_strip(p.m, p.n, [&]<int R, int kVecs>(std::int64_t i0, std::int64_t j0) {
    avx512_micro<R, kVecs>(p, i0, j0);
  });
}

void product_amx_bf16(const Bf16Product& p) {
  amx_product(AmxOp::bf16, {reinterpret_cast<const std::uint8_t*>(p.a), p.lda * 2,
                            reinterpret_cast<const std::uint8_t*>(p.b), p.ldb * 4, p.c, p.ldc, p.m,
                            p.n, p.k * 2, p.accumulate});
}

#undef QKV_AVX512_BF16
#endif

}  // namespace

float dpbf16_pair(float acc, std::uint16_t a0, std::uint16_t a1, std::uint16_t b0,
                  std::uint16_t b1) {
  acc = fma_ftz(widen_daz(a1), widen_daz(b1), acc);
  return fma_ftz(widen_daz(a0), widen_daz(b0), acc);
}

float tdpbf16_pair(float acc, std::uint16_t a0, std::uint16_t a1, std::uint16_t b0,
                   std::uint16_t b1) {
  acc = fma_ftz(widen_daz(a0), widen_daz(b0), acc);
  return fma_ftz(widen_daz(a1), widen_daz(b1), acc);
}

namespace {

#if !QKV_ENGINES_X86
// Never available (engine_available), so never run.
void product_avx512_bf16(const Bf16Product&) {}
void product_amx_bf16(const Bf16Product&) {}
#endif

// The engines in Bf16Engine's order.
constexpr EngineRow<Bf16Product> kEngines[] = {
    {"avx512_bf16", detail::Family::avx512_bf16, product_avx512_bf16},
    {"amx_bf16", detail::Family::amx_bf16, product_amx_bf16},
    {"emulated avx512_bf16", std::nullopt, emulate<dpbf16_pair>},
    {"emulated amx_bf16", std::nullopt, emulate<tdpbf16_pair>},
};
static_assert(std::size(kEngines) == static_cast<std::size_t>(Bf16Engine::emulate_amx_bf16) + 1);

}  // namespace

const char* engine_name(Bf16Engine e) { return row_of(kEngines, e).name; }
bool engine_available(Bf16Engine e) { return runs_now(row_of(kEngines, e), QKV_ENGINES_X86); }
void bf16_product(Bf16Engine e, const Bf16Product& p) { row_of(kEngines, e).run(p); }

}  // namespace qkv::cpu::engines
