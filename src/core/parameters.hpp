// core/parameters.hpp — the learnable parameters' rows
// (QKV_ATTENTION_PARAMETERS) evaluated for one call: what the backward
// allocates, validates and writes for each parameter gradient.
#pragma once

#include <vector>

#include "core/problem.hpp"
#include "qkv/backward.hpp"

namespace qkv::detail {

// One row of QKV_ATTENTION_PARAMETERS for a problem and its options.
struct ParameterRow {
  const char* name = "";                  // the gradient's field, e.g. "d_sinks"
  std::vector<std::int64_t> sizes;        // its shape for this problem
  bool used = false;                      // the options use the parameter
  const char* option = "";                // names the parameter in messages
  Tensor AttentionGradients::*tensor{};   // the field of the allocating result
  TensorView GradientOutputs::*output{};  // the field of the caller's views
};

// Every row, in order, used or not.
std::vector<ParameterRow> parameter_rows(const AttentionProblem& p, const AttentionOptions& o);

// Allocates the used parameters' gradients (stat dtype) into g.
void allocate_parameter_gradients(const AttentionProblem& p, const AttentionOptions& o,
                                  AttentionGradients& g);

// Views of g's gradients, all of them.
GradientOutputs views_of(AttentionGradients& g);

}  // namespace qkv::detail
