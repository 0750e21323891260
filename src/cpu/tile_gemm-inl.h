// Packing and register-tiled micro-kernels for the two products of a flash
// attention tile, S = Q K^T and O += P V, in f32 (BLIS-style: a strip of up to
// kRows rows of A is broadcast one element at a time against two vectors of a
// packed B panel, keeping kRows x 2 accumulators in registers).
//
// Packed layouts (NR = 2 vectors of floats, the micro-panel width):
//   K^T panels  [ceil(n / NR)][Dk][NR]  panel p holds keys p*NR .. p*NR+NR-1
//   V panels    [DvPad / NR][n_pad][NR] panel c holds value columns c*NR ..
// Rows past n and columns past Dv are zero, so tails need no special case in
// the products (padded score columns are masked to -inf by the caller).
#if defined(QKV_CPU_TILE_GEMM_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_CPU_TILE_GEMM_INL_H_
#undef QKV_CPU_TILE_GEMM_INL_H_
#else
#define QKV_CPU_TILE_GEMM_INL_H_
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu/vec_math-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::cpu {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Rows per register strip: 6 x 2 accumulators + 2 panel vectors + 1 broadcast
// fill the 16 vector registers of AVX2.
inline constexpr int kRows = 6;

inline std::int64_t PanelWidth() {
  return 2 * static_cast<std::int64_t>(hn::Lanes(hn::ScalableTag<float>()));
}

// One row of `n` elements of `dtype` at element stride `stride`, as f32.
inline void LoadStridedRowF32(const void* src, DType dtype, std::int64_t n, std::int64_t stride,
                              float* HWY_RESTRICT dst) {
  if (stride == 1) return LoadRowF32(src, dtype, n, dst);
  const auto* bytes = static_cast<const std::uint8_t*>(src);
  const std::int64_t size = dtype == DType::f32 ? 4 : 2;
  for (std::int64_t c = 0; c < n; ++c) LoadRowF32(bytes + c * stride * size, dtype, 1, dst + c);
}

// Packs n rows (row r at element offset r * row_stride of `src`) of Dk values
// into K^T panels; `row` is scratch of Dk floats.
inline void PackKeys(const void* src, DType dtype, std::int64_t row_stride, std::int64_t col_stride,
                     std::int64_t n, std::int64_t n_pad, std::int64_t dk, float* HWY_RESTRICT row,
                     float* HWY_RESTRICT panels) {
  const std::int64_t nr = PanelWidth();
  const std::int64_t size = dtype == DType::f32 ? 4 : 2;
  const auto* bytes = static_cast<const std::uint8_t*>(src);
  for (std::int64_t r = 0; r < n_pad; ++r) {
    float* dst = panels + (r / nr) * dk * nr + r % nr;
    if (r < n) {
      LoadStridedRowF32(bytes + r * row_stride * size, dtype, dk, col_stride, row);
      for (std::int64_t k = 0; k < dk; ++k) dst[k * nr] = row[k];
    } else {
      for (std::int64_t k = 0; k < dk; ++k) dst[k * nr] = 0.0f;
    }
  }
}

// Packs n rows of Dv values into V panels of n_pad rows (columns past Dv
// zero); `row` is scratch of DvPad floats.
inline void PackValues(const void* src, DType dtype, std::int64_t row_stride,
                       std::int64_t col_stride, std::int64_t n, std::int64_t n_pad, std::int64_t dv,
                       std::int64_t dv_pad, float* HWY_RESTRICT row, float* HWY_RESTRICT panels) {
  const std::int64_t nr = PanelWidth();
  const std::int64_t size = dtype == DType::f32 ? 4 : 2;
  const auto* bytes = static_cast<const std::uint8_t*>(src);
  for (std::int64_t r = 0; r < n_pad; ++r) {
    if (r < n) {
      LoadStridedRowF32(bytes + r * row_stride * size, dtype, dv, col_stride, row);
      std::fill(row + dv, row + dv_pad, 0.0f);
    } else {
      std::fill(row, row + dv_pad, 0.0f);
    }
    for (std::int64_t c = 0; c < dv_pad; c += nr) {
      std::memcpy(panels + (c * n_pad + r * nr), row + c,
                  static_cast<std::size_t>(nr) * sizeof(float));
    }
  }
}

// s[R][NR] = q[R][Dk] . panel[Dk][NR]
template <int R>
HWY_INLINE void MicroScores(const float* HWY_RESTRICT q, std::int64_t dk,
                            const float* HWY_RESTRICT panel, float* HWY_RESTRICT s,
                            std::int64_t lds) {
  const hn::ScalableTag<float> d;
  const std::size_t n = hn::Lanes(d);
  using V = hn::Vec<decltype(d)>;
  V acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = hn::Zero(d);
  for (std::int64_t k = 0; k < dk; ++k) {
    const V b0 = hn::Load(d, panel + k * 2 * n);
    const V b1 = hn::Load(d, panel + k * 2 * n + n);
    for (int r = 0; r < R; ++r) {
      const V a = hn::Set(d, q[r * dk + k]);
      acc0[r] = hn::MulAdd(a, b0, acc0[r]);
      acc1[r] = hn::MulAdd(a, b1, acc1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    hn::Store(acc0[r], d, s + r * lds);
    hn::Store(acc1[r], d, s + r * lds + n);
  }
}

// o[R][NR] += p[R][n] . panel[n][NR]
template <int R>
HWY_INLINE void MicroValues(const float* HWY_RESTRICT p, std::int64_t ldp, std::int64_t n_keys,
                            const float* HWY_RESTRICT panel, float* HWY_RESTRICT o,
                            std::int64_t ldo) {
  const hn::ScalableTag<float> d;
  const std::size_t n = hn::Lanes(d);
  using V = hn::Vec<decltype(d)>;
  V acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) {
    acc0[r] = hn::Load(d, o + r * ldo);
    acc1[r] = hn::Load(d, o + r * ldo + n);
  }
  for (std::int64_t j = 0; j < n_keys; ++j) {
    const V b0 = hn::Load(d, panel + j * 2 * n);
    const V b1 = hn::Load(d, panel + j * 2 * n + n);
    for (int r = 0; r < R; ++r) {
      const V a = hn::Set(d, p[r * ldp + j]);
      acc0[r] = hn::MulAdd(a, b0, acc0[r]);
      acc1[r] = hn::MulAdd(a, b1, acc1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    hn::Store(acc0[r], d, o + r * ldo);
    hn::Store(acc1[r], d, o + r * ldo + n);
  }
}

// Calls f(std::integral_constant<int, R>) for the strip height R = rows (1..kRows).
template <class F>
HWY_INLINE void WithStripRows(std::int64_t rows, F&& f) {
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
      return f(std::integral_constant<int, kRows>());
  }
}

// S[rows][panels * NR] = Q[rows][Dk] K^T for packed K^T panels.
inline void ScoresTile(const float* HWY_RESTRICT q, std::int64_t rows, std::int64_t dk,
                       const float* HWY_RESTRICT k_panels, std::int64_t panels,
                       float* HWY_RESTRICT s, std::int64_t lds) {
  const std::int64_t nr = PanelWidth();
  for (std::int64_t r0 = 0; r0 < rows; r0 += kRows) {
    WithStripRows(rows - r0, [&](auto strip) {
      for (std::int64_t p = 0; p < panels; ++p) {
        MicroScores<strip()>(q + r0 * dk, dk, k_panels + p * dk * nr, s + r0 * lds + p * nr, lds);
      }
    });
  }
}

// O[rows][panels * NR] += P[rows][n_keys] V for packed V panels of n_pad rows.
inline void AccumulateValues(const float* HWY_RESTRICT p, std::int64_t rows, std::int64_t ldp,
                             std::int64_t n_keys, const float* HWY_RESTRICT v_panels,
                             std::int64_t n_pad, std::int64_t panels, float* HWY_RESTRICT o,
                             std::int64_t ldo) {
  const std::int64_t nr = PanelWidth();
  for (std::int64_t r0 = 0; r0 < rows; r0 += kRows) {
    WithStripRows(rows - r0, [&](auto strip) {
      for (std::int64_t c = 0; c < panels; ++c) {
        MicroValues<strip()>(p + r0 * ldp, ldp, n_keys, v_panels + c * n_pad * nr,
                             o + r0 * ldo + c * nr, ldo);
      }
    });
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace qkv::cpu
HWY_AFTER_NAMESPACE();

#endif  // QKV_CPU_TILE_GEMM_INL_H_
