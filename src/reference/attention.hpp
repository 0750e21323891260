// The reference attention: plain loops mirroring the formulas of
// qkv/attention.hpp, accumulating in double, no SIMD, no threads. Every fast
// path is tested against it.
#pragma once

#include "core/problem.hpp"
#include "qkv/attention.hpp"

namespace qkv::reference {

// Writes out (and lse, probs when defined) for a validated problem.
void attention(const detail::AttentionProblem& problem, ConstTensorView q, ConstTensorView k,
               ConstTensorView v, const AttentionOutputs& outputs, const AttentionOptions& options);

// The same loops computed naively in f32 and, for precision f16 or bf16,
// with every score and weight rounded to it (as a framework computing in that
// dtype rounds between operations). The error of this computation against
// attention() is the yardstick of the fast kernels' tolerance.
void naive_attention(const detail::AttentionProblem& problem, ConstTensorView q, ConstTensorView k,
                     ConstTensorView v, const AttentionOutputs& outputs,
                     const AttentionOptions& options, DType precision);

}  // namespace qkv::reference
