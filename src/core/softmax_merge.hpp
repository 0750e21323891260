// Merging softmax results computed over disjoint sets of keys: the splits of
// split-KV decoding (cpu/decode-inl.h) and the ring steps of context-parallel
// attention (dist/ring.cpp) both end here, so the two cannot drift apart.
//
// Part s of one query row holds m_s (its running maximum score), l_s (its
// sum of e^(score - m_s)) and o_s (its sum of e^(score - m_s) v). A part that
// is already normalized passes m_s = its lse, l_s = 1 and o_s = its output,
// which is the same thing written differently. The merged row is
//   out = sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s,   M = max_s m_s,
//   lse = M + log(sum_s e^(m_s - M) l_s),
// with out = 0 and lse = -inf when every part is empty (m_s = -inf), as
// for a row with no admitted key. A part whose m_s or l_s is NaN met a NaN
// score (or +inf - +inf): the merged row is NaN, out and lse, whatever the
// other parts hold (semantics.md, "Fully masked rows, NaN and infinities").
// Its m_s alone does not show it: a running maximum may skip a NaN score
// (x86's max returns its second operand when one is NaN), leaving m_s
// finite, or -inf when every other score of the part is masked, while the
// NaN reaches l_s through the exponential. Parts are added in index order.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace qkv::detail {

template <class Real>
struct SoftmaxPart {
  Real m;         // maximum score (or lse); -inf for an empty part
  Real l;         // sum of e^(score - m) (1 for a normalized part)
  const Real* o;  // [dv]: sum of e^(score - m) v (the output, normalized)
};

// Writes the merged row of `parts` parts (part(s) returns SoftmaxPart<Real>)
// into out[0, dv) and returns its lse.
template <class Real, class PartAt>
Real merge_softmax_parts(std::int64_t parts, std::int64_t dv, PartAt part, Real* out) {
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
  const Real inv = sum == Real(0) ? Real(0) : Real(1) / sum;
  for (std::int64_t c = 0; c < dv; ++c) out[c] *= inv;
  return sum == Real(0) ? kNegInf : top + std::log(sum);
}

}  // namespace qkv::detail
