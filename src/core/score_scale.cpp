#include "core/score_scale.hpp"

#include <cmath>
#include <string>
#include <vector>

#include "core/checks.hpp"
#include "core/elements.hpp"

namespace qkv::detail {
namespace {

std::int64_t row_offset(ConstTensorView t, std::int64_t b, std::int64_t row, std::int64_t h) {
  return b * t.stride(0) + row * t.stride(1) + h * t.stride(2);
}

// ln(n_i) of a row with n_i keys (0 for none), or 1 without score_scale_log_n.
double log_keys(const AttentionOptions& o, const QueryRow& r) {
  if (!o.score_scale_log_n) return 1.0;
  return r.keys > 0 ? std::log(static_cast<double>(r.keys)) : 0.0;
}

void check(const AttentionOptions& o, std::int64_t hq, Reasons& r) {
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

void apply(ConstTensorView q, std::span<const QueryRow> rows, const AttentionOptions& o,
           TensorView out) {
  for (const QueryRow& r : rows) {
    const double ln_n = log_keys(o, r);
    for (std::int64_t h = 0; h < q.size(2); ++h) {
      const double c = static_cast<double>(o.score_scale[static_cast<std::size_t>(h)]) * ln_n;
      const std::int64_t from = row_offset(q, r.batch, r.row, h);
      const std::int64_t to = row_offset(out, r.batch, r.row, h);
      for (std::int64_t d = 0; d < q.size(3); ++d) {
        store(out.data(), out.dtype(), to + d * out.stride(3),
              c * load(q.data(), q.dtype(), from + d * q.stride(3)));
      }
    }
  }
}

void pull_back(ConstTensorView q, ConstTensorView dq_scaled, std::span<const QueryRow> rows,
               const AttentionOptions& o, TensorView dq, TensorView d_score_scale) {
  const std::int64_t hq = q.size(2);
  std::vector<double> sums(static_cast<std::size_t>(hq), 0.0);
  for (const QueryRow& r : rows) {
    const double ln_n = log_keys(o, r);
    for (std::int64_t h = 0; h < hq; ++h) {
      const double c = static_cast<double>(o.score_scale[static_cast<std::size_t>(h)]) * ln_n;
      const std::int64_t at_q = row_offset(q, r.batch, r.row, h);
      const std::int64_t at_g = row_offset(dq_scaled, r.batch, r.row, h);
      const std::int64_t at_dq = row_offset(dq, r.batch, r.row, h);
      double dot = 0.0;
      for (std::int64_t d = 0; d < q.size(3); ++d) {
        const double g = load(dq_scaled.data(), dq_scaled.dtype(), at_g + d * dq_scaled.stride(3));
        dot += g * load(q.data(), q.dtype(), at_q + d * q.stride(3));
        store(dq.data(), dq.dtype(), at_dq + d * dq.stride(3), c * g);
      }
      sums[static_cast<std::size_t>(h)] += dot * ln_n;
    }
  }
  if (!d_score_scale.defined()) return;
  for (std::int64_t h = 0; h < hq; ++h) {
    store(d_score_scale.data(), d_score_scale.dtype(), h * d_score_scale.stride(0),
          sums[static_cast<std::size_t>(h)]);
  }
}

bool used(const AttentionOptions& o) { return !o.score_scale.empty(); }

void remove(AttentionOptions& o) {
  o.score_scale = {};
  o.score_scale_log_n = false;
}

void select_heads(AttentionOptions& o, std::int64_t h0, std::int64_t n) {
  o.score_scale = o.score_scale.subspan(static_cast<std::size_t>(h0), static_cast<std::size_t>(n));
}

}  // namespace

const QueryMap kScoreScaleMap{.used = used,
                              .check = check,
                              .remove = remove,
                              .select_heads = select_heads,
                              .apply = apply,
                              .pull_back = pull_back,
                              .gradient = &AttentionGradients::d_score_scale,
                              .gradient_view = &GradientOutputs::d_score_scale};

}  // namespace qkv::detail
