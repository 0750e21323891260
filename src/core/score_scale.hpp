// core/score_scale.hpp — options.score_scale, a learned multiplier of each
// head's logits, as a map of the queries (core/query_maps.hpp): with
// dot-product scores the logit scale * <c q_i, k_j> is c times
// scale * <q_i, k_j>, so every path runs the scaled queries unchanged and the
// multiplier touches no kernel.
//
// Row i of head h has the multiplier c_hi = score_scale[h], times ln(n_i)
// with score_scale_log_n (Scalable-Softmax), n_i the keys of the row's key
// range (QueryRow::keys; c_hi = 0 when n_i is 0). Backward, from
// dq' = dL/d(c q): dq_i = c_hi dq'_i and dL/dscore_scale[h] = sum over (b, i)
// of <dq'_i, q_i> (times ln(n_i)), in double.
#pragma once

#include "core/query_maps.hpp"

namespace qkv::detail {

// Its row of kQueryMaps.
extern const QueryMap kScoreScaleMap;

}  // namespace qkv::detail
