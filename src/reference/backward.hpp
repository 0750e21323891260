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

}  // namespace qkv::reference
