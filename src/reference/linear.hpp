// The reference linear attention: the quadratic form of qkv/linear.hpp,
// out_i = sum_j w_ij v_j / (sum_j w_ij + eps) with w_ij = <phi(q_i), phi(k_j)>,
// in plain loops accumulating in double, and its backward. Every fast path
// is tested against it.
#pragma once

#include "core/linear_problem.hpp"

namespace qkv::reference {

// Writes out for a validated problem; a causal pass starts from the initial
// state of `states` and writes its final state when requested.
void linear_attention(const detail::LinearProblem& problem, ConstTensorView q, ConstTensorView k,
                      ConstTensorView v, TensorView out, const LinearAttentionOptions& options,
                      const detail::LinearStates& states = {});

// The same loops computed naively in f32 and, for precision f16 or bf16,
// with the features, every w_ij, the numerator and the normalizer rounded to
// it (as a framework computing in that dtype rounds between operations). Its
// error against linear_attention() is the yardstick of the fast kernels'
// tolerance.
void naive_linear_attention(const detail::LinearProblem& problem, ConstTensorView q,
                            ConstTensorView k, ConstTensorView v, TensorView out,
                            const LinearAttentionOptions& options, DType precision,
                            const detail::LinearStates& states = {});

// Writes dq, dk and dv (the formulas of qkv/linear.hpp) for a validated
// problem.
void linear_attention_backward(const detail::LinearProblem& problem, ConstTensorView q,
                               ConstTensorView k, ConstTensorView v, ConstTensorView dout,
                               const LinearAttentionGradientOutputs& grads,
                               const LinearAttentionOptions& options);

// The backward's loops in f32, rounding for f16 or bf16 what a framework
// would: features, w_ij, numerator, normalizer, g_i, c_i, dw_ij and the
// summed gradients.
void naive_linear_attention_backward(const detail::LinearProblem& problem, ConstTensorView q,
                                     ConstTensorView k, ConstTensorView v, ConstTensorView dout,
                                     const LinearAttentionGradientOutputs& grads,
                                     const LinearAttentionOptions& options, DType precision);

}  // namespace qkv::reference
