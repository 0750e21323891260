// The normalized Walsh-Hadamard transform of a row of n = 2^k values:
// x <- H x / sqrt(n), H the Sylvester Hadamard matrix. It is orthogonal and
// its own inverse, so rotating queries and keys by it leaves every score
// q . k unchanged, and values rotated by it give outputs that the same
// transform turns back. A KV cache with KvCacheConfig::rotate stores keys
// and values rotated (before quantizing: an outlier channel is spread over
// the whole row instead of dominating its block's scale), and decoding
// rotates the queries and un-rotates the outputs.
#pragma once

#include <cmath>
#include <cstdint>

namespace qkv::detail {

inline bool is_power_of_two(std::int64_t n) { return n >= 1 && (n & (n - 1)) == 0; }

// In place, O(n log n) butterflies; n a power of two.
template <class T>
void hadamard(T* x, std::int64_t n) {
  for (std::int64_t len = 1; len < n; len <<= 1) {
    for (std::int64_t i = 0; i < n; i += 2 * len) {
      for (std::int64_t j = i; j < i + len; ++j) {
        const T a = x[j], b = x[j + len];
        x[j] = a + b;
        x[j + len] = a - b;
      }
    }
  }
  const T norm = static_cast<T>(1.0 / std::sqrt(static_cast<double>(n)));
  for (std::int64_t i = 0; i < n; ++i) x[i] *= norm;
}

}  // namespace qkv::detail
