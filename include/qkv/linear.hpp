// qkv/linear.hpp — linear attention (Katharopoulos et al. 2020, "Transformers
// are RNNs"): the softmax kernel exp(<q, k>) replaced by a feature-map inner
// product <phi(q), phi(k)>, which turns attention into running sums.
//
// Shapes (those of qkv/attention.hpp; any non-negative strides, so a
// [B, H, N, D] tensor passes as `t.transpose(1, 2)` without a copy):
//   q    [B, Nq, Hq,  D]
//   k    [B, Nk, Hkv, D]
//   v    [B, Nk, Hkv, Dv]
//   out  [B, Nq, Hq,  Dv]      dtype of q
// Hq must be a multiple of Hkv; query head h reads KV head h / (Hq / Hkv)
// (multi-head, grouped-query and multi-query attention). q, k and v share one
// dtype: f32, bf16, f16, or f64 (reference backend only). phi maps a row of
// D numbers to M features (M = D for the built-in maps); Dv >= 1, and D >= 1
// for the built-in maps (a custom map may take D = 0 and still give features).
//
// Per sequence b and query head h, with a_i = phi(q_i), b_j = phi(k_j):
//   S_i = sum_{j in J(i)} b_j v_j^T       [M, Dv]
//   z_i = sum_{j in J(i)} b_j             [M]
//   out_i = S_i^T a_i / (a_i^T z_i + eps)          options.normalize (default)
//   out_i = S_i^T a_i                              normalize = false
// where J(i) is every key (0 <= j < Nk), or with options.causal the keys
// j <= i, which requires Nq == Nk. Equivalently (the quadratic form),
// out_i = sum_j w_ij v_j / (sum_j w_ij + eps) with w_ij = <a_i, b_j>.
// No scale is applied to q (fold one into q if the model uses it).
//
// The normalizer: eps defaults to 1e-6, the value of the fast-transformers
// library (Katharopoulos et al.'s reference implementation), so that models
// trained there reproduce here. It only keeps 0 / 0 away: a query whose
// features miss every key (possible with relu) gets out = 0, and with the
// positive elu + 1 features a^T z is a sum of positive terms, far above eps
// unless the features underflow. Custom maps whose features can be negative
// (random Fourier features) may make a^T z vanish or change sign; use
// normalize = false there and normalize in the model.
//
// Causal passes carry a state, the pair (S, z) per sequence and KV head
// summed over a prefix of the keys. A causal forward can return the state
// after its last key, and linear_attention_step continues from a state
// with new tokens, so a prefill followed by steps computes the same outputs
// as one causal pass over the whole sequence (up to rounding).
#pragma once

#include <cstdint>
#include <functional>
#include <span>

#include "qkv/attention.hpp"
#include "qkv/tensor.hpp"

namespace qkv {

// The feature map phi, applied to every row of q and k.
enum class FeatureMap : std::uint8_t {
  elu_plus_one,  // phi(x) = elu(x) + 1: x + 1 for x > 0, e^x otherwise; M = D
  relu,          // phi(x) = max(x, 0); M = D (derivative 0 at x = 0)
  custom,        // options.custom: a row-wise callable, any M
};

// A user-supplied feature map, called once per row (never per element):
// `map(x, phi)` writes phi(x) for one row x of D numbers into M numbers, and
// `vjp(x, dphi, dx)` writes the vector-Jacobian product dx = J_phi(x)^T dphi
// (D numbers), needed by linear_attention_backward only. Both run in double
// (the fast backend converts its f32 rows) and may be called concurrently
// from several threads, so they must be pure. An exception thrown by either
// propagates out of the qkv call.
struct CustomFeatureMap {
  using Map = std::function<void(std::span<const double> x, std::span<double> phi)>;
  using Vjp = std::function<void(std::span<const double> x, std::span<const double> dphi,
                                 std::span<double> dx)>;
  std::int64_t features = 0;  // M, the length of phi(x); >= 1; required
  Map map;                    // required
  Vjp vjp;                    // required by the backward; empty = forward only
};

// Options of the linear attention calls. Every field has a default.
struct LinearAttentionOptions {
  FeatureMap feature_map = FeatureMap::elu_plus_one;  // phi; elu + 1 by default
  CustomFeatureMap custom;  // FeatureMap::custom only; default empty (must stay so otherwise)
  bool causal = false;      // true: query i sums keys j <= i (needs Nq == Nk); default all keys
  bool normalize = true;    // default divides by a^T z + eps; false: out = S^T a (plain sum)
  double eps = 1e-6;        // added to the normalizer; finite, >= 0 (see the header)
  // Positions per chunk of the fast causal kernels, 1 to 1024 (default 64);
  // results change only by rounding.
  std::int64_t chunk = 64;
  // Default: the fast kernels for f32, bf16 and f16, the reference for f64.
  Backend backend = Backend::automatic;
  // Allocating forward, causal only: also return the final state (default no).
  bool return_state = false;
};

// The running sums of a causal pass over a prefix of the keys, per sequence
// and KV head; f32 (f64 for f64 inputs). Tensors are zero-filled when
// created, so a fresh linear_attention_state is the empty prefix.
struct LinearAttentionState {
  Tensor s;  // [B, Hkv, M, Dv]: sum_j phi(k_j) v_j^T
  Tensor z;  // [B, Hkv, M]: sum_j phi(k_j)
};

// Result of the allocating forward; state is undefined unless
// options.return_state.
struct LinearAttentionResult {
  Tensor out;                  // [B, Nq, Hq, Dv], dtype of q
  LinearAttentionState state;  // after the last key
};

// Gradients returned by the allocating backward.
struct LinearAttentionGradients {
  Tensor dq;  // [B, Nq, Hq, D], dtype of q
  Tensor dk;  // [B, Nk, Hkv, D]
  Tensor dv;  // [B, Nk, Hkv, Dv]
};

// Caller-provided gradient views: all required, overwritten (not
// accumulated into), any strides, no overlap with the inputs or each other.
struct LinearAttentionGradientOutputs {
  TensorView dq = {};  // [B, Nq, Hq, D], dtype of q
  TensorView dk = {};  // [B, Nk, Hkv, D]
  TensorView dv = {};  // [B, Nk, Hkv, Dv]
};

// The state of an empty prefix: zeros, s [batch, kv_heads, features,
// value_dim] and z [batch, kv_heads, features] of `dtype` (f32, or f64 for
// f64 inputs).
LinearAttentionState linear_attention_state(std::int64_t batch, std::int64_t kv_heads,
                                            std::int64_t features, std::int64_t value_dim,
                                            DType dtype = DType::f32);

// q [B, Nq, Hq, D], k [B, Nk, Hkv, D], v [B, Nk, Hkv, Dv] -> out [B, Nq, Hq, Dv]
// (and, causal with options.return_state, the state after the last key).
// Throws qkv::Error (listing every problem) on invalid input.
LinearAttentionResult linear_attention(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                                       const LinearAttentionOptions& options = {});

// The same into a caller view `out` [B, Nq, Hq, Dv] (dtype of q, any
// strides, not overlapping the inputs). With `final_state` (causal only),
// its tensors, shaped as linear_attention_state(B, Hkv, M, Dv), are
// overwritten with the state after the last key; options.return_state is
// ignored.
void linear_attention_into(ConstTensorView q, ConstTensorView k, ConstTensorView v, TensorView out,
                           const LinearAttentionOptions& options = {},
                           LinearAttentionState* final_state = nullptr);

// Continues a causal pass from `state` with n new tokens, q [B, n, Hq, D],
// k [B, n, Hkv, D], v [B, n, Hkv, Dv] (n = 1 decodes one token; n > 1 is a
// chunked prefill), returns out [B, n, Hq, Dv] and advances `state` past the
// new keys. Token t sees the state's prefix and new keys 0..t. The options
// must be causal (as those of the prefill); return_state is ignored.
Tensor linear_attention_step(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                             LinearAttentionState& state,
                             const LinearAttentionOptions& options = {});

// The same into a caller view `out` [B, n, Hq, Dv].
void linear_attention_step_into(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                                LinearAttentionState& state, TensorView out,
                                const LinearAttentionOptions& options = {});

// Gradients of a loss with respect to q, k and v, given dout = dL/dout
// [B, Nq, Hq, Dv] (dtype of q) and the options of the forward (a custom map
// needs its vjp). The forward's output is not needed: the backward
// recomputes what it uses. With g_i = dout_i / den_i (den_i = a_i^T z_i +
// eps; g_i = dout_i without normalization) and c_i = -<g_i, out_i>
// (0 without normalization):
//   dv_j = sum_{i: j in J(i)} w_ij g_i
//   da_i = sum_{j in J(i)} (<g_i, v_j> + c_i) b_j,   dq_i = J_phi(q_i)^T da_i
//   db_j = sum_{i: j in J(i)} (<g_i, v_j> + c_i) a_i, dk_j = J_phi(k_j)^T db_j
// dk and dv sum over every query head that reads the KV head.
LinearAttentionGradients linear_attention_backward(ConstTensorView q, ConstTensorView k,
                                                   ConstTensorView v, ConstTensorView dout,
                                                   const LinearAttentionOptions& options = {});

// The same into caller-provided views.
void linear_attention_backward_into(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                                    ConstTensorView dout,
                                    const LinearAttentionGradientOutputs& grads,
                                    const LinearAttentionOptions& options = {});

}  // namespace qkv
