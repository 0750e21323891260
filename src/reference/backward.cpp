// The reference backward: the formulas of qkv/backward.hpp in plain loops,
// accumulating in double. Scores come from the forward's own score code
// (reference/scores.hpp); for each pair (i, j) the masks admit and whose
// score is not -inf, with P_ij = exp(s_ij - lse_i) and lse_i the row's
// logsumexp recomputed in double (the caller's lse is f32, half an ulp of
// |lse| off in the exponent), rZ_ij = Z_ij / (1 - p) the scaled dropout mask
// (1 without dropout) and D_i = <dout_i, out_i>:
//
//   dv_j  += rZ_ij P_ij dout_i
//   dS_ij  = P_ij (rZ_ij <dout_i, v_j> - D_i)          gradient of the score s_ij
//   d_table[h, bucket(i, j)] += dS_ij                  the bias is added to s_ij
//   d_mask[b, h, i, j] += dS_ij                        so is a float mask
//   dR_ij  = dS_ij (1 - tanh^2(R_ij / c))              through softcap c tanh(R / c)
//
// and through the raw score R_ij = f(q_i, k_j):
//
//   dot       R = scale <q_i, k_j>:    dq_i += scale dR k_j,  dk_j += scale dR q_i
//   additive  R = sum_a v_a t_a,  t = tanh(u),  u = W_q q_i + W_k k_j + b:
//             dv_a += dR t_a,  du_a = dR v_a (1 - t_a^2),  d_bias += du,
//             dq_i += W_q^T du,  dW_q += du q_i^T,  dk_j += W_k^T du,  dW_k += du k_j^T
//
// D_i is the softmax's correction: sum_l P_il dP_il with dP_il = rZ_il
// <dout_i, v_l> equals <dout_i, out_i> because out_i = sum_l P_il rZ_il v_l.
// ALiBi is a constant here; a float mask has a gradient when asked
// (options.mask_requires_grad), summed where the mask broadcasts.
//
// The same loops in float, rounding P, dP and dS to f16/bf16 for those
// inputs and taking the caller's lse as a kernel would, are the naive
// computation whose error sets the fast backward's tolerance
// (naive_attention_backward).
#include "reference/backward.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "core/elements.hpp"
#include "core/mask_gradient.hpp"
#include "core/query_maps.hpp"
#include "core/softmax_epilogue.hpp"
#include "reference/scores.hpp"

namespace qkv::reference {
namespace {

using detail::load;
using detail::store;

// Element (r, c) of a rank-2 view.
double at2(ConstTensorView t, std::int64_t r, std::int64_t c) {
  return load(t.data(), t.dtype(), r * t.stride(0) + c * t.stride(1));
}

// Writes row-major [rows][cols] `values` to rows [begin, begin + rows) of head
// `h` of the rank-4 [B, N, H, cols] view `t`.
template <class Real>
void scatter_rows(TensorView t, std::int64_t b, std::int64_t begin, std::int64_t rows,
                  std::int64_t h, const std::vector<Real>& values) {
  const std::int64_t cols = t.size(3);
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < cols; ++c) {
      store(t.data(), t.dtype(),
            b * t.stride(0) + (begin + r) * t.stride(1) + h * t.stride(2) + c * t.stride(3),
            values[r * cols + c]);
    }
  }
}

// Writes row-major `values` to a rank-1 or rank-2 view (when defined).
template <class Real>
void store_parameter(TensorView t, const std::vector<Real>& values) {
  if (!t.defined()) return;
  const std::int64_t cols = t.rank() == 2 ? t.size(1) : 1;
  const std::int64_t col_stride = t.rank() == 2 ? t.stride(1) : 0;
  for (std::int64_t r = 0; r < t.size(0); ++r) {
    for (std::int64_t c = 0; c < cols; ++c) {
      store(t.data(), t.dtype(), r * t.stride(0) + c * col_stride, values[r * cols + c]);
    }
  }
}

// y += W^T x for W [A][n] and x [A] (the adjoint of x -> W x).
template <class Real>
void add_transposed_product(ConstTensorView w, const Real* x, Real* y) {
  for (std::int64_t a = 0; a < w.size(0); ++a) {
    for (std::int64_t c = 0; c < w.size(1); ++c) y[c] += static_cast<Real>(at2(w, a, c)) * x[a];
  }
}

// dW += x y^T for x [A] and y [n], dW row-major [A][n].
template <class Real>
void add_outer_product(const Real* x, const Real* y, std::int64_t a_size, std::int64_t n,
                       std::vector<Real>& dw) {
  for (std::int64_t a = 0; a < a_size; ++a) {
    for (std::int64_t c = 0; c < n; ++c) dw[a * n + c] += x[a] * y[c];
  }
}

template <class Real>
bool all_zero(const Real* x, std::int64_t n) {
  return std::all_of(x, x + n, [](Real e) { return e == 0; });
}

// The row's lse from its scores and its sink (-inf: none), finished by the
// epilogue (core/softmax_epilogue.hpp): the sink (-inf without one) when
// every score is -inf (no key admitted), NaN when one is NaN or +inf.
template <class Real>
Real logsumexp(const std::vector<Real>& scores, Real sink) {
  constexpr Real kNegInf = -std::numeric_limits<Real>::infinity();
  Real max = kNegInf;
  for (const Real x : scores) max = std::isnan(x) || x > max ? x : max;
  if (std::isnan(max) || max == -kNegInf) return std::numeric_limits<Real>::quiet_NaN();
  Real sum = 0;
  if (max != kNegInf) {
    for (const Real x : scores) sum += std::exp(x - max);
  }
  return detail::finish_row(max, sum, sink).lse;
}

// The backward loops in arithmetic `Real`; P, dP and dS are rounded to
// `rounding` (identity for f32 and f64). With `own_lse` the weights come from
// the row's logsumexp recomputed in `Real`, else from the caller's lse (as a
// kernel computing in that precision would use its forward's).
template <class Real>
void backward_in(const detail::AttentionProblem& p, ConstTensorView q, ConstTensorView k,
                 ConstTensorView v, ConstTensorView out, ConstTensorView dout, ConstTensorView lse,
                 const GradientOutputs& grads, const AttentionOptions& o, DType rounding,
                 bool own_lse) {
  constexpr Real kNegInf = -std::numeric_limits<Real>::infinity();
  const bool additive = o.score == Score::additive;
  const std::int64_t a_size = p.attention_size;  // 0 unless additive
  const std::vector<Real> additive_v = vector_of<Real>(o.additive.v, a_size);
  const std::vector<Real> additive_bias = vector_of<Real>(o.additive.bias, a_size);
  const ConstTensorView table = o.relative_bias.table;
  const std::int64_t buckets = table.defined() ? table.size(1) : 0;
  const bool dropout = o.dropout_p > 0.0;
  const auto keep_scale = static_cast<Real>(1.0 / (1.0 - o.dropout_p));  // r

  // Parameter gradients, summed over every sequence, head and row.
  std::vector<Real> d_table(static_cast<std::size_t>(p.hq * buckets));  // [Hq][buckets]
  std::vector<Real> d_w_q(static_cast<std::size_t>(a_size * p.dq));     // [A][Dq]
  std::vector<Real> d_w_k(static_cast<std::size_t>(a_size * p.dk));     // [A][Dk]
  std::vector<Real> d_additive_v(static_cast<std::size_t>(a_size));     // [A]
  std::vector<Real> d_additive_bias(static_cast<std::size_t>(a_size));  // [A]
  // dS at every (b, h, i, j), for d_mask (core/mask_gradient.hpp).
  Tensor ds_full = grads.d_mask.defined() ? detail::score_gradients(p, dtype_of_v<Real>) : Tensor();
  Real* const ds_at = ds_full.defined() ? ds_full.data<Real>() : nullptr;

  std::vector<unsigned char> keep;  // Z of one row
  std::vector<Real> raw_scores;     // R_ij of one row
  std::vector<Real> scores;         // s_ij of one row; -inf where key j is dropped
  for (std::int64_t s = 0; s < p.sequences; ++s) {
    const detail::SequenceExtent seq = p.sequence(s);
    const std::int64_t nk = seq.nk_rows;
    for (std::int64_t hk = 0; hk < p.hkv; ++hk) {
      const auto keys = gather_rows<Real>(k, seq.batch, seq.k_begin, nk, hk);    // [nk][Dk]
      const auto values = gather_rows<Real>(v, seq.batch, seq.k_begin, nk, hk);  // [nk][Dv]
      const auto key_proj =
          additive ? project(keys, nk, o.additive.w_k) : std::vector<Real>{};  // [nk][A]
      // Gradients of this KV head's keys and values, summed over the query
      // heads that share it; d_key_proj [nk][A] is that of k_j W_k^T.
      std::vector<Real> dk(static_cast<std::size_t>(nk * p.dk));
      std::vector<Real> dv(static_cast<std::size_t>(nk * p.dv));
      std::vector<Real> d_key_proj(static_cast<std::size_t>(nk * a_size));
      for (std::int64_t h = hk * p.group(); h < (hk + 1) * p.group(); ++h) {
        const HeadContext<Real> head{p, o, seq, s, h, keys, key_proj, additive_v, additive_bias};
        for (std::int64_t i = 0; i < seq.nq; ++i) {
          const std::int64_t row = seq.q_begin + i;
          const auto q_row = gather_rows<Real>(q, seq.batch, row, 1, h);  // [Dq]
          const auto query = additive ? project(q_row, 1, o.additive.w_q) : q_row;
          const auto out_row = gather_rows<Real>(out, seq.batch, row, 1, h);    // [Dv]
          const auto dout_row = gather_rows<Real>(dout, seq.batch, row, 1, h);  // [Dv]
          raw_scores.assign(static_cast<std::size_t>(nk), 0);
          scores.assign(static_cast<std::size_t>(nk), kNegInf);
          for (std::int64_t j = 0; j < nk; ++j) {
            if (!key_admitted(head, i, j)) continue;
            raw_scores[j] = raw_score(head, query, j);
            scores[j] = round_to(add_biases(head, i, j, soft_capped(o, raw_scores[j])), rounding);
          }
          const Real row_lse =
              own_lse ? logsumexp(scores, detail::sink_of<Real>(o.sinks.data(), o.sinks.size(), h))
                      : static_cast<Real>(load(
                            lse.data(), lse.dtype(),
                            seq.batch * lse.stride(0) + h * lse.stride(1) + row * lse.stride(2)));
          std::vector<Real> dq(static_cast<std::size_t>(p.dq));
          std::vector<Real> d_query(static_cast<std::size_t>(a_size));  // of q_i W_q^T
          // A row without admitted keys (lse = -inf) had out = 0 and no
          // weights: its gradients are zero.
          if (row_lse != kNegInf) {
            const Real d_i = detail::row_delta(dout_row.data(), out_row.data(), p.dv);
            if (dropout) dropout_row(p, o, s, h, i, nk, keep);
            for (std::int64_t j = 0; j < nk; ++j) {
              // Dropped keys (masks, or a score of -inf) contribute nothing,
              // not even 0 * inf from a value or key they never meet.
              if (scores[j] == kNegInf) continue;
              const Real raw = raw_scores[j];  // R_ij
              const Real score = scores[j];
              const Real prob = round_to(detail::weight_from_lse(score, row_lse), rounding);
              // A factor of exactly 0 (a weight that underflowed, a dropout
              // zero) cancels its terms, even a NaN or inf in the other factor.
              if (prob == 0) continue;
              const Real rz = dropout ? (keep[j] != 0 ? keep_scale : Real(0)) : Real(1);
              Real dp = 0;  // <dout_i, v_j>, which rZ_ij multiplies
              if (rz != 0) {
                for (std::int64_t c = 0; c < p.dv; ++c) {
                  dp += dout_row[c] * values[j * p.dv + c];
                  dv[j * p.dv + c] += rz * prob * dout_row[c];
                }
                dp = round_to(dp, rounding);
              }
              const Real ds = round_to(prob * (rz * dp - d_i), rounding);
              if (ds == 0) continue;
              if (table.defined()) d_table[h * buckets + relative_bucket(head, i, j)] += ds;
              if (ds_at != nullptr) {
                ds_at[((seq.batch * p.hq + h) * p.nq + row) * p.nk + seq.k_begin + j] = ds;
              }
              Real dr = ds;
              if (o.softcap > 0.0) {
                const Real t = std::tanh(raw / static_cast<Real>(o.softcap));
                dr *= 1.0 - t * t;
              }
              if (additive) {
                for (std::int64_t a = 0; a < a_size; ++a) {
                  const Real t = std::tanh(query[a] + key_proj[j * a_size + a] + additive_bias[a]);
                  const Real du = dr * additive_v[a] * (1.0 - t * t);
                  d_additive_v[a] += dr * t;
                  d_additive_bias[a] += du;
                  d_query[a] += du;
                  d_key_proj[j * a_size + a] += du;
                }
              } else {
                for (std::int64_t c = 0; c < p.dk; ++c) {
                  dq[c] += static_cast<Real>(p.scale) * dr * keys[j * p.dk + c];
                  dk[j * p.dk + c] += static_cast<Real>(p.scale) * dr * q_row[c];
                }
              }
            }
          }
          // A row or key that no admitted pair reached has a zero gradient
          // of its projection and is skipped, so that whatever it holds
          // (padding, NaN) never enters dW_q or dW_k as 0 * NaN.
          if (additive && !all_zero(d_query.data(), a_size)) {
            add_transposed_product(o.additive.w_q, d_query.data(), dq.data());
            add_outer_product(d_query.data(), q_row.data(), a_size, p.dq, d_w_q);
          }
          scatter_rows(grads.dq, seq.batch, row, 1, h, dq);
        }
      }
      if (additive) {
        for (std::int64_t j = 0; j < nk; ++j) {
          const Real* d_proj = d_key_proj.data() + j * a_size;
          if (all_zero(d_proj, a_size)) continue;
          add_transposed_product(o.additive.w_k, d_proj, dk.data() + j * p.dk);
          add_outer_product(d_proj, keys.data() + j * p.dk, a_size, p.dk, d_w_k);
        }
      }
      scatter_rows(grads.dk, seq.batch, seq.k_begin, nk, hk, dk);
      scatter_rows(grads.dv, seq.batch, seq.k_begin, nk, hk, dv);
    }
  }
  store_parameter(grads.d_relative_bias, d_table);
  store_parameter(grads.d_additive_w_q, d_w_q);
  store_parameter(grads.d_additive_w_k, d_w_k);
  store_parameter(grads.d_additive_v, d_additive_v);
  store_parameter(grads.d_additive_bias, d_additive_bias);
  if (ds_at != nullptr) detail::sum_into_mask(ds_full, grads.d_mask);
}

}  // namespace

void attention_backward(const detail::AttentionProblem& p, ConstTensorView q, ConstTensorView k,
                        ConstTensorView v, ConstTensorView out, ConstTensorView dout,
                        ConstTensorView lse, const GradientOutputs& grads,
                        const AttentionOptions& o) {
  // The exact weights come from the row's own logsumexp in double, not from
  // the caller's (f32, half an ulp of |lse| off in the exponent), unless the
  // keys are only a block of the row's (a piece of a larger call).
  backward_in<double>(p, q, k, v, out, dout, lse, grads, o, DType::f64, !o.shard.partial_keys);
}

void sink_gradients(const detail::AttentionProblem& p, ConstTensorView out, ConstTensorView dout,
                    ConstTensorView lse, const AttentionOptions& o, TensorView d_sinks) {
  std::vector<double> out_row(static_cast<std::size_t>(p.dv));
  std::vector<double> dout_row(static_cast<std::size_t>(p.dv));
  for (std::int64_t h = 0; h < p.hq; ++h) {
    double g = 0;
    for (std::int64_t s = 0; s < p.sequences; ++s) {
      const detail::SequenceExtent seq = p.sequence(s);
      g += detail::sink_gradient<double>(
          o.sinks[static_cast<std::size_t>(h)], seq.nq, [&](std::int64_t i) {
            const std::int64_t row = seq.q_begin + i;
            for (std::int64_t c = 0; c < p.dv; ++c) {
              const Shape at = {seq.batch, row, h, c};
              out_row[c] = load(out.data(), out.dtype(), detail::offset(at, out.strides(), 4));
              dout_row[c] = load(dout.data(), dout.dtype(), detail::offset(at, dout.strides(), 4));
            }
            const Shape at = {seq.batch, h, row};
            return std::pair<double, double>{
                load(lse.data(), lse.dtype(), detail::offset(at, lse.strides(), 3)),
                detail::row_delta(dout_row.data(), out_row.data(), p.dv)};
          });
    }
    detail::store(d_sinks.data(), d_sinks.dtype(), h * d_sinks.stride(0), g);
  }
}

void naive_attention_backward(const detail::AttentionProblem& p, ConstTensorView q,
                              ConstTensorView k, ConstTensorView v, ConstTensorView out,
                              ConstTensorView dout, ConstTensorView lse,
                              const GradientOutputs& grads, const AttentionOptions& o,
                              DType precision) {
  if (detail::maps_queries(o)) {  // the queries mapped in `precision` (core/query_maps.hpp)
    const std::vector<detail::QueryRow> rows = detail::query_rows(p, o);
    Tensor d_mapped(DType::f32, {p.batch, p.nq, p.hq, p.dq});
    backward_in<float>(p, detail::mapped_queries(q, rows, o, precision), k, v, out, dout, lse,
                       detail::mapped_gradients(grads, d_mapped), detail::without_query_maps(o),
                       precision, false);
    detail::query_map_gradients(q, d_mapped, rows, o, precision, grads.dq, grads);
    return;
  }
  backward_in<float>(p, q, k, v, out, dout, lse, grads, o, precision, false);
}

}  // namespace qkv::reference
