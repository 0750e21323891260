// qkv/modules/multihead_attention.hpp — torch.nn.MultiheadAttention on qkv's
// kernels, with grouped K/V heads, positions and a KV cache for decoding.
//
// Shapes (batch first, as torch's `batch_first=True`):
//   query  [B, Nq, E]        f32, f64, bf16 or f16 (one dtype for all three)
//   key    [B, Nk, kdim]     kdim = E unless configured
//   value  [B, Nk, vdim]     vdim = E unless configured
//   out    [B, Nq, E]        dtype of query
//   weights [B, Nq, Nk] (head average) or [B, H, Nq, Nk] (per head), f32
//           (f64 for f64 inputs); only with need_weights
// With H query heads of dimension Dh = E / H and Hkv K/V heads (Hkv divides
// H; Hkv = H is torch's module, Hkv = 1 multi-query, otherwise grouped-query):
//   Q = query Wq^T + bq  [B, Nq, H, Dh]      K = key Wk^T + bk  [B, Nk, Hkv, Dh]
//   V = value Wv^T + bv  [B, Nk, Hkv, Dh]    A = attention(Q, K, V)  (qkv::attention,
//   scale 1/sqrt(Dh), query head h reads K/V head h / (H / Hkv))
//   out = A Wo^T + bo
//
// Parameters, under torch's state-dict names so its state dicts load:
//   in_proj_weight  [E + 2 Hkv Dh, E]   Wq, Wk, Wv stacked (torch: [3E, E])
//                                       when kdim == vdim == E
//   q_proj_weight [E, E], k_proj_weight [Hkv Dh, kdim], v_proj_weight
//                 [Hkv Dh, vdim]        otherwise (torch's names)
//   in_proj_bias    [E + 2 Hkv Dh]      bq, bk, bv (with bias)
//   out_proj.weight [E, E], out_proj.bias [E]
//   relative_attention_bias.weight [num_buckets, H]   with Position::relative_bias
//                                       (Hugging Face T5's layout)
//
// Masks follow torch: in key_padding_mask and a bool attn_mask, true means
// "do not attend"; float masks are added to the scores. Unlike torch, a query
// whose keys are all masked gets zeros, not NaN, and the weights returned by
// a training call are the softmax before dropout (torch returns them after).
// Positions (RoPE, ALiBi, relative bias) count query and key rows from 0.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "qkv/kv_cache.hpp"
#include "qkv/modules/linear.hpp"
#include "qkv/modules/parameter.hpp"
#include "qkv/modules/positional.hpp"
#include "qkv/tensor.hpp"

namespace qkv::nn {

// How positions enter the attention.
enum class Position : std::uint8_t {
  none,           // order-free (add absolute encodings to the inputs yourself)
  rope,           // rotary embedding of Q and K after projection (`rope` below)
  alibi,          // linear biases, slopes qkv::alibi_slopes(H)
  relative_bias,  // T5's learned bias by bucketed relative position
};

struct MultiHeadAttentionConfig {
  std::int64_t embed_dim = 0;          // E (>= 1)
  std::int64_t num_heads = 1;          // H; divides E
  std::int64_t num_kv_heads = 0;       // Hkv; divides H; 0 = H
  std::int64_t kdim = 0;               // key features; 0 = E
  std::int64_t vdim = 0;               // value features; 0 = E
  bool bias = true;                    // in_proj_bias and out_proj.bias
  double dropout = 0.0;                // probability of dropping a weight in training calls, < 1
  Position position = Position::none;  // positional method
  RopeConfig rope;                     // Position::rope: base, layout, rotary_dim
  std::int64_t num_buckets = 32;       // Position::relative_bias: buckets (see
  std::int64_t max_distance = 128;     //   qkv/modules/positional.hpp for their limits)
  bool bidirectional = true;           // Position::relative_bias: false for decoders
  DType dtype = DType::f32;            // parameter storage: f32, f64, bf16 or f16
};

// Per-call options of forward and backward.
struct MultiHeadAttentionOptions {
  ConstTensorView key_padding_mask;  // [B, Nk]: bool (true = padding) or float (added)
  ConstTensorView attn_mask;         // [Nq, Nk] or [B * H, Nq, Nk]: bool (true = masked) or float
  bool causal = false;               // query i sees keys j <= i (torch's is_causal)
  bool need_weights = false;         // also return the attention weights
  bool average_attn_weights = true;  // weights averaged over heads ([B, Nq, Nk])
  bool training = false;             // apply dropout (config.dropout)
  std::uint64_t dropout_seed = 0;    // training: key of the dropout generator
  std::uint32_t dropout_offset = 0;  // training: counter offset, new per call
  bool save_for_backward = false;    // keep what backward needs in the result
};

// What backward needs from the forward (the projections after RoPE, the
// attention output before the output projection and its logsumexp).
struct MultiHeadAttentionSaved {
  Tensor q, k, v;  // [B, Nq, H, Dh], [B, Nk, Hkv, Dh] x 2, compute dtype
  Tensor attn;     // A [B, Nq, H, Dh], compute dtype
  Tensor lse;      // [B, H, Nq]
};

struct MultiHeadAttentionResult {
  Tensor out;                     // [B, Nq, E], dtype of query
  Tensor weights;                 // see the header; undefined unless need_weights
  MultiHeadAttentionSaved saved;  // filled when save_for_backward
};

struct MultiHeadAttentionGradients {
  Tensor dquery;  // [B, Nq, E]; for self-attention the input's gradient is
  Tensor dkey;    // [B, Nk, kdim]  dquery + dkey + dvalue
  Tensor dvalue;  // [B, Nk, vdim]
};

class MultiHeadAttention {
 public:
  // Zeroed parameters; throws qkv::Error listing every bad config field.
  explicit MultiHeadAttention(const MultiHeadAttentionConfig& config);

  const MultiHeadAttentionConfig& config() const { return config_; }
  std::int64_t head_dim() const { return head_dim_; }

  // Self-attention is forward(x, x, x, ...). Throws qkv::Error listing every
  // problem with shapes, dtypes and masks.
  MultiHeadAttentionResult forward(ConstTensorView query, ConstTensorView key,
                                   ConstTensorView value,
                                   const MultiHeadAttentionOptions& options = {}) const;

  // Gradients of a loss with respect to query, key and value given dout =
  // dLoss/dout [B, Nq, E]; adds the parameter gradients to their `grad`.
  // `saved` comes from forward with save_for_backward, called with the same
  // inputs and options.
  MultiHeadAttentionGradients backward(ConstTensorView query, ConstTensorView key,
                                       ConstTensorView value, const MultiHeadAttentionSaved& saved,
                                       ConstTensorView dout,
                                       const MultiHeadAttentionOptions& options = {});

  // Incremental self-attention for decoding: x_new [B, n, E] (1 <= n <= 16)
  // are the next tokens of every sequence in `cache` (a KvCache with
  // kv_heads = Hkv and head_dim = Dh). Projects them, appends K and V to the
  // cache (rotating K at its positions with Position::rope) and attends the
  // new queries to everything cached, causally; returns [B, n, E]. Supports
  // Position::none, rope and alibi (positions are the cache lengths). Bad
  // arguments throw before the cache changes; once K and V are appended only
  // running out of memory can still fail.
  Tensor forward_step(ConstTensorView x_new, KvCache& cache) const;

  // Every parameter under its torch name, each preceded by `prefix`.
  NamedParameters named_parameters(std::string_view prefix = "");

  Parameter in_proj_weight;                           // [E + 2 Hkv Dh, E] when packed
  Parameter q_proj_weight;                            // [E, E] when not packed
  Parameter k_proj_weight;                            // [Hkv Dh, kdim] when not packed
  Parameter v_proj_weight;                            // [Hkv Dh, vdim] when not packed
  Parameter in_proj_bias;                             // [E + 2 Hkv Dh] with bias
  Linear out_proj;                                    // E -> E
  std::optional<RelativePositionBias> relative_bias;  // with Position::relative_bias

 private:
  bool packed() const { return in_proj_weight.defined(); }

  MultiHeadAttentionConfig config_;
  std::vector<float> alibi_;  // [H] with Position::alibi
  std::int64_t head_dim_ = 0;
  std::int64_t kv_dim_ = 0;  // Hkv * Dh
};

}  // namespace qkv::nn
