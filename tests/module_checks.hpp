// Gradient checks shared by the module tests: central finite differences of
// a scalar loss L = sum(w * y) in double, compared with a module's backward.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/elements.hpp"
#include "qkv/error.hpp"
#include "qkv/modules/parameter.hpp"
#include "test_paths.hpp"
#include "test_util.hpp"

namespace qkv::test {

// Path of a golden file in tests/data/.
inline std::string test_data(const std::string& name) {
  return std::string(kTestDataDir) + "/" + name;
}

// Elements of t (any strides) in row-major order, as T.
template <class T>
std::vector<T> values_of(ConstTensorView t) {
  std::vector<T> out;
  out.reserve(static_cast<std::size_t>(t.numel()));
  detail::for_each_index(t.sizes(), t.rank(), [&](const Shape& idx) {
    out.push_back(static_cast<T>(
        detail::load(t.data(), t.dtype(), detail::offset(idx, t.strides(), t.rank()))));
  });
  return out;
}

// The reasons of the qkv::Error that f throws (a test failure if none).
template <class F>
std::vector<std::string> reasons_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.reasons();
  }
  ADD_FAILURE() << "expected qkv::Error";
  return {};
}

// One tensor whose gradient is checked: `value` (f64, contiguous) is perturbed
// in place, `analytic` is the backward's gradient for it.
struct GradientTarget {
  std::string name;
  TensorView value;
  ConstTensorView analytic;
};

// L(y) = sum_i w_i y_i over y's elements (w and y of the same sizes) and the
// magnitude sum_i |w_i y_i|, which bounds L's rounding error.
inline double weighted_sum(ConstTensorView y, ConstTensorView w, double* magnitude) {
  double sum = 0.0, mag = 0.0;
  detail::for_each_index(y.sizes(), y.rank(), [&](const Shape& idx) {
    const double a = detail::load(y.data(), y.dtype(), detail::offset(idx, y.strides(), y.rank()));
    const double b = detail::load(w.data(), w.dtype(), detail::offset(idx, w.strides(), w.rank()));
    sum += a * b;
    mag += std::fabs(a * b);
  });
  if (magnitude != nullptr) *magnitude = mag;
  return sum;
}

// Checks every element of every target: dL/dx by central differences
// (L(x + h) - L(x - h)) / 2h against the analytic gradient. `forward`
// recomputes the module's output (f64) from the current values.
//
// Error model of the difference quotient in double: truncation h^2 |L'''| / 6
// (about 1e-12 for h = 1e-6 and third derivatives of order 1; allowed 1e-8
// relative to the gradient) plus rounding of the two losses, at most
// 2 * 64 u * sum|w y| / (2h) with u = 2^-53 and a generous 64 for the
// operations per output element (modules chain GEMMs, softmax, tanh).
inline void expect_gradients_match_fd(const std::function<Tensor()>& forward, ConstTensorView w,
                                      const std::vector<GradientTarget>& targets, double h = 1e-6) {
  double magnitude = 0.0;
  weighted_sum(forward(), w, &magnitude);
  const double rounding = 64.0 * std::ldexp(1.0, -53) * (magnitude + 1.0) / h;
  for (const GradientTarget& t : targets) {
    ASSERT_EQ(t.value.dtype(), DType::f64) << t.name;
    ASSERT_TRUE(t.value.is_contiguous()) << t.name;
    ASSERT_EQ(
        std::vector<std::int64_t>(t.value.size_span().begin(), t.value.size_span().end()),
        std::vector<std::int64_t>(t.analytic.size_span().begin(), t.analytic.size_span().end()))
        << t.name;
    double* x = static_cast<double*>(t.value.data());
    int failures = 0;
    std::int64_t index = 0;
    detail::for_each_index(t.analytic.sizes(), t.analytic.rank(), [&](const Shape& idx) {
      const double saved = x[index];
      x[index] = saved + h;
      const double plus = weighted_sum(forward(), w, nullptr);
      x[index] = saved - h;
      const double minus = weighted_sum(forward(), w, nullptr);
      x[index] = saved;
      const double numeric = (plus - minus) / (2.0 * h);
      const double analytic =
          detail::load(t.analytic.data(), t.analytic.dtype(),
                       detail::offset(idx, t.analytic.strides(), t.analytic.rank()));
      const double tol = 1e-8 * (1.0 + std::fabs(analytic)) + rounding;
      if (!(std::fabs(numeric - analytic) <= tol) && ++failures <= 5) {
        ADD_FAILURE() << t.name << " element " << index << ": analytic " << analytic
                      << ", finite difference " << numeric << " (tolerance " << tol << ")";
      }
      ++index;
    });
    EXPECT_EQ(failures, 0) << t.name << ": " << failures << " elements differ";
  }
}

}  // namespace qkv::test
