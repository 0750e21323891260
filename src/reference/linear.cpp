// The reference linear attention in the quadratic form, per sequence b,
// query head h and query row i, with a_i = phi(q_i), b_j = phi(k_j) and J(i)
// the admitted keys (all, or j <= i when causal):
//
//   w_ij  = <a_i, b_j>
//   num_i = S0^T a_i + sum_{j in J(i)} w_ij v_j      S0, z0: the initial state
//   den_i = a_i^T z0 + sum_{j in J(i)} w_ij + eps    (zero unless a causal
//   out_i = num_i / den_i  (num_i if not normalized)  pass continues one)
//
// and its backward, from g_i = dout_i / den_i and c_i = -<g_i, out_i> (the
// gradient of out_i through den_i), both recomputed here:
//
//   dw_ij = <g_i, v_j> + c_i
//   dv_j += w_ij g_i,  da_i += dw_ij b_j,  db_j += dw_ij a_i
//   dq_i  = J_phi(q_i)^T da_i,  dk_j = J_phi(k_j)^T db_j
//
// (without normalization g_i = dout_i and c_i = 0). The backward has no
// initial state: it differentiates qkv::linear_attention.
#include "reference/linear.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/elements.hpp"
#include "reference/scores.hpp"

namespace qkv::reference {
namespace {

using detail::LinearProblem;
using detail::LinearStates;
using detail::load;
using detail::store;

// phi(x) for one row x [D] into M features, rounded to `rounding`.
template <class Real>
std::vector<Real> features(const LinearAttentionOptions& o, const Real* x, std::int64_t d,
                           std::int64_t m, DType rounding) {
  std::vector<Real> phi(static_cast<std::size_t>(m));
  switch (o.feature_map) {
    case FeatureMap::elu_plus_one:
      for (std::int64_t c = 0; c < d; ++c) phi[c] = x[c] > 0 ? x[c] + 1 : std::exp(x[c]);
      break;
    case FeatureMap::relu:
      for (std::int64_t c = 0; c < d; ++c) phi[c] = std::max(x[c], Real(0));
      break;
    case FeatureMap::custom: {
      const std::vector<double> xd(x, x + d);
      std::vector<double> out(static_cast<std::size_t>(m));
      o.custom.map(xd, out);
      std::copy(out.begin(), out.end(), phi.begin());
      break;
    }
  }
  for (Real& f : phi) f = round_to(f, rounding);
  return phi;
}

// J_phi(x)^T dphi for one row x [D] (dphi [M]): the gradient of the row.
template <class Real>
std::vector<Real> feature_vjp(const LinearAttentionOptions& o, const Real* x, const Real* dphi,
                              std::int64_t d, std::int64_t m) {
  std::vector<Real> dx(static_cast<std::size_t>(d));
  switch (o.feature_map) {
    case FeatureMap::elu_plus_one:
      for (std::int64_t c = 0; c < d; ++c) dx[c] = dphi[c] * (x[c] > 0 ? Real(1) : std::exp(x[c]));
      break;
    case FeatureMap::relu:
      for (std::int64_t c = 0; c < d; ++c) dx[c] = x[c] > 0 ? dphi[c] : Real(0);
      break;
    case FeatureMap::custom: {
      const std::vector<double> xd(x, x + d), gd(dphi, dphi + m);
      std::vector<double> out(static_cast<std::size_t>(d));
      o.custom.vjp(xd, gd, out);
      std::copy(out.begin(), out.end(), dx.begin());
      break;
    }
  }
  return dx;
}

// Features of rows [0, n) of head h of sequence b of a rank-4 view: [n][M].
template <class Real>
std::vector<std::vector<Real>> feature_rows(const LinearAttentionOptions& o, ConstTensorView t,
                                            std::int64_t b, std::int64_t n, std::int64_t h,
                                            std::int64_t m, DType rounding) {
  const std::int64_t d = t.size(3);
  const std::vector<Real> x = gather_rows<Real>(t, b, 0, n, h);
  std::vector<std::vector<Real>> phi;
  for (std::int64_t r = 0; r < n; ++r) phi.push_back(features(o, x.data() + r * d, d, m, rounding));
  return phi;
}

// The last key row i sees (exclusive end of J(i)).
inline std::int64_t keys_end(const LinearAttentionOptions& o, const LinearProblem& p,
                             std::int64_t i) {
  return o.causal ? i + 1 : p.nk;
}

// Numerator and normalizer of one query row (see the top of the file); w
// receives w_ij for j in J(i).
template <class Real>
struct RowSums {
  std::vector<Real> num;  // [Dv]
  Real den = 0;           // includes eps; 1 when not normalized
  std::vector<Real> w;    // [keys_end]
};

template <class Real>
RowSums<Real> row_sums(const LinearAttentionOptions& o, const LinearProblem& p,
                       const std::vector<Real>& a, const std::vector<std::vector<Real>>& phi_k,
                       const std::vector<Real>& values, const std::vector<Real>& s0,
                       const std::vector<Real>& z0, std::int64_t i, DType rounding) {
  RowSums<Real> r;
  r.num.assign(static_cast<std::size_t>(p.dv), Real(0));
  for (std::int64_t m = 0; m < p.features; ++m) {
    r.den += a[m] * z0[m];
    for (std::int64_t c = 0; c < p.dv; ++c) r.num[c] += a[m] * s0[m * p.dv + c];
  }
  const std::int64_t end = keys_end(o, p, i);
  r.w.resize(static_cast<std::size_t>(end));
  for (std::int64_t j = 0; j < end; ++j) {
    Real w = 0;
    for (std::int64_t m = 0; m < p.features; ++m) w += a[m] * phi_k[j][m];
    w = round_to(w, rounding);
    r.w[j] = w;
    r.den += w;
    for (std::int64_t c = 0; c < p.dv; ++c) r.num[c] += w * values[j * p.dv + c];
  }
  for (Real& x : r.num) x = round_to(x, rounding);
  r.den = o.normalize ? round_to(r.den + static_cast<Real>(o.eps), rounding) : Real(1);
  return r;
}

// The state of (sequence b, KV head h) as [m][cols] (cols = 1 for z); zeros
// when the view is undefined (the empty prefix).
template <class Real>
std::vector<Real> state_of(ConstTensorView t, std::int64_t b, std::int64_t h, std::int64_t m,
                           std::int64_t cols) {
  std::vector<Real> x(static_cast<std::size_t>(m * cols), Real(0));
  if (!t.defined()) return x;
  for (std::int64_t r = 0; r < m; ++r) {
    for (std::int64_t c = 0; c < cols; ++c) {
      const std::int64_t off = b * t.stride(0) + h * t.stride(1) + r * t.stride(2) +
                               (t.rank() == 4 ? c * t.stride(3) : 0);
      x[r * cols + c] = static_cast<Real>(load(t.data(), t.dtype(), off));
    }
  }
  return x;
}

// Writes x [m][cols] as the state of (sequence b, KV head h).
template <class Real>
void store_state(TensorView t, std::int64_t b, std::int64_t h, std::int64_t m, std::int64_t cols,
                 const std::vector<Real>& x) {
  for (std::int64_t r = 0; r < m; ++r) {
    for (std::int64_t c = 0; c < cols; ++c) {
      const std::int64_t off = b * t.stride(0) + h * t.stride(1) + r * t.stride(2) +
                               (t.rank() == 4 ? c * t.stride(3) : 0);
      store(t.data(), t.dtype(), off, x[r * cols + c]);
    }
  }
}

inline std::int64_t row_offset(ConstTensorView t, std::int64_t b, std::int64_t i, std::int64_t h,
                               std::int64_t c) {
  return b * t.stride(0) + i * t.stride(1) + h * t.stride(2) + c * t.stride(3);
}

template <class Real>
void forward_in(const LinearProblem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                TensorView out, const LinearAttentionOptions& o, const LinearStates& states,
                DType rounding) {
  const std::int64_t m = p.features;
  for (std::int64_t b = 0; b < p.batch; ++b) {
    for (std::int64_t hk = 0; hk < p.hkv; ++hk) {
      const auto phi_k = feature_rows<Real>(o, k, b, p.nk, hk, m, rounding);
      const std::vector<Real> values = gather_rows<Real>(v, b, 0, p.nk, hk);
      const std::vector<Real> s0 = state_of<Real>(states.s_in, b, hk, m, p.dv);
      const std::vector<Real> z0 = state_of<Real>(states.z_in, b, hk, m, 1);
      for (std::int64_t h = hk * p.group(); h < (hk + 1) * p.group(); ++h) {
        const std::vector<Real> x = gather_rows<Real>(q, b, 0, p.nq, h);
        for (std::int64_t i = 0; i < p.nq; ++i) {
          const std::vector<Real> a = features(o, x.data() + i * p.d, p.d, m, rounding);
          const RowSums<Real> r = row_sums(o, p, a, phi_k, values, s0, z0, i, rounding);
          for (std::int64_t c = 0; c < p.dv; ++c) {
            store(out.data(), out.dtype(), row_offset(out, b, i, h, c), r.num[c] / r.den);
          }
        }
      }
      if (!states.s_out.defined()) continue;
      // The final state: the initial one plus every key of the pass.
      std::vector<Real> s = s0, z = z0;
      for (std::int64_t j = 0; j < p.nk; ++j) {
        for (std::int64_t r = 0; r < m; ++r) {
          z[r] += phi_k[j][r];
          for (std::int64_t c = 0; c < p.dv; ++c)
            s[r * p.dv + c] += phi_k[j][r] * values[j * p.dv + c];
        }
      }
      store_state(states.s_out, b, hk, m, p.dv, s);
      store_state(states.z_out, b, hk, m, 1, z);
    }
  }
}

template <class Real>
void backward_in(const LinearProblem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                 ConstTensorView dout, const LinearAttentionGradientOutputs& grads,
                 const LinearAttentionOptions& o, DType rounding) {
  const std::int64_t m = p.features;
  const std::vector<Real> no_s(static_cast<std::size_t>(m * p.dv), Real(0));
  const std::vector<Real> no_z(static_cast<std::size_t>(m), Real(0));
  for (std::int64_t b = 0; b < p.batch; ++b) {
    for (std::int64_t hk = 0; hk < p.hkv; ++hk) {
      const std::vector<Real> keys = gather_rows<Real>(k, b, 0, p.nk, hk);
      const auto phi_k = feature_rows<Real>(o, k, b, p.nk, hk, m, rounding);
      const std::vector<Real> values = gather_rows<Real>(v, b, 0, p.nk, hk);
      std::vector<std::vector<Real>> db(static_cast<std::size_t>(p.nk),
                                        std::vector<Real>(static_cast<std::size_t>(m), Real(0)));
      std::vector<Real> dv(static_cast<std::size_t>(p.nk * p.dv), Real(0));
      for (std::int64_t h = hk * p.group(); h < (hk + 1) * p.group(); ++h) {
        const std::vector<Real> x = gather_rows<Real>(q, b, 0, p.nq, h);
        const std::vector<Real> dy = gather_rows<Real>(dout, b, 0, p.nq, h);
        for (std::int64_t i = 0; i < p.nq; ++i) {
          const std::vector<Real> a = features(o, x.data() + i * p.d, p.d, m, rounding);
          const RowSums<Real> r = row_sums(o, p, a, phi_k, values, no_s, no_z, i, rounding);
          std::vector<Real> g(static_cast<std::size_t>(p.dv));
          Real c = 0;  // -<g_i, out_i>
          for (std::int64_t col = 0; col < p.dv; ++col) {
            g[col] = round_to(dy[i * p.dv + col] / r.den, rounding);
            if (o.normalize) c -= g[col] * round_to(r.num[col] / r.den, rounding);
          }
          c = round_to(c, rounding);
          std::vector<Real> da(static_cast<std::size_t>(m), Real(0));
          for (std::int64_t j = 0; j < keys_end(o, p, i); ++j) {
            Real dw = c;
            for (std::int64_t col = 0; col < p.dv; ++col) dw += g[col] * values[j * p.dv + col];
            dw = round_to(dw, rounding);
            for (std::int64_t f = 0; f < m; ++f) {
              da[f] += dw * phi_k[j][f];
              db[j][f] += dw * a[f];
            }
            for (std::int64_t col = 0; col < p.dv; ++col) dv[j * p.dv + col] += r.w[j] * g[col];
          }
          for (Real& y : da) y = round_to(y, rounding);
          const std::vector<Real> dq = feature_vjp(o, x.data() + i * p.d, da.data(), p.d, m);
          for (std::int64_t col = 0; col < p.d; ++col) {
            store(grads.dq.data(), grads.dq.dtype(), row_offset(grads.dq, b, i, h, col), dq[col]);
          }
        }
      }
      for (std::int64_t j = 0; j < p.nk; ++j) {
        for (Real& y : db[j]) y = round_to(y, rounding);
        const std::vector<Real> dk = feature_vjp(o, keys.data() + j * p.d, db[j].data(), p.d, m);
        for (std::int64_t col = 0; col < p.d; ++col) {
          store(grads.dk.data(), grads.dk.dtype(), row_offset(grads.dk, b, j, hk, col), dk[col]);
        }
        for (std::int64_t col = 0; col < p.dv; ++col) {
          store(grads.dv.data(), grads.dv.dtype(), row_offset(grads.dv, b, j, hk, col),
                dv[j * p.dv + col]);
        }
      }
    }
  }
}

}  // namespace

void linear_attention(const LinearProblem& p, ConstTensorView q, ConstTensorView k,
                      ConstTensorView v, TensorView out, const LinearAttentionOptions& o,
                      const LinearStates& states) {
  forward_in<double>(p, q, k, v, out, o, states, DType::f64);
}

void naive_linear_attention(const LinearProblem& p, ConstTensorView q, ConstTensorView k,
                            ConstTensorView v, TensorView out, const LinearAttentionOptions& o,
                            DType precision, const LinearStates& states) {
  forward_in<float>(p, q, k, v, out, o, states, precision);
}

void linear_attention_backward(const LinearProblem& p, ConstTensorView q, ConstTensorView k,
                               ConstTensorView v, ConstTensorView dout,
                               const LinearAttentionGradientOutputs& grads,
                               const LinearAttentionOptions& o) {
  backward_in<double>(p, q, k, v, dout, grads, o, DType::f64);
}

void naive_linear_attention_backward(const LinearProblem& p, ConstTensorView q, ConstTensorView k,
                                     ConstTensorView v, ConstTensorView dout,
                                     const LinearAttentionGradientOutputs& grads,
                                     const LinearAttentionOptions& o, DType precision) {
  backward_in<float>(p, q, k, v, dout, grads, o, precision);
}

}  // namespace qkv::reference
