// The keys that causal and the sliding window admit to a query, written
// once for every backend: the fused forward and backward (their tile
// masks, block spans and skipping), decoding, and the reference.
//
// Query row i of a sequence of nq queries and nk keys sits on the key axis
// at position p_i = i + query_offset: nk - nq further with Align::bottom_right,
// plus options.shard.position (a piece of a larger call). Row i admits key j
// iff lo <= j < hi for [lo, hi) = key_range(p_i):
//   j < nk,  j <= p_i (causal),  p_i - j <= window_left,  j - p_i <= window_right
// (a window side of -1 is unbounded). Both ends grow with p_i. Masks given
// as data (bool mask, mask_mod, sparse patterns) come on top of this range.
#pragma once

#include <algorithm>
#include <cstdint>

#include "qkv/attention.hpp"

namespace qkv::detail {

// Keys [lo, hi) of one query; hi == lo when there are none.
struct KeyRange {
  std::int64_t lo, hi;
};

// p_i - i for a sequence of nq queries and nk keys.
inline std::int64_t query_offset(Align align, std::int64_t shard_position, std::int64_t nq,
                                 std::int64_t nk) {
  return (align == Align::bottom_right ? nk - nq : 0) + shard_position;
}
inline std::int64_t query_offset(const AttentionOptions& o, std::int64_t nq, std::int64_t nk) {
  return query_offset(o.align, o.shard.position, nq, nk);
}

// The keys of [0, nk) that the query at position `pos` admits.
inline KeyRange key_range(bool causal, std::int64_t window_left, std::int64_t window_right,
                          std::int64_t pos, std::int64_t nk) {
  // Windows may be as wide as int64 allows; positions are below 2^60
  // (kMaxSequence), so comparing with them first never overflows.
  std::int64_t lo = 0, hi = nk;
  if (window_left >= 0 && window_left < pos) lo = pos - window_left;
  if (causal) hi = std::min(hi, pos + 1);
  if (window_right >= 0 && window_right < nk - pos) hi = std::min(hi, pos + window_right + 1);
  lo = std::min(lo, nk);
  return {lo, std::max(hi, lo)};
}
inline KeyRange key_range(const AttentionOptions& o, std::int64_t pos, std::int64_t nk) {
  return key_range(o.causal, o.window_left, o.window_right, pos, nk);
}

}  // namespace qkv::detail
