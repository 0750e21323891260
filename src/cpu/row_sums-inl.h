// Sums of a tile's accumulators: the kRows x kTokens dot products of a
// score tile, each held as a vector of partial sums, reduced together and
// stored (the decode kernel's f32 tiles, cpu/decode-inl.h, and its bf16
// tiles, cpu/bf16_dot-inl.h). Per Highway target, hence the toggle.
#if defined(QKV_CPU_ROW_SUMS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_CPU_ROW_SUMS_INL_H_
#undef QKV_CPU_ROW_SUMS_INL_H_
#else
#define QKV_CPU_ROW_SUMS_INL_H_
#endif

#include <cstdint>

#include "core/hwy_namespace.hpp"
#include "hwy/highway.h"

QKV_HWY_NAMESPACE_BEGIN(cpu);

template <class D>
HWY_INLINE float Sum(D d, hn::Vec<D> v) {
  return hn::GetLane(hn::SumOfLanes(d, v));
}

// Multi-row reductions need whole 128-bit blocks of four f32 lanes.
#if HWY_TARGET != HWY_SCALAR

// v folded to its first 128-bit block: the sum of its blocks.
template <class D>
HWY_INLINE hn::Vec<hn::Full128<float>> FoldTo128(D d, hn::Vec<D> v) {
  if constexpr (hn::MaxLanes(d) > 4) {
    const hn::Half<D> dh;
    return FoldTo128(dh, hn::Add(hn::LowerHalf(dh, v), hn::UpperHalf(dh, v)));
  } else {
    return v;
  }
}

// Lane u of the result (per 128-bit block) is the sum of the four lanes of
// that block of b_u: a 4 x 4 transpose folded into three adds.
template <class D4>
HWY_INLINE hn::Vec<D4> Reduce4Blocks(D4 d4, hn::Vec<D4> b0, hn::Vec<D4> b1, hn::Vec<D4> b2,
                                     hn::Vec<D4> b3) {
  const hn::Repartition<std::uint64_t, D4> d64;
  const auto t0 = hn::Add(hn::InterleaveLower(d4, b0, b1), hn::InterleaveUpper(d4, b0, b1));
  const auto t1 = hn::Add(hn::InterleaveLower(d4, b2, b3), hn::InterleaveUpper(d4, b2, b3));
  const auto lo = hn::InterleaveLower(d64, hn::BitCast(d64, t0), hn::BitCast(d64, t1));
  const auto hi = hn::InterleaveUpper(d64, hn::BitCast(d64, t0), hn::BitCast(d64, t1));
  return hn::Add(hn::BitCast(d4, lo), hn::BitCast(d4, hi));
}
#endif

// Keeps v in a register. Where a vector is used by several FMAs, GCC may
// instead fold a load of it into each of them, which makes a loop with more
// loads than FMAs bound by the load ports.
template <class V>
HWY_INLINE void KeepInRegister(V& v) {
#if HWY_ARCH_X86 && HWY_TARGET != HWY_SCALAR && HWY_TARGET != HWY_EMU128 && \
    (HWY_COMPILER_GCC_ACTUAL || HWY_COMPILER_CLANG)
  asm("" : "+v"(v.raw));
#else
  (void)v;
#endif
}

// out[t * out_stride + u] = (the lanes of acc[t][u] summed) + scalar[t][u]
// for kRows rows and kTokens tokens; four rows at a time are reduced
// together in 128-bit blocks.
template <int kRows, int kTokens, class D>
HWY_INLINE void StoreScoreSums(D d, const hn::Vec<D> (&acc)[kTokens][kRows],
                               const float (&scalar)[kTokens][4], float* HWY_RESTRICT out,
                               std::int64_t out_stride) {
#if HWY_TARGET != HWY_SCALAR
  if constexpr (kRows == 4) {
    const hn::Full128<float> d4;
    if constexpr (kTokens == 2 && hn::MaxLanes(d) == 8) {
      // Both tokens at once: fold each row's two accumulators into the two
      // blocks of one vector, then reduce the four rows per block.
      hn::Vec<D> e[4];
      for (int u = 0; u < 4; ++u) {
        e[u] = hn::Add(hn::ConcatLowerLower(d, acc[1][u], acc[0][u]),
                       hn::ConcatUpperUpper(d, acc[1][u], acc[0][u]));
      }
      const auto sums = Reduce4Blocks(d, e[0], e[1], e[2], e[3]);
      const hn::Half<D> dh;
      hn::StoreU(hn::Add(hn::LowerHalf(dh, sums), hn::Load(d4, scalar[0])), d4, out);
      hn::StoreU(hn::Add(hn::UpperHalf(dh, sums), hn::Load(d4, scalar[1])), d4, out + out_stride);
    } else {
      for (int t = 0; t < kTokens; ++t) {
        const auto sums = Reduce4Blocks(d4, FoldTo128(d, acc[t][0]), FoldTo128(d, acc[t][1]),
                                        FoldTo128(d, acc[t][2]), FoldTo128(d, acc[t][3]));
        hn::StoreU(hn::Add(sums, hn::Load(d4, scalar[t])), d4, out + t * out_stride);
      }
    }
    return;
  }
#endif
  for (int t = 0; t < kTokens; ++t) {
    for (int u = 0; u < kRows; ++u) out[t * out_stride + u] = Sum(d, acc[t][u]) + scalar[t][u];
  }
}

QKV_HWY_NAMESPACE_END(cpu);

#endif  // QKV_CPU_ROW_SUMS_INL_H_
