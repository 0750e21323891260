// Register-tiled micro-kernels for the two products of a flash attention tile,
// computed with keys as rows (S^T) so that softmax statistics, which are per
// query, vectorize across queries:
//   S^T[keys][rows]  = K[keys][Dk] . Q^T[Dk][rows]
//   O[rows][Dv]     += (S^T)^T . V[keys][Dv]
// BLIS-style: a strip of up to kStrip elements of A is broadcast one at a
// time against two vectors of B, keeping kStrip x 2 accumulators in
// registers.
//
// Layouts (NR = 2 vectors of floats): Q^T as panels [rows_pad / NR][Dk][NR];
// K row-major with leading dimension ldk; V as column panels [dv_pad / NR]
// [keys][NR], v_panel_stride floats apart; S^T row-major [keys][rows_pad];
// O row-major [rows][ldo]. rows_pad and dv_pad are multiples of NR; padding
// holds zeros.
#if defined(QKV_CPU_TILE_GEMM_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_CPU_TILE_GEMM_INL_H_
#undef QKV_CPU_TILE_GEMM_INL_H_
#else
#define QKV_CPU_TILE_GEMM_INL_H_
#endif

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "core/hwy_namespace.hpp"
#include "hwy/highway.h"

QKV_HWY_NAMESPACE_BEGIN(cpu);

// Register tiles (strip rows x vectors) of the two products. 6 x 2 leaves
// room for the two B vectors and a broadcast in AVX2's 16 registers; 3 x 4
// measured no better here within the run-to-run noise.
inline constexpr int kScoreStrip = 6;
inline constexpr int kScoreVecs = 2;
inline constexpr int kValueStrip = 6;
inline constexpr int kValueVecs = 2;

inline std::int64_t Lanes() {
  return static_cast<std::int64_t>(hn::Lanes(hn::ScalableTag<float>()));
}
// Width of a Q^T panel (the scores' B operand).
inline std::int64_t PanelWidth() { return kScoreVecs * Lanes(); }
// Multiple that the padded value width must have.
inline std::int64_t ValueWidth() { return kValueVecs * Lanes(); }

// c[R][NR] (row stride ldc) = sum_k a[r * a_row + k * a_k] * b[k * NR .. +NR]
// with `accumulate` adding to c instead of overwriting it.
template <int R, int kVecs, bool kAccumulate>
HWY_INLINE void Micro(const float* HWY_RESTRICT a, std::int64_t a_row, std::int64_t a_k,
                      std::int64_t depth, const float* HWY_RESTRICT b, std::int64_t ldb,
                      float* HWY_RESTRICT c, std::int64_t ldc) {
  const hn::ScalableTag<float> d;
  const std::size_t n = hn::Lanes(d);
  using V = hn::Vec<decltype(d)>;
  V acc[R][kVecs];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < kVecs; ++v) {
      acc[r][v] = kAccumulate ? hn::LoadU(d, c + r * ldc + v * n) : hn::Zero(d);
    }
  }
  for (std::int64_t k = 0; k < depth; ++k) {
    V b_vec[kVecs];
    for (int v = 0; v < kVecs; ++v) b_vec[v] = hn::LoadU(d, b + k * ldb + v * n);
    for (int r = 0; r < R; ++r) {
      const V x = hn::Set(d, a[r * a_row + k * a_k]);
      for (int v = 0; v < kVecs; ++v) acc[r][v] = hn::MulAdd(x, b_vec[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < kVecs; ++v) hn::StoreU(acc[r][v], d, c + r * ldc + v * n);
  }
}

// Calls f(std::integral_constant<int, R>) for the strip height R = min(rows, kStrip).
template <int kStrip, class F>
HWY_INLINE void WithStrip(std::int64_t rows, F&& f) {
  if (rows >= kStrip) return f(std::integral_constant<int, kStrip>());
  switch (rows) {
    case 1:
      return f(std::integral_constant<int, 1>());
    case 2:
      return f(std::integral_constant<int, 2>());
    case 3:
      return f(std::integral_constant<int, (kStrip > 3 ? 3 : 1)>());
    case 4:
      return f(std::integral_constant<int, (kStrip > 4 ? 4 : 1)>());
    default:
      return f(std::integral_constant<int, (kStrip > 5 ? 5 : 1)>());
  }
}

// Keys [begin, end) of a block that a query panel or row must compute;
// empty when begin >= end.
struct KeySpan {
  std::int64_t begin = 0;
  std::int64_t end = 0;
};

// S^T[keys][rows_pad] = K[keys][Dk] Q^T for Q^T packed as panels, for the
// panels that hold the first `rows` queries. With `panel_keys` (one span per
// panel), panel p computes only keys [begin, end); its other scores are left
// as they are (the caller masks them). Panels outer: one Q^T panel (Dk x NR
// floats) stays in L1 while the key strips stream past it. A last panel
// whose rows fit its first vector computes that vector only (a unit of 16
// rows, for one, with NR = 32): the other columns hold padding rows, whose
// scores no output reads, so they keep whatever they held.
inline void ScoresTransposed(const float* HWY_RESTRICT k, std::int64_t ldk, std::int64_t keys,
                             std::int64_t dk, const float* HWY_RESTRICT q_panels, std::int64_t rows,
                             std::int64_t rows_pad, const KeySpan* panel_keys,
                             float* HWY_RESTRICT s) {
  const std::int64_t nr = PanelWidth();
  for (std::int64_t p = 0; p < rows; p += nr) {
    const KeySpan span = panel_keys != nullptr ? panel_keys[p / nr] : KeySpan{0, keys};
    const bool one_vector = rows - p <= Lanes();
    for (std::int64_t j0 = span.begin; j0 < span.end; j0 += kScoreStrip) {
      WithStrip<kScoreStrip>(span.end - j0, [&](auto strip) {
        if (one_vector) {
          Micro<strip(), 1, false>(k + j0 * ldk, ldk, 1, dk, q_panels + p * dk, nr,
                                   s + j0 * rows_pad + p, rows_pad);
        } else {
          Micro<strip(), kScoreVecs, false>(k + j0 * ldk, ldk, 1, dk, q_panels + p * dk, nr,
                                            s + j0 * rows_pad + p, rows_pad);
        }
      });
    }
  }
}

// O[rows][dv_pad] += P V with P given transposed, P^T[keys][rows_pad], and
// V as column panels of NR floats whose rows are v_row floats apart (NR when
// packed); with `overwrite` (only without row_keys), O = P V instead. With
// `row_keys` (one span per row; keys outside it have P = 0), each strip of
// rows runs over the union of its rows' spans only. Value column panels
// outer: the panel's keys x NR floats stay in L1 while the query strips
// stream past.
inline void AccumulateValues(const float* HWY_RESTRICT p_t, std::int64_t rows_pad,
                             std::int64_t rows, std::int64_t keys, const KeySpan* row_keys,
                             const float* HWY_RESTRICT v, std::int64_t v_row,
                             std::int64_t v_panel_stride, std::int64_t dv_pad,
                             float* HWY_RESTRICT o, std::int64_t ldo, bool overwrite = false) {
  const std::int64_t nr = ValueWidth();
  for (std::int64_t c = 0; c < dv_pad; c += nr) {
    for (std::int64_t r0 = 0; r0 < rows; r0 += kValueStrip) {
      WithStrip<kValueStrip>(rows - r0, [&](auto strip) {
        KeySpan span{0, keys};
        if (row_keys != nullptr) {
          span = {keys, 0};
          for (int r = 0; r < strip(); ++r) {
            span.begin = std::min(span.begin, row_keys[r0 + r].begin);
            span.end = std::max(span.end, row_keys[r0 + r].end);
          }
        }
        if (span.begin >= span.end) return;
        const float* panel = v + (c / nr) * v_panel_stride + span.begin * v_row;
        const float* p = p_t + span.begin * rows_pad + r0;
        const std::int64_t depth = span.end - span.begin;
        float* out = o + r0 * ldo + c;
        if (overwrite) {
          Micro<strip(), kValueVecs, false>(p, 1, rows_pad, depth, panel, v_row, out, ldo);
        } else if (v_row == nr) {  // packed panels: the row step is a compile-time constant
          Micro<strip(), kValueVecs, true>(p, 1, rows_pad, depth, panel, nr, out, ldo);
        } else {
          Micro<strip(), kValueVecs, true>(p, 1, rows_pad, depth, panel, v_row, out, ldo);
        }
      });
    }
  }
}

// The rows that see any key of each strip of kValueStrip keys, from the
// rows' key spans: strip_rows[s] = [min, max + 1) of the rows r with
// row_keys[r] meeting keys [s * kValueStrip, (s + 1) * kValueStrip); empty
// ({rows, 0}) if none. Rows in between that do not see a key have P = 0.
inline void StripRows(const KeySpan* row_keys, std::int64_t rows, std::int64_t keys,
                      KeySpan* strip_rows) {
  const std::int64_t strips = (keys + kValueStrip - 1) / kValueStrip;
  for (std::int64_t s = 0; s < strips; ++s) strip_rows[s] = {rows, 0};
  for (std::int64_t r = 0; r < rows; ++r) {
    const KeySpan span = row_keys[r];
    if (span.begin >= span.end) continue;
    for (std::int64_t s = span.begin / kValueStrip; s <= (span.end - 1) / kValueStrip; ++s) {
      strip_rows[s].begin = std::min(strip_rows[s].begin, r);
      strip_rows[s].end = r + 1;
    }
  }
}

// C[keys][ldc] += A^T B for A^T[keys][rows_pad] (a product's left operand
// stored transposed, like P^T) and B as column panels [d_pad / NR][rows_pad]
// [NR]: the backward's dV += P^T dO and dK += dS^T Q, contracting over the
// first `rows` rows, or with `strip_rows` (StripRows) over the rows that see
// each key strip. Column panels outer: a panel of B stays in L1 while the key
// strips of A stream past.
inline void AccumulateTransposed(const float* HWY_RESTRICT a_t, std::int64_t rows_pad,
                                 std::int64_t rows, std::int64_t keys, const KeySpan* strip_rows,
                                 const float* HWY_RESTRICT b_panels, std::int64_t d_pad,
                                 float* HWY_RESTRICT c, std::int64_t ldc) {
  const std::int64_t nr = ValueWidth();
  for (std::int64_t c0 = 0; c0 < d_pad; c0 += nr) {
    const float* panel = b_panels + (c0 / nr) * rows_pad * nr;
    for (std::int64_t j0 = 0; j0 < keys; j0 += kValueStrip) {
      const KeySpan r = strip_rows != nullptr ? strip_rows[j0 / kValueStrip] : KeySpan{0, rows};
      if (r.begin >= r.end) continue;
      WithStrip<kValueStrip>(keys - j0, [&](auto strip) {
        Micro<strip(), kValueVecs, true>(a_t + j0 * rows_pad + r.begin, rows_pad, 1,
                                         r.end - r.begin, panel + r.begin * nr, nr,
                                         c + j0 * ldc + c0, ldc);
      });
    }
  }
}

QKV_HWY_NAMESPACE_END(cpu);

#endif  // QKV_CPU_TILE_GEMM_INL_H_
