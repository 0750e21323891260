// Register-tiled micro-kernels for the two products of a flash attention tile,
// computed with keys as rows (S^T) so that softmax statistics, which are per
// query, vectorize across queries:
//   S^T[keys][rows]  = K[keys][Dk] . Q^T[Dk][rows]
//   O[rows][Dv]     += (S^T)^T . V[keys][Dv]
// BLIS-style: a strip of up to kStrip elements of A is broadcast one at a
// time against two vectors of B, keeping kStrip x 2 accumulators in
// registers (6 x 2 + 2 + 1 = 15 of AVX2's 16 vector registers).
//
// Layouts (NR = 2 vectors of floats): Q^T as panels [rows_pad / NR][Dk][NR];
// K and V row-major, contiguous, with leading dimensions ldk and ldv; S^T
// row-major [keys][rows_pad]; O row-major [rows][ldo]. rows_pad and the
// value width are multiples of NR; padding holds zeros.
#if defined(QKV_CPU_TILE_GEMM_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_CPU_TILE_GEMM_INL_H_
#undef QKV_CPU_TILE_GEMM_INL_H_
#else
#define QKV_CPU_TILE_GEMM_INL_H_
#endif

#include <cstdint>
#include <type_traits>

#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::cpu {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

inline constexpr int kStrip = 6;

inline std::int64_t PanelWidth() {
  return 2 * static_cast<std::int64_t>(hn::Lanes(hn::ScalableTag<float>()));
}

// c[R][NR] (row stride ldc) = sum_k a[r * a_row + k * a_k] * b[k * NR .. +NR]
// with `accumulate` adding to c instead of overwriting it.
template <int R, bool kAccumulate>
HWY_INLINE void Micro(const float* HWY_RESTRICT a, std::int64_t a_row, std::int64_t a_k,
                      std::int64_t depth, const float* HWY_RESTRICT b, std::int64_t ldb,
                      float* HWY_RESTRICT c, std::int64_t ldc) {
  const hn::ScalableTag<float> d;
  const std::size_t n = hn::Lanes(d);
  using V = hn::Vec<decltype(d)>;
  V acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) {
    acc0[r] = kAccumulate ? hn::LoadU(d, c + r * ldc) : hn::Zero(d);
    acc1[r] = kAccumulate ? hn::LoadU(d, c + r * ldc + n) : hn::Zero(d);
  }
  for (std::int64_t k = 0; k < depth; ++k) {
    const V b0 = hn::LoadU(d, b + k * ldb);
    const V b1 = hn::LoadU(d, b + k * ldb + n);
    for (int r = 0; r < R; ++r) {
      const V x = hn::Set(d, a[r * a_row + k * a_k]);
      acc0[r] = hn::MulAdd(x, b0, acc0[r]);
      acc1[r] = hn::MulAdd(x, b1, acc1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    hn::StoreU(acc0[r], d, c + r * ldc);
    hn::StoreU(acc1[r], d, c + r * ldc + n);
  }
}

// Calls f(std::integral_constant<int, R>) for the strip height R = min(rows, kStrip).
template <class F>
HWY_INLINE void WithStrip(std::int64_t rows, F&& f) {
  switch (rows) {
    case 1:
      return f(std::integral_constant<int, 1>());
    case 2:
      return f(std::integral_constant<int, 2>());
    case 3:
      return f(std::integral_constant<int, 3>());
    case 4:
      return f(std::integral_constant<int, 4>());
    case 5:
      return f(std::integral_constant<int, 5>());
    default:
      return f(std::integral_constant<int, kStrip>());
  }
}

// S^T[keys][rows_pad] = K[keys][Dk] Q^T for Q^T packed as panels. Panels
// outer: one Q^T panel (Dk x NR floats) stays in L1 while the key strips
// stream past it.
inline void ScoresTransposed(const float* HWY_RESTRICT k, std::int64_t ldk, std::int64_t keys,
                             std::int64_t dk, const float* HWY_RESTRICT q_panels,
                             std::int64_t rows_pad, float* HWY_RESTRICT s) {
  const std::int64_t nr = PanelWidth();
  for (std::int64_t p = 0; p < rows_pad; p += nr) {
    for (std::int64_t j0 = 0; j0 < keys; j0 += kStrip) {
      WithStrip(keys - j0, [&](auto strip) {
        Micro<strip(), false>(k + j0 * ldk, ldk, 1, dk, q_panels + p * dk, nr,
                              s + j0 * rows_pad + p, rows_pad);
      });
    }
  }
}

// O[rows][dv_pad] += P V with P given transposed, P^T[keys][rows_pad]. Value
// column panels outer: the panel's keys x NR floats stay in L1 while the
// query strips stream past.
inline void AccumulateValues(const float* HWY_RESTRICT p_t, std::int64_t rows_pad,
                             std::int64_t rows, std::int64_t keys, const float* HWY_RESTRICT v,
                             std::int64_t ldv, std::int64_t dv_pad, float* HWY_RESTRICT o,
                             std::int64_t ldo) {
  const std::int64_t nr = PanelWidth();
  for (std::int64_t c = 0; c < dv_pad; c += nr) {
    for (std::int64_t r0 = 0; r0 < rows; r0 += kStrip) {
      WithStrip(rows - r0, [&](auto strip) {
        Micro<strip(), true>(p_t + r0, 1, rows_pad, keys, v + c, ldv, o + r0 * ldo + c, ldo);
      });
    }
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace qkv::cpu
HWY_AFTER_NAMESPACE();

#endif  // QKV_CPU_TILE_GEMM_INL_H_
