#include "core/gemm.hpp"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <string>
#include <utility>

#include "qkv/error.hpp"

namespace qkv::detail {

namespace {

int blas_int(std::int64_t v, const char* what) {
  if (v > INT_MAX) {
    throw Error(std::string("GEMM ") + what + ": " + std::to_string(v) +
                " exceeds the BLAS integer range (" + std::to_string(INT_MAX) + ")");
  }
  return static_cast<int>(v);
}

// C = alpha op(A) op(B) + beta C when m == 1 or n == 1, as one GEMV on the
// matrix operand, the vector read with its stride.
void gemv(DType dtype, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k,
          double alpha, const void* a, std::int64_t lda, const void* b, std::int64_t ldb,
          double beta, void* c, std::int64_t ldc) {
  // Row form (m == 1): c[n] = op(B)^T x with x = row 0 of op(A). op(B) is B
  // stored [k, n] (row-major, ld ldb), so op(B)^T x is a transposed GEMV of
  // it; with trans_b, B is stored [n, k] and it is a plain GEMV.
  const bool row = m == 1;
  const void* matrix = row ? b : a;
  const std::int64_t ld = row ? ldb : lda;
  // Stored shape of the matrix operand and whether the product transposes it.
  const bool transposed = row ? !trans_b : trans_a;
  const std::int64_t rows = row ? (trans_b ? n : k) : (trans_a ? k : m);
  const std::int64_t cols = row ? (trans_b ? k : n) : (trans_a ? m : k);
  const void* x = row ? a : b;
  // Consecutive elements of the vector operand: along op(A)'s row or op(B)'s column.
  const std::int64_t incx = row ? (trans_a ? lda : 1) : (trans_b ? 1 : ldb);
  const std::int64_t incy = row ? 1 : ldc;
  const CBLAS_TRANSPOSE t = transposed ? CblasTrans : CblasNoTrans;
  const int r = blas_int(rows, "rows"), cl = blas_int(cols, "cols");
  const int l = std::max(1, blas_int(ld, "ld")), ix = std::max(1, blas_int(incx, "incx"));
  const int iy = std::max(1, blas_int(incy, "incy"));
  if (dtype == DType::f64) {
    cblas_dgemv(CblasRowMajor, t, r, cl, alpha, static_cast<const double*>(matrix), l,
                static_cast<const double*>(x), ix, beta, static_cast<double*>(c), iy);
  } else {
    cblas_sgemv(CblasRowMajor, t, r, cl, static_cast<float>(alpha),
                static_cast<const float*>(matrix), l, static_cast<const float*>(x), ix,
                static_cast<float>(beta), static_cast<float*>(c), iy);
  }
}

}  // namespace

namespace {

// OpenBLAS's OpenMP build splits a call among omp_get_max_threads() threads
// and rounds differently for different counts: in this scope that is 1.
class OneBlasThread {
 public:
  OneBlasThread() : saved_(omp_get_max_threads()) { omp_set_num_threads(1); }
  ~OneBlasThread() { omp_set_num_threads(saved_); }
  OneBlasThread(const OneBlasThread&) = delete;
  OneBlasThread& operator=(const OneBlasThread&) = delete;

 private:
  int saved_;
};

// One block of C on the calling thread. gemm() has checked that every size
// fits BLAS's int, so nothing here throws inside its parallel loop.
void serial_gemm(DType dtype, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n,
                 std::int64_t k, double alpha, const void* a, std::int64_t lda, const void* b,
                 std::int64_t ldb, double beta, void* c, std::int64_t ldc) {
  const OneBlasThread one;
  // A single row or column is a matrix-vector product: OpenBLAS's GEMM
  // would pack the whole other matrix first (a decode step's projections).
  // (k == 0 stays with GEMM: GEMV returns early without applying beta.)
  if ((m == 1 || n == 1) && k > 0) {
    gemv(dtype, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  } else {
    const CBLAS_TRANSPOSE ta = trans_a ? CblasTrans : CblasNoTrans;
    const CBLAS_TRANSPOSE tb = trans_b ? CblasTrans : CblasNoTrans;
    const int mi = blas_int(m, "m"), ni = blas_int(n, "n"), ki = blas_int(k, "k");
    // BLAS requires leading dimensions >= 1 even when k == 0.
    const int la = std::max(1, blas_int(lda, "lda")), lb = std::max(1, blas_int(ldb, "ldb"));
    const int lc = std::max(1, blas_int(ldc, "ldc"));
    if (dtype == DType::f64) {
      cblas_dgemm(CblasRowMajor, ta, tb, mi, ni, ki, alpha, static_cast<const double*>(a), la,
                  static_cast<const double*>(b), lb, beta, static_cast<double*>(c), lc);
    } else {
      cblas_sgemm(CblasRowMajor, ta, tb, mi, ni, ki, static_cast<float>(alpha),
                  static_cast<const float*>(a), la, static_cast<const float*>(b), lb,
                  static_cast<float>(beta), static_cast<float*>(c), lc);
    }
  }
}

const char* advance(const void* p, DType dtype, std::int64_t elements) {
  return static_cast<const char*>(p) + elements * static_cast<std::int64_t>(dtype_size(dtype));
}

void copy_row(DType dtype, const void* from, std::int64_t n, void* to) {
  if (n > 0) std::memcpy(to, from, static_cast<std::size_t>(n) * dtype_size(dtype));
}

}  // namespace

void gemm(DType dtype, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k,
          double alpha, const void* a, std::int64_t lda, const void* b, std::int64_t ldb,
          double beta, void* c, std::int64_t ldc, const void* bias) {
  if (bias != nullptr) beta = 1.0;  // each block starts from its bias rows
  for (const auto& [value, what] :
       {std::pair{m, "m"}, {n, "n"}, {k, "k"}, {lda, "lda"}, {ldb, "ldb"}, {ldc, "ldc"}}) {
    blas_int(value, what);
  }
  if (m == 0 || n == 0) return;
  // C is cut into at most kBlocks blocks of whole rows (of whole columns
  // when it is one row), at least kMinBlock wide, from the sizes alone; each
  // block is one single-threaded BLAS call and the blocks run in parallel.
  // Every element is then computed by the same call for any thread count,
  // so results are bitwise identical, and a block's packing of the other
  // operand is small next to its arithmetic.
  constexpr std::int64_t kBlocks = 32, kMinBlock = 64;
  const bool by_columns = m == 1;
  const std::int64_t extent = by_columns ? n : m;
  const std::int64_t blocks = std::clamp<std::int64_t>(extent / kMinBlock, 1, kBlocks);
  const std::int64_t size = (extent + blocks - 1) / blocks;
  void* const cc = c;
#pragma omp parallel for schedule(static) if (blocks > 1)
  for (std::int64_t block = 0; block < blocks; ++block) {
    const std::int64_t first = block * size, count = std::min(size, extent - first);
    if (count <= 0) continue;
    if (by_columns) {
      // Columns [first, first + count) of op(B): rows of B when transposed.
      const void* b_cols = advance(b, dtype, trans_b ? first * ldb : first);
      void* c_cols = const_cast<char*>(advance(cc, dtype, first));
      if (bias != nullptr) copy_row(dtype, advance(bias, dtype, first), count, c_cols);
      serial_gemm(dtype, trans_a, trans_b, 1, count, k, alpha, a, lda, b_cols, ldb, beta, c_cols,
                  ldc);
    } else {
      // Rows [first, first + count) of op(A): columns of A when transposed.
      const void* a_rows = advance(a, dtype, trans_a ? first : first * lda);
      void* c_rows = const_cast<char*>(advance(cc, dtype, first * ldc));
      for (std::int64_t r = 0; bias != nullptr && r < count; ++r) {
        copy_row(dtype, bias, n, const_cast<char*>(advance(c_rows, dtype, r * ldc)));
      }
      serial_gemm(dtype, trans_a, trans_b, count, n, k, alpha, a_rows, lda, b, ldb, beta, c_rows,
                  ldc);
    }
  }
}

}  // namespace qkv::detail
