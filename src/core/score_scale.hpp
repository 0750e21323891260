// core/score_scale.hpp — options.score_scale, a learned multiplier of each
// head's logits, by scaling the queries: with dot-product scores the logit
// scale * <c q_i, k_j> is c times scale * <q_i, k_j>, so every path runs the
// scaled queries unchanged and the multiplier touches no kernel.
//
// Row i of head h has the multiplier c_hi = score_scale[h], times ln(n_i)
// with score_scale_log_n (Scalable-Softmax), n_i the keys of the row's key
// range (causal, window, key_lengths, alignment; masks given as data come on
// top and do not count; c_hi = 0 when n_i is 0). The scaled queries are
// rounded to q's dtype: one more rounding of each query for 16-bit inputs.
// Backward, from dq' = dL/d(c q): dq_i = c_hi dq'_i and
// dL/dscore_scale[h] = sum over (b, i) of <dq'_i, q_i> (times ln(n_i)).
#pragma once

#include "core/problem.hpp"
#include "qkv/attention.hpp"

namespace qkv::detail {

// c_hi q_i for every row and head: [B, Nq, Hq, Dq] in q's dtype.
Tensor scaled_queries(const AttentionProblem& p, ConstTensorView q, const AttentionOptions& o);

// The options without the score scale: what the paths run on scaled queries.
AttentionOptions without_score_scale(const AttentionOptions& o);

// dq = c dq' and d_score_scale [Hq] (stat dtype) from dq', the gradient with
// respect to the scaled queries. dq may not alias dq_scaled.
void score_scale_gradients(const AttentionProblem& p, ConstTensorView q, ConstTensorView dq_scaled,
                           const AttentionOptions& o, TensorView dq, TensorView d_score_scale);

}  // namespace qkv::detail
