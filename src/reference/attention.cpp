#include "reference/attention.hpp"

#include <cmath>
#include <limits>
#include <vector>

#include "core/elements.hpp"
#include "core/query_maps.hpp"
#include "core/softmax_epilogue.hpp"
#include "reference/scores.hpp"

namespace qkv::reference {
namespace {

using detail::AttentionProblem;
using detail::SequenceExtent;
using detail::store;

// The attention loops in arithmetic `Real`; scores and weights are rounded to
// `rounding` (identity for f32 and f64).
template <class Real>
void attention_in(const AttentionProblem& p, ConstTensorView q, ConstTensorView k,
                  ConstTensorView v, const AttentionOutputs& outputs, const AttentionOptions& o,
                  DType rounding) {
  constexpr Real kNegInf = -std::numeric_limits<Real>::infinity();
  const TensorView out = outputs.out;
  const TensorView lse = outputs.lse;
  const TensorView probs = outputs.probs;
  // Packed sequences leave the cross-sequence blocks of probs at zero.
  if (probs.defined()) detail::fill(probs, 0.0);
  const std::vector<Real> additive_v = vector_of<Real>(o.additive.v, p.attention_size);
  const std::vector<Real> additive_bias = vector_of<Real>(o.additive.bias, p.attention_size);
  // Dropout keeps a weight with probability 1 - p and scales it by 1 / (1 - p).
  const bool dropout = o.dropout_p > 0.0;
  const auto keep_scale = static_cast<Real>(1.0 / (1.0 - o.dropout_p));
  std::vector<unsigned char> keep;  // Z of one row
  std::vector<Real> dropped;        // P_ij Z_ij / (1 - p) of one row
  std::vector<Real> scores;
  for (std::int64_t s = 0; s < p.sequences; ++s) {
    const SequenceExtent seq = p.sequence(s);
    for (std::int64_t hk = 0; hk < p.hkv; ++hk) {
      const auto keys = gather_rows<Real>(k, seq.batch, seq.k_begin, seq.nk_rows, hk);
      const auto values = gather_rows<Real>(v, seq.batch, seq.k_begin, seq.nk_rows, hk);
      const auto key_proj = o.score == Score::additive ? project(keys, seq.nk_rows, o.additive.w_k)
                                                       : std::vector<Real>{};
      for (std::int64_t h = hk * p.group(); h < (hk + 1) * p.group(); ++h) {
        const HeadContext<Real> c{p, o, seq, s, h, keys, key_proj, additive_v, additive_bias};
        for (std::int64_t i = 0; i < seq.nq; ++i) {
          std::vector<Real> query = gather_rows<Real>(q, seq.batch, seq.q_begin + i, 1, h);
          if (o.score == Score::additive) query = project(query, 1, o.additive.w_q);

          // Scores of admitted keys; -inf for dropped ones.
          scores.assign(static_cast<std::size_t>(seq.nk_rows), kNegInf);
          Real row_max = kNegInf;
          for (std::int64_t j = 0; j < seq.nk_rows; ++j) {
            if (!key_admitted(c, i, j)) continue;
            scores[j] = round_to(score(c, query, i, j), rounding);
            // A NaN score makes the maximum (and so the whole row) NaN.
            if (std::isnan(scores[j])) {
              row_max = std::numeric_limits<Real>::quiet_NaN();
            } else if (scores[j] > row_max) {
              row_max = scores[j];
            }
          }
          // Softmax with the maximum subtracted, finished by the epilogue
          // (core/softmax_epilogue.hpp): a row with no finite score (all keys
          // dropped) has weights 0, output 0 and lse -inf.
          Real sum = 0;
          for (Real& x : scores) {
            x = row_max == kNegInf ? Real(0) : std::exp(x - row_max);
            sum += x;
          }
          const detail::RowFinish<Real> finish = detail::finish_row(
              row_max, sum, detail::sink_of<Real>(o.sinks.data(), o.sinks.size(), h));
          for (Real& x : scores) x = round_to(x * finish.scale, rounding);  // the weights
          // out_i = sum_j P_ij Z_ij / (1 - p) v_j; lse and probs stay those of
          // P. A framework's dropout returns a tensor of its dtype, hence the
          // rounding of the scaled weights.
          if (dropout) {
            dropout_row(p, o, s, h, i, seq.nk_rows, keep);
            dropped.resize(static_cast<std::size_t>(seq.nk_rows));
            for (std::int64_t j = 0; j < seq.nk_rows; ++j) {
              dropped[j] = keep[j] != 0 ? round_to(scores[j] * keep_scale, rounding) : Real(0);
            }
          }
          const std::vector<Real>& weights = dropout ? dropped : scores;
          const std::int64_t row = seq.q_begin + i;
          for (std::int64_t c_out = 0; c_out < p.dv; ++c_out) {
            Real acc = 0;
            for (std::int64_t j = 0; j < seq.nk_rows; ++j) {
              // Zero weights are skipped: 0 * v_j would be NaN for non-finite
              // values in padding or masked keys.
              if (weights[j] != 0) acc += weights[j] * values[j * p.dv + c_out];
            }
            store(out.data(), out.dtype(),
                  seq.batch * out.stride(0) + row * out.stride(1) + h * out.stride(2) +
                      c_out * out.stride(3),
                  acc);
          }
          if (lse.defined()) {
            store(lse.data(), lse.dtype(),
                  seq.batch * lse.stride(0) + h * lse.stride(1) + row * lse.stride(2), finish.lse);
          }
          if (probs.defined()) {
            for (std::int64_t j = 0; j < seq.nk_rows; ++j) {
              store(probs.data(), probs.dtype(),
                    seq.batch * probs.stride(0) + h * probs.stride(1) + row * probs.stride(2) +
                        (seq.k_begin + j) * probs.stride(3),
                    scores[j]);
            }
          }
        }
      }
    }
  }
}

}  // namespace

void attention(const AttentionProblem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
               const AttentionOutputs& outputs, const AttentionOptions& o) {
  attention_in<double>(p, q, k, v, outputs, o, DType::f64);
}

void naive_attention(const AttentionProblem& p, ConstTensorView q, ConstTensorView k,
                     ConstTensorView v, const AttentionOutputs& outputs, const AttentionOptions& o,
                     DType precision) {
  if (detail::maps_queries(o)) {  // the queries mapped in `precision` (core/query_maps.hpp)
    attention_in<float>(p, detail::mapped_queries(p, q, o, precision), k, v, outputs,
                        detail::without_query_maps(o), precision);
    return;
  }
  attention_in<float>(p, q, k, v, outputs, o, precision);
}

}  // namespace qkv::reference
