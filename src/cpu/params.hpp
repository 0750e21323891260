// What the fused kernels read of a call's options: AttentionOptions lowered
// once by the entry point (lower, below), in the form the kernels use, like
// FlashAttention's Flash_fwd_params. Kernels take these, never the public
// options struct: an option reaches a kernel only through a field here, so
// this struct is the list of what the fused paths implement (the capability
// table, core/capabilities.cpp, refuses or reroutes the rest before a
// kernel runs). Plain data: views of the caller's tensors and spans, valid
// for the call.
#pragma once

#include <cstdint>
#include <span>

#include "core/key_range.hpp"
#include "qkv/attention.hpp"
#include "qkv/sparse.hpp"

namespace qkv::cpu {

// Dropout of the weights: Philox counters of qkv::dropout_keep.
struct DropoutParams {
  double p = 0.0;            // probability of zeroing a weight; 0 = off
  std::uint64_t seed = 0;    // key of the generator
  std::uint32_t offset = 0;  // counter offset of the call
  ShardOffsets shard;        // global row, key and head indices of this piece
};

struct KernelParams {
  Score score = Score::scaled_dot;  // f(q, k): dot products, or the additive MLP
  double scale = 1.0;               // multiplies <q, k> (1 unless Score::scaled_dot)
  detail::KeyRule keys;             // each query's key range: causal, window, alignment
  double softcap = 0.0;             // c > 0: s = c tanh(s / c); 0 = off
  // ALiBi slopes: [Hq], or [S * Hq] per sequence (see slope); empty = off.
  std::span<const float> alibi_slopes;
  RelativePositionBias relative_bias;  // T5 bias table; table undefined = off
  ConstTensorView float_mask;          // added to the scores; undefined = none
  ConstTensorView bool_mask;           // false drops the key; undefined = none
  SparsePattern sparse;                // admitted (query, key) pairs; undefined = all
  std::span<const float> sinks;        // [Hq] learned sink logits; empty = none
  AdditiveScore additive;              // Score::additive's parameters
  DropoutParams dropout;
  // medium: bf16 products allowed where a kernel has them (decode of bf16
  // caches on AVX512-BF16, see cpu/bf16_dot-inl.h)
  MatmulPrecision matmul_precision = MatmulPrecision::highest;

  // The ALiBi slope of query head h of sequence s, for Hq query heads.
  float slope(std::int64_t s, std::int64_t h, std::int64_t hq) const {
    const bool per_sequence = static_cast<std::int64_t>(alibi_slopes.size()) != hq;
    return alibi_slopes[static_cast<std::size_t>(per_sequence ? s * hq + h : h)];
  }
};

// The options as the fused kernels read them, for a call whose scores are
// multiplied by `scale` (AttentionProblem::scale); the entry points call it
// once per call. score_mod and mask_mod go separately, as tile hooks
// (detail::TileMods).
inline KernelParams lower(const AttentionOptions& o, double scale) {
  KernelParams k;
  k.score = o.score;
  k.scale = scale;
  k.keys = detail::key_rule(o);
  k.softcap = o.softcap;
  k.alibi_slopes = o.alibi_slopes;
  k.relative_bias = o.relative_bias;
  if (o.mask.defined()) (o.mask.dtype() == DType::boolean ? k.bool_mask : k.float_mask) = o.mask;
  k.sparse = o.sparse;
  k.sinks = o.sinks;
  k.additive = o.additive;
  k.matmul_precision = o.matmul_precision;
  k.dropout = {o.dropout_p, o.dropout_seed, o.dropout_offset, o.shard};
  return k;
}

}  // namespace qkv::cpu
