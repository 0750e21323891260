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
// Parameter gradients (the rows of QKV_ATTENTION_PARAMETERS below) are f32
// (f64 for f64 inputs), shaped like the parameter, e.g. d_sinks [Hq]:
// dL/dS_h = -sum_(b, i) e^(S_h - lse_bhi) D_bhi. A float mask is data
// unless options.mask_requires_grad: then d_mask, shaped like the mask, is
// dS_ij summed over the dimensions along which the mask broadcasts (the
// fused backward keeps B * Hq * Nq * Nk floats of dS for it).
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
#include <vector>

#include "qkv/attention.hpp"

namespace qkv {

// Sizes a parameter gradient's shape is made of (the rows' `s`).
struct ParameterSizes {
  std::int64_t hq = 0;              // query heads
  std::int64_t dq = 0;              // q's head dimension
  std::int64_t dk = 0;              // k's head dimension
  std::int64_t attention_size = 0;  // A of Score::additive
  std::int64_t num_buckets = 0;     // relative_bias.table.size(1)
  std::vector<std::int64_t> mask;   // options.mask's sizes (rank 0 to 4)
};

// The learnable parameters, one row each: X(gradient, sizes, used, option,
// doc). `gradient` names the gradient's field in AttentionGradients and
// GradientOutputs (and in Python); `sizes` is its shape, a parenthesized list
// of expressions of ParameterSizes `s` (or one vector); `used` says, from the
// options `o`, when the call uses the parameter (its gradient is then
// computed, and required by attention_backward_into); `option` names the
// parameter in messages. Every parameter gradient is f32 (f64 for f64 inputs). The
// allocation, the validation and the Python results derive from these rows.
#define QKV_ATTENTION_PARAMETERS(X)                                                               \
  X(d_relative_bias, (s.hq, s.num_buckets), o.relative_bias.table.defined(),                      \
    "relative_bias.table", "[Hq, num_buckets]: the learned bias by relative position")            \
  X(d_additive_w_q, (s.attention_size, s.dq), o.score == Score::additive, "Score::additive",      \
    "[A, Dq]: additive.w_q")                                                                      \
  X(d_additive_w_k, (s.attention_size, s.dk), o.score == Score::additive, "Score::additive",      \
    "[A, Dk]: additive.w_k")                                                                      \
  X(d_additive_v, (s.attention_size), o.score == Score::additive, "Score::additive",              \
    "[A]: additive.v")                                                                            \
  X(d_additive_bias, (s.attention_size), o.score == Score::additive && o.additive.bias.defined(), \
    "additive.bias", "[A]: additive.bias")                                                        \
  X(d_sinks, (s.hq), !o.sinks.empty(), "sinks", "[Hq]: the sinks' logits")                        \
  X(d_score_scale, (s.hq), !o.score_scale.empty(), "score_scale", "[Hq]: the logits' scales")     \
  X(d_mask, (s.mask), o.mask_requires_grad, "mask_requires_grad",                                 \
    "mask's shape: dS summed over the dimensions along which the float mask broadcasts")

// Gradients returned by the allocating overload; parameter gradients are
// undefined when the options do not use the parameter.
struct AttentionGradients {
  Tensor dq;  // [B, Nq, Hq, Dq]
  Tensor dk;  // [B, Nk, Hkv, Dk]
  Tensor dv;  // [B, Nk, Hkv, Dv]
#define QKV_PARAMETER_TENSOR(gradient, sizes, used, option, doc) Tensor gradient;
  QKV_ATTENTION_PARAMETERS(QKV_PARAMETER_TENSOR)
#undef QKV_PARAMETER_TENSOR
};

// Caller-provided gradient views. dq, dk, dv are required; each parameter
// gradient is required exactly when the options use the parameter. They are
// overwritten (not accumulated into), must not overlap the inputs or each
// other, and may have any strides.
struct GradientOutputs {
  TensorView dq = {};  // [B, Nq, Hq, Dq], dtype of q
  TensorView dk = {};  // [B, Nk, Hkv, Dk], dtype of q
  TensorView dv = {};  // [B, Nk, Hkv, Dv], dtype of q
#define QKV_PARAMETER_VIEW(gradient, sizes, used, option, doc) TensorView gradient = {};
  QKV_ATTENTION_PARAMETERS(QKV_PARAMETER_VIEW)
#undef QKV_PARAMETER_VIEW
};

// A parameter gradient that a call computes: its row's name and its shape.
struct ParameterGradient {
  const char* name = "";            // the row's gradient, e.g. "d_sinks"
  std::vector<std::int64_t> sizes;  // its shape
  DType dtype = DType::f32;         // f32 (f64 for f64 inputs)
};

// The parameter gradients that attention_backward computes for these inputs
// and options, in the rows' order: what attention_backward_into needs.
// Throws qkv::Error on invalid input.
std::vector<ParameterGradient> parameter_gradients(ConstTensorView q, ConstTensorView k,
                                                   ConstTensorView v,
                                                   const AttentionOptions& options = {});

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
