// Validation of attention and linear attention calls: named checks that
// append reasons, gathered into one qkv::Error. The result is the resolved
// problem geometry (core/problem.hpp, core/linear_problem.hpp) that the
// backends consume, so no kernel re-derives shapes from options.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/checks.hpp"
#include "core/linear_problem.hpp"
#include "core/problem.hpp"
#include "qkv/attention.hpp"
#include "qkv/backward.hpp"

namespace qkv::detail {

// Appends a reason unless k's hkv KV heads can be shared by hq query heads
// (grouped-query attention: hkv >= 1 divides hq).
void check_head_groups(ConstTensorView k, std::int64_t hq, std::int64_t hkv, Reasons& reasons);

// Options that need no tensor shape (enum values, windows, softcap, dropout
// probability, backend); appends a reason for each bad one.
void check_scalar_options(const AttentionOptions& options, Reasons& reasons);

// options.scale for the options' score and head dim Dk; returns the scale
// that multiplies <q, k> (1 for Score::dot and Score::additive).
double check_scale(const AttentionOptions& options, std::int64_t dk, Reasons& reasons);

// options.alibi_slopes: Hq or sequences * Hq finite slopes (none: off).
void check_alibi(const AttentionOptions& options, std::int64_t hq, std::int64_t sequences,
                 bool varlen, Reasons& reasons);

// options.sinks: Hq logits, each finite or -inf (none: off).
void check_sinks(const AttentionOptions& options, std::int64_t hq, Reasons& reasons);

// Checks q, k, v and options; throws qkv::Error listing every problem.
AttentionProblem check_attention_inputs(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                                        const AttentionOptions& options);

// Checks caller-provided outputs against a validated problem; throws
// qkv::Error listing every problem.
void check_attention_outputs(const AttentionProblem& problem, ConstTensorView q, ConstTensorView k,
                             ConstTensorView v, const AttentionOptions& options,
                             const AttentionOutputs& outputs);

// Checks the extra inputs of a backward call (out, dout, lse) and that the
// options are differentiable; throws qkv::Error listing every problem.
void check_backward_inputs(const AttentionProblem& problem, ConstTensorView out,
                           ConstTensorView dout, ConstTensorView lse,
                           const AttentionOptions& options);

// Checks caller-provided gradient views: shapes, dtypes, presence exactly
// when the options use the parameter, and no overlap with the call's inputs
// or with each other; throws qkv::Error listing every problem.
void check_gradient_outputs(const AttentionProblem& problem, ConstTensorView q, ConstTensorView k,
                            ConstTensorView v, ConstTensorView out, ConstTensorView dout,
                            ConstTensorView lse, const AttentionOptions& options,
                            const GradientOutputs& grads);

// Linear attention: checks q, k, v and the options; throws qkv::Error listing every problem.
LinearProblem check_linear_inputs(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                                  const LinearAttentionOptions& options);

}  // namespace qkv::detail
