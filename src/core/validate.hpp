// Validation of attention calls: named checks that append reasons, gathered
// into one qkv::Error. The result is the resolved problem geometry that the
// backends consume, so no kernel re-derives shapes from options.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "qkv/attention.hpp"
#include "qkv/backward.hpp"

namespace qkv::detail {

// Rows of one sequence (a batch entry, or a packed sequence in varlen mode).
struct SequenceExtent {
  std::int64_t q_begin = 0;  // first query row in q's dimension 1
  std::int64_t nq = 0;       // query rows
  std::int64_t k_begin = 0;  // first key row in k's and v's dimension 1
  std::int64_t nk_rows = 0;  // key rows present in k and v
  std::int64_t nk = 0;       // valid keys (key_lengths, else nk_rows)
  std::int64_t batch = 0;    // index into dimension 0 of q, k, v, out
};

// The geometry of a validated attention call.
struct AttentionProblem {
  std::int64_t batch = 0;      // q.size(0)
  std::int64_t sequences = 0;  // batch, or S in varlen mode
  std::int64_t nq = 0;         // q.size(1) (total rows in varlen mode)
  std::int64_t nk = 0;         // k.size(1)
  std::int64_t hq = 0;
  std::int64_t hkv = 0;
  std::int64_t dq = 0;  // q's head dim (differs from dk only for additive scores)
  std::int64_t dk = 0;
  std::int64_t dv = 0;
  std::int64_t attention_size = 0;  // A of the additive score
  bool varlen = false;
  double scale = 1.0;             // multiplies <q, k> (1 for Score::dot)
  DType dtype = DType::f32;       // of q, k, v and out
  DType stat_dtype = DType::f32;  // of lse and probs

  std::int64_t group() const { return hkv == 0 ? 0 : hq / hkv; }
  SequenceExtent sequence(std::int64_t s, const AttentionOptions& options) const;
};

// Appends a reason when t's extent overflows int64 or its data is null while
// it has elements; returns whether it is addressable and backed.
bool check_memory(const char* name, ConstTensorView t, std::vector<std::string>& reasons);

// A tensor argument: defined, of rank `rank` (-1: any), backed by memory when
// it has elements, and addressable. Appends the reasons it is not; returns
// whether later checks may look at its sizes.
bool check_tensor(const char* name, ConstTensorView t, int rank, std::vector<std::string>& reasons);

// Appends a reason unless dimension d of t (its `what`) equals `expected`,
// which comes from `source` ("q's batch 2").
void check_dim(const char* name, ConstTensorView t, int d, const char* what, std::int64_t expected,
               const std::string& source, std::vector<std::string>& reasons);

// Appends a reason unless k's hkv KV heads can be shared by hq query heads
// (grouped-query attention: hkv >= 1 divides hq).
void check_head_groups(ConstTensorView k, std::int64_t hq, std::int64_t hkv,
                       std::vector<std::string>& reasons);

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
// when the options use the parameter, and no overlap with `inputs` (named by
// `input_names`) or with each other; throws qkv::Error listing every problem.
void check_gradient_outputs(const AttentionProblem& problem,
                            std::span<const ConstTensorView> inputs,
                            std::span<const char* const> input_names,
                            const AttentionOptions& options, const GradientOutputs& grads);

}  // namespace qkv::detail
