#include "reference/attention.hpp"

#include <cmath>
#include <limits>
#include <vector>

#include "core/elements.hpp"
#include "qkv/positional.hpp"

namespace qkv::reference {
namespace {

using detail::AttentionProblem;
using detail::load;
using detail::SequenceExtent;
using detail::store;

// Rounds x to `dtype` (f16 or bf16) as a framework computing in that dtype
// does between operations; identity for f32 and f64.
template <class Real>
Real round_to(Real x, DType dtype) {
  switch (dtype) {
    case DType::f16:
      return static_cast<Real>(to_float(to_f16(static_cast<double>(x))));
    case DType::bf16:
      return static_cast<Real>(to_float(to_bf16(static_cast<double>(x))));
    default:
      return x;
  }
}

// Element (a, b, c, d) of a rank-4 view.
double at4(ConstTensorView t, std::int64_t a, std::int64_t b, std::int64_t c, std::int64_t d) {
  return load(t.data(), t.dtype(),
              a * t.stride(0) + b * t.stride(1) + c * t.stride(2) + d * t.stride(3));
}

// Element [b, h, i, j] of a mask broadcast (right-aligned) to [B, Hq, Nq, Nk].
double mask_at(ConstTensorView mask, std::int64_t b, std::int64_t h, std::int64_t i,
               std::int64_t j) {
  const std::int64_t index[4] = {b, h, i, j};
  std::int64_t offset = 0;
  for (int d = 0; d < mask.rank(); ++d) {
    const std::int64_t x = index[4 - mask.rank() + d];
    offset += (mask.size(d) == 1 ? 0 : x) * mask.stride(d);
  }
  return load(mask.data(), mask.dtype(), offset);
}

// Rows [begin, begin + n) of head `h` of a rank-4 [B, N, H, D] view, as
// row-major doubles [n][D].
template <class Real>
std::vector<Real> gather_rows(ConstTensorView t, std::int64_t b, std::int64_t begin, std::int64_t n,
                              std::int64_t h) {
  const std::int64_t d = t.size(3);
  std::vector<Real> rows(static_cast<std::size_t>(n * d));
  for (std::int64_t r = 0; r < n; ++r) {
    for (std::int64_t c = 0; c < d; ++c) {
      rows[r * d + c] = static_cast<Real>(at4(t, b, begin + r, h, c));
    }
  }
  return rows;
}

// x W^T for x [n][in] and W [A][in]: [n][A] (the additive score's projections).
template <class Real>
std::vector<Real> project(const std::vector<Real>& x, std::int64_t n, ConstTensorView w) {
  const std::int64_t a_size = w.size(0);
  const std::int64_t in = w.size(1);
  std::vector<Real> y(static_cast<std::size_t>(n * a_size));
  for (std::int64_t r = 0; r < n; ++r) {
    for (std::int64_t a = 0; a < a_size; ++a) {
      Real acc = 0;
      for (std::int64_t c = 0; c < in; ++c) {
        acc += x[r * in + c] *
               static_cast<Real>(load(w.data(), w.dtype(), a * w.stride(0) + c * w.stride(1)));
      }
      y[r * a_size + a] = acc;
    }
  }
  return y;
}

// Everything about one (sequence, query head) that the score formula needs.
template <class Real>
struct HeadContext {
  const AttentionProblem& p;
  const AttentionOptions& o;
  SequenceExtent seq;
  std::int64_t s = 0;                      // sequence index
  std::int64_t h = 0;                      // query head
  const std::vector<Real>& keys;           // [nk_rows][Dk]
  const std::vector<Real>& key_proj;       // additive: [nk_rows][A] = k W_k^T
  const std::vector<Real>& additive_v;     // additive: v [A]
  const std::vector<Real>& additive_bias;  // additive: bias [A] (zeros if absent)
};

// Position of query row i on the key axis (the diagonal for causal/window).
template <class Real>
std::int64_t query_position(const HeadContext<Real>& c, std::int64_t i) {
  return c.o.align == Align::bottom_right ? i + (c.seq.nk - c.seq.nq) : i;
}

template <class Real>
bool key_admitted(const HeadContext<Real>& c, std::int64_t i, std::int64_t j) {
  const AttentionOptions& o = c.o;
  const std::int64_t pos = query_position(c, i);
  if (j >= c.seq.nk) return false;
  if (o.causal && j > pos) return false;
  if (o.window_left >= 0 && j < pos - o.window_left) return false;
  if (o.window_right >= 0 && j > pos + o.window_right) return false;
  if (o.mask.defined() && o.mask.dtype() == DType::boolean &&
      mask_at(o.mask, c.seq.batch, c.h, c.seq.q_begin + i, c.seq.k_begin + j) == 0.0) {
    return false;
  }
  if (o.mask_mod && !o.mask_mod(c.s, c.h, i, j)) return false;
  return true;
}

// f(q_i, k_j) plus every bias, before masking. `query` is q_i [Dq], or for the
// additive score q_i W_q^T [A].
template <class Real>
Real score(const HeadContext<Real>& c, const std::vector<Real>& query, std::int64_t i,
           std::int64_t j) {
  const AttentionOptions& o = c.o;
  Real s = 0;
  if (o.score == Score::additive) {
    const std::int64_t a_size = c.p.attention_size;
    for (std::int64_t a = 0; a < a_size; ++a) {
      s += c.additive_v[a] * std::tanh(query[a] + c.key_proj[j * a_size + a] + c.additive_bias[a]);
    }
  } else {
    const std::int64_t d = c.p.dk;
    for (std::int64_t t = 0; t < d; ++t) s += query[t] * c.keys[j * d + t];
    s *= static_cast<Real>(c.p.scale);
  }
  if (o.softcap > 0.0) {
    const auto cap = static_cast<Real>(o.softcap);
    s = cap * std::tanh(s / cap);
  }
  const std::int64_t pos = query_position(c, i);
  if (!o.alibi_slopes.empty()) {
    const bool per_batch = static_cast<std::int64_t>(o.alibi_slopes.size()) != c.p.hq;
    const Real slope =
        o.alibi_slopes[static_cast<std::size_t>(per_batch ? c.s * c.p.hq + c.h : c.h)];
    s += -slope * static_cast<Real>(std::llabs(pos - j));
  }
  if (o.relative_bias.table.defined()) {
    const ConstTensorView table = o.relative_bias.table;
    const std::int64_t bucket = t5_relative_bucket(
        j - pos, table.size(1), o.relative_bias.max_distance, o.relative_bias.bidirectional);
    s += static_cast<Real>(
        load(table.data(), table.dtype(), c.h * table.stride(0) + bucket * table.stride(1)));
  }
  if (o.mask.defined() && o.mask.dtype() != DType::boolean) {
    s += static_cast<Real>(mask_at(o.mask, c.seq.batch, c.h, c.seq.q_begin + i, c.seq.k_begin + j));
  }
  if (o.score_mod) s = static_cast<Real>(o.score_mod(s, c.s, c.h, i, j));
  return s;
}

template <class Real>
std::vector<Real> vector_of(ConstTensorView t, std::int64_t n) {
  std::vector<Real> x(static_cast<std::size_t>(n), Real(0));
  if (!t.defined()) return x;
  for (std::int64_t a = 0; a < n; ++a) {
    x[a] = static_cast<Real>(load(t.data(), t.dtype(), a * t.stride(0)));
  }
  return x;
}

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
  if (probs.defined()) {
    // Packed sequences leave the cross-sequence blocks of probs at zero.
    detail::for_each_index(probs.sizes(), 4, [&](const Shape& idx) {
      store(probs.data(), probs.dtype(), detail::offset(idx, probs.strides(), 4), 0.0);
    });
  }
  const std::vector<Real> additive_v = vector_of<Real>(o.additive.v, p.attention_size);
  const std::vector<Real> additive_bias = vector_of<Real>(o.additive.bias, p.attention_size);
  std::vector<Real> scores;
  for (std::int64_t s = 0; s < p.sequences; ++s) {
    const SequenceExtent seq = p.sequence(s, o);
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
          // Softmax with the maximum subtracted; a row with no finite score
          // (all keys dropped) has weights 0, output 0 and lse -inf.
          Real sum = 0;
          for (Real& x : scores) {
            x = row_max == kNegInf ? Real(0) : std::exp(x - row_max);
            sum += x;
          }
          const Real inv_sum = sum == 0 ? Real(0) : 1 / sum;
          for (Real& x : scores) x = round_to(x * inv_sum, rounding);  // the weights
          const std::int64_t row = seq.q_begin + i;
          for (std::int64_t c_out = 0; c_out < p.dv; ++c_out) {
            Real acc = 0;
            for (std::int64_t j = 0; j < seq.nk_rows; ++j) {
              if (scores[j] != 0) acc += scores[j] * values[j * p.dv + c_out];
            }
            store(out.data(), out.dtype(),
                  seq.batch * out.stride(0) + row * out.stride(1) + h * out.stride(2) +
                      c_out * out.stride(3),
                  acc);
          }
          if (lse.defined()) {
            store(lse.data(), lse.dtype(),
                  seq.batch * lse.stride(0) + h * lse.stride(1) + row * lse.stride(2),
                  sum == 0 ? kNegInf : row_max + std::log(sum));
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
  attention_in<float>(p, q, k, v, outputs, o, precision);
}

}  // namespace qkv::reference
