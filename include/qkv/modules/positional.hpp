// qkv/modules/positional.hpp — learned position encodings (qkv::nn).
//
// LearnedPositionalEmbedding: absolute positions added to the input, as
// GPT-2's wpe or BERT's position_embeddings (a torch.nn.Embedding indexed by
// position).
//   x, y, dx, dy  [B, N, dim]          any strides; y and dx in the dtype of x
//   weight        [max_positions, dim] f32, f64, bf16 or f16
//
// RelativePositionBias: T5's learned relative position bias, one scalar per
// head and relative-position bucket, added to the attention scores. The
// parameter has Hugging Face T5Attention's layout, nn.Embedding(num_buckets,
// n_heads) under "relative_attention_bias.weight", so T5 weights load
// unchanged; attention reads it through options() as the transposed table.
//   weight        [num_buckets, H]     f32, f64, bf16 or f16
//   table         [H, num_buckets]     a view of weight (AttentionOptions::relative_bias)
//   bias          [H, nq, nk]          dense bias, for inspection
// The bias of query i and key j is weight[bucket(j - p_i), h] with the bucket
// function t5_relative_bucket (qkv/positional.hpp) and p_i the query's
// position on the key axis (see qkv/attention.hpp), which is HF's compute_bias:
// relative_position = memory_position - context_position, bucketed with
// bidirectional = not is_decoder. (T5 also leaves its scores unscaled:
// Score::dot.)
#pragma once

#include <cstdint>
#include <string_view>

#include "qkv/attention.hpp"
#include "qkv/modules/parameter.hpp"
#include "qkv/tensor.hpp"

namespace qkv::nn {

class LearnedPositionalEmbedding {
 public:
  // A zeroed table (fill it with init_uniform or load_parameters). Throws
  // qkv::Error unless max_positions, dim >= 1 and dtype is floating.
  LearnedPositionalEmbedding(std::int64_t max_positions, std::int64_t dim,
                             DType dtype = DType::f32);

  std::int64_t max_positions() const { return max_positions_; }
  std::int64_t dim() const { return dim_; }

  // y[b, n] = x[b, n] + weight[start + n]: row n of every sequence sits at
  // position start + n (start > 0 continues a sequence, as in decoding).
  // Throws qkv::Error unless x is [B, N, dim], start >= 0 and
  // start + N <= max_positions.
  Tensor forward(ConstTensorView x, std::int64_t start = 0) const;

  // Given the forward's x and start and dy = dLoss/dy [B, N, dim], returns
  // dx = dy (dtype of x) and adds sum_b dy[b, n] to weight.grad[start + n].
  Tensor backward(ConstTensorView x, ConstTensorView dy, std::int64_t start = 0);

  // "weight", preceded by `prefix`.
  NamedParameters named_parameters(std::string_view prefix = "");

  Parameter weight;  // [max_positions, dim]

 private:
  std::int64_t max_positions_ = 0;
  std::int64_t dim_ = 0;
};

class RelativePositionBias {
 public:
  // A zeroed table. bidirectional = true for encoders (keys before and after
  // the query get separate buckets), false for causal decoders. Throws
  // qkv::Error unless num_heads >= 1, num_buckets >= 2 (>= 4 when
  // bidirectional), max_distance exceeds the exact buckets (num_buckets / 4
  // when bidirectional, else num_buckets / 2) and dtype is floating.
  RelativePositionBias(std::int64_t num_heads, std::int64_t num_buckets = 32,
                       std::int64_t max_distance = 128, bool bidirectional = true,
                       DType dtype = DType::f32);

  std::int64_t num_heads() const { return heads_; }
  std::int64_t num_buckets() const { return buckets_; }
  std::int64_t max_distance() const { return max_distance_; }
  bool bidirectional() const { return bidirectional_; }

  // The bias for AttentionOptions::relative_bias: `table` is weight
  // transposed to [H, num_buckets], a view (valid while this module lives and
  // its weight is not reassigned), so loaded or updated weights take effect
  // without a copy.
  qkv::RelativePositionBias options() const;

  // Adds d_table [H, num_buckets] (attention_backward's d_relative_bias, any
  // floating dtype and strides) to weight.grad, transposed.
  void backward(ConstTensorView d_table);

  // The dense bias [H, nq, nk] in the weight's dtype: element (h, i, j) is
  // weight[bucket(j - i), h], as HF's compute_bias(nq, nk). That is the bias
  // attention adds with Align::top_left or nq == nk; with Align::bottom_right
  // (the default, and decoding against a cache) query i sits at
  // i + nk - nq, the last nq rows of bias(nk, nk). Throws qkv::Error if nq
  // or nk < 0.
  Tensor bias(std::int64_t nq, std::int64_t nk) const;

  // "relative_attention_bias.weight", preceded by `prefix`.
  NamedParameters named_parameters(std::string_view prefix = "");

  Parameter weight;  // [num_buckets, H]

 private:
  std::int64_t heads_ = 0;
  std::int64_t buckets_ = 0;
  std::int64_t max_distance_ = 0;
  bool bidirectional_ = true;
};

}  // namespace qkv::nn
