// qkv/internal/kernels.hpp: the kernels' internals that the tools use, behind
// a declared interface so that the tools include no private header.
#include "core/sparse.hpp"
#include "cpu/flash.hpp"
#include "qkv/internal/kernels.hpp"

namespace qkv::internal {

const char* kernel_target() { return cpu::flash_target(); }

void exp_row(const float* src, std::int64_t n, float* dst) { cpu::exp_row(src, n, dst); }

void store_row(const float* src, std::int64_t n, void* dst, DType dtype) {
  cpu::store_row(src, n, dst, dtype);
}

bool admitted_pairs(const SparsePattern& pattern, std::int64_t h, std::int64_t i0,
                    std::int64_t rows, std::int64_t p0, std::int64_t j0, std::int64_t cols,
                    std::uint8_t* keep) {
  const detail::PatternTile tile{h, i0, rows, p0, j0, cols};
  if (detail::coverage(pattern, tile) == detail::Coverage::none) return false;
  detail::fill_admitted(pattern, tile, keep);
  return true;
}

}  // namespace qkv::internal
