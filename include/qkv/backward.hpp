// qkv/backward.hpp — gradients of qkv::attention for training.
//
// Given the forward's inputs, its output `out` and logsumexp `lse`, and the
// gradient of a loss with respect to the output, `dout`, computes the
// gradients with respect to q, k, v and the learnable parameters the options
// use. Shapes (as in qkv/attention.hpp):
//   q, dq   [B, Nq, Hq,  Dq]      dtype of q
//   k, dk   [B, Nk, Hkv, Dk]      dtype of q
//   v, dv   [B, Nk, Hkv, Dv]      dtype of q
//   out, dout [B, Nq, Hq, Dv]     dtype of q
//   lse     [B, Hq, Nq]           f32 (f64 for f64 inputs), from the forward
// Parameter gradients are f32 (f64 for f64 inputs), shaped like the
// parameter:
//   d_relative_bias   [Hq, num_buckets]   when options.relative_bias is set
//   d_additive_w_q    [A, Dq]             Score::additive
//   d_additive_w_k    [A, Dk]             Score::additive
//   d_additive_v      [A]                 Score::additive
//   d_additive_bias   [A]                 Score::additive with a bias
//   d_sinks           [Hq]                when options.sinks is set:
//                     dL/dS_h = -sum_(b, i) e^(S_h - lse_bhi) D_bhi
// With GQA/MQA, dk and dv sum the contributions of every query head that
// reads the KV head. Keys a row never attends to, and rows with no admitted
// key, get zero gradient (never NaN). The options must be those of the
// forward call (same masks, biases, dropout seed and offset); `score_mod`
// has no derivative here and is rejected.
//
// `out` and `lse` may both be left undefined (not one alone), for a caller
// that kept neither: Score::additive on the fast backend with key_lengths
// as its one mask then computes the weights and lse from its own
// projections, with D_i = sum_j P_ij dP_ij (no forward pass); any other
// call runs the forward first. Not with options.shard.partial_keys, whose
// lse must be the whole rows'.
//
// Backends: the fused backward runs dot-product scores (Score::scaled_dot,
// Score::dot). Score::additive has a fast backward in f32 (GEMMs and one
// vectorized tanh loop over the admitted pairs, with the weights from the
// forward's probabilities pass, so B * Hq * Nq * Nk floats of scratch) for
// every option but dropout, softcap and the relative position bias; with
// those, Backend::automatic runs the reference backward and Backend::fast is
// rejected with a qkv::Error saying so. As for every score, f64 inputs run
// the reference on Backend::automatic. A fast result holding a NaN or an
// infinity is recomputed by the reference (see docs/semantics.md).
//
// FlashAttention-2's form: with P recomputed from lse, Z the dropout mask
// and r = 1 / (1 - dropout_p),
//   D_i  = sum_c dout_ic out_ic
//   dv_j = sum_i r Z_ij P_ij dout_i
//   dS_ij = P_ij (r Z_ij <dout_i, v_j> - D_i)     (then through softcap's tanh)
//   dq_i = scale sum_j dS_ij k_j,  dk_j = scale sum_i dS_ij q_i
#pragma once

#include <cstdint>

#include "qkv/attention.hpp"

namespace qkv {

// Gradients returned by the allocating overload; parameter gradients are
// undefined when the options do not use the parameter.
struct AttentionGradients {
  Tensor dq;               // [B, Nq, Hq, Dq]
  Tensor dk;               // [B, Nk, Hkv, Dk]
  Tensor dv;               // [B, Nk, Hkv, Dv]
  Tensor d_relative_bias;  // [Hq, num_buckets]
  Tensor d_additive_w_q;   // [A, Dq]
  Tensor d_additive_w_k;   // [A, Dk]
  Tensor d_additive_v;     // [A]
  Tensor d_additive_bias;  // [A]
  Tensor d_sinks;          // [Hq]
};

// Caller-provided gradient views. dq, dk, dv are required; each parameter
// gradient is required exactly when the options use the parameter. They are
// overwritten (not accumulated into), must not overlap the inputs or each
// other, and may have any strides.
struct GradientOutputs {
  TensorView dq = {};               // [B, Nq, Hq, Dq], dtype of q
  TensorView dk = {};               // [B, Nk, Hkv, Dk], dtype of q
  TensorView dv = {};               // [B, Nk, Hkv, Dv], dtype of q
  TensorView d_relative_bias = {};  // [Hq, num_buckets], f32 (f64 for f64 inputs)
  TensorView d_additive_w_q = {};   // [A, Dq], f32 (f64)
  TensorView d_additive_w_k = {};   // [A, Dk], f32 (f64)
  TensorView d_additive_v = {};     // [A], f32 (f64)
  TensorView d_additive_bias = {};  // [A], f32 (f64); only with a bias
  TensorView d_sinks = {};          // [Hq], f32 (f64); only with sinks
};

// Computes the gradients and returns freshly allocated tensors.
// Throws qkv::Error (listing every problem) on invalid input.
AttentionGradients attention_backward(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                                      ConstTensorView out, ConstTensorView dout,
                                      ConstTensorView lse, const AttentionOptions& options = {});

// Computes the gradients into caller-provided views.
void attention_backward_into(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                             ConstTensorView out, ConstTensorView dout, ConstTensorView lse,
                             const GradientOutputs& grads, const AttentionOptions& options = {});

// The dropout generator, exposed so that callers can reproduce the mask:
// Philox4x32-10 (Salmon et al., SC'11) keyed by the seed (low word first)
// with counter (j / 4, i, b * Hq + h, offset); word j % 4 of the result, as
// u = (word >> 8) * 2^-24, keeps weight (b, h, i, j) iff u >= p. b is the
// batch entry (the sequence in packed varlen mode), h the query head, i and j
// positions inside the sequence.
bool dropout_keep(std::uint64_t seed, std::uint32_t offset, double p, std::int64_t hq,
                  std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j);

}  // namespace qkv
