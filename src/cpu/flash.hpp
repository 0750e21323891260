// The fused CPU attention kernels (flash attention: tiled, online softmax,
// O(N) extra memory). This header is the plain-C++ side: the per-call plan
// that the SIMD bodies (flash-inl.h, compiled per Highway target) consume.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "core/problem.hpp"
#include "cpu/engines/bf16_product.hpp"
#include "cpu/engines/int8_product.hpp"
#include "cpu/params.hpp"
#include "qkv/backward.hpp"
#include "qkv/flex.hpp"

namespace qkv::cpu {

// Tile sizes. Rows of a tile are (query head of a KV group) x (query
// position); columns are keys.
struct FlashConfig {
  std::int64_t rows = 96;   // target rows of a Q tile (all heads of a KV group)
  std::int64_t keys = 256;  // keys per KV tile
  // Per-thread budget for a task's keys and values packed once for all its
  // units; a task needing more packs each block as it comes.
  std::int64_t packed_keys_bytes = std::int64_t{16} << 20;
};

// The tile sizes in use: FlashConfig's defaults, overridden by the
// environment variables QKV_FLASH_ROWS and QKV_FLASH_KEYS (for tuning) and,
// for tests of the per-block packing, QKV_FLASH_PACKED_KEYS_BYTES.
FlashConfig flash_config();

// How a (unit, key block) tile relates to the explicit masks.
enum class BlockClass : std::uint8_t { empty, partial, full };

// One parallel work item: positions [i0, i0 + positions) of every query head
// sharing KV head `hkv` in sequence `s`.
struct Unit {
  std::int64_t s = 0;
  std::int64_t hkv = 0;
  std::int64_t i0 = 0;
  std::int64_t positions = 0;
  std::int64_t first_block = 0;  // index of this unit's first entry in block_class
};

// A run of consecutive units of one (sequence, KV head) that one thread
// processes in order, sharing one packing of their keys and values.
struct Task {
  std::int64_t unit_begin = 0;
  std::int64_t unit_end = 0;
};

struct FlashPlan {
  const detail::AttentionProblem* problem = nullptr;
  KernelParams params;                     // the call's options, lowered
  const detail::TileMods* mods = nullptr;  // never null; members may be
  ConstTensorView q, k, v;
  TensorView out;    // may be undefined in the probabilities pass
  TensorView lse;    // f32 [B, Hq, Nq]; always defined (caller's or scratch)
  TensorView probs;  // f32 [B, Hq, Nq, Nk]; undefined unless requested
  // f32 [B, Hq, Nq] each: every row's score maximum m and the scale of its
  // finish (detail::finish_row: P = e^(s - m) scale), written by the forward
  // for the probabilities pass; undefined unless probs is.
  TensorView row_max, row_scale;
  FlashConfig config;
  std::int64_t positions_per_unit = 0;
  // The largest unit (positions) and key range (rows of K of one sequence):
  // scratch is sized from these, so a small problem neither allocates nor
  // clears a full tile.
  std::int64_t max_positions = 0;
  std::int64_t max_key_rows = 0;
  std::vector<Unit> units;  // grouped by (sequence, KV head), positions ascending
  std::vector<Task> tasks;
  // Per unit, per key block (empty when no bool mask, mask_mod or sparse
  // pattern): classification of those explicit masks.
  std::vector<BlockClass> block_class;
  // Score::additive parameters in f32: W_q [A][Dq], W_k [A][Dk], bias [A]
  // (empty if none), v [A rounded up to 16] zero-padded.
  std::vector<float> additive_w_q, additive_w_k, additive_bias, additive_v;
  // [Hq][2 R + 1] relative position bias by j - p_i + R (empty when unused).
  std::vector<float> relative_bias;
  std::int64_t relative_radius = 0;  // R
  // The engine of the products (flash_engine-inl.h, forward;
  // flash_backward_engine-inl.h, backward), or none: f32 FMAs on the inputs
  // widened to f32 (products_engine chooses).
  std::optional<engines::Bf16Engine> engine;
  // MatmulPrecision::int8: the forward's Q K^T in int8 on this engine (with
  // `engine` for P V), or none.
  std::optional<engines::Int8Engine> int8;
};

// The engine for a call's products, forward and backward: bf16 q, k and v,
// or f32 and f16 ones under MatmulPrecision::medium (rounded to bf16), with
// a dot-product score, where engines::bf16_engine() has one; else none.
std::optional<engines::Bf16Engine> products_engine(const KernelParams& params, ConstTensorView q,
                                                   ConstTensorView k, ConstTensorView v);

// The engine of a forward's int8 Q K^T: under MatmulPrecision::int8, where
// the products run on `engine` and engines::int8_engine() has one.
std::optional<engines::Int8Engine> scores_int8_engine(const KernelParams& params,
                                                      std::optional<engines::Bf16Engine> engine);

// Builds the plan: units, block classes (evaluating bool masks and mask_mod
// once, sparse patterns from their parameters), the relative bias table;
// tile sizes from `config`.
FlashPlan make_plan(const detail::AttentionProblem& problem, const KernelParams& params,
                    const detail::TileMods& mods, ConstTensorView q, ConstTensorView k,
                    ConstTensorView v, TensorView out, TensorView lse, TensorView probs,
                    const FlashConfig& config = flash_config());

// Tile sizes of the backward pass (key blocks are its outer loop, so they are
// smaller than the forward's): QKV_FLASH_BWD_ROWS / QKV_FLASH_BWD_KEYS.
FlashConfig flash_backward_config();

// What the backward pass reads besides the plan's q, k, v (the plan's out,
// lse and probs are unused), and what it writes.
struct BackwardArgs {
  ConstTensorView out;    // [B, Nq, Hq, Dv], the forward's output
  ConstTensorView dout;   // [B, Nq, Hq, Dv]
  ConstTensorView lse;    // f32 [B, Hq, Nq], the forward's
  GradientOutputs grads;  // dq, dk, dv, d_relative_bias (not the additive score's)
};

// Backward pass (dot-product scores): dq, dk, dv and the relative bias
// gradient, for a plan made with flash_backward_config(). Runs on OpenMP
// threads; the result does not depend on the thread count. Returns whether
// every gradient it wrote is finite.
bool flash_backward(const FlashPlan& plan, const BackwardArgs& args);

// One parallel work item of the backward: key blocks [block_begin,
// block_end) of one (sequence, KV head), visited by its units [unit_begin,
// unit_end). It owns those rows of dk and dv, and adds its share of dq into
// dQ partial buffer `chunk`.
struct BackwardTask {
  std::int64_t unit_begin = 0;
  std::int64_t unit_end = 0;
  std::int64_t block_begin = 0;
  std::int64_t block_end = 0;
  std::int64_t chunk = 0;
};

// The backward's work split and f32 accumulators. Splitting a head's keys
// into `chunks` (chosen from the problem, never from the thread count) keeps
// every thread busy when B * Hkv is small; each chunk adds into its own dQ
// buffer and the buffers are summed in a fixed order, so no floating-point
// atomics and no dependence on the schedule.
struct BackwardPlan {
  const FlashPlan* plan = nullptr;
  BackwardArgs args;
  std::vector<BackwardTask> tasks;
  std::int64_t chunks = 1;
  std::int64_t dq_ld = 0;       // floats per dQ row: Dq rounded up to the vector
  float* dq_partial = nullptr;  // [chunks][B * Nq * Hq][dq_ld], zeroed
  // Relative bias gradient by j - p_i + R, per task: [tasks][group][2 R + 1].
  double* bias_partial = nullptr;
  // d_mask's buffer of dS, [B, Hq, Nq, Nk] zeroed (core/mask_gradient.hpp),
  // or null without d_mask.
  float* ds_full = nullptr;
};

// Forward pass: out and lse (and row_max, row_scale when defined). Runs on
// OpenMP threads; the result does not depend on the thread count. Returns
// whether every output and lse is finite (lse -inf for rows without keys).
bool flash_forward(const FlashPlan& plan);
// Attention probabilities from the row maxima and scales of a completed
// forward pass.
void flash_probabilities(const FlashPlan& plan);
// Name of the Highway target the kernels dispatch to on this CPU ("AVX2").
const char* flash_target();
// The kernels' building blocks, exposed for tests: the output conversion
// (f32 -> f32/bf16/f16, RNE) and the softmax exp.
void store_row(const float* src, std::int64_t n, void* dst, DType dtype);
void exp_row(const float* src, std::int64_t n, float* dst);

}  // namespace qkv::cpu
