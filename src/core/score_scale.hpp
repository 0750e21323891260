// core/score_scale.hpp — options.score_scale, a learned multiplier of each
// head's logits, by scaling the queries: with dot-product scores the logit
// scale * <c q_i, k_j> is c times scale * <q_i, k_j>, so every path runs the
// scaled queries unchanged and the multiplier touches no kernel.
//
// Row i of head h has the multiplier c_hi = score_scale[h], times ln(n_i)
// with score_scale_log_n (Scalable-Softmax), n_i the keys of the row's key
// range (causal, window, key_lengths, alignment; masks given as data come on
// top and do not count; c_hi = 0 when n_i is 0). The scaled queries are
// wider than 16-bit inputs, so no path rounds them to bf16 or f16 (an engine
// at matmul_precision medium rounds its operands as it always does): f64 for
// the reference, which then computes c_hi q_i . k_j in double as if the
// scale were applied to the score, f32 for the fused kernels, which widen
// every query to f32 anyway (one rounding of c_hi q_i to f32).
// Backward, from dq' = dL/d(c q): dq_i = c_hi dq'_i and
// dL/dscore_scale[h] = sum over (b, i) of <dq'_i, q_i> (times ln(n_i)).
#pragma once

#include <span>
#include <vector>

#include "core/checks.hpp"
#include "core/key_range.hpp"
#include "core/problem.hpp"
#include "qkv/attention.hpp"

namespace qkv::detail {

// Appends a reason for each problem of options.score_scale and
// score_scale_log_n for Hq query heads.
void check_score_scale(const AttentionOptions& o, std::int64_t hq, Reasons& r);

// One query row of q: its batch entry, its index in q's dimension 1, and
// ln(n_i) (1 without score_scale_log_n); c_hi = score_scale[h] ln_n.
struct ScaledRow {
  std::int64_t batch = 0;
  std::int64_t row = 0;
  double ln_n = 1.0;
};

// ln(n_i) of a row whose keys are the range r (0 for an empty one), or 1
// without score_scale_log_n.
double log_keys(const AttentionOptions& o, KeyRange r);

// Every row of a call's q (problem p), with its key range.
std::vector<ScaledRow> scaled_rows(const AttentionProblem& p, const AttentionOptions& o);

// c_hi q_i for the given rows and every head: [B, Nq, Hq, Dq] in `dtype`
// (rows not listed are left unwritten). The overload with a problem takes
// all of its rows.
Tensor scaled_queries(ConstTensorView q, std::span<const ScaledRow> rows, const AttentionOptions& o,
                      DType dtype);
Tensor scaled_queries(const AttentionProblem& p, ConstTensorView q, const AttentionOptions& o,
                      DType dtype);

// The options without the score scale: what the paths run on scaled queries.
AttentionOptions without_score_scale(const AttentionOptions& o);

// dq = c dq' on the given rows, and d_score_scale [Hq] (undefined: not
// asked) the rows' sum, from dq', the gradient with respect to the scaled
// queries, in double. dq may be dq_scaled itself.
void score_scale_gradients(ConstTensorView q, ConstTensorView dq_scaled,
                           std::span<const ScaledRow> rows, const AttentionOptions& o,
                           TensorView dq, TensorView d_score_scale);

}  // namespace qkv::detail
