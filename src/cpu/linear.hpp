// The fast linear attention kernels: the plain-C++ side, the per-call plan
// that the SIMD bodies (linear-inl.h, compiled per Highway target) consume.
#pragma once

#include <cstdint>
#include <vector>

#include "core/linear_problem.hpp"

namespace qkv::cpu {

struct LinearPlan {
  const detail::LinearProblem* problem = nullptr;
  const LinearAttentionOptions* options = nullptr;
  ConstTensorView q, k, v;
  TensorView out;  // undefined in the backward
  // Causal passes: the initial state (s_in null: zeros; z_in empty: zeros)
  // and where the final state goes (null: not requested), f32 contiguous
  // [B][Hkv][M][Dv] and [B][Hkv][M]. s_out may equal s_in; z_in is a copy,
  // because every value-column block of a head reads it and the first one
  // writes z_out.
  const float* s_in = nullptr;
  std::vector<float> z_in;
  float* s_out = nullptr;
  float* z_out = nullptr;
  // Value-column blocks per (sequence, KV head) in the causal forward, so
  // that B * Hkv < threads still keeps every thread busy. Each output
  // element is computed by the same operations whatever the split, so this
  // may follow the thread count without changing any result.
  std::int64_t column_blocks = 1;
  // (sequence, KV head) pairs per unit of the causal forward, visited chunk
  // by chunk together (see CausalForwardUnit); like column_blocks it changes
  // no result.
  std::int64_t unit_heads = 1;
};

// Builds the plan of a validated call; `states` as in reference::linear_attention.
LinearPlan make_linear_plan(const detail::LinearProblem& problem,
                            const LinearAttentionOptions& options, ConstTensorView q,
                            ConstTensorView k, ConstTensorView v, TensorView out,
                            const detail::LinearStates& states);

// Forward pass: out (and the final state). Runs on OpenMP threads; the result
// does not depend on the thread count.
void linear_forward(const LinearPlan& plan);

// Backward pass: dq, dk, dv from dout. Runs on OpenMP threads; the result
// does not depend on the thread count.
void linear_backward(const LinearPlan& plan, ConstTensorView dout,
                     const LinearAttentionGradientOutputs& grads);

}  // namespace qkv::cpu
