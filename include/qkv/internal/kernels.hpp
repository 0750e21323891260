// qkv/internal/kernels.hpp — what benchmarks and tools need from inside the
// kernels, for the `qkv` tool's baselines and reports. Not part of the
// stable API: names and signatures may change with the kernels.
#pragma once

#include <cstdint>

#include "qkv/dtype.hpp"
#include "qkv/sparse.hpp"

namespace qkv::internal {

// The Highway target the fused kernels dispatch to on this CPU ("AVX3",
// "AVX2", "SSE4", ...).
const char* kernel_target();

// dst[i] = exp(src[i]) for i < n with the kernels' vectorized exp (src and
// dst may be the same row).
void exp_row(const float* src, std::int64_t n, float* dst);

// Stores n floats into dst as `dtype` (f32, bf16 or f16), rounded as the
// kernels round their outputs.
void store_row(const float* src, std::int64_t n, void* dst, DType dtype);

// The (query, key) pairs that `pattern` admits for head h in the tile of
// query rows [i0, i0 + rows) at positions [p0, p0 + rows) and keys
// [j0, j0 + cols): keep[c * rows + r] = 1 when row r may attend to key
// j0 + c, else 0. Returns false, leaving keep alone, when the pattern admits
// no pair of the tile (found without visiting the pairs).
bool admitted_pairs(const SparsePattern& pattern, std::int64_t h, std::int64_t i0,
                    std::int64_t rows, std::int64_t p0, std::int64_t j0, std::int64_t cols,
                    std::uint8_t* keep);

}  // namespace qkv::internal
