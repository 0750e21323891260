// Half-precision inputs on the reference backend: it computes in double and rounds once, so
// (1) its f16/bf16 output is exactly the rounding of the f64 result on the
// same (widened) inputs, and (2) it differs from the f32-input result by no
// more than what rounding the inputs can cause. For (2), with unit roundoff u
// of the input format, each score moves by at most
//   E = scale * max_j sum_t |q_t| |k_jt| (2u + u^2),
// each weight by a factor within [e^-2E, e^2E], so
//   |out16 - out32| <= (e^2E - 1) max_j |v16_j| + u max_j |v_j|
// plus the rounding of each output (half an ulp of its format).
#include <gtest/gtest.h>

#include <cmath>

#include "test_util.hpp"

namespace {

using qkv::DType;
using qkv::Tensor;
using qkv::test::unit_roundoff;

// Half an ulp of x in a format with unit roundoff u (normal range).
double half_ulp(double x, double u) {
  if (x == 0.0) return 0.0;
  int e = 0;
  std::frexp(x, &e);  // |x| in [2^(e-1), 2^e)
  return u * std::ldexp(1.0, e - 1);
}

class HalfInputs : public ::testing::TestWithParam<DType> {};

TEST_P(HalfInputs, OutputIsTheExactResultRoundedOnce) {
  const DType dtype = GetParam();
  const Tensor q = qkv::test::random_tensor(dtype, {2, 13, 4, 24}, 31);
  const Tensor k = qkv::test::random_tensor(dtype, {2, 17, 2, 24}, 32);
  const Tensor v = qkv::test::random_tensor(dtype, {2, 17, 2, 24}, 33);
  qkv::AttentionOptions opt;
  opt.backend = qkv::Backend::reference;
  opt.causal = true;
  const Tensor out = qkv::attention(q, k, v, opt).out;
  const Tensor exact = qkv::attention(qkv::to_dtype(q, DType::f64), qkv::to_dtype(k, DType::f64),
                                      qkv::to_dtype(v, DType::f64), opt)
                           .out;
  EXPECT_EQ(qkv::test::max_abs_diff(out, qkv::to_dtype(exact, dtype)), 0.0);
}

TEST_P(HalfInputs, AgreesWithF32WithinInputRounding) {
  const DType dtype = GetParam();
  const double u = unit_roundoff(dtype);
  const std::int64_t nq = 9, nk = 21, d = 32;
  const Tensor q32 = qkv::test::random_tensor(DType::f32, {1, nq, 1, d}, 41);
  const Tensor k32 = qkv::test::random_tensor(DType::f32, {1, nk, 1, d}, 42);
  const Tensor v32 = qkv::test::random_tensor(DType::f32, {1, nk, 1, d}, 43);
  const Tensor q = qkv::to_dtype(q32, dtype), k = qkv::to_dtype(k32, dtype),
               v = qkv::to_dtype(v32, dtype);
  qkv::AttentionOptions opt;
  opt.backend = qkv::Backend::reference;
  const Tensor out32 = qkv::attention(q32, k32, v32, opt).out;
  const Tensor out = qkv::attention(q, k, v, opt).out;
  const double scale = 1.0 / std::sqrt(double(d));
  for (std::int64_t i = 0; i < nq; ++i) {
    double e_max = 0.0;
    for (std::int64_t j = 0; j < nk; ++j) {
      double dot_abs = 0.0;
      for (std::int64_t t = 0; t < d; ++t)
        dot_abs += std::fabs(q32.get({0, i, 0, t})) * std::fabs(k32.get({0, j, 0, t}));
      e_max = std::max(e_max, scale * dot_abs * (2 * u + u * u));
    }
    for (std::int64_t c = 0; c < d; ++c) {
      double v_max = 0.0, v16_max = 0.0;
      for (std::int64_t j = 0; j < nk; ++j) {
        v_max = std::max(v_max, std::fabs(v32.get({0, j, 0, c})));
        v16_max = std::max(v16_max, std::fabs(v.get({0, j, 0, c})));
      }
      const double a = out.get({0, i, 0, c});
      const double b = out32.get({0, i, 0, c});
      const double bound = std::expm1(2 * e_max) * v16_max + u * v_max + half_ulp(a, u) +
                           half_ulp(b, unit_roundoff(DType::f32));
      ASSERT_LT(bound, 0.1) << "the bound must be tight enough to catch a wrong result";
      EXPECT_LE(std::fabs(a - b), bound) << "row " << i << " col " << c;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Precision, HalfInputs, ::testing::Values(DType::f16, DType::bf16),
                         [](const auto& p) { return std::string(qkv::dtype_name(p.param)); });

}  // namespace
