// Validation of attention calls: named checks that append reasons, gathered
// into one qkv::Error. The result is the resolved problem geometry that the
// backends consume, so no kernel re-derives shapes from options.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/checks.hpp"
#include "qkv/attention.hpp"
#include "qkv/backward.hpp"

namespace qkv::detail {

// The longest sequence (Nq, Nk) a call may have: positions p_i and their
// differences p_i - j then stay far inside int64, so mask and pattern
// arithmetic on them cannot overflow. No backed tensor comes near; only
// empty or broadcast views could ask for more.
inline constexpr std::int64_t kMaxSequence = (std::int64_t{1} << 60) - 1;

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

}  // namespace qkv::detail
