// Row-major GEMM on OpenBLAS, split into fixed blocks of rows so that the
// result does not depend on the thread count. Used by the modules'
// projections and by the additive score's backward.
#pragma once

#include <cstdint>

#include "qkv/tensor.hpp"

namespace qkv::detail {

// Row-major C[m, n] = alpha * op(A) op(B) + beta * C on OpenBLAS (sgemm for
// f32, dgemm for f64); op(A) is [m, k], op(B) is [k, n]; lda, ldb, ldc are
// row strides in elements. With `bias` ([n], same dtype) and beta = 0, C =
// alpha * op(A) op(B) + bias on every row (a linear layer), the bias written
// into each block of C just before its product. Bitwise identical results
// for any thread count (see gemm.cpp). Throws qkv::Error when a size exceeds
// BLAS's int.
void gemm(DType dtype, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k,
          double alpha, const void* a, std::int64_t lda, const void* b, std::int64_t ldb,
          double beta, void* c, std::int64_t ldc, const void* bias = nullptr);

}  // namespace qkv::detail
