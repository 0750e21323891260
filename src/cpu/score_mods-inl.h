// The score-modification seam of the fused kernels: everything between
// S = Q K^T and the softmax, on one tile of S^T [keys][rows_pad] (column r
// of a unit's rows is query head hkv * group + r / positions at position
// i0 + r % positions). Forward and backward both call ModifyAndMask; the
// backward adds the derivatives that are not the identity (softcap) and the
// gradient of the learned relative bias; decode applies the biases it takes
// one score at a time (ModifyScore). The terms run in the order of
// docs/semantics.md ("Order of operations"):
//
//   softcap -> ALiBi -> relative bias -> float mask -> score_mod
//   -> ranges (causal, window, key lengths) -> bool mask -> mask_mod
//   -> sparse pattern
//
// A new bias is one more step here (and its derivative below if it is not
// additive); a new mask that is a set of admitted keys is a SparsePattern
// kind (core/sparse.cpp), which ModifyAndMask and the tile classification
// already apply. Masked scores become -inf.
#if defined(QKV_CPU_SCORE_MODS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_CPU_SCORE_MODS_INL_H_
#undef QKV_CPU_SCORE_MODS_INL_H_
#else
#define QKV_CPU_SCORE_MODS_INL_H_
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>

#include "core/elements.hpp"
#include "core/hwy_namespace.hpp"
#include "core/key_range.hpp"
#include "core/sparse.hpp"
#include "cpu/flash.hpp"
#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"

QKV_HWY_NAMESPACE_BEGIN(cpu);

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Everything a unit needs to address its rows: row g * positions + t is
// query head hkv * group + g at position i0 + t of sequence seq.
struct UnitGeometry {
  detail::SequenceExtent seq;
  std::int64_t group = 0;
  std::int64_t positions = 0;
  std::int64_t offset = 0;  // p_i = i + offset
  std::int64_t rows() const { return group * positions; }
};

// One head's columns of a tile: S^T columns [0, positions) of `s` (row
// stride rows_pad) are queries at positions pos0, pos0 + 1, ...; keys are
// [j0, j0 + cols) of the sequence.
struct HeadTile {
  float* HWY_RESTRICT s;
  std::int64_t rows_pad;
  std::int64_t h;          // query head
  std::int64_t pos0;       // key-axis position of the first query
  std::int64_t positions;  // queries of this head in the tile
  std::int64_t j0, cols;
};

// ---- biases -----------------------------------------------------------------

// s = cap * tanh(s / cap) on every column (padding included) of keys [0, cols).
inline void Softcap(double softcap, std::int64_t cols, float* HWY_RESTRICT s,
                    std::int64_t rows_pad) {
  const hn::ScalableTag<float> d;
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(d));
  const auto cap = hn::Set(d, static_cast<float>(softcap));
  const auto inv = hn::Set(d, static_cast<float>(1.0 / softcap));
  for (std::int64_t c = 0; c < cols; ++c) {
    float* row = s + c * rows_pad;
    for (std::int64_t r = 0; r < rows_pad; r += lanes) {
      hn::Store(hn::Mul(cap, hn::Tanh(d, hn::Mul(hn::Load(d, row + r), inv))), d, row + r);
    }
  }
}

// ALiBi: -slope * |p_i - j|, a vector of queries at a time.
inline void AddAlibi(const HeadTile& t, float slope) {
  const hn::ScalableTag<float> d;
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(d));
  const hn::RebindToSigned<decltype(d)> di;
  const auto iota = hn::ConvertTo(d, hn::Iota(di, 0));
  for (std::int64_t c = 0; c < t.cols; ++c) {
    float* row = t.s + c * t.rows_pad;
    const std::int64_t first = t.pos0 - (t.j0 + c);
    std::int64_t x = 0;
    for (; x + lanes <= t.positions; x += lanes) {
      const auto delta = hn::Add(iota, hn::Set(d, static_cast<float>(first + x)));
      hn::StoreU(hn::MulAdd(hn::Abs(delta), hn::Set(d, -slope), hn::LoadU(d, row + x)), d, row + x);
    }
    for (; x < t.positions; ++x) row[x] -= slope * static_cast<float>(std::llabs(first + x));
  }
}

// The learned relative bias bias(j - p_i); `table` points at index R (delta 0)
// of the head's row [2 R + 1]. Indexed j - p_i: decreasing in i, walked backwards.
inline void AddRelativeBias(const HeadTile& t, const float* table) {
  for (std::int64_t c = 0; c < t.cols; ++c) {
    float* row = t.s + c * t.rows_pad;
    for (std::int64_t x = 0; x < t.positions; ++x) row[x] += table[t.j0 + c - (t.pos0 + x)];
  }
}

// The float mask, added; rows of sequence `seq` from query row q_row0.
inline void AddFloatMask(const HeadTile& t, ConstTensorView m, const detail::SequenceExtent& seq,
                         std::int64_t q_row0) {
  const std::int64_t js = detail::mask_key_stride(m);
  for (std::int64_t x = 0; x < t.positions; ++x) {
    const std::int64_t base = detail::mask_row_offset(m, seq.batch, t.h, seq.q_begin + q_row0 + x);
    for (std::int64_t c = 0; c < t.cols; ++c) {
      t.s[c * t.rows_pad + x] += static_cast<float>(
          detail::load(m.data(), m.dtype(), base + (seq.k_begin + t.j0 + c) * js));
    }
  }
}

// ---- masks ------------------------------------------------------------------

// Drops keys outside each query's range (detail::key_range). Key j0 + c is
// open to query i iff lo_i <= j0 + c < hi_i: each lane's bounds, relative to
// j0 and clamped to [0, cols], are small integers, exact in float however
// long the sequence.
inline void MaskOutsideRanges(const HeadTile& t, const detail::KeyRule& keys, std::int64_t nk) {
  const hn::ScalableTag<float> d;
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(d));
  const hn::RebindToSigned<decltype(d)> di;
  const auto iota = hn::ConvertTo(d, hn::Iota(di, 0));
  HWY_ALIGN float lo_rel[hn::MaxLanes(d)];
  HWY_ALIGN float hi_rel[hn::MaxLanes(d)];
  for (std::int64_t x0 = 0; x0 < t.positions; x0 += lanes) {
    for (std::int64_t x = 0; x < lanes; ++x) {
      const detail::KeyRange kr = keys.range(t.pos0 + std::min(x0 + x, t.positions - 1), nk);
      lo_rel[x] = static_cast<float>(std::clamp<std::int64_t>(kr.lo - t.j0, 0, t.cols));
      hi_rel[x] = static_cast<float>(std::clamp<std::int64_t>(kr.hi - t.j0, 0, t.cols));
    }
    const auto lo = hn::Load(d, lo_rel);
    const auto hi = hn::Load(d, hi_rel);
    // Both ends grow with the position, so every query of the vector keeps
    // the keys from the last one's lo to the first one's hi: those need no
    // mask.
    const std::int64_t last = std::min(x0 + lanes, t.positions) - 1;
    const auto open_begin = static_cast<std::int64_t>(lo_rel[last - x0]);
    const std::int64_t open_end = std::max(open_begin, static_cast<std::int64_t>(hi_rel[0]));
    for (std::int64_t c = 0; c < t.cols; ++c) {
      if (c == open_begin) c = open_end;
      if (c >= t.cols) break;
      const auto j = hn::Set(d, static_cast<float>(c));
      const auto keep = hn::And(hn::Ge(j, lo), hn::Lt(j, hi));
      float* s = t.s + c * t.rows_pad + x0;
      // Lanes past this head's queries belong to the next head (or to
      // padding): leave them as they are.
      const auto mine = hn::Lt(iota, hn::Set(d, static_cast<float>(t.positions - x0)));
      hn::StoreU(hn::IfThenElse(hn::AndNot(keep, mine), hn::Set(d, kNegInf), hn::LoadU(d, s)), d,
                 s);
    }
  }
}

// The bool mask: false drops the key.
inline void MaskBool(const HeadTile& t, ConstTensorView m, const detail::SequenceExtent& seq,
                     std::int64_t q_row0) {
  const std::int64_t js = detail::mask_key_stride(m);
  const auto* bits = static_cast<const std::uint8_t*>(m.data());
  for (std::int64_t x = 0; x < t.positions; ++x) {
    const std::int64_t base = detail::mask_row_offset(m, seq.batch, t.h, seq.q_begin + q_row0 + x);
    for (std::int64_t c = 0; c < t.cols; ++c) {
      if (bits[base + (seq.k_begin + t.j0 + c) * js] == 0) t.s[c * t.rows_pad + x] = kNegInf;
    }
  }
}

// The sparse pattern's rejected pairs, unless it admits the whole tile.
inline void MaskPattern(const HeadTile& t, const SparsePattern& pattern, std::int64_t q_row0) {
  const detail::PatternTile tile{t.h, q_row0, t.positions, t.pos0, t.j0, t.cols};
  if (detail::coverage(pattern, tile) != detail::Coverage::all) {
    detail::mask_rejected(pattern, tile, t.s, 1, t.rows_pad);
  }
}

// ---- the pipeline -------------------------------------------------------------

// Adds the biases (softcap, ALiBi, relative bias, float mask) and score_mod
// to S^T, then (when partial) drops keys outside each query's range and those
// the bool mask, mask_mod or the sparse pattern reject. Columns past the
// unit's rows are ignored later, so they need no care.
inline void ModifyAndMask(const FlashPlan& plan, const Unit& u, const UnitGeometry& g,
                          std::int64_t j0, std::int64_t cols, bool range_partial, bool mask_partial,
                          float* HWY_RESTRICT s, std::int64_t rows_pad) {
  const KernelParams& o = plan.params;
  const detail::AttentionProblem& p = *plan.problem;
  if (o.softcap > 0.0) Softcap(o.softcap, cols, s, rows_pad);
  const std::int64_t width = 2 * plan.relative_radius + 1;
  for (std::int64_t gi = 0; gi < g.group; ++gi) {
    const std::int64_t h = u.hkv * g.group + gi;
    const std::int64_t r0 = gi * g.positions;  // this head's first column
    const HeadTile t{s + r0, rows_pad, h, u.i0 + g.offset, g.positions, j0, cols};
    if (!o.alibi_slopes.empty()) AddAlibi(t, o.slope(u.s, h, p.hq));
    if (!plan.relative_bias.empty()) {
      AddRelativeBias(t, plan.relative_bias.data() + h * width + plan.relative_radius);
    }
    if (o.float_mask.defined()) AddFloatMask(t, o.float_mask, g.seq, u.i0);
    if (plan.mods->score_mod != nullptr) {
      plan.mods->score_mod(plan.mods->context,
                           {s + r0, 1, rows_pad, u.s, h, u.i0, g.positions, j0, cols});
    }
    if (range_partial) MaskOutsideRanges(t, o.keys, g.seq.nk);
    if (o.bool_mask.defined() && mask_partial) MaskBool(t, o.bool_mask, g.seq, u.i0);
    if (plan.mods->mask_mod != nullptr && mask_partial) {
      plan.mods->mask_mod(plan.mods->context,
                          {s + r0, 1, rows_pad, u.s, h, u.i0, g.positions, j0, cols});
    }
    if (o.sparse.defined() && mask_partial) MaskPattern(t, o.sparse, u.i0);
  }
}

// ---- one score at a time (decode) -------------------------------------------

// The biases decode_attention takes (it rejects the others), on one score of
// a query at key-axis position pos for key j: softcap, then ALiBi with the
// query head's slope. Computed in float with std::tanh.
inline float ModifyScore(float x, double softcap, bool alibi, float slope, std::int64_t pos,
                         std::int64_t j) {
  if (softcap > 0.0) {
    const auto cap = static_cast<float>(softcap);
    x = cap * std::tanh(x / cap);
  }
  if (alibi) x -= slope * static_cast<float>(std::llabs(pos - j));
  return x;
}

// ---- derivatives (backward) ---------------------------------------------------

// dS through the softcap, in place on ds [keys][rows_pad]: s = c tanh(raw / c)
// has ds/draw = 1 - tanh^2(raw / c); `raw` holds S^T before the cap.
inline void SoftcapGradient(double softcap, const float* HWY_RESTRICT raw, std::int64_t cols,
                            std::int64_t rows_used, std::int64_t rows_pad, float* HWY_RESTRICT ds) {
  const hn::ScalableTag<float> d;
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(d));
  const auto inv = hn::Set(d, static_cast<float>(1.0 / softcap));
  const auto one = hn::Set(d, 1.0f);
  for (std::int64_t c = 0; c < cols; ++c) {
    for (std::int64_t r = 0; r < rows_used; r += lanes) {
      const auto t = hn::Tanh(d, hn::Mul(hn::Load(d, raw + c * rows_pad + r), inv));
      float* x = ds + c * rows_pad + r;
      hn::Store(hn::Mul(hn::Load(d, x), hn::NegMulAdd(t, t, one)), d, x);
    }
  }
}

// Adds dS of the tile to the task's relative bias gradient by distance
// j - p_i + R (summed over the tile's rows of each head).
inline void AccumulateBiasGradient(const FlashPlan& plan, const Unit& u, const UnitGeometry& g,
                                   std::int64_t j0, std::int64_t cols, std::int64_t rows_pad,
                                   const float* HWY_RESTRICT ds, double* HWY_RESTRICT partial) {
  const std::int64_t width = 2 * plan.relative_radius + 1;
  for (std::int64_t gi = 0; gi < g.group; ++gi) {
    double* by_delta = partial + gi * width + plan.relative_radius;
    for (std::int64_t t = 0; t < g.positions; ++t) {
      const std::int64_t pos = u.i0 + t + g.offset;
      const float* col = ds + gi * g.positions + t;
      for (std::int64_t c = 0; c < cols; ++c) by_delta[j0 + c - pos] += col[c * rows_pad];
    }
  }
}

// Writes dS of the tile into ds_full, [B, Hq, Nq, Nk] (d_mask's buffer,
// core/mask_gradient.hpp), at its (batch entry, head, query row, key).
inline void StoreScoreGradient(const FlashPlan& plan, const Unit& u, const UnitGeometry& g,
                               std::int64_t j0, std::int64_t cols, std::int64_t rows_pad,
                               const float* HWY_RESTRICT ds, float* HWY_RESTRICT ds_full) {
  const detail::AttentionProblem& p = *plan.problem;
  for (std::int64_t gi = 0; gi < g.group; ++gi) {
    const std::int64_t h = u.hkv * g.group + gi;
    for (std::int64_t t = 0; t < g.positions; ++t) {
      const std::int64_t row = g.seq.q_begin + u.i0 + t;
      float* dst = ds_full + ((g.seq.batch * p.hq + h) * p.nq + row) * p.nk + g.seq.k_begin + j0;
      const float* col = ds + gi * g.positions + t;
      for (std::int64_t c = 0; c < cols; ++c) dst[c] = col[c * rows_pad];
    }
  }
}

QKV_HWY_NAMESPACE_END(cpu);

#endif  // QKV_CPU_SCORE_MODS_INL_H_
