#include "modules/common.hpp"

#include <cblas.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <random>

#include "qkv/error.hpp"

namespace qkv::nn {

void zero_grad(const NamedParameters& parameters) {
  for (const NamedParameter& p : parameters) p.parameter->grad = Tensor();
}

Parameter make_parameter(DType dtype, std::initializer_list<std::int64_t> sizes) {
  if (!is_floating(dtype)) {
    throw Error("parameter dtype: expected f32, f64, bf16 or f16, got " +
                std::string(dtype_name(dtype)));
  }
  return Parameter{Tensor(dtype, sizes), Tensor()};
}

void init_uniform(const NamedParameters& parameters, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (const NamedParameter& p : parameters) {
    TensorView v = p.parameter->value;
    std::int64_t fan_in = v.rank() == 1 ? v.size(0) : 1;
    for (int d = 1; d < v.rank(); ++d) fan_in *= v.size(d);
    const double bound = 1.0 / std::sqrt(static_cast<double>(std::max<std::int64_t>(fan_in, 1)));
    std::uniform_real_distribution<double> dist(-bound, bound);
    Tensor f64(DType::f64, v.size_span());
    double* x = f64.data<double>();
    for (std::int64_t i = 0; i < f64.numel(); ++i) x[i] = dist(rng);
    copy(f64, v);
  }
}

namespace detail {

DType compute_dtype(DType input) { return input == DType::f64 ? DType::f64 : DType::f32; }

Dense dense(ConstTensorView x, DType dtype) {
  if (x.dtype() == dtype && x.is_contiguous()) return Dense{Tensor(), x.data()};
  Dense d{to_dtype(x, dtype), nullptr};
  d.data = d.storage.view().data();
  return d;
}

namespace {

int blas_int(std::int64_t v, const char* what) {
  if (v > INT_MAX) {
    throw Error(std::string("GEMM ") + what + ": " + std::to_string(v) +
                " exceeds the BLAS integer range (" + std::to_string(INT_MAX) + ")");
  }
  return static_cast<int>(v);
}

}  // namespace

void gemm(DType dtype, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k,
          double alpha, const void* a, std::int64_t lda, const void* b, std::int64_t ldb,
          double beta, void* c, std::int64_t ldc) {
  if (m == 0 || n == 0) return;
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

Tensor& grad_of(Parameter& p, DType dtype) {
  if (!p.grad.defined()) {
    p.grad = Tensor(dtype, p.value.view().size_span());
  } else if (p.grad.dtype() != dtype) {
    throw Error("parameter gradient: holds " + std::string(dtype_name(p.grad.dtype())) +
                " gradients, this backward computes " + std::string(dtype_name(dtype)) +
                " (call zero_grad between f32 and f64 backward calls)");
  }
  return p.grad;
}

namespace {

template <class T>
void add_row_t(T* data, std::int64_t rows, std::int64_t cols, const T* row) {
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < cols; ++c) data[r * cols + c] += row[c];
  }
}

template <class T>
void add_column_sums_t(const T* data, std::int64_t rows, std::int64_t cols, T* out) {
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < cols; ++c) out[c] += data[r * cols + c];
  }
}

}  // namespace

void add_row(DType dtype, void* data, std::int64_t rows, std::int64_t cols, const void* row) {
  if (dtype == DType::f64) {
    add_row_t(static_cast<double*>(data), rows, cols, static_cast<const double*>(row));
  } else {
    add_row_t(static_cast<float*>(data), rows, cols, static_cast<const float*>(row));
  }
}

void add_column_sums(DType dtype, const void* data, std::int64_t rows, std::int64_t cols,
                     void* out) {
  if (dtype == DType::f64) {
    add_column_sums_t(static_cast<const double*>(data), rows, cols, static_cast<double*>(out));
  } else {
    add_column_sums_t(static_cast<const float*>(data), rows, cols, static_cast<float*>(out));
  }
}

bool check_input(const char* name, ConstTensorView x, int rank, const char* shape,
                 std::vector<std::string>& reasons) {
  if (!x.defined()) {
    reasons.push_back(std::string(name) + ": required, got an undefined view");
    return false;
  }
  bool ok = true;
  if (!is_floating(x.dtype())) {
    reasons.push_back(std::string(name) + ": expected f32, f64, bf16 or f16, got " +
                      std::string(dtype_name(x.dtype())));
    ok = false;
  }
  if (rank > 0 && x.rank() != rank) {
    reasons.push_back(std::string(name) + ": expected rank " + std::to_string(rank) + " " + shape +
                      ", got " + shape_string(x.size_span()));
    ok = false;
  }
  return ok;
}

std::vector<std::int64_t> with_last(ConstTensorView x, std::int64_t last) {
  std::vector<std::int64_t> sizes(x.size_span().begin(), x.size_span().end());
  sizes.back() = last;
  return sizes;
}

}  // namespace detail
}  // namespace qkv::nn
