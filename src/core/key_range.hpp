// The keys that causal and the sliding window admit to a query, written
// once for every backend: the fused forward and backward (their tile
// masks, block spans and skipping), decoding, and the reference.
//
// Query row i of a sequence of nq queries and nk keys sits on the key axis
// at position p_i = i + offset: nk - nq further with Align::bottom_right,
// plus options.shard.position (a piece of a larger call). Row i admits key j
// iff lo <= j < hi for [lo, hi) = KeyRule::range(p_i, nk):
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
  // The keys it holds (0 when empty).
  std::int64_t size() const { return hi > lo ? hi - lo : 0; }
};

// The options that decide each query's key range, lowered from
// AttentionOptions (key_rule) or set by an entry point (decoding is causal
// and bottom-right by definition).
struct KeyRule {
  bool causal = false;                // drop keys after p_i
  std::int64_t window_left = -1;      // keys at most this far before p_i; -1 = unbounded
  std::int64_t window_right = -1;     // keys at most this far after p_i; -1 = unbounded
  Align align = Align::bottom_right;  // where row 0 sits: 0 or nk - nq
  std::int64_t shard_position = 0;    // added to every p_i (a piece of a larger call)

  // p_i - i for a sequence of nq queries and nk keys.
  std::int64_t offset(std::int64_t nq, std::int64_t nk) const {
    return (align == Align::bottom_right ? nk - nq : 0) + shard_position;
  }

  // The keys of [0, nk) that the query at position `pos` admits.
  KeyRange range(std::int64_t pos, std::int64_t nk) const {
    // Windows may be as wide as int64 allows; positions are below 2^60
    // (kMaxSequence), so comparing with them first never overflows.
    std::int64_t lo = 0, hi = nk;
    if (window_left >= 0 && window_left < pos) lo = pos - window_left;
    if (causal) hi = std::min(hi, pos + 1);
    if (window_right >= 0 && window_right < nk - pos) hi = std::min(hi, pos + window_right + 1);
    lo = std::min(lo, nk);
    return {lo, std::max(hi, lo)};
  }

  // Whether some query at a position of [p_first, p_last] admits some key of
  // [k_lo, k_hi) (k_hi at most nk): a test on whole blocks of queries and
  // keys, without a range per position. Both ends of the range grow with
  // the position, so the first position whose range reaches k_lo decides.
  bool reaches(std::int64_t p_first, std::int64_t p_last, std::int64_t k_lo,
               std::int64_t k_hi) const {
    if (k_hi <= k_lo || p_last < p_first) return false;
    std::int64_t p = p_first;
    if (causal) p = std::max(p, k_lo);
    // Windows may be as large as int64 allows: compare distances, which are
    // bounded by the sequence lengths, instead of shifting by the window.
    if (window_right >= 0 && k_lo - p > window_right) p = k_lo - window_right;
    if (p > p_last) return false;
    return !(window_left >= 0 && p - k_hi >= window_left);
  }
};

inline KeyRule key_rule(const AttentionOptions& o) {
  return {o.causal, o.window_left, o.window_right, o.align, o.shard.position};
}

}  // namespace qkv::detail
