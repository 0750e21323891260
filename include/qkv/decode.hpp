// qkv/decode.hpp — attention of a few new queries against a KvCache.
//
// After appending the newest n tokens (1 <= n <= 16) of every sequence to
// the cache, their queries attend to everything the sequence holds:
//   q    [B, n, Hq, Dk]       dtype f32, bf16 or f16 (f64: reference only)
//   out  [B, n, Hq, Dv]       dtype of q
//   lse  [B, Hq, n]           f32, optional
// Query t of sequence b sits at position length(b) - n + t and sees keys
// 0 .. length(b) - n + t (causal, aligned bottom-right); Hq is a multiple of
// the cache's Hkv (GQA/MQA: the query heads sharing a KV head are computed
// together, so each cached byte is read once per step). The options apply as
// in qkv::attention (scale, softcap, ALiBi, window_left, sinks, sparse
// patterns of positions, backend); masks, key_lengths, cu_seqlens, relative bias,
// score/mask callables, additive scores, dropout and block-sparse layouts
// (indexed by query rows) do not apply here and are rejected. Every sequence
// must hold at least n tokens.
//
// Long caches are split across threads (flash-decoding): a sequence's keys
// are cut into a number of splits chosen from B * Hkv and the cache length
// only, each split's partial output and logsumexp are merged in a fixed
// order, so results are bitwise identical for any thread count.
#pragma once

#include "qkv/attention.hpp"
#include "qkv/kv_cache.hpp"

namespace qkv {

// Returns out [B, n, Hq, Dv] (and lse when options.return_lse).
AttentionResult decode_attention(ConstTensorView q, const KvCache& cache,
                                 const AttentionOptions& options = {});

// Writes out (and lse when defined) into caller views.
void decode_attention_into(ConstTensorView q, const KvCache& cache, TensorView out,
                           TensorView lse = {}, const AttentionOptions& options = {});

}  // namespace qkv
