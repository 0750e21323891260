#include "core/score_scale.hpp"

#include <cmath>
#include <vector>

#include "core/elements.hpp"
#include "core/key_range.hpp"

namespace qkv::detail {
namespace {

// Calls f(b, row, h, c_hi, ln_n) for every query row (its index in q's
// dimension 1 and its batch entry) and head, ln_n the row's ln(n_i) (1
// without score_scale_log_n).
template <class F>
void for_each_row(const AttentionProblem& p, const AttentionOptions& o, F&& f) {
  const KeyRule rule = key_rule(o);
  for (std::int64_t s = 0; s < p.sequences; ++s) {
    const SequenceExtent e = p.sequence(s);
    const std::int64_t offset = rule.offset(e.nq, e.nk);
    for (std::int64_t i = 0; i < e.nq; ++i) {
      double ln_n = 1.0;
      if (o.score_scale_log_n) {
        const KeyRange r = rule.range(i + offset, e.nk);
        ln_n = r.hi > r.lo ? std::log(static_cast<double>(r.hi - r.lo)) : 0.0;
      }
      for (std::int64_t h = 0; h < p.hq; ++h) {
        f(e.batch, e.q_begin + i, h, static_cast<double>(o.score_scale[h]) * ln_n, ln_n);
      }
    }
  }
}

std::int64_t row_offset(ConstTensorView t, std::int64_t b, std::int64_t row, std::int64_t h) {
  return b * t.stride(0) + row * t.stride(1) + h * t.stride(2);
}

}  // namespace

Tensor scaled_queries(const AttentionProblem& p, ConstTensorView q, const AttentionOptions& o) {
  Tensor scaled(q.dtype(), {q.size(0), q.size(1), q.size(2), q.size(3)});
  const TensorView out = scaled;
  for_each_row(p, o, [&](std::int64_t b, std::int64_t row, std::int64_t h, double c, double) {
    const std::int64_t from = row_offset(q, b, row, h), to = row_offset(out, b, row, h);
    for (std::int64_t d = 0; d < p.dq; ++d) {
      store(out.data(), out.dtype(), to + d * out.stride(3),
            c * load(q.data(), q.dtype(), from + d * q.stride(3)));
    }
  });
  return scaled;
}

AttentionOptions without_score_scale(const AttentionOptions& o) {
  AttentionOptions rest = o;
  rest.score_scale = {};
  rest.score_scale_log_n = false;
  return rest;
}

void score_scale_gradients(const AttentionProblem& p, ConstTensorView q, ConstTensorView dq_scaled,
                           const AttentionOptions& o, TensorView dq, TensorView d_score_scale) {
  std::vector<double> sums(static_cast<std::size_t>(p.hq), 0.0);
  for_each_row(p, o, [&](std::int64_t b, std::int64_t row, std::int64_t h, double c, double ln_n) {
    const std::int64_t at_q = row_offset(q, b, row, h), at_g = row_offset(dq_scaled, b, row, h),
                       at_dq = row_offset(dq, b, row, h);
    double dot = 0.0;
    for (std::int64_t d = 0; d < p.dq; ++d) {
      const double g = load(dq_scaled.data(), dq_scaled.dtype(), at_g + d * dq_scaled.stride(3));
      dot += g * load(q.data(), q.dtype(), at_q + d * q.stride(3));
      store(dq.data(), dq.dtype(), at_dq + d * dq.stride(3), c * g);
    }
    sums[static_cast<std::size_t>(h)] += dot * ln_n;
  });
  if (!d_score_scale.defined()) return;
  for (std::int64_t h = 0; h < p.hq; ++h) {
    store(d_score_scale.data(), d_score_scale.dtype(), h * d_score_scale.stride(0),
          sums[static_cast<std::size_t>(h)]);
  }
}

}  // namespace qkv::detail
