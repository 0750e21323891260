// Small examples whose expected numbers were computed by hand.
#include <gtest/gtest.h>

#include <cmath>

#include "qkv/qkv.hpp"

namespace {

TEST(AttentionExamples, TwoKeysScaledDot) {
  // One query [1, 0], keys [1, 0] and [0, 1], values [1, 2] and [3, 4], Dk = 2:
  // scores = [1/sqrt(2), 0], weights = [w, 1 - w] with
  // w = 1 / (1 + exp(-1/sqrt(2))) = 0.66976155...
  float q[] = {1, 0};
  float k[] = {1, 0, 0, 1};
  float v[] = {1, 2, 3, 4};
  qkv::AttentionOptions opt;
  opt.return_lse = true;
  opt.return_probs = true;
  const auto r = qkv::attention(qkv::ConstTensorView(q, {1, 1, 1, 2}),
                                qkv::ConstTensorView(k, {1, 2, 1, 2}),
                                qkv::ConstTensorView(v, {1, 2, 1, 2}), opt);
  const double w = 0.6697615493266569;
  EXPECT_NEAR(r.probs.get({0, 0, 0, 0}), w, 1e-7);
  EXPECT_NEAR(r.out.get({0, 0, 0, 0}), 1 * w + 3 * (1 - w), 1e-6);
  EXPECT_NEAR(r.out.get({0, 0, 0, 1}), 2 * w + 4 * (1 - w), 1e-6);
  // lse = log(exp(1/sqrt 2) + 1) = 1.10794...
  EXPECT_NEAR(r.lse.get({0, 0, 0}), 1.1079403076572498, 1e-6);
}

}  // namespace
