// The decode kernel's tiles on AVX512-BF16 (cpu/decode-inl.h), for caches
// stored in bf16 under MatmulPrecision::medium: VDPBF16PS multiplies 32
// pairs of bf16 values and adds each pair's two products to one of 16 f32
// sums, twice the products of an f32 FMA per instruction, and the stored
// rows need no widening.
//   Scores: the query rows are rounded to bf16 once per call; a key row is
//   read as it is stored.
//   Values: the weights p of a block are rounded to bf16 (the sum l keeps
//   them in f32, as FlashAttention does) and packed in pairs of tokens,
//   (p_c, p_c+1) in one 32-bit lane; two tokens' value rows are interleaved
//   by 16-bit unpacks, so that each lane of the accumulators gets
//   p_c v_c[j] + p_c+1 v_c+1[j]. The unpacks work within 128-bit blocks:
//   the accumulators hold the columns of each chunk of 32 permuted (lane i
//   of the first vector: column 8 (i / 4) + i % 4; of the second: 4 more),
//   and UnpermuteChunks puts a finished row back in order.
// Highway 1.0.3 has neither a bf16 dot product nor a target with
// AVX512-BF16: these are intrinsics in functions that add the extension to
// the AVX3 target, and run only where core/isa.hpp says the CPU has it.
// Elsewhere kBf16Dot is false and none of this is compiled.
#if defined(QKV_CPU_BF16_DOT_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_CPU_BF16_DOT_INL_H_
#undef QKV_CPU_BF16_DOT_INL_H_
#else
#define QKV_CPU_BF16_DOT_INL_H_
#endif

#include <cstdint>
#include <cstring>

#include "core/hwy_namespace.hpp"
#include "cpu/row_sums-inl.h"
#include "cpu/vec_math-inl.h"
#include "hwy/highway.h"

#if HWY_ARCH_X86 && (HWY_COMPILER_GCC_ACTUAL || HWY_COMPILER_CLANG)
#include <immintrin.h>
#endif

QKV_HWY_NAMESPACE_BEGIN(cpu);

// Values per chunk: one vector of bf16, the columns of two f32 accumulators.
constexpr std::int64_t kBf16Chunk = 32;

// Puts each chunk of 32 columns of a row of n (a multiple of 32) back in
// order after the value tiles' interleaving (see the header).
inline void UnpermuteChunks(float* HWY_RESTRICT row, std::int64_t n) {
  float chunk[kBf16Chunk];
  for (std::int64_t x = 0; x < n; x += kBf16Chunk) {
    std::memcpy(chunk, row + x, sizeof chunk);
    for (std::int64_t i = 0; i < kBf16Chunk / 2; ++i) {
      row[x + 8 * (i / 4) + i % 4] = chunk[i];
      row[x + 8 * (i / 4) + 4 + i % 4] = chunk[kBf16Chunk / 2 + i];
    }
  }
}

// The weights of a block's `cols` tokens (s[c * stride + r], rows_pad rows
// a multiple of the lanes) rounded to bf16 and packed by pairs of tokens:
// p2[(c / 2) * stride + r] = p_c | p_c+1 << 16 (0 past cols).
inline void PackWeightPairs(const float* HWY_RESTRICT s, std::int64_t stride, std::int64_t cols,
                            std::int64_t rows_pad, std::uint32_t* HWY_RESTRICT p2) {
  const hn::ScalableTag<float> d;
  const hn::RebindToUnsigned<decltype(d)> du;
  const auto lanes = static_cast<std::int64_t>(hn::Lanes(d));
  for (std::int64_t c = 0; c < cols; c += 2) {
    for (std::int64_t r = 0; r < rows_pad; r += lanes) {
      const auto lo = Bf16Bits(d, hn::LoadU(d, s + c * stride + r));
      const auto hi =
          c + 1 < cols ? Bf16Bits(d, hn::LoadU(d, s + (c + 1) * stride + r)) : hn::Zero(du);
      hn::StoreU(hn::Or(lo, hn::ShiftLeft<16>(hi)), du, p2 + c / 2 * stride + r);
    }
  }
}

#if (HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL) && \
    (HWY_COMPILER_GCC_ACTUAL || HWY_COMPILER_CLANG)
constexpr bool kBf16Dot = true;
#define QKV_BF16_DOT_TARGET __attribute__((target(HWY_TARGET_STR ",avx512bf16")))

// Scores of kRows query rows (q, bf16, q_stride apart) against kTokens bf16
// key rows of dk values (a multiple of 32): out[t * out_stride + u].
template <int kRows, int kTokens>
QKV_BF16_DOT_TARGET HWY_NOINLINE void ScoreTileBf16(const std::uint16_t* HWY_RESTRICT q,
                                                    std::int64_t q_stride,
                                                    const std::uint16_t* const* keys,
                                                    std::int64_t dk, float* HWY_RESTRICT out,
                                                    std::int64_t out_stride) {
  const hn::ScalableTag<float> d;
  __m512 acc[kTokens][kRows];
  for (int t = 0; t < kTokens; ++t) {
    for (int u = 0; u < kRows; ++u) acc[t][u] = _mm512_setzero_ps();
  }
  for (std::int64_t x = 0; x < dk; x += kBf16Chunk) {
    __m512i qv[kRows];
    for (int u = 0; u < kRows; ++u) {
      qv[u] = _mm512_loadu_si512(q + u * q_stride + x);
      asm("" : "+v"(qv[u]));  // in a register, not a load folded into each product
    }
    for (int t = 0; t < kTokens; ++t) {
      const __m512i kv = _mm512_loadu_si512(keys[t] + x);
      for (int u = 0; u < kRows; ++u) {
        acc[t][u] = _mm512_dpbf16_ps(acc[t][u], (__m512bh)kv, (__m512bh)qv[u]);
      }
    }
  }
  hn::Vec<decltype(d)> sums[kTokens][kRows];
  for (int t = 0; t < kTokens; ++t) {
    for (int u = 0; u < kRows; ++u) sums[t][u].raw = acc[t][u];
  }
  HWY_ALIGN const float none[kTokens][4] = {};
  StoreScoreSums<kRows, kTokens>(d, sums, none, out, out_stride);
}

// acc[u] += p_c[u] v_c + p_c+1[u] v_c+1 for the pair of value rows v0, v1
// (nullptr: a row of zeros) at `offset`, row u's packed weights at p[u].
template <int kRows, int kChunks>
QKV_BF16_DOT_TARGET HWY_INLINE void ValuePairBf16(__m512 (&acc)[kRows][2 * kChunks],
                                                  const std::uint32_t* HWY_RESTRICT p,
                                                  const std::uint16_t* v0, const std::uint16_t* v1,
                                                  std::int64_t offset) {
  __m512i lo[kChunks], hi[kChunks];
  for (int ch = 0; ch < kChunks; ++ch) {
    const __m512i a = _mm512_loadu_si512(v0 + offset + ch * kBf16Chunk);
    const __m512i b =
        v1 != nullptr ? _mm512_loadu_si512(v1 + offset + ch * kBf16Chunk) : _mm512_setzero_si512();
    lo[ch] = _mm512_unpacklo_epi16(a, b);
    hi[ch] = _mm512_unpackhi_epi16(a, b);
  }
  for (int u = 0; u < kRows; ++u) {
    const __m512i pu = _mm512_set1_epi32(static_cast<int>(p[u]));
    for (int ch = 0; ch < kChunks; ++ch) {
      acc[u][2 * ch] = _mm512_dpbf16_ps(acc[u][2 * ch], (__m512bh)lo[ch], (__m512bh)pu);
      acc[u][2 * ch + 1] = _mm512_dpbf16_ps(acc[u][2 * ch + 1], (__m512bh)hi[ch], (__m512bh)pu);
    }
  }
}

// O[u] += sum_c p_c[u] v_c for kRows rows and kChunks chunks of 32 columns
// from `offset` of cols bf16 value rows; p2 packed by PackWeightPairs
// (row u of pair i at p2[i * p_stride + u]); O's chunks permuted (see the
// header), rows o_stride apart.
template <int kRows, int kChunks>
QKV_BF16_DOT_TARGET HWY_NOINLINE void ValueTileBf16(const std::uint32_t* HWY_RESTRICT p2,
                                                    std::int64_t p_stride,
                                                    const std::uint16_t* const* values,
                                                    std::int64_t offset, std::int64_t cols,
                                                    float* HWY_RESTRICT o, std::int64_t o_stride) {
  __m512 acc[kRows][2 * kChunks];
  for (int u = 0; u < kRows; ++u) {
    for (int k = 0; k < 2 * kChunks; ++k) acc[u][k] = _mm512_loadu_ps(o + u * o_stride + 16 * k);
  }
  std::int64_t c = 0;
  for (; c + 1 < cols; c += 2) {
    ValuePairBf16<kRows, kChunks>(acc, p2 + c / 2 * p_stride, values[c], values[c + 1], offset);
  }
  if (c < cols)
    ValuePairBf16<kRows, kChunks>(acc, p2 + c / 2 * p_stride, values[c], nullptr, offset);
  for (int u = 0; u < kRows; ++u) {
    for (int k = 0; k < 2 * kChunks; ++k) _mm512_storeu_ps(o + u * o_stride + 16 * k, acc[u][k]);
  }
}

#undef QKV_BF16_DOT_TARGET
#else
constexpr bool kBf16Dot = false;
// Declared for the kernel's branches under `if constexpr (kBf16Dot)`, which
// this target discards: never called, never defined.
template <int kRows, int kTokens>
void ScoreTileBf16(const std::uint16_t*, std::int64_t, const std::uint16_t* const*, std::int64_t,
                   float*, std::int64_t);
template <int kRows, int kChunks>
void ValueTileBf16(const std::uint32_t*, std::int64_t, const std::uint16_t* const*, std::int64_t,
                   std::int64_t, float*, std::int64_t);
#endif

QKV_HWY_NAMESPACE_END(cpu);

#endif  // QKV_CPU_BF16_DOT_INL_H_
