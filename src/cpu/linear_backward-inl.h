// The per-target body of the linear attention backward (formulas in
// qkv/linear.hpp), on the building blocks of linear-inl.h. With A = phi(Q_n),
// K = phi(K_n), V = V_n for chunk n and G = dout / den row-wise:
//
//   pass 1, forward over the chunks, state S^T and z:
//     U = G S^T + tril(G V^T) K,  c_i = -<a_i, u_i> / den_i,  da_i = u_i + c_i z_i  ->  dq
//   pass 2, backward over the chunks, state R = sum_i a_i g_i^T and r = sum_i c_i a_i over
//   the queries after the chunk:
//     dK^T = R V^T + r + A^T tril(G V^T + c),  dV = K R + tril(A K^T)^T G  ->  dk, dv,
//     then R += A^T G, r += A^T c
//
// The non-causal backward sums S and R over all positions first and drops
// the tril terms.
#if defined(QKV_CPU_LINEAR_BACKWARD_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_CPU_LINEAR_BACKWARD_INL_H_
#undef QKV_CPU_LINEAR_BACKWARD_INL_H_
#else
#define QKV_CPU_LINEAR_BACKWARD_INL_H_
#endif

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/hwy_namespace.hpp"
#include "cpu/linear-inl.h"
#include "hwy/highway.h"

QKV_HWY_NAMESPACE_BEGIN(cpu);

// dphi/dx times g: 1 for x > 0, else e^x (elu + 1) or 0 (relu).
template <class D, class V = hn::Vec<D>>
HWY_INLINE V PhiVjp(D d, V x, V g, FeatureMap map) {
  const auto positive = hn::Gt(x, hn::Zero(d));
  if (map == FeatureMap::relu) return hn::IfThenElseZero(positive, g);
  return hn::IfThenElse(positive, g, hn::Mul(g, FastExp(d, x)));
}

// dx [D] = J_phi(x)^T df for one row x [D], df [M].
inline void FeatureVjp(const LinearAttentionOptions& o, const LinearShape& s,
                       const float* HWY_RESTRICT x, const float* HWY_RESTRICT df,
                       float* HWY_RESTRICT dx, LinearScratch& w) {
  if (o.feature_map == FeatureMap::custom) {
    std::copy_n(x, s.d, w.xd.begin());
    std::copy_n(df, s.m, w.fd.begin());
    o.custom.vjp(w.xd, w.fd, w.gd);
    std::copy_n(w.gd.begin(), s.d, dx);
    return;
  }
  ForLanes(s.d, [&](auto d, std::int64_t i) {
    hn::StoreU(PhiVjp(d, hn::LoadU(d, x + i), hn::LoadU(d, df + i), o.feature_map), d, dx + i);
  });
}

// The rows of head h `offset` positions after p0 (0: none).
inline RowsAhead Ahead(std::int64_t b, std::int64_t h, std::int64_t p0, std::int64_t offset) {
  return offset == 0 ? RowsAhead{} : RowsAhead{b, h, p0 + offset};
}

// Contraction spans for Product (linear-inl.h) with triangular operands
// read transposed. A upper triangular: row r sums k >= r.
inline auto FromRow(std::int64_t depth) {
  return [depth](std::int64_t r0, std::int64_t, std::int64_t) { return KeySpan{r0, depth}; };
}
// B lower triangular: column j sums k >= j.
inline auto FromColumn(std::int64_t depth) {
  return [depth](std::int64_t, std::int64_t, std::int64_t c0) { return KeySpan{c0, depth}; };
}

// What the backward passes share: dout, the gradients, and per query row
// (b, h, i) the normalizer den and c = -<a, u> / den from pass 1
// ([B][Hq][Nq] each).
struct BackwardState {
  ConstTensorView dout;
  LinearAttentionGradientOutputs grads;
  std::vector<float> den, c;
  std::int64_t RowIndex(const detail::LinearProblem& p, std::int64_t b, std::int64_t h,
                        std::int64_t i) const {
    return (b * p.hq + h) * p.nq + i;
  }
};

// g = dout / den for rows [p0, p0 + n) of head h into w.grad [n][dv_pad],
// den from w.den (not normalized: g = dout); prefetches the rows of head h
// `ahead` positions away (0: none).
inline void GradRows(const LinearPlan& plan, const LinearShape& s, const BackwardState& bs,
                     std::int64_t b, std::int64_t h, std::int64_t p0, std::int64_t n,
                     std::int64_t ahead, LinearScratch& w) {
  LoadRows(bs.dout, b, h, p0, n, 0, s.dv, s.dv_pad, Ahead(b, h, p0, ahead), w.grad.get());
  if (!plan.options->normalize) return;
  for (std::int64_t t = 0; t < n; ++t) Divide(w.grad.get() + t * s.dv_pad, s.dv, w.den[t]);
}

// Pass 1 for the queries [p0, p0 + n) of every head of KV head hk: den, g,
// U = G S^T (+ tril(G V^T) K when causal), c, da and dq. st is S^T
// [dv_pad][m_pad] over the keys before the chunk (causal) or all keys;
// query row t sees the key sums zsum + t * z_ld. Causal needs w.keys and
// w.values_t of the chunk.
inline void QueryGradChunk(const LinearPlan& plan, const LinearShape& s, BackwardState& bs,
                           std::int64_t b, std::int64_t hk, std::int64_t p0, std::int64_t n,
                           const float* st, const float* zsum, std::int64_t z_ld,
                           LinearScratch& w) {
  const detail::LinearProblem& p = *plan.problem;
  const LinearAttentionOptions& o = *plan.options;
  const std::int64_t n_pad = RoundUp(n, ValueWidth());
  const float eps = static_cast<float>(o.eps);
  float* u_rows = w.rows.get();                       // [n][m_pad]
  const std::int64_t ahead = o.causal ? s.chunk : 0;  // causal chunks run in order
  for (std::int64_t h = hk * p.group(); h < (hk + 1) * p.group(); ++h) {
    FeatureRows(plan, s, plan.q, b, h, p0, n, Ahead(b, h, p0, ahead), w.a.get(), w.x.get(), w);
    for (std::int64_t t = 0; t < n; ++t) {
      w.den[t] = o.normalize ? Dot(w.a.get() + t * s.m_pad, zsum + t * z_ld, s.m_pad) + eps : 1.0f;
    }
    GradRows(plan, s, bs, b, h, p0, n, ahead, w);
    Product<false>(w.grad.get(), s.dv_pad, 1, n, st, s.m_pad, s.m_pad, u_rows, s.m_pad, All(s.dv));
    if (o.causal) {
      Product<false>(w.grad.get(), s.dv_pad, 1, n, w.values_t.get(), s.c_pad, n_pad, w.square.get(),
                     s.c_pad, LowerPanels(s.dv));
      LowerTriangle(w.square.get(), s.c_pad, n, n_pad, nullptr);
      Product<true>(w.square.get(), s.c_pad, 1, n, w.keys.get(), s.m_pad, s.m_pad, u_rows, s.m_pad,
                    UpToRow(n));
    }
    for (std::int64_t t = 0; t < n; ++t) {
      float* u = u_rows + t * s.m_pad;
      const float c = o.normalize ? -Dot(w.a.get() + t * s.m_pad, u, s.m_pad) / w.den[t] : 0.0f;
      AddScaled(c, zsum + t * z_ld, s.m_pad, u);  // da = u + c z
      FeatureVjp(o, s, w.x.get() + t * s.d, u, w.row.get(), w);
      StoreViewRow(w.row.get(), s.d, bs.grads.dq, b, p0 + t, h);
      const std::int64_t index = bs.RowIndex(p, b, h, p0 + t);
      bs.den[index] = w.den[t];
      bs.c[index] = c;
    }
  }
}

// Features, g and c of the queries [p0, p0 + n) of head h, from pass 1's
// den and c: into w.a, w.grad and w.c; prefetches `ahead` as GradRows.
inline void LoadQueryGrads(const LinearPlan& plan, const LinearShape& s, const BackwardState& bs,
                           std::int64_t b, std::int64_t h, std::int64_t p0, std::int64_t n,
                           std::int64_t ahead, LinearScratch& w) {
  FeatureRows(plan, s, plan.q, b, h, p0, n, Ahead(b, h, p0, ahead), w.a.get(), nullptr, w);
  for (std::int64_t t = 0; t < n; ++t) {
    const std::int64_t index = bs.RowIndex(*plan.problem, b, h, p0 + t);
    w.den[t] = bs.den[index];
    w.c[t] = bs.c[index];
  }
  GradRows(plan, s, bs, b, h, p0, n, ahead, w);
}

// R [M][dv_pad] += A^T G and r += A^T c over the n rows in w.a, w.grad, w.c.
inline void AddQueryState(const LinearShape& s, std::int64_t n, float* R, float* r,
                          LinearScratch& w) {
  Product<true>(w.a.get(), 1, s.m_pad, s.m, w.grad.get(), s.dv_pad, s.dv_pad, R, s.dv_pad, All(n));
  for (std::int64_t t = 0; t < n; ++t) AddScaled(w.c[t], w.a.get() + t * s.m_pad, s.m_pad, r);
}

// Pass 2 for the keys [p0, p0 + n) of KV head hk: dK^T = R V^T + r and
// dV = K R from the queries after the chunk (causal) or all queries; when
// causal, plus the chunk's own queries through the tril terms, whose
// contributions are then added to R and r. Writes dk and dv.
inline void KeyGradChunk(const LinearPlan& plan, const LinearShape& s, const BackwardState& bs,
                         std::int64_t b, std::int64_t hk, std::int64_t p0, std::int64_t n, float* R,
                         float* r, LinearScratch& w) {
  const detail::LinearProblem& p = *plan.problem;
  const LinearAttentionOptions& o = *plan.options;
  const std::int64_t n_pad = RoundUp(n, ValueWidth());
  const std::int64_t ahead = o.causal ? -s.chunk : 0;  // causal chunks run in reverse
  FeatureRows(plan, s, plan.k, b, hk, p0, n, Ahead(b, hk, p0, ahead), w.keys.get(), w.xk.get(), w);
  LoadRows(plan.v, b, hk, p0, n, 0, s.dv, s.dv_pad, Ahead(b, hk, p0, ahead), w.values.get());
  Transpose(w.values.get(), n, s.dv, s.dv_pad, w.values_t.get(), s.c_pad);
  float* dk_t = w.keys_grad.get();  // [M][c_pad]
  float* dv_rows = w.rows2.get();   // [n][dv_pad]
  Product<false>(R, s.dv_pad, 1, s.m, w.values_t.get(), s.c_pad, n_pad, dk_t, s.c_pad, All(s.dv));
  for (std::int64_t m = 0; m < s.m; ++m) {
    for (std::int64_t j = 0; j < n; ++j) dk_t[m * s.c_pad + j] += r[m];
  }
  Product<false>(w.keys.get(), s.m_pad, 1, n, R, s.dv_pad, s.dv_pad, dv_rows, s.dv_pad, All(s.m));
  if (o.causal) {
    Transpose(w.keys.get(), n, s.m, s.m_pad, w.keys_t.get(), s.c_pad);
    for (std::int64_t h = hk * p.group(); h < (hk + 1) * p.group(); ++h) {
      LoadQueryGrads(plan, s, bs, b, h, p0, n, ahead, w);
      // P = tril(A K^T) [i][j]; dV += P^T G.
      Product<false>(w.a.get(), s.m_pad, 1, n, w.keys_t.get(), s.c_pad, n_pad, w.square.get(),
                     s.c_pad, LowerPanels(s.m));
      LowerTriangle(w.square.get(), s.c_pad, n, n_pad, nullptr);
      Product<true>(w.square.get(), 1, s.c_pad, n, w.grad.get(), s.dv_pad, s.dv_pad, dv_rows,
                    s.dv_pad, FromRow(n));
      // W^T = tril(G V^T + c) [i][j]; dK^T += A^T W^T.
      Product<false>(w.grad.get(), s.dv_pad, 1, n, w.values_t.get(), s.c_pad, n_pad,
                     w.square2.get(), s.c_pad, LowerPanels(s.dv));
      LowerTriangle(w.square2.get(), s.c_pad, n, n_pad, w.c.get());
      Product<true>(w.a.get(), 1, s.m_pad, s.m, w.square2.get(), s.c_pad, n_pad, dk_t, s.c_pad,
                    FromColumn(n));
      AddQueryState(s, n, R, r, w);
    }
  }
  for (std::int64_t j = 0; j < n; ++j) {
    float* db = w.rows.get();  // column j of dK^T, gathered
    for (std::int64_t m = 0; m < s.m; ++m) db[m] = dk_t[m * s.c_pad + j];
    FeatureVjp(o, s, w.xk.get() + j * s.d, db, w.row.get(), w);
    StoreViewRow(w.row.get(), s.d, bs.grads.dk, b, p0 + j, hk);
    StoreViewRow(dv_rows + j * s.dv_pad, s.dv, bs.grads.dv, b, p0 + j, hk);
  }
}

// The causal backward of (sequence b, KV head hk): pass 1 over the chunks in
// order carrying S^T and z, pass 2 in reverse carrying R and r.
inline void CausalBackwardUnit(const LinearPlan& plan, const LinearShape& s, BackwardState& bs,
                               std::int64_t b, std::int64_t hk, LinearScratch& w) {
  const detail::LinearProblem& p = *plan.problem;
  float* st = w.state.get();  // S^T [dv_pad][m_pad]
  float* z = w.z.get();
  std::fill_n(st, s.dv_pad * s.m_pad, 0.0f);
  std::fill_n(z, s.m_pad, 0.0f);
  for (std::int64_t p0 = 0; p0 < p.nq; p0 += s.chunk) {
    const std::int64_t n = std::min(s.chunk, p.nq - p0);
    const RowsAhead next{b, hk, p0 + s.chunk};
    FeatureRows(plan, s, plan.k, b, hk, p0, n, next, w.keys.get(), nullptr, w);
    RunningSums(w.keys.get(), n, s.m_pad, z, w.prefix.get());
    LoadRows(plan.v, b, hk, p0, n, 0, s.dv, s.dv_pad, next, w.values.get());
    Transpose(w.values.get(), n, s.dv, s.dv_pad, w.values_t.get(), s.c_pad);
    QueryGradChunk(plan, s, bs, b, hk, p0, n, st, w.prefix.get(), s.m_pad, w);
    Product<true>(w.values_t.get(), s.c_pad, 1, s.dv, w.keys.get(), s.m_pad, s.m_pad, st, s.m_pad,
                  All(n));
    std::copy_n(w.prefix.get() + (n - 1) * s.m_pad, s.m_pad, z);
  }
  float* R = w.state.get();  // R [m_pad][dv_pad]
  float* r = w.r.get();
  std::fill_n(R, s.m_pad * s.dv_pad, 0.0f);
  std::fill_n(r, s.m_pad, 0.0f);
  for (std::int64_t p0 = (DivCeil(p.nq, s.chunk) - 1) * s.chunk; p0 >= 0; p0 -= s.chunk) {
    KeyGradChunk(plan, s, bs, b, hk, p0, std::min(s.chunk, p.nq - p0), R, r, w);
  }
}

// The non-causal backward: S, z over all keys; pass 1 per chunk of queries;
// R, r over all queries (split like the key sums); pass 2 per chunk of keys.
inline void NonCausalBackward(const LinearPlan& plan, const LinearShape& s, BackwardState& bs) {
  const detail::LinearProblem& p = *plan.problem;
  const std::int64_t heads = p.batch * p.hkv;
  const KeySums sums = SumKeys(plan, s);
  Floats st = AllocFloats(heads * s.dv_pad * s.m_pad);  // S^T per head
  for (std::int64_t h = 0; h < heads; ++h) {
    Transpose(sums.s.get() + h * s.m * s.dv_pad, s.m, s.dv_pad, s.dv_pad,
              st.get() + h * s.dv_pad * s.m_pad, s.m_pad);
  }
  const std::int64_t q_chunks = DivCeil(p.nq, s.chunk);
  ForEachUnit(s, heads * q_chunks, [&](std::int64_t u, LinearScratch& w) {
    const std::int64_t head = u / q_chunks, p0 = u % q_chunks * s.chunk;
    QueryGradChunk(plan, s, bs, head / p.hkv, head % p.hkv, p0, std::min(s.chunk, p.nq - p0),
                   st.get() + head * s.dv_pad * s.m_pad, sums.z.get() + head * s.m_pad, 0, w);
  });

  const std::int64_t splits = SplitCount(p.nq);
  const std::int64_t r_size = s.m_pad * s.dv_pad;
  Floats partial_r = AllocFloats(heads * splits * r_size);
  Floats partial_rv = AllocFloats(heads * splits * s.m_pad);
  ForEachUnit(s, heads * splits, [&](std::int64_t u, LinearScratch& w) {
    const std::int64_t head = u / splits, b = head / p.hkv, hk = head % p.hkv;
    const KeySpan range = SplitChunks(u % splits, splits, q_chunks);
    for (std::int64_t chunk = range.begin; chunk < range.end; ++chunk) {
      const std::int64_t p0 = chunk * s.chunk, n = std::min(s.chunk, p.nq - p0);
      for (std::int64_t h = hk * p.group(); h < (hk + 1) * p.group(); ++h) {
        LoadQueryGrads(plan, s, bs, b, h, p0, n, s.chunk, w);
        AddQueryState(s, n, partial_r.get() + u * r_size, partial_rv.get() + u * s.m_pad, w);
      }
    }
  });
  Floats R = AllocFloats(heads * r_size), r = AllocFloats(heads * s.m_pad);
  for (std::int64_t h = 0; h < heads; ++h) {
    for (std::int64_t i = 0; i < splits; ++i) {
      AddScaled(1.0f, partial_r.get() + (h * splits + i) * r_size, r_size, R.get() + h * r_size);
      AddScaled(1.0f, partial_rv.get() + (h * splits + i) * s.m_pad, s.m_pad,
                r.get() + h * s.m_pad);
    }
  }
  const std::int64_t k_chunks = DivCeil(p.nk, s.chunk);
  ForEachUnit(s, heads * k_chunks, [&](std::int64_t u, LinearScratch& w) {
    const std::int64_t head = u / k_chunks, p0 = u % k_chunks * s.chunk;
    KeyGradChunk(plan, s, bs, head / p.hkv, head % p.hkv, p0, std::min(s.chunk, p.nk - p0),
                 R.get() + head * r_size, r.get() + head * s.m_pad, w);
  });
}

inline void LinearBackwardImpl(const LinearPlan& plan, ConstTensorView dout,
                               const LinearAttentionGradientOutputs& grads) {
  const detail::LinearProblem& p = *plan.problem;
  const LinearShape s = LinearShapeOf(plan);
  const auto rows = static_cast<std::size_t>(p.batch * p.hq * p.nq);
  BackwardState bs{dout, grads, std::vector<float>(rows), std::vector<float>(rows)};
  if (!plan.options->causal) return NonCausalBackward(plan, s, bs);
  ForEachUnit(s, p.batch * p.hkv, [&](std::int64_t u, LinearScratch& w) {
    CausalBackwardUnit(plan, s, bs, u / p.hkv, u % p.hkv, w);
  });
}

QKV_HWY_NAMESPACE_END(cpu);

#endif  // QKV_CPU_LINEAR_BACKWARD_INL_H_
