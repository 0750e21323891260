// The reference attention: plain loops mirroring the formulas of
// qkv/attention.hpp, accumulating in double, no SIMD, no threads. Every fast
// path is tested against it.
#pragma once

#include "core/validate.hpp"
#include "qkv/attention.hpp"

namespace qkv::reference {

// Writes out (and lse, probs when defined) for a validated problem.
void attention(const detail::AttentionProblem& problem, ConstTensorView q, ConstTensorView k,
               ConstTensorView v, const AttentionOutputs& outputs, const AttentionOptions& options);

}  // namespace qkv::reference
