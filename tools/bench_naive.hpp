// The materialized attention baselines of `qkv bench` (forward and backward),
// and the causal/window key ranges that both they and the benchmark's FLOP
// count use.
#pragma once

#include <cstdint>

#include "qkv/attention.hpp"

namespace qkv::tools {

// Keys [begin, end) that query row i attends to under options.causal,
// window_left/right and align (see qkv/attention.hpp); empty when begin >= end.
struct KeyRange {
  std::int64_t begin = 0;
  std::int64_t end = 0;
};
KeyRange keys_of_row(std::int64_t i, std::int64_t nq, std::int64_t nk,
                     const AttentionOptions& options);

// Number of unmasked (query, key) pairs of one head.
std::int64_t unmasked_pairs(std::int64_t nq, std::int64_t nk, const AttentionOptions& options);

// out = softmax(scale q k^T + mask) v the way a framework without a fused
// kernel computes it: per (batch, head) on `threads` OpenMP threads, the head
// is widened to f32, S = scale Q K^T [Nq, Nk] is materialized by sgemm, masked
// with -inf, softmaxed row by row, and O = P V (sgemm) is rounded into `out`.
// Scratch: Nq * Nk floats per thread. q [B, Nq, Hq, D], k and v [B, Nk, Hkv,
// D], out [B, Nq, Hq, D], all of one dtype (f32, bf16 or f16) with unit
// stride in D. Honours options.scale, causal, window_left/right and align.
void materialized_attention(ConstTensorView q, ConstTensorView k, ConstTensorView v, TensorView out,
                            const AttentionOptions& options, int threads);

// The gradients of qkv/backward.hpp the way a framework without a fused
// kernel computes them: per KV head on `threads` OpenMP threads, for each
// query head reading it, the head is widened to f32 and
//   S  = scale Q K^T                  sgemm, [Nq, Nk]
//   P  = exp(S - lse), 0 where masked  (lse from the forward, not recomputed)
//   dV += P^T dO                      sgemm
//   dP = dO V^T                       sgemm, [Nq, Nk]
//   dS = P * (dP - rowsum(dO * O))
//   dQ = scale dS K                   sgemm
//   dK += scale dS^T Q                sgemm
// with dK and dV summed in f32 over the query heads of the KV head and then
// rounded into dk and dv; dQ is rounded into dq. Scratch: 2 Nq * Nk floats
// per thread (P and dP / dS). q, out, dout, dq [B, Nq, Hq, D]; k, v, dk, dv
// [B, Nk, Hkv, D]; all of one dtype (f32, bf16 or f16) with unit stride in D;
// lse f32 [B, Hq, Nq]. Honours options.scale, causal, window_left/right and
// align; no dropout.
void materialized_attention_backward(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                                     ConstTensorView out, ConstTensorView dout, ConstTensorView lse,
                                     TensorView dq, TensorView dk, TensorView dv,
                                     const AttentionOptions& options, int threads);

}  // namespace qkv::tools
