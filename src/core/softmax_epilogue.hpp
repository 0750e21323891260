// The end of a softmax row, written once for every backend: the fused
// forward and its probabilities pass (cpu/flash-inl.h), decoding's split-KV
// merge (cpu/decode-inl.h), the ring's merge of pieces (dist/ring.cpp), the
// reference forward and backward (reference/*.cpp, in double) and the
// backward's row terms (cpu/flash_backward-inl.h, cpu/additive_backward.cpp).
// A term that joins every row's softmax denominator is added here, in
// finish_row, and its gradient next to the backward's row terms.
//
// Forward. A row's admitted scores s_j reduce to a running maximum m, a sum
// l = sum_j e^(s_j - m) and an accumulator O = sum_j e^(s_j - m) v_j. Then
//   out = scale O,  p_j = scale e^(s_j - m),  scale = 1 / l,  lse = m + log l
// (finish_row). A learned sink S (qkv/attention.hpp) joins the denominator
// there: with M = max(m, S) and L = l e^(m - M) + e^(S - M),
//   scale = e^(m - M) / L,  lse = M + log L,
// and S = -inf (no sink) is the plain finish above, operation for operation.
// A row without admitted keys then has out = 0 and lse = S; without a sink
// such a row (l = 0, m = -inf) has out = 0,
// p = 0 and lse = -inf. A NaN score reaches l through e^(s - m), so IEEE
// arithmetic makes out and lse NaN (semantics.md, "Fully masked rows, NaN
// and infinities").
//
// Merge. Parts of one row over disjoint keys, part s holding m_s, l_s and
// O_s (a normalized part: m_s = its lse, l_s = 1, O_s = its output), merge
// into M = max_s m_s, l = sum_s e^(m_s - M) l_s, O = sum_s e^(m_s - M) O_s,
// finished as above (merge_softmax_parts). The parts themselves are not
// finished: a denominator term enters once, in the merged row's finish_row.
// A part whose m_s or l_s is NaN met a NaN score (or +inf - +inf): the
// merged row is NaN, out and lse, whatever the other parts hold. Its m_s
// alone does not show it: a running maximum may skip a NaN score (x86's max
// returns its second operand when one is NaN), leaving m_s finite, or -inf
// when every other score of the part is masked, while the NaN reaches l_s
// through the exponential. Parts are added in index order.
//
// Backward. With lse_i from the forward, the weights are recovered as
//   P_ij = e^(s_ij - lse_i), 0 for a row without keys (lse_i = -inf)
// (weight_from_lse), and the softmax's correction is
//   D_i = sum_c dout_ic out_ic  (row_delta),   dS_ij = P_ij (dP_ij - D_i),
// which a sink leaves unchanged (it is inside lse_i). The sink's own
// gradient, over the rows i of its head, is
//   dL/dS = -sum_i e^(S - lse_i) D_i            (sink_gradient).
// The vectorized kernels keep their own loops of these two formulas.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

namespace qkv::detail {

// A finished row: out = scale O, p_j = scale e^(s_j - m), and its lse.
template <class Real>
struct RowFinish {
  Real scale;
  Real lse;
};

// The finish of a row with running maximum m and sum l, and the row's sink
// logit (-inf: none; see above).
template <class Real>
RowFinish<Real> finish_row(Real m, Real l, Real sink = -std::numeric_limits<Real>::infinity()) {
  if (sink == -std::numeric_limits<Real>::infinity()) {
    if (l == Real(0)) return {Real(0), -std::numeric_limits<Real>::infinity()};
    return {Real(1) / l, m + std::log(l)};
  }
  // std::max keeps a NaN m; a NaN l reaches L.
  const Real top = std::isnan(m) ? m : std::max(m, sink);
  const Real w = std::exp(m - top);
  const Real sum = l * w + std::exp(sink - top);
  return {w / sum, top + std::log(sum)};
}

// The sink logit of query head h: sinks[h], or -inf without sinks.
template <class Real>
Real sink_of(const float* sinks, std::size_t count, std::int64_t h) {
  return count == 0 ? -std::numeric_limits<Real>::infinity()
                    : static_cast<Real>(sinks[static_cast<std::size_t>(h)]);
}

template <class Real>
struct SoftmaxPart {
  Real m;         // maximum score (or lse); -inf for an empty part
  Real l;         // sum of e^(score - m) (1 for a normalized part)
  const Real* o;  // [dv]: sum of e^(score - m) v (the output, normalized)
};

// Writes the merged row of `parts` parts (part(s) returns SoftmaxPart<Real>)
// into out[0, dv) and returns its lse; `sink` (-inf: none) enters the merged
// row's finish.
template <class Real, class PartAt>
Real merge_softmax_parts(std::int64_t parts, std::int64_t dv, PartAt part, Real* out,
                         Real sink = -std::numeric_limits<Real>::infinity()) {
  constexpr Real kNegInf = -std::numeric_limits<Real>::infinity();
  Real top = kNegInf;
  for (std::int64_t s = 0; s < parts; ++s) {
    const SoftmaxPart<Real> p = part(s);
    if (std::isnan(p.m) || std::isnan(p.l)) {
      std::fill_n(out, dv, std::numeric_limits<Real>::quiet_NaN());
      return std::numeric_limits<Real>::quiet_NaN();
    }
    top = std::max(top, p.m);
  }
  std::fill_n(out, dv, Real(0));
  Real sum = 0;
  if (top != kNegInf) {
    for (std::int64_t s = 0; s < parts; ++s) {
      const SoftmaxPart<Real> p = part(s);
      if (p.m == kNegInf) continue;
      const Real w = std::exp(p.m - top);
      sum += w * p.l;
      for (std::int64_t c = 0; c < dv; ++c) out[c] += w * p.o[c];
    }
  }
  const RowFinish<Real> row = finish_row(top, sum, sink);
  for (std::int64_t c = 0; c < dv; ++c) out[c] *= row.scale;
  return row.lse;
}

// The weight of a score s in a row whose logsumexp is lse.
template <class Real>
Real weight_from_lse(Real s, Real lse) {
  return lse == -std::numeric_limits<Real>::infinity() ? Real(0) : std::exp(s - lse);
}

// D = sum_c dout[c] out[c] over one row of n columns, in column order.
template <class Real>
Real row_delta(const Real* dout, const Real* out, std::int64_t n) {
  Real d = 0;
  for (std::int64_t c = 0; c < n; ++c) d += dout[c] * out[c];
  return d;
}

// dL/dS = -sum_i e^(S - lse_i) D_i over `rows` rows of one head, in row
// order; row(i) returns the pair {lse_i, D_i}. 0 without a sink (S = -inf).
template <class Real, class RowAt>
Real sink_gradient(Real sink, std::int64_t rows, RowAt row) {
  if (sink == -std::numeric_limits<Real>::infinity()) return Real(0);
  Real g = 0;
  for (std::int64_t i = 0; i < rows; ++i) {
    const auto [lse, d] = row(i);
    g -= std::exp(sink - static_cast<Real>(lse)) * static_cast<Real>(d);
  }
  return g;
}

}  // namespace qkv::detail
