#include "core/score_scale.hpp"

#include <cmath>
#include <string>
#include <vector>

#include "core/checks.hpp"
#include "core/elements.hpp"
#include "core/key_range.hpp"

namespace qkv::detail {
namespace {

std::int64_t row_offset(ConstTensorView t, std::int64_t b, std::int64_t row, std::int64_t h) {
  return b * t.stride(0) + row * t.stride(1) + h * t.stride(2);
}

}  // namespace

double log_keys(const AttentionOptions& o, KeyRange r) {
  if (!o.score_scale_log_n) return 1.0;
  return r.hi > r.lo ? std::log(static_cast<double>(r.hi - r.lo)) : 0.0;
}

std::vector<ScaledRow> scaled_rows(const AttentionProblem& p, const AttentionOptions& o) {
  std::vector<ScaledRow> rows;
  rows.reserve(static_cast<std::size_t>(p.sequences > 0 ? p.sequence(0).nq * p.sequences : 0));
  const KeyRule rule = key_rule(o);
  for (std::int64_t s = 0; s < p.sequences; ++s) {
    const SequenceExtent e = p.sequence(s);
    const std::int64_t offset = rule.offset(e.nq, e.nk);
    for (std::int64_t i = 0; i < e.nq; ++i) {
      rows.push_back({e.batch, e.q_begin + i, log_keys(o, rule.range(i + offset, e.nk))});
    }
  }
  return rows;
}

void check_score_scale(const AttentionOptions& o, std::int64_t hq, Reasons& r) {
  if (o.score_scale.empty()) {
    if (o.score_scale_log_n) {
      r.push_back(
          "options.score_scale_log_n: scales score_scale, which is empty: expected [Hq] "
          "scales with it");
    }
    return;
  }
  if (static_cast<std::int64_t>(o.score_scale.size()) != hq) {
    r.push_back("options.score_scale: expected Hq = " + std::to_string(hq) + " scales, got " +
                std::to_string(o.score_scale.size()));
  }
  for (std::size_t h = 0; h < o.score_scale.size(); ++h) {
    if (!std::isfinite(o.score_scale[h])) {
      r.push_back("options.score_scale[" + std::to_string(h) + "]: expected a finite scale, got " +
                  num(o.score_scale[h]));
      break;
    }
  }
  if (o.score == Score::additive) {
    r.push_back(
        "options.score_scale: scales dot-product scores (Score::scaled_dot, Score::dot), "
        "got Score::additive");
  }
  // ln(n_i) counts the keys of the whole call, which a piece (options.shard)
  // does not see.
  const ShardOffsets& sh = o.shard;
  if (o.score_scale_log_n && (sh.position != 0 || sh.row != 0 || sh.key != 0)) {
    r.push_back(
        "options.score_scale_log_n: not supported with a nonzero options.shard position, row "
        "or key");
  }
}

Tensor scaled_queries(ConstTensorView q, std::span<const ScaledRow> rows, const AttentionOptions& o,
                      DType dtype) {
  Tensor scaled(dtype, {q.size(0), q.size(1), q.size(2), q.size(3)});
  const TensorView out = scaled;
  for (const ScaledRow& r : rows) {
    for (std::int64_t h = 0; h < q.size(2); ++h) {
      const double c = static_cast<double>(o.score_scale[static_cast<std::size_t>(h)]) * r.ln_n;
      const std::int64_t from = row_offset(q, r.batch, r.row, h);
      const std::int64_t to = row_offset(out, r.batch, r.row, h);
      for (std::int64_t d = 0; d < q.size(3); ++d) {
        store(out.data(), out.dtype(), to + d * out.stride(3),
              c * load(q.data(), q.dtype(), from + d * q.stride(3)));
      }
    }
  }
  return scaled;
}

Tensor scaled_queries(const AttentionProblem& p, ConstTensorView q, const AttentionOptions& o,
                      DType dtype) {
  return scaled_queries(q, scaled_rows(p, o), o, dtype);
}

AttentionOptions without_score_scale(const AttentionOptions& o) {
  AttentionOptions rest = o;
  rest.score_scale = {};
  rest.score_scale_log_n = false;
  return rest;
}

void score_scale_gradients(ConstTensorView q, ConstTensorView dq_scaled,
                           std::span<const ScaledRow> rows, const AttentionOptions& o,
                           TensorView dq, TensorView d_score_scale) {
  const std::int64_t hq = q.size(2);
  std::vector<double> sums(static_cast<std::size_t>(hq), 0.0);
  for (const ScaledRow& r : rows) {
    for (std::int64_t h = 0; h < hq; ++h) {
      const double c = static_cast<double>(o.score_scale[static_cast<std::size_t>(h)]) * r.ln_n;
      const std::int64_t at_q = row_offset(q, r.batch, r.row, h);
      const std::int64_t at_g = row_offset(dq_scaled, r.batch, r.row, h);
      const std::int64_t at_dq = row_offset(dq, r.batch, r.row, h);
      double dot = 0.0;
      for (std::int64_t d = 0; d < q.size(3); ++d) {
        const double g = load(dq_scaled.data(), dq_scaled.dtype(), at_g + d * dq_scaled.stride(3));
        dot += g * load(q.data(), q.dtype(), at_q + d * q.stride(3));
        store(dq.data(), dq.dtype(), at_dq + d * dq.stride(3), c * g);
      }
      sums[static_cast<std::size_t>(h)] += dot * r.ln_n;
    }
  }
  if (!d_score_scale.defined()) return;
  for (std::int64_t h = 0; h < hq; ++h) {
    store(d_score_scale.data(), d_score_scale.dtype(), h * d_score_scale.stride(0),
          sums[static_cast<std::size_t>(h)]);
  }
}

}  // namespace qkv::detail
