// cpu/engines/strips.hpp — the blocking of the AVX-512 dot-product
// micro-kernels (bf16_product.cpp, int8_product.cpp): C [m x n] in strips
// of up to 8 rows by 32 columns, two vectors of 16 columns, one vector for
// a last strip of 16 (n is a multiple of 16). 8 x 2 accumulators, the B
// vectors and a broadcast fit AVX-512's 32 registers.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>

namespace qkv::cpu::engines {

// Calls micro.template operator()<R, kVecs>(i0, j0) for each strip: rows
// [i0, i0 + R), columns [j0, j0 + 16 kVecs). R and kVecs are template
// arguments so that each micro-kernel keeps its accumulators in registers.
template <class Micro>
void for_each_strip(std::int64_t m, std::int64_t n, Micro&& micro) {
  for (std::int64_t j0 = 0; j0 < n; j0 += 32) {
    for (std::int64_t i0 = 0; i0 < m; i0 += 8) {
      const std::int64_t rows = std::min<std::int64_t>(m - i0, 8);
      const auto strip = [&]<int kVecs, int... R>(std::integer_sequence<int, R...>) {
        ((rows == R + 1 ? micro.template operator()<R + 1, kVecs>(i0, j0) : void()), ...);
      };
      if (j0 + 32 <= n) {
        strip.template operator()<2>(std::make_integer_sequence<int, 8>{});
      } else {
        strip.template operator()<1>(std::make_integer_sequence<int, 8>{});
      }
    }
  }
}

}  // namespace qkv::cpu::engines
