// Helpers shared by the tests: seeded random tensors and comparisons.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "core/elements.hpp"
#include "qkv/qkv.hpp"

namespace qkv::test {

// A contiguous tensor of `dtype` with values uniform in [lo, hi), rounded once.
inline Tensor random_tensor(DType dtype, std::span<const std::int64_t> sizes, std::uint32_t seed,
                            double lo = -1.0, double hi = 1.0) {
  Tensor t(dtype, sizes);
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> dist(lo, hi);
  const TensorView v = t.view();
  detail::for_each_index(v.sizes(), v.rank(), [&](const Shape& idx) {
    detail::store(v.data(), v.dtype(), detail::offset(idx, v.strides(), v.rank()), dist(gen));
  });
  return t;
}
inline Tensor random_tensor(DType dtype, std::initializer_list<std::int64_t> sizes,
                            std::uint32_t seed, double lo = -1.0, double hi = 1.0) {
  return random_tensor(dtype, std::span<const std::int64_t>(sizes.begin(), sizes.size()), seed, lo,
                       hi);
}

// Unit roundoff (half an ulp of 1) of a floating format; f32's for f64 too,
// since the tests compare against f32 computations.
inline double unit_roundoff(DType d) {
  switch (d) {
    case DType::f16:
      return std::ldexp(1.0, -11);
    case DType::bf16:
      return std::ldexp(1.0, -8);
    default:
      return std::ldexp(1.0, -24);
  }
}

// Largest |a - b| over all elements (same sizes); NaN if either holds a NaN.
inline double max_abs_diff(ConstTensorView a, ConstTensorView b) {
  double worst = 0.0;
  detail::for_each_index(a.sizes(), a.rank(), [&](const Shape& idx) {
    const double x = detail::load(a.data(), a.dtype(), detail::offset(idx, a.strides(), a.rank()));
    const double y = detail::load(b.data(), b.dtype(), detail::offset(idx, b.strides(), b.rank()));
    const double d = std::fabs(x - y);
    worst = std::isnan(d) ? d : std::max(worst, d);
  });
  return worst;
}

// Largest |a| over all elements.
inline double max_abs(ConstTensorView a) {
  double worst = 0.0;
  detail::for_each_index(a.sizes(), a.rank(), [&](const Shape& idx) {
    worst = std::max(worst, std::fabs(detail::load(a.data(), a.dtype(),
                                                   detail::offset(idx, a.strides(), a.rank()))));
  });
  return worst;
}

// True when any element is NaN or infinite.
inline bool has_non_finite(ConstTensorView a) {
  bool bad = false;
  detail::for_each_index(a.sizes(), a.rank(), [&](const Shape& idx) {
    bad = bad || !std::isfinite(
                     detail::load(a.data(), a.dtype(), detail::offset(idx, a.strides(), a.rank())));
  });
  return bad;
}

}  // namespace qkv::test
