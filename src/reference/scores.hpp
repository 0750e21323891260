// The score formula of qkv/attention.hpp in plain loops, shared by the
// reference forward (attention.cpp) and backward (backward.cpp) so that both
// read the same definition: which keys a row admits, f(q_i, k_j), softcap,
// the additive biases, and the dropout mask. `Real` is the arithmetic (double
// for the reference, float for the naive yardstick).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "core/elements.hpp"
#include "core/key_range.hpp"
#include "core/philox.hpp"
#include "core/problem.hpp"
#include "qkv/attention.hpp"
#include "qkv/positional.hpp"

namespace qkv::reference {

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
inline double at4(ConstTensorView t, std::int64_t a, std::int64_t b, std::int64_t c,
                  std::int64_t d) {
  return detail::load(t.data(), t.dtype(),
                      a * t.stride(0) + b * t.stride(1) + c * t.stride(2) + d * t.stride(3));
}

// Element [b, h, i, j] of a mask broadcast (right-aligned) to [B, Hq, Nq, Nk].
inline double mask_at(ConstTensorView mask, std::int64_t b, std::int64_t h, std::int64_t i,
                      std::int64_t j) {
  const std::int64_t index[4] = {b, h, i, j};
  std::int64_t offset = 0;
  for (int d = 0; d < mask.rank(); ++d) {
    const std::int64_t x = index[4 - mask.rank() + d];
    offset += (mask.size(d) == 1 ? 0 : x) * mask.stride(d);
  }
  return detail::load(mask.data(), mask.dtype(), offset);
}

// Rows [begin, begin + n) of head `h` of a rank-4 [B, N, H, D] view, as
// row-major [n][D].
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
        acc += x[r * in + c] * static_cast<Real>(detail::load(w.data(), w.dtype(),
                                                              a * w.stride(0) + c * w.stride(1)));
      }
      y[r * a_size + a] = acc;
    }
  }
  return y;
}

// The n elements of a rank-1 view; zeros when it is undefined.
template <class Real>
std::vector<Real> vector_of(ConstTensorView t, std::int64_t n) {
  std::vector<Real> x(static_cast<std::size_t>(n), Real(0));
  if (!t.defined()) return x;
  for (std::int64_t a = 0; a < n; ++a) {
    x[a] = static_cast<Real>(detail::load(t.data(), t.dtype(), a * t.stride(0)));
  }
  return x;
}

// Everything about one (sequence, query head) that the score formula needs.
template <class Real>
struct HeadContext {
  const detail::AttentionProblem& p;
  const AttentionOptions& o;
  detail::SequenceExtent seq;
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
  return i + detail::key_rule(c.o).offset(c.seq.nq, c.seq.nk);
}

// Whether row i attends to key j: every mask of the options admits it.
template <class Real>
bool key_admitted(const HeadContext<Real>& c, std::int64_t i, std::int64_t j) {
  const AttentionOptions& o = c.o;
  const std::int64_t pos = query_position(c, i);
  const detail::KeyRange range = detail::key_rule(o).range(pos, c.seq.nk);
  if (j < range.lo || j >= range.hi) return false;
  if (o.mask.defined() && o.mask.dtype() == DType::boolean &&
      mask_at(o.mask, c.seq.batch, c.h, c.seq.q_begin + i, c.seq.k_begin + j) == 0.0) {
    return false;
  }
  if (o.mask_mod && !o.mask_mod(c.s, c.h, i, j)) return false;
  return o.sparse.admits(c.h, i, pos, j);
}

// f(q_i, k_j) alone: the scaled or plain dot product, or the additive score.
// `query` is q_i [Dq], or for the additive score q_i W_q^T [A].
template <class Real>
Real raw_score(const HeadContext<Real>& c, const std::vector<Real>& query, std::int64_t j) {
  Real s = 0;
  if (c.o.score == Score::additive) {
    const std::int64_t a_size = c.p.attention_size;
    for (std::int64_t a = 0; a < a_size; ++a) {
      s += c.additive_v[a] * std::tanh(query[a] + c.key_proj[j * a_size + a] + c.additive_bias[a]);
    }
  } else {
    const std::int64_t d = c.p.dk;
    for (std::int64_t t = 0; t < d; ++t) s += query[t] * c.keys[j * d + t];
    s *= static_cast<Real>(c.p.scale);
  }
  return s;
}

// c tanh(s / c) for softcap c > 0; s unchanged when off.
template <class Real>
Real soft_capped(const AttentionOptions& o, Real s) {
  if (o.softcap <= 0.0) return s;
  const auto cap = static_cast<Real>(o.softcap);
  return cap * std::tanh(s / cap);
}

// The T5 bucket of key j relative to query row i (relative position bias).
template <class Real>
std::int64_t relative_bucket(const HeadContext<Real>& c, std::int64_t i, std::int64_t j) {
  const RelativePositionBias& rb = c.o.relative_bias;
  return t5_relative_bucket(j - query_position(c, i), rb.table.size(1), rb.max_distance,
                            rb.bidirectional);
}

// s plus the biases that follow softcap, in the order of qkv/attention.hpp:
// ALiBi, relative position bias, float mask. None depends on q, k or v.
template <class Real>
Real add_biases(const HeadContext<Real>& c, std::int64_t i, std::int64_t j, Real s) {
  const AttentionOptions& o = c.o;
  if (!o.alibi_slopes.empty()) {
    const bool per_batch = static_cast<std::int64_t>(o.alibi_slopes.size()) != c.p.hq;
    const Real slope =
        o.alibi_slopes[static_cast<std::size_t>(per_batch ? c.s * c.p.hq + c.h : c.h)];
    s += -slope * static_cast<Real>(std::llabs(query_position(c, i) - j));
  }
  if (o.relative_bias.table.defined()) {
    const ConstTensorView table = o.relative_bias.table;
    s += static_cast<Real>(
        detail::load(table.data(), table.dtype(),
                     c.h * table.stride(0) + relative_bucket(c, i, j) * table.stride(1)));
  }
  if (o.mask.defined() && o.mask.dtype() != DType::boolean) {
    s += static_cast<Real>(mask_at(o.mask, c.seq.batch, c.h, c.seq.q_begin + i, c.seq.k_begin + j));
  }
  return s;
}

// The score of key j for query row i before masking: f(q_i, k_j), softcap,
// the biases, then score_mod, in the order of qkv/attention.hpp.
template <class Real>
Real score(const HeadContext<Real>& c, const std::vector<Real>& query, std::int64_t i,
           std::int64_t j) {
  Real s = add_biases(c, i, j, soft_capped(c.o, raw_score(c, query, j)));
  if (c.o.score_mod) s = static_cast<Real>(c.o.score_mod(s, c.s, c.h, i, j));
  return s;
}

// The dropout mask Z of keys [0, n) of row i of query head h in sequence s
// (1 = kept), from the generator of qkv::dropout_keep: one Philox call yields
// the words of four consecutive keys.
inline void dropout_row(const detail::AttentionProblem& p, const AttentionOptions& o,
                        std::int64_t s, std::int64_t h, std::int64_t i, std::int64_t n,
                        std::vector<unsigned char>& keep) {
  const std::uint32_t threshold = detail::dropout_threshold(o.dropout_p);
  const std::int64_t stream = detail::dropout_stream(o.shard, p.hq, s, h);
  detail::PhiloxCounter words{};
  keep.resize(static_cast<std::size_t>(n));
  for (std::int64_t j = 0; j < n; ++j) {
    const std::int64_t global = j + o.shard.key;  // words come four keys at a time
    if (j == 0 || global % 4 == 0) {
      words =
          detail::dropout_words(o.dropout_seed, o.dropout_offset, stream, i + o.shard.row, global);
    }
    keep[j] = (words[static_cast<std::size_t>(global % 4)] >> 8) >= threshold ? 1 : 0;
  }
}

}  // namespace qkv::reference
