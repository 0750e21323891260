// Small examples whose expected numbers were computed by hand (or with a
// calculator from the formula), so a wrong kernel cannot agree by accident.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "qkv/qkv.hpp"

namespace {

using qkv::ConstTensorView;

TEST(AttentionExamples, TwoKeysScaledDot) {
  // One query [1, 0], keys [1, 0] and [0, 1], values [1, 2] and [3, 4], Dk = 2:
  // scores = [1/sqrt(2), 0], weights = [w, 1 - w] with
  // w = 1 / (1 + exp(-1/sqrt(2))) = 0.66976155...
  double q[] = {1, 0};
  double k[] = {1, 0, 0, 1};
  double v[] = {1, 2, 3, 4};
  qkv::AttentionOptions opt;
  opt.return_lse = true;
  opt.return_probs = true;
  const auto r = qkv::attention(ConstTensorView(q, {1, 1, 1, 2}), ConstTensorView(k, {1, 2, 1, 2}),
                                ConstTensorView(v, {1, 2, 1, 2}), opt);
  const double w = 0.6697615493266569;
  EXPECT_NEAR(r.probs.get({0, 0, 0, 0}), w, 1e-15);
  EXPECT_NEAR(r.probs.get({0, 0, 0, 1}), 1 - w, 1e-15);
  EXPECT_NEAR(r.out.get({0, 0, 0, 0}), 1 * w + 3 * (1 - w), 1e-15);
  EXPECT_NEAR(r.out.get({0, 0, 0, 1}), 2 * w + 4 * (1 - w), 1e-15);
  // lse = log(exp(1/sqrt 2) + 1) = 1.10794...
  EXPECT_NEAR(r.lse.get({0, 0, 0}), 1.1079403076572498, 1e-15);
}

TEST(AttentionExamples, F32OutputIsTheRoundedExactResult) {
  float q[] = {1, 0};
  float k[] = {1, 0, 0, 1};
  float v[] = {1, 2, 3, 4};
  qkv::AttentionOptions opt;
  opt.backend = qkv::Backend::reference;
  const auto r = qkv::attention(ConstTensorView(q, {1, 1, 1, 2}), ConstTensorView(k, {1, 2, 1, 2}),
                                ConstTensorView(v, {1, 2, 1, 2}), opt);
  const double w = 0.6697615493266569;
  EXPECT_EQ(r.out.data<float>()[0], static_cast<float>(1 * w + 3 * (1 - w)));
  EXPECT_EQ(r.out.data<float>()[1], static_cast<float>(2 * w + 4 * (1 - w)));
}

TEST(AttentionExamples, CausalThreeTokensDot) {
  // q = k = [1, 2, 3] (D = 1), v = [10, 20, 30], plain dot scores, causal:
  // row 0 sees key 0 only; row 1: scores [2, 4]; row 2: scores [3, 6, 9].
  double x[] = {1, 2, 3};
  double v[] = {10, 20, 30};
  qkv::AttentionOptions opt;
  opt.score = qkv::Score::dot;
  opt.causal = true;
  opt.return_probs = true;
  const ConstTensorView xv(x, {1, 3, 1, 1});
  const auto r = qkv::attention(xv, xv, ConstTensorView(v, {1, 3, 1, 1}), opt);
  EXPECT_EQ(r.out.get({0, 0, 0, 0}), 10.0);
  // Row 1: weights 1/(1+e^2), e^2/(1+e^2) = 0.11920292202, 0.88079707798.
  EXPECT_NEAR(r.out.get({0, 1, 0, 0}), 10 * 0.11920292202211755 + 20 * 0.8807970779778823, 1e-13);
  // Row 2: weights proportional to e^3, e^6, e^9.
  const double z = std::exp(3.0) + std::exp(6.0) + std::exp(9.0);
  EXPECT_NEAR(r.out.get({0, 2, 0, 0}),
              (10 * std::exp(3.0) + 20 * std::exp(6.0) + 30 * std::exp(9.0)) / z, 1e-12);
  EXPECT_EQ(r.probs.get({0, 0, 0, 1}), 0.0);
  EXPECT_EQ(r.probs.get({0, 0, 1, 2}), 0.0);
}

TEST(AttentionExamples, AdditiveScore) {
  // Bahdanau: s_j = v^T tanh(W_q q + W_k k_j) with Dq = Dk = 1, A = 2,
  // W_q = [[1], [0]], W_k = [[0], [1]], v = [1, -1], q = 0.5, keys 0 and 1:
  // s_0 = tanh(0.5) - tanh(0) = 0.46211715726, s_1 = tanh(0.5) - tanh(1) =
  // -0.29947699870; weights 0.68169974219, 0.31830025781; values 2 and -4.
  double q[] = {0.5};
  double k[] = {0, 1};
  double vals[] = {2, -4};
  double w_q[] = {1, 0};
  double w_k[] = {0, 1};
  double v_att[] = {1, -1};
  qkv::AttentionOptions opt;
  opt.score = qkv::Score::additive;
  opt.additive.w_q = ConstTensorView(w_q, {2, 1});
  opt.additive.w_k = ConstTensorView(w_k, {2, 1});
  opt.additive.v = ConstTensorView(v_att, {2});
  opt.return_lse = true;
  opt.return_probs = true;
  const auto r = qkv::attention(ConstTensorView(q, {1, 1, 1, 1}), ConstTensorView(k, {1, 2, 1, 1}),
                                ConstTensorView(vals, {1, 2, 1, 1}), opt);
  EXPECT_NEAR(r.probs.get({0, 0, 0, 0}), 0.6816997421945262, 1e-15);
  EXPECT_NEAR(r.out.get({0, 0, 0, 0}), 0.09019845316715736, 1e-14);
  EXPECT_NEAR(r.lse.get({0, 0, 0}), 0.8452831360537247, 1e-15);

  // A bias b = [0, -1] shifts the second pre-activation: s_j = tanh(0.5) -
  // tanh(k_j - 1), so s_0 = tanh(0.5) + tanh(1) and s_1 = tanh(0.5).
  double bias[] = {0, -1};
  opt.additive.bias = ConstTensorView(bias, {2});
  const auto rb = qkv::attention(ConstTensorView(q, {1, 1, 1, 1}), ConstTensorView(k, {1, 2, 1, 1}),
                                 ConstTensorView(vals, {1, 2, 1, 1}), opt);
  const double w0 = 1.0 / (1.0 + std::exp(-std::tanh(1.0)));
  EXPECT_NEAR(rb.probs.get({0, 0, 0, 0}), w0, 1e-15);
}

TEST(AttentionExamples, FullyMaskedRowIsZeroWithMinusInfinityLse) {
  double q[] = {1, 2};
  double k[] = {1, 1};
  double v[] = {5, 6};
  bool mask[] = {true, false, false, false};  // row 1 admits no key
  qkv::AttentionOptions opt;
  opt.mask = ConstTensorView(mask, {2, 2});
  opt.return_lse = true;
  opt.return_probs = true;
  const auto r = qkv::attention(ConstTensorView(q, {1, 2, 1, 1}), ConstTensorView(k, {1, 2, 1, 1}),
                                ConstTensorView(v, {1, 2, 1, 1}), opt);
  EXPECT_EQ(r.out.get({0, 0, 0, 0}), 5.0);
  EXPECT_EQ(r.lse.get({0, 0, 0}), 1.0);  // one key with score 1 * 1 / sqrt(1)
  EXPECT_EQ(r.out.get({0, 1, 0, 0}), 0.0);
  EXPECT_EQ(r.lse.get({0, 0, 1}), -std::numeric_limits<double>::infinity());
  EXPECT_EQ(r.probs.get({0, 0, 1, 0}), 0.0);
  EXPECT_EQ(r.probs.get({0, 0, 1, 1}), 0.0);
}

TEST(Positional, SinusoidalValues) {
  const qkv::Tensor pe = qkv::sinusoidal_positions(4, 4, 10000.0, qkv::DType::f64);
  EXPECT_EQ(pe.get({0, 0}), 0.0);
  EXPECT_EQ(pe.get({0, 1}), 1.0);
  EXPECT_DOUBLE_EQ(pe.get({1, 0}), std::sin(1.0));
  EXPECT_DOUBLE_EQ(pe.get({1, 1}), std::cos(1.0));
  EXPECT_DOUBLE_EQ(pe.get({3, 2}), std::sin(0.03));  // frequency 10000^(-2/4)
  EXPECT_DOUBLE_EQ(pe.get({3, 3}), std::cos(0.03));
  EXPECT_THROW(qkv::sinusoidal_positions(4, 0), qkv::Error);
  EXPECT_THROW(qkv::sinusoidal_positions(4, 4, 1.0), qkv::Error);
}

TEST(Positional, AlibiSlopes) {
  const std::vector<float> s8 = qkv::alibi_slopes(8);
  for (int h = 0; h < 8; ++h) EXPECT_EQ(s8[h], std::ldexp(1.0f, -(h + 1)));
  // 12 heads: the 8 slopes of 8 heads, then slopes 1, 3, 5, 7 of 16 heads.
  const std::vector<float> s12 = qkv::alibi_slopes(12);
  ASSERT_EQ(s12.size(), 12u);
  EXPECT_EQ(s12[7], std::ldexp(1.0f, -8));
  EXPECT_FLOAT_EQ(s12[8], static_cast<float>(std::exp2(-0.5)));
  EXPECT_FLOAT_EQ(s12[11], static_cast<float>(std::exp2(-3.5)));
  EXPECT_THROW(qkv::alibi_slopes(0), qkv::Error);
}

TEST(Positional, T5BucketsMatchTheReferenceImplementation) {
  // Values of T5's _relative_position_bucket (32 buckets, max distance 128).
  EXPECT_EQ(qkv::t5_relative_bucket(0, 32, 128, true), 0);
  EXPECT_EQ(qkv::t5_relative_bucket(-1, 32, 128, true), 1);
  EXPECT_EQ(qkv::t5_relative_bucket(1, 32, 128, true), 17);
  EXPECT_EQ(qkv::t5_relative_bucket(-7, 32, 128, true), 7);
  EXPECT_EQ(qkv::t5_relative_bucket(-8, 32, 128, true), 8);
  EXPECT_EQ(qkv::t5_relative_bucket(-20, 32, 128, true), 10);
  EXPECT_EQ(qkv::t5_relative_bucket(-200, 32, 128, true), 15);
  EXPECT_EQ(qkv::t5_relative_bucket(200, 32, 128, true), 31);
  EXPECT_EQ(qkv::t5_relative_bucket(5, 32, 128, false), 0);
  EXPECT_EQ(qkv::t5_relative_bucket(-5, 32, 128, false), 5);
  EXPECT_EQ(qkv::t5_relative_bucket(-20, 32, 128, false), 17);
  EXPECT_EQ(qkv::t5_relative_bucket(-1000, 32, 128, false), 31);
  EXPECT_THROW(qkv::t5_relative_bucket(0, 2, 128, true), qkv::Error);
}

}  // namespace
