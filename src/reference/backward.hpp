// The reference backward: plain loops in double over the formulas of
// qkv/backward.hpp, recomputing each row's scores, softmax and logsumexp
// (the caller's lse is not read). Every fast backward is tested against it, and it is tested
// against central finite differences of the reference forward.
#pragma once

#include "core/problem.hpp"
#include "qkv/backward.hpp"

namespace qkv::reference {

// Writes every defined view of `grads` for a validated problem.
void attention_backward(const detail::AttentionProblem& problem, ConstTensorView q,
                        ConstTensorView k, ConstTensorView v, ConstTensorView out,
                        ConstTensorView dout, ConstTensorView lse, const GradientOutputs& grads,
                        const AttentionOptions& options);

// The same loops computed naively in f32 from the caller's lse and, for
// precision f16 or bf16, with every score, weight P, dP and dS rounded to
// it. Its error against
// attention_backward() is the yardstick of the fast backward's tolerance.
void naive_attention_backward(const detail::AttentionProblem& problem, ConstTensorView q,
                              ConstTensorView k, ConstTensorView v, ConstTensorView out,
                              ConstTensorView dout, ConstTensorView lse,
                              const GradientOutputs& grads, const AttentionOptions& options,
                              DType precision);

// d_sinks[h] = -sum over the rows (b, i) of head h of e^(S_h - lse) D_bi,
// with D = <dout, out> in double (core/softmax_epilogue.hpp), from the
// caller's out, dout and lse: the same for every backend, and for a call
// that is one shard of a larger problem's query rows. Rows outside every
// packed sequence take no part.
void sink_gradients(const detail::AttentionProblem& problem, ConstTensorView out,
                    ConstTensorView dout, ConstTensorView lse, const AttentionOptions& options,
                    TensorView d_sinks);

}  // namespace qkv::reference
