// qkv::nn::Linear: forward against a double loop, backward against finite
// differences, 16-bit weights, and validation.
#include <gtest/gtest.h>

#include "module_checks.hpp"
#include "qkv/modules/linear.hpp"

namespace qkv::test {
namespace {

// y[r, o] = sum_i x[r, i] w[o, i] + b[o] in double, x viewed as [rows, in].
Tensor linear_in_double(ConstTensorView x, ConstTensorView w, ConstTensorView b) {
  const Tensor xd = to_dtype(x, DType::f64);
  const std::int64_t in = w.size(1), out = w.size(0), rows = x.numel() / in;
  std::vector<std::int64_t> sizes(x.size_span().begin(), x.size_span().end());
  sizes.back() = out;
  Tensor y(DType::f64, sizes);
  const double* xp = xd.data<double>();
  double* yp = y.data<double>();
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t o = 0; o < out; ++o) {
      double s = b.defined() ? b.get({o}) : 0.0;
      for (std::int64_t i = 0; i < in; ++i) s += xp[r * in + i] * w.get({o, i});
      yp[r * out + o] = s;
    }
  }
  return y;
}

TEST(LinearModule, ForwardMatchesDoubleLoopAcrossShapesAndViews) {
  for (auto [in, out, bias] : {std::tuple{1, 1, true}, {7, 3, false}, {17, 33, true}}) {
    nn::Linear lin(in, out, bias);
    nn::init_uniform(lin.named_parameters(), 11);
    // A [2, 3, in] input read through a transposed view of [3, 2, in].
    const Tensor base = random_tensor(DType::f32, {3, 2, in}, 5);
    const ConstTensorView x = base.view().transpose(0, 1);
    const Tensor y = lin.forward(x);
    ASSERT_EQ(y.size(2), out);
    const Tensor want = linear_in_double(x, lin.weight.value, lin.bias.value);
    // f32 GEMM: each output is a dot product of length in plus the bias, with
    // error at most (in + 1) u sum|x w| (u = 2^-24), where |x| < 1 and
    // |w|, |b| <= 1/sqrt(in) give sum|x w| <= sqrt(in) + 1; 2x that bound.
    const double tol = 2.0 * (in + 1) * std::ldexp(1.0, -24) * (std::sqrt(double(in)) + 1.0);
    EXPECT_LE(max_abs_diff(y, want), tol) << in << "x" << out;
  }
}

TEST(LinearModule, SixteenBitWeightsAndInputsRoundOnce) {
  for (DType dt : {DType::bf16, DType::f16}) {
    nn::Linear lin(24, 10, true, dt);
    nn::init_uniform(lin.named_parameters(), 3);
    const Tensor x = random_tensor(dt, {4, 24}, 9);
    const Tensor y = lin.forward(x);
    EXPECT_EQ(y.dtype(), dt);
    const Tensor want = linear_in_double(x, lin.weight.value, lin.bias.value);
    // f32 accumulation of exact 16-bit products (error as above, in = 24),
    // then one rounding to dt; 2x the sum.
    const double tol = 2.0 * (max_abs(want) * unit_roundoff(dt) +
                              25 * std::ldexp(1.0, -24) * (std::sqrt(24.0) + 1));
    EXPECT_LE(max_abs_diff(y, want), tol) << dtype_name(dt);
  }
}

TEST(LinearModule, SingleRowsAndColumnsRunAsVectorProducts) {
  // One row against 200 outputs (the GEMV split into column blocks, as in a
  // decode step) and 200 rows against one output (one column).
  for (auto [rows, in, out] : {std::tuple{1, 37, 200}, {200, 37, 1}, {1, 1, 1}}) {
    nn::Linear lin(in, out);
    nn::init_uniform(lin.named_parameters(), 4);
    const Tensor x = random_tensor(DType::f32, {rows, in}, 6);
    const Tensor want = linear_in_double(x, lin.weight.value, lin.bias.value);
    const double tol = 2.0 * (in + 1) * std::ldexp(1.0, -24) * (std::sqrt(double(in)) + 1.0);
    EXPECT_LE(max_abs_diff(lin.forward(x), want), tol) << rows << "x" << in << "x" << out;
  }
}

TEST(LinearModule, BackwardMatchesFiniteDifferences) {
  // Shapes where every product of the backward is a vector product: one
  // output (dW's rows), one input feature (dx's columns), one row.
  for (auto [rows, in, out, bias] : {std::tuple{6, 5, 4, true},
                                     {6, 5, 4, false},
                                     {6, 5, 1, true},
                                     {6, 1, 4, true},
                                     {1, 5, 4, true}}) {
    nn::Linear lin(in, out, bias, DType::f64);
    nn::init_uniform(lin.named_parameters(), 21);
    Tensor x = random_tensor(DType::f64, {rows, in}, 22);
    const Tensor w = random_tensor(DType::f64, {rows, out}, 23);
    const Tensor dx = lin.backward(x, w);
    std::vector<GradientTarget> targets{{"x", x.view(), dx.view()},
                                        {"weight", lin.weight.value, lin.weight.grad}};
    if (bias) targets.push_back({"bias", lin.bias.value, lin.bias.grad});
    expect_gradients_match_fd([&] { return lin.forward(x); }, w, targets);
  }
}

TEST(LinearModule, GradientsAccumulateUntilZeroGrad) {
  nn::Linear lin(3, 2, true, DType::f64);
  nn::init_uniform(lin.named_parameters(), 1);
  const Tensor x = random_tensor(DType::f64, {4, 3}, 2);
  const Tensor dy = random_tensor(DType::f64, {4, 2}, 3);
  lin.backward(x, dy);
  const Tensor once = lin.weight.grad;
  lin.backward(x, dy);
  for (std::int64_t o = 0; o < 2; ++o) {
    for (std::int64_t i = 0; i < 3; ++i) {
      EXPECT_DOUBLE_EQ(lin.weight.grad.get({o, i}), 2.0 * once.get({o, i}));
    }
  }
  nn::zero_grad(lin.named_parameters());
  EXPECT_FALSE(lin.weight.grad.defined());
  // An f32 backward after f64 gradients without zero_grad is refused.
  lin.backward(x, dy);
  EXPECT_THROW(lin.backward(to_dtype(x, DType::f32), to_dtype(dy, DType::f32)), Error);
}

TEST(LinearModule, ValidationNamesEveryProblem) {
  EXPECT_THROW(nn::Linear(0, 3), Error);
  nn::Linear lin(4, 3);
  try {
    lin.backward(Tensor(DType::f32, {2, 5}), Tensor(DType::boolean, {2, 3}));
    FAIL() << "expected qkv::Error";
  } catch (const Error& e) {
    ASSERT_EQ(e.reasons().size(), 2u) << e.what();
    EXPECT_NE(std::string(e.what()).find("in_features = 4"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("dy: expected dtype f32"), std::string::npos) << e.what();
  }
  EXPECT_THROW(lin.forward(Tensor(DType::f32, {2, 3})), Error);
  // No rows: an empty result, and gradients that stay zero.
  EXPECT_EQ(lin.forward(Tensor(DType::f32, {0, 4})).numel(), 0);
  EXPECT_EQ(lin.backward(Tensor(DType::f32, {0, 4}), Tensor(DType::f32, {0, 3})).numel(), 0);
  EXPECT_EQ(max_abs(lin.weight.grad), 0.0);
  // A parameter replaced by one of another shape is named, not read past its end.
  lin.weight.value = Tensor(DType::f32, {1, 1});
  try {
    lin.forward(Tensor(DType::f32, {2, 4}));
    FAIL() << "expected qkv::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("weight: expected a floating parameter of sizes [3, 4]"),
              std::string::npos)
        << e.what();
  }
  // A null view with elements is rejected before BLAS reads it.
  EXPECT_THROW(
      nn::Linear(4, 3).forward(ConstTensorView(static_cast<const float*>(nullptr), {2, 4})), Error);
}

}  // namespace
}  // namespace qkv::test
