#include "modules/common.hpp"

#include <algorithm>
#include <cmath>
#include <random>

#include "qkv/error.hpp"

namespace qkv::nn {

void zero_grad(const NamedParameters& parameters) {
  for (const NamedParameter& p : parameters) p.parameter->grad = Tensor();
}

Parameter make_parameter(DType dtype, std::initializer_list<std::int64_t> sizes) {
  detail::Reasons r;
  detail::check_floating("parameter dtype", dtype, r);
  detail::throw_if(r);
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

// Empty when p's gradient may accumulate in `dtype`.
std::string grad_dtype_reason(const Parameter& p, DType dtype) {
  if (!p.grad.defined() || p.grad.dtype() == dtype) return {};
  return ".grad: holds " + str(p.grad.dtype()) + " gradients, this backward computes " +
         str(dtype) + " (call zero_grad between f32 and f64 backward calls)";
}

}  // namespace

Tensor& grad_of(Parameter& p, DType dtype) {
  if (const std::string reason = grad_dtype_reason(p, dtype); !reason.empty()) {
    throw Error("parameter" + reason);
  }
  if (!p.grad.defined()) p.grad = Tensor(dtype, p.value.view().size_span());
  return p.grad;
}

void check_grads(const NamedParameters& parameters, DType dtype, Reasons& r) {
  for (const NamedParameter& p : parameters) {
    if (const std::string reason = grad_dtype_reason(*p.parameter, dtype); !reason.empty()) {
      r.push_back(p.name + reason);
    }
  }
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

bool check_input(const char* name, ConstTensorView x, int rank, const char* layout,
                 Reasons& reasons) {
  return check_view(name, x, {.rank = rank, .layout = layout, .floating = true}, reasons);
}

bool check_parameter(const std::string& name, const Parameter& p,
                     std::initializer_list<std::int64_t> sizes, Reasons& reasons) {
  const auto has = [&](const Tensor& t) {
    return std::equal(t.sizes().begin(), t.sizes().begin() + t.rank(), sizes.begin(), sizes.end());
  };
  const std::vector<std::int64_t> want(sizes);
  if (!p.value.defined() || !is_floating(p.value.dtype()) || !has(p.value)) {
    reasons.push_back(
        name + ": expected a floating parameter of sizes " + shape_string(want) + ", got " +
        (p.value.defined() ? str(p.value.dtype()) + " " + shape_of(p.value) : std::string("none")));
    return false;
  }
  if (p.grad.defined() && !has(p.grad)) {
    reasons.push_back(name + ".grad: expected sizes " + shape_string(want) + ", got " +
                      shape_of(p.grad));
    return false;
  }
  return true;
}

Tensor in_dtype(Tensor t, DType dtype) {
  if (t.dtype() == dtype) return t;
  return to_dtype(t, dtype);
}

std::vector<std::int64_t> with_last(ConstTensorView x, std::int64_t last) {
  std::vector<std::int64_t> sizes(x.size_span().begin(), x.size_span().end());
  sizes.back() = last;
  return sizes;
}

}  // namespace detail
}  // namespace qkv::nn
