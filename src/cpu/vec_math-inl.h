// SIMD building blocks of the CPU kernels: an exp for softmax that never
// returns subnormals, exact dtype conversions of rows (widening on load,
// round-to-nearest-even narrowing on store), and rows of strided views. Compiled once per Highway
// target by the including .cpp (foreach_target.h), hence the toggled include guard.
#if defined(QKV_CPU_VEC_MATH_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_CPU_VEC_MATH_INL_H_
#undef QKV_CPU_VEC_MATH_INL_H_
#else
#define QKV_CPU_VEC_MATH_INL_H_
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>

#include "core/hwy_namespace.hpp"
#include "hwy/aligned_allocator.h"
#include "hwy/highway.h"
#include "qkv/dtype.hpp"
#include "qkv/tensor.hpp"

QKV_HWY_NAMESPACE_BEGIN(cpu);

// e^x for x <= 88, within 2 ulp (1.24 at worst in tests/vec_math_test.cpp's
// sweep). Below ln(2^-126) the result is exactly 0, so products with it
// never touch subnormals (which are slow); -inf gives 0 and NaN gives NaN.
// Cody-Waite range reduction x = n ln2 + r, |r| <= ln2/2, and a degree-6
// polynomial for e^r fitted for minimax relative error on that interval (3%
// of an ulp), in six FMAs: Cephes' degree-7 polynomial took two operations
// more and measured 1.23 ulp in the same sweep.
template <class D, class V = hn::Vec<D>>
HWY_INLINE V FastExp(D d, V x) {
  const hn::RebindToSigned<D> di;
  const V n = hn::Round(hn::Mul(x, hn::Set(d, 1.44269504088896341f)));
  V r = hn::MulAdd(n, hn::Set(d, -0.693359375f), x);
  r = hn::MulAdd(n, hn::Set(d, 2.12194440e-4f), r);
  V p = hn::Set(d, 1.3836845756e-3f);
  p = hn::MulAdd(p, r, hn::Set(d, 8.3748158067e-3f));
  p = hn::MulAdd(p, r, hn::Set(d, 4.1668225080e-2f));
  p = hn::MulAdd(p, r, hn::Set(d, 1.6666419804e-1f));
  p = hn::MulAdd(p, r, hn::Set(d, 4.9999991059e-1f));
  p = hn::MulAdd(p, r, hn::Set(d, 1.0f));
  p = hn::MulAdd(p, r, hn::Set(d, 1.0f));
  // 2^n built in the exponent field; n >= -126 wherever the result is kept.
  const auto n_int = hn::ConvertTo(di, hn::Max(n, hn::Set(d, -126.0f)));
  const V scale = hn::BitCast(d, hn::ShiftLeft<23>(hn::Add(n_int, hn::Set(di, 127))));
  const V result = hn::Mul(p, scale);
  return hn::IfThenZeroElse(hn::Lt(x, hn::Set(d, -87.33654475f)), result);
}

// One key block of the online softmax on key-major scores
// s[c * stride + r] (keys c < cols, query rows r < rows_used, a multiple of
// the vector width, s and stride aligned), a vector of rows at a time:
// updates each row's running max m and sum l, replaces the scores by their
// weights exp(s - m_new) and stores alpha = exp(m_old - m_new), the factor
// for the output accumulated so far. Masked scores are -inf and give
// exactly 0; a row with nothing admitted yet keeps m = -inf (its weights are
// exp(-inf - 0) = 0); a NaN score gives NaN through the exp and the sum.
// keys(r) returns the keys {begin, end} that the vector of rows from r may
// see; the caller guarantees that their scores outside it are masked (-inf),
// so their weights are stored as 0 without computing them: the same result
// as the full pass, with the exps of a window's edge blocks skipped.
template <class KeysOf>
inline void OnlineSoftmaxBlock(float* HWY_RESTRICT s, std::int64_t stride, std::int64_t cols,
                               std::int64_t rows_used, float* HWY_RESTRICT m, float* HWY_RESTRICT l,
                               float* HWY_RESTRICT alpha, KeysOf keys) {
  const hn::ScalableTag<float> d;
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(d));
  const auto neg_inf = hn::Set(d, -std::numeric_limits<float>::infinity());
  for (std::int64_t r = 0; r < rows_used; r += lanes) {
    const auto [begin, end] = keys(r);
    auto block_max = neg_inf;
    for (std::int64_t c = begin; c < end; ++c) {
      block_max = hn::Max(block_max, hn::Load(d, s + c * stride + r));
    }
    const auto m_old = hn::Load(d, m + r);
    const auto m_new = hn::Max(m_old, block_max);
    const auto shift = hn::IfThenZeroElse(hn::Eq(m_new, neg_inf), m_new);
    auto sum = hn::Zero(d);
    for (std::int64_t c = 0; c < cols; ++c) {
      float* x = s + c * stride + r;
      if (c < begin || c >= end) {
        hn::Store(hn::Zero(d), d, x);
        continue;
      }
      const auto p = FastExp(d, hn::Sub(hn::Load(d, x), shift));
      hn::Store(p, d, x);
      sum = hn::Add(sum, p);
    }
    const auto a = FastExp(d, hn::Sub(m_old, shift));
    hn::Store(hn::MulAdd(a, hn::Load(d, l + r), sum), d, l + r);
    hn::Store(m_new, d, m + r);
    hn::Store(a, d, alpha + r);
  }
}

// The same over every key of the block.
inline void OnlineSoftmaxBlock(float* HWY_RESTRICT s, std::int64_t stride, std::int64_t cols,
                               std::int64_t rows_used, float* HWY_RESTRICT m, float* HWY_RESTRICT l,
                               float* HWY_RESTRICT alpha) {
  OnlineSoftmaxBlock(s, stride, cols, rows_used, m, l, alpha, [cols](std::int64_t) {
    return std::pair<std::int64_t, std::int64_t>{0, cols};
  });
}

// Rows [0, rows) of o (width floats each, ld apart, width a multiple of the
// vector width) times their alpha, skipping rows whose running max did not
// move (alpha = 1).
inline void RescaleRows(float* HWY_RESTRICT o, std::int64_t rows, std::int64_t ld,
                        std::int64_t width, const float* HWY_RESTRICT alpha) {
  const hn::ScalableTag<float> d;
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(d));
  for (std::int64_t r = 0; r < rows; ++r) {
    if (alpha[r] == 1.0f) continue;
    float* row = o + r * ld;
    const auto a = hn::Set(d, alpha[r]);
    for (std::int64_t c = 0; c < width; c += lanes) {
      hn::StoreU(hn::Mul(hn::LoadU(d, row + c), a), d, row + c);
    }
  }
}

// Converts n contiguous elements of `dtype` at `src` to f32 (exact).
inline void LoadRowF32(const void* src, DType dtype, std::int64_t n, float* HWY_RESTRICT dst) {
  const hn::ScalableTag<float> df;
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(df));
  if (dtype == DType::f32) {
    // (Empty views may have null data, which memcpy must not see.)
    if (n > 0) std::memcpy(dst, src, static_cast<std::size_t>(n) * sizeof(float));
    return;
  }
  const hn::Rebind<std::uint16_t, decltype(df)> du16;
  const hn::RebindToUnsigned<decltype(df)> du32;
  const auto* s = static_cast<const std::uint16_t*>(src);
  std::int64_t c = 0;
  if (dtype == DType::bf16) {
    for (; c + lanes <= n; c += lanes) {
      const auto wide = hn::PromoteTo(du32, hn::LoadU(du16, s + c));
      hn::StoreU(hn::BitCast(df, hn::ShiftLeft<16>(wide)), df, dst + c);
    }
    for (; c < n; ++c) dst[c] = to_float(bf16{s[c]});
  } else {
    const hn::Rebind<hwy::float16_t, decltype(df)> df16;
    const auto* h = reinterpret_cast<const hwy::float16_t*>(s);
    for (; c + lanes <= n; c += lanes)
      hn::StoreU(hn::PromoteTo(df, hn::LoadU(df16, h + c)), df, dst + c);
    for (; c < n; ++c) dst[c] = to_float(f16{s[c]});
  }
}

// bf16 bit patterns of a float vector, rounded to nearest even; NaN stays a
// quiet NaN with its sign.
template <class DF, class VU = hn::Vec<hn::RebindToUnsigned<DF>>>
HWY_INLINE VU Bf16Bits(DF /*df*/, hn::Vec<DF> v) {
  const hn::RebindToUnsigned<DF> du;
  const VU bits = hn::BitCast(du, v);
  const VU odd = hn::And(hn::ShiftRight<16>(bits), hn::Set(du, 1u));
  const VU rounded = hn::ShiftRight<16>(hn::Add(bits, hn::Add(hn::Set(du, 0x7fffu), odd)));
  const VU quiet_nan = hn::Or(hn::ShiftRight<16>(bits), hn::Set(du, 0x0040u));
  return hn::IfThenElse(hn::RebindMask(du, hn::IsNaN(v)), quiet_nan, rounded);
}

// f16 bit patterns of a float vector, rounded to nearest even with gradual
// underflow and overflow to infinity (F. Giesen's float_to_half_fast3_rtne).
template <class DF, class VU = hn::Vec<hn::RebindToUnsigned<DF>>>
HWY_INLINE VU F16Bits(DF df, hn::Vec<DF> v) {
  const hn::RebindToUnsigned<DF> du;
  const hn::RebindToSigned<DF> di;
  const VU bits = hn::BitCast(du, v);
  const VU sign = hn::And(bits, hn::Set(du, 0x80000000u));
  const VU mag = hn::Xor(bits, sign);
  // The magnitude is below 2^31, so signed compares order it correctly.
  const auto imag = hn::BitCast(di, mag);
  const auto above = [&](std::uint32_t x) {
    return hn::RebindMask(du, hn::Gt(imag, hn::Set(di, static_cast<std::int32_t>(x))));
  };
  // |v| >= 65536, inf or NaN.
  const VU special = hn::IfThenElse(above(0x7f800000u), hn::Set(du, 0x7e00u), hn::Set(du, 0x7c00u));
  // |v| < 2^-14: adding 0.5 aligns the subnormal mantissa, rounding in the FPU.
  const VU denorm_magic = hn::Set(du, ((127u - 15u) + (23u - 10u) + 1u) << 23);
  const VU subnormal = hn::Sub(
      hn::BitCast(du, hn::Add(hn::BitCast(df, mag), hn::BitCast(df, denorm_magic))), denorm_magic);
  // Normal: rebias the exponent and round the 13 dropped bits to even.
  const VU odd = hn::And(hn::ShiftRight<13>(mag), hn::Set(du, 1u));
  const VU normal = hn::ShiftRight<13>(
      hn::Add(hn::Add(mag, hn::Set(du, 0xc8000fffu)), odd));  // (15 - 127) << 23 wraps
  VU half = hn::IfThenElse(above(0x387fffffu), normal, subnormal);
  half = hn::IfThenElse(above(0x477fffffu), special, half);
  return hn::Or(half, hn::ShiftRight<16>(sign));
}

// Stores n floats to `dst` of `dtype` (f32, bf16 or f16), rounding once.
inline void StoreRowFromF32(const float* HWY_RESTRICT src, std::int64_t n, void* dst, DType dtype) {
  if (dtype == DType::f32) {
    // (Empty views may have null data, which memcpy must not see.)
    if (n > 0) std::memcpy(dst, src, static_cast<std::size_t>(n) * sizeof(float));
    return;
  }
  const hn::ScalableTag<float> df;
  const hn::Rebind<std::uint16_t, decltype(df)> du16;
  const hn::RebindToSigned<decltype(df)> di32;
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(df));
  auto* d16 = static_cast<std::uint16_t*>(dst);
  std::int64_t c = 0;
  for (; c + lanes <= n; c += lanes) {
    const auto v = hn::LoadU(df, src + c);
    const auto bits = dtype == DType::bf16 ? Bf16Bits(df, v) : F16Bits(df, v);
    // Every pattern is <= 0xffff, so the saturating demotion is exact.
    hn::StoreU(hn::DemoteTo(du16, hn::BitCast(di32, bits)), du16, d16 + c);
  }
  for (; c < n; ++c) d16[c] = dtype == DType::bf16 ? to_bf16(src[c]).bits : to_f16(src[c]).bits;
}

// Transposes the n x n matrix whose rows are v[0], ..., v[n - 1] (n =
// Lanes(d), a power of two), in place: afterwards lane j of v[i] holds what
// lane i of v[j] held. One butterfly stage per bit b of the lane index: rows
// i and i + b (bit b of i clear) exchange the lanes whose index has bit b
// set in one and clear in the other, by a lane permutation and a blend each.
// The stages and pairs are unrolled at compile time, so that v stays in
// registers.
template <std::int32_t kBit, class D, class V>
HWY_INLINE void TransposeStage(D d, V* HWY_RESTRICT v) {
  constexpr auto kN = static_cast<std::int32_t>(hn::MaxLanes(D()));
  if constexpr (kBit < kN) {
    const hn::RebindToSigned<D> di;
    const auto iota = hn::Iota(di, 0);
    const auto bit = hn::Set(di, kBit);
    const auto high = hn::RebindMask(d, hn::Ne(hn::And(iota, bit), hn::Zero(di)));
    const auto down = hn::IndicesFromVec(d, hn::AndNot(bit, iota));  // j - b where bit b is set
    const auto up = hn::IndicesFromVec(d, hn::Or(iota, bit));        // j + b where it is clear
    [&]<std::size_t... kPair>(std::index_sequence<kPair...>) {
      (
          [&] {
            constexpr std::int32_t i = static_cast<std::int32_t>(kPair) / kBit * 2 * kBit +
                                       static_cast<std::int32_t>(kPair) % kBit;
            const V lo = v[i], hi = v[i + kBit];
            v[i] = hn::IfThenElse(high, hn::TableLookupLanes(hi, down), lo);
            v[i + kBit] = hn::IfThenElse(high, hi, hn::TableLookupLanes(lo, up));
          }(),
          ...);
    }
    (std::make_index_sequence<static_cast<std::size_t>(kN / 2)>());
    TransposeStage<2 * kBit>(d, v);
  }
}
template <class D, class V>
HWY_INLINE void TransposeSquare(D d, V* HWY_RESTRICT v) {
  TransposeStage<1>(d, v);
}

using Floats = hwy::AlignedFreeUniquePtr<float[]>;

// n (at least 1) zeroed floats, aligned for any vector: padding must never
// hold NaN.
inline Floats AllocFloats(std::int64_t n) {
  const auto size = static_cast<std::size_t>(std::max<std::int64_t>(n, 1));
  Floats p = hwy::AllocateAligned<float>(size);
  std::fill_n(p.get(), size, 0.0f);
  return p;
}

// x rounded up to a multiple of m.
inline std::int64_t RoundUp(std::int64_t x, std::int64_t m) { return (x + m - 1) / m * m; }

// Bytes per element of the activations' dtypes (f32, or 16-bit).
inline std::int64_t ElementBytes(DType d) { return d == DType::f32 ? 4 : 2; }

// Bytes between consecutive indices of dimension d of t, and 0 for a
// dimension that is never stepped: one of at most one index, or any of a
// view without elements. Validation bounds the byte extent of what a view
// reaches, not such strides, which may hold anything (2^62 times the
// element size overflows int64).
inline std::int64_t StepBytes(ConstTensorView t, int d) {
  return t.size(d) > 1 && t.numel() > 0 ? t.stride(d) * ElementBytes(t.dtype()) : 0;
}

// Bytes from the first element of a row of `width` elements of t (along its
// last dimension) to the end of its last: 0 for an empty row.
inline std::int64_t RowSpanBytes(ConstTensorView t, std::int64_t width) {
  return width > 0 ? (width - 1) * StepBytes(t, 3) + ElementBytes(t.dtype()) : 0;
}

// Row (a, b, c) of a rank-4 view: the address of its first element. An
// empty view may have null data (no row of it is read); its rows are null.
inline const std::uint8_t* At(ConstTensorView t, std::int64_t a, std::int64_t b, std::int64_t c) {
  const auto* base = static_cast<const std::uint8_t*>(t.data());
  if (base == nullptr) return nullptr;
  return base + (a * t.stride(0) + b * t.stride(1) + c * t.stride(2)) * ElementBytes(t.dtype());
}

// One row of n elements at element stride `stride`, as f32.
inline void LoadStridedRowF32(const std::uint8_t* src, DType dtype, std::int64_t n,
                              std::int64_t stride, float* HWY_RESTRICT dst) {
  if (stride == 1) return LoadRowF32(src, dtype, n, dst);
  for (std::int64_t c = 0; c < n; ++c) {
    LoadRowF32(src + c * stride * ElementBytes(dtype), dtype, 1, dst + c);
  }
}

// Whether the n floats at x (n a multiple of the vector width, x aligned)
// are all finite: x * 0 is NaN exactly where x is NaN or infinite.
inline bool AllFinite(const float* HWY_RESTRICT x, std::int64_t n) {
  const hn::ScalableTag<float> d;
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(d));
  auto poison = hn::Zero(d);
  for (std::int64_t c = 0; c < n; c += lanes) {
    poison = hn::Add(poison, hn::Mul(hn::Load(d, x + c), hn::Zero(d)));
  }
  return hn::AllFalse(d, hn::IsNaN(poison));
}

// Row (a, b, c) of a rank-4 view, the first n elements of its last dim, from
// f32 (rounded once to the view's dtype).
inline void StoreViewRow(const float* HWY_RESTRICT src, std::int64_t n, TensorView t,
                         std::int64_t a, std::int64_t b, std::int64_t c) {
  auto* dst = const_cast<std::uint8_t*>(At(t, a, b, c));
  if (t.stride(3) == 1) return StoreRowFromF32(src, n, dst, t.dtype());
  for (std::int64_t x = 0; x < n; ++x) {
    StoreRowFromF32(src + x, 1, dst + x * t.stride(3) * ElementBytes(t.dtype()), t.dtype());
  }
}

QKV_HWY_NAMESPACE_END(cpu);

#endif  // QKV_CPU_VEC_MATH_INL_H_
