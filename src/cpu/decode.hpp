// Decode attention against a KV cache (flash-decoding): the plain-C++ side,
// the plan that the SIMD body (decode-inl.h, compiled per Highway target)
// consumes. The cache comes as the plain view of cache/view.hpp.
#pragma once

#include <cstdint>
#include <vector>

#include "cache/view.hpp"
#include "core/key_range.hpp"
#include "cpu/params.hpp"

namespace qkv::cpu {

// One work item: keys [begin, end) of sequence `b`, all KV heads, for all its
// query rows (Hq x n); its partial result goes to workspace slot `slot`.
struct DecodeItem {
  std::int64_t b = 0;
  std::int64_t begin = 0;
  std::int64_t end = 0;
  std::int64_t slot = 0;
};

struct DecodePlan {
  const cache::KvView* cache = nullptr;
  KernelParams params;  // the call's options, lowered (keys: causal, bottom-right)
  ConstTensorView q;    // [B, n, Hq, Dk]
  TensorView out;       // [B, n, Hq, Dv]
  TensorView lse;       // f32 [B, Hq, n] or undefined
  std::int64_t batch = 0, n = 0, hq = 0, hkv = 0, dk = 0, dv = 0;
  float scale = 1.0f;
  // Splits per sequence: from B and the longest sequence only, never from
  // the thread count.
  std::int64_t splits = 1;
  std::vector<DecodeItem> items;  // sequence major, splits in key order
  // Per slot: rows = Hq * n (row h * n + t); O [rows][dv_pad] unnormalized,
  // m and l [rows].
  std::int64_t rows = 0;
  std::int64_t dv_pad = 0;
  std::vector<float> partial_o, partial_m, partial_l;
};

// The key-axis position of query token t of a call of n tokens against a
// sequence holding `length` (the plan's key rule is bottom-right: the last
// token is at length - 1), and the keys it admits.
inline std::int64_t decode_position(const DecodePlan& plan, std::int64_t length, std::int64_t t) {
  return t + plan.params.keys.offset(plan.n, length);
}
inline detail::KeyRange decode_key_range(const DecodePlan& plan, std::int64_t length,
                                         std::int64_t t) {
  return plan.params.keys.range(decode_position(plan, length, t), length);
}

// Builds the items and workspace of a validated decode call.
DecodePlan make_decode_plan(const cache::KvView& cache, const KernelParams& params,
                            ConstTensorView q, TensorView out, TensorView lse);

// Runs the items on OpenMP threads and merges the splits in order.
void decode(DecodePlan& plan);

}  // namespace qkv::cpu
