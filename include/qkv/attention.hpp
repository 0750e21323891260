// qkv/attention.hpp — the attention operator: out = softmax(f(Q, K)) V.
//
// Shapes (FlashAttention's layout; any non-negative strides, so a
// [B, H, N, D] tensor passes as `t.transpose(1, 2)` without a copy):
//   q    [B, Nq, Hq,  Dk]
//   k    [B, Nk, Hkv, Dk]
//   v    [B, Nk, Hkv, Dv]
//   out  [B, Nq, Hq,  Dv]      dtype of q
//   lse  [B, Hq, Nq]           f32 (f64 for f64 inputs); natural log
//   probs[B, Hq, Nq, Nk]       f32 (f64 for f64 inputs); the softmax weights
// Hq must be a multiple of Hkv; query head h reads KV head h / (Hq / Hkv)
// (Hkv == Hq: multi-head, 1 < Hkv < Hq: grouped-query, Hkv == 1: multi-query).
// q, k and v share one dtype: f32, f64, f16 or bf16.
//
// Packed variable-length batches (`cu_seqlens_q` / `cu_seqlens_k`, as in
// FlashAttention's varlen API): q, k, v, out have B == 1 and hold S sequences
// back to back; sequence s owns rows [cu_seqlens_q[s], cu_seqlens_q[s+1]) of q
// and [cu_seqlens_k[s], cu_seqlens_k[s+1]) of k and v. It is exactly dense
// attention with a block-diagonal mask; lse is [1, Hq, total_q] and probs
// [1, Hq, total_q, total_k]. Everywhere below, "sequence b" means the batch
// entry b, or the packed sequence b, and i, j are positions *inside* it.
//
// Per sequence b, query row i and key j, the score is built in this order:
//   s  = scale * <q_i, k_j>               Score::scaled_dot (scale = 1/sqrt(Dk))
//      | <q_i, k_j>                       Score::dot
//      | v^T tanh(W_q q_i + W_k k_j + b)  Score::additive
//   s  = c * tanh(s / c)                  if softcap c > 0
//   s += -slope[h] * |p_i - j|            ALiBi
//   s += table[h, bucket(j - p_i)]        relative position bias (T5 buckets)
//   s += mask[b, h, i, j]                 float (additive) mask
//   s  = score_mod(s, b, h, i, j)         user callable
// and key j is dropped (s = -inf) unless every mask admits it:
//   j < nk_b                              key lengths (else nk_b = Nk)
//   j <= p_i                              causal
//   p_i - left <= j <= p_i + right        sliding window (-1: unbounded side)
//   mask[b, h, i, j] == true              bool mask
//   mask_mod(b, h, i, j) == true          user callable
//   sparse.admits(h, i, p_i, j)           sparse pattern (qkv/sparse.hpp)

// where p_i, the position of query i on the key axis, is i + (nk_b - nq_b)
// with Align::bottom_right (FlashAttention >= 2.1, KV-cache decoding) or i
// with Align::top_left (PyTorch's `is_causal`); the two agree when nq_b == nk_b.
// `options.shard.position` (default 0) is added to p_i in both alignments.
// Learned attention sinks (gpt-oss, StreamingLLM): with options.sinks, query
// head h has a logit S_h that joins every row's softmax denominator and adds
// nothing to the output:
//   p_ij = e^(s_ij) / (e^(S_h) + sum_k e^(s_ik)),   out_i = sum_j p_ij v_j,
//   lse_i = log(e^(S_h) + sum_k e^(s_ik)),
// so a row whose keys are all dropped has out = 0 and lse = S_h.
// Softmax subtracts the row maximum. A row whose keys are all dropped has
// out = 0, lse = -inf and probs = 0, never NaN. A NaN score yields a NaN row.
// Keys a row does not admit never affect it, whatever their k and v hold
// (NaN, infinities); docs/semantics.md states the rules for non-finite
// inputs, which every backend follows. Sequence lengths (Nq, Nk, and the
// packed totals) are below 2^60, so positions and window bounds never
// overflow; scale is finite (|scale| <= FLT_MAX) and softcap is 0 or in
// [2^-126, 2^126].
//
// Dropout (training): with dropout_p = p > 0 each weight P[b, h, i, j] is kept
// with probability 1 - p and scaled by 1 / (1 - p), else zeroed, before it
// multiplies V: out_i = sum_j P_ij Z_ij / (1 - p) v_j. Z is a pure function
// of (dropout_seed, dropout_offset, b, h, i, j) (see dropout_keep in
// qkv/backward.hpp; h, i and j shifted by options.shard), so the backward regenerates it without
// storing it and no result depends on the thread count. lse and probs are those of softmax before
// dropout.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>

#include "qkv/sparse.hpp"
#include "qkv/tensor.hpp"

namespace qkv {

// How scores f(q, k) are computed.
enum class Score : std::uint8_t {
  scaled_dot,  // scale * <q, k>; scale defaults to 1/sqrt(Dk)
  dot,         // <q, k>
  additive,    // v^T tanh(W_q q + W_k k + bias) (Bahdanau)
};

// Where query row i sits on the key axis when nq != nk (see the header).
enum class Align : std::uint8_t { top_left, bottom_right };

// Which implementation runs the call.
enum class Backend : std::uint8_t {
  automatic,  // the fastest backend that supports the call (see qkv/backward.hpp)
  reference,  // plain loops in double: the specification
  fast,       // fused CPU kernels
};

// How exactly the products Q K^T and P V are computed (PyTorch's
// torch.set_float32_matmul_precision names). A permission, not a demand: a
// path that has no faster product for the call computes it at `highest`.
enum class MatmulPrecision : std::uint8_t {
  highest,  // f32 products of the stored values (f64 for f64 inputs)
  medium,   // bf16 dot products with f32 sums where the CPU has an engine for
            // them (AMX, AVX512-BF16; `qkv info`): the fused forward and
            // backward of f32 and f16 inputs (rounded to bf16) and
            // decode_attention of bf16 caches (docs/matrix-engines.md)
  int8,     // medium, and the fused forward's Q K^T in int8 (per-row Q and
            // per-key K scales, K smoothed by its mean over the keys:
            // SageAttention) where the CPU has AMX-INT8 or AVX512-VNNI and a
            // bf16 engine; the backward computes at medium (docs/numerics.md)
};

// Parameters of Score::additive, shared by all heads. A is the attention size.
struct AdditiveScore {
  ConstTensorView w_q;   // [A, Dq] (Dq = q's last dim); required
  ConstTensorView w_k;   // [A, Dk]; required
  ConstTensorView v;     // [A]; required
  ConstTensorView bias;  // [A]; optional (undefined = no bias)
};

// T5-style learned relative position bias: table[h, bucket(j - p_i)], with the
// bucket function of `t5_relative_bucket` (qkv/positional.hpp).
struct RelativePositionBias {
  ConstTensorView table;            // [Hq, num_buckets]; undefined = off
  std::int64_t max_distance = 128;  // distance at which buckets stop growing
  bool bidirectional = true;        // false: all keys after the query share bucket 0
};

// score_mod(score, b, h, i, j) -> new score; mask_mod(b, h, i, j) -> keep?
using ScoreMod = std::function<double(double score, std::int64_t b, std::int64_t h, std::int64_t i,
                                      std::int64_t j)>;
using MaskMod = std::function<bool(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j)>;

// Where a call sits inside a larger problem it computes one piece of
// (context parallelism, qkv/distributed.hpp): a block of query rows against
// a block of keys, or a subset of the heads. With every field 0 the call is
// the whole problem. Query positions p_i (causal, window, ALiBi) move by
// `position`; the dropout generator sees the global row, key and head, so a
// problem split into pieces drops exactly the weights the whole call drops.
// Masks, key lengths and the user callables keep the call's own indices;
// relative_bias and sparse are rejected when position, row or key is set.
struct ShardOffsets {
  std::int64_t position = 0;  // added to every query position p_i, in keys of this call
  std::int64_t row = 0;       // global index of query row 0 (dropout), >= 0
  std::int64_t key = 0;       // global index of key 0 (dropout), >= 0
  std::int64_t head = 0;      // global index of query head 0 (dropout), >= 0
  std::int64_t heads = 0;     // query heads of the whole problem (dropout); 0 = Hq
  // The keys are a block of each row's keys: the backward takes the weights
  // from the given lse (the whole row's) on every backend; without it the
  // reference backward recomputes lse from the call's own keys in double.
  bool partial_keys = false;
};

// The options of qkv::attention, one row each: X(type, name, default, doc).
// Every default means "off". The struct below, the option names, the
// predicates "is this option on" (its value differs from the default), the
// capability table of which path takes which option (src/core/capabilities.cpp)
// and Python's keyword arguments (qkv.attention's **options) all come from
// these rows, so that a new option is one row plus its semantics
// (docs/architecture.md, "Adding a feature").
#define QKV_ATTENTION_OPTIONS(X)                                                                  \
  X(Score, score, Score::scaled_dot, "how f(q, k) is computed")                                   \
  X(std::optional<double>, scale, std::nullopt, "Score::scaled_dot only; default 1/sqrt(Dk)")     \
  X(AdditiveScore, additive, {}, "Score::additive only: its parameters")                          \
  X(bool, causal, false, "drop keys after the query's position")                                  \
  X(Align, align, Align::bottom_right, "query positions for causal, window, ALiBi, bias")         \
  X(std::int64_t, window_left, -1, "keys at most this far before p_i; -1 = unbounded")            \
  X(std::int64_t, window_right, -1, "keys at most this far after p_i; -1 = unbounded")            \
  X(std::span<const std::int64_t>, key_lengths, {}, "[B] valid keys per sequence; empty = all")   \
  X(std::span<const std::int64_t>, cu_seqlens_q, {},                                              \
    "[S + 1] packed query offsets; empty = dense")                                                \
  X(std::span<const std::int64_t>, cu_seqlens_k, {},                                              \
    "[S + 1] packed key offsets; with cu_seqlens_q")                                              \
  X(ConstTensorView, mask, {},                                                                    \
    "bool (true = attend) or float (added), broadcast to [B, Hq, Nq, Nk]")                        \
  X(bool, mask_requires_grad, false,                                                              \
    "backward: also d_mask, the float mask's gradient; no effect on the forward")                 \
  X(std::span<const float>, alibi_slopes, {}, "[Hq], or [B * Hq] ([S * Hq] packed); empty = off") \
  X(std::span<const float>, sinks, {},                                                            \
    "[Hq] learned logit per query head joining each row's softmax denominator; empty = off")      \
  X(std::span<const float>, score_scale, {},                                                      \
    "[Hq] learned multiplier of head h's logits (dot-product scores); empty = off")               \
  X(bool, score_scale_log_n, false,                                                               \
    "with score_scale: also times ln(n_i), n_i the keys of row i's range (Scalable-Softmax)")     \
  X(RelativePositionBias, relative_bias, {}, "learned bias by relative position; off")            \
  X(double, softcap, 0.0, "c > 0 applies c * tanh(s / c); 0 = off")                               \
  X(ScoreMod, score_mod, {}, "score_mod(s, b, h, i, j) -> new score; empty = identity")           \
  X(MaskMod, mask_mod, {}, "mask_mod(b, h, i, j) -> keep?; empty = keep all")                     \
  X(SparsePattern, sparse, {}, "sparse attention pattern (qkv/sparse.hpp); undefined = off")      \
  X(double, dropout_p, 0.0, "probability of zeroing a weight; 0 = off, < 1")                      \
  X(std::uint64_t, dropout_seed, 0, "key of the dropout generator")                               \
  X(std::uint32_t, dropout_offset, 0, "counter offset: use a new one per call and layer")         \
  X(ShardOffsets, shard, {}, "the call as a piece of a larger one; all 0 = whole")                \
  X(Backend, backend, Backend::automatic, "which implementation runs")                            \
  X(MatmulPrecision, matmul_precision, MatmulPrecision::highest,                                  \
    "medium allows bf16 products, int8 also int8 Q K^T (see the enum)")                           \
  X(bool, return_lse, false, "allocating overload: also return lse")                              \
  X(bool, return_probs, false, "allocating overload: also return probs (B*Hq*Nq*Nk values)")

// Options of qkv::attention (the rows above). Every field has a default
// that means "off".
struct AttentionOptions {
#define QKV_OPTION_FIELD(type, name, init, doc) type name = init;
  QKV_ATTENTION_OPTIONS(QKV_OPTION_FIELD)
#undef QKV_OPTION_FIELD
};

// Result of the allocating overload; lse and probs are undefined unless asked.
struct AttentionResult {
  Tensor out;    // [B, Nq, Hq, Dv], dtype of q
  Tensor lse;    // [B, Hq, Nq]
  Tensor probs;  // [B, Hq, Nq, Nk]
};

// Caller-provided outputs. `out` is required; `lse` and `probs` are computed
// only when defined. Outputs must not overlap the inputs or each other.
struct AttentionOutputs {
  TensorView out = {};    // [B, Nq, Hq, Dv], dtype of q, any strides
  TensorView lse = {};    // [B, Hq, Nq], f32 (f64 for f64 inputs)
  TensorView probs = {};  // [B, Hq, Nq, Nk], f32 (f64 for f64 inputs)
};

// Computes attention and returns freshly allocated outputs.
// Throws qkv::Error (listing every problem) on invalid input.
AttentionResult attention(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                          const AttentionOptions& options = {});

// Computes attention into caller-provided views (no copy of the result).
// `options.return_lse` / `return_probs` are ignored: defined views decide.
void attention_into(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                    const AttentionOutputs& outputs, const AttentionOptions& options = {});

}  // namespace qkv
