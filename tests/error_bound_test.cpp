// The worst-case bounds of error_bound.hpp: they hold for the fast kernels
// on adversarial inputs (large scores, long rows, every bias), and they are
// tight enough to catch wrong results: a dropped key, a scale off by 0.1%,
// a bias applied to the wrong row. (The tolerance policy's sweep in
// flash_forward_test.cpp and flash_backward_test.cpp checks them too.)
#include "error_bound.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "attention_checks.hpp"
#include "qkv/attention.hpp"
#include "test_util.hpp"

namespace qkv::test {
namespace {

struct Case {
  Inputs in;
  AttentionOptions opt;
};

Case make_case(DType dtype, std::int64_t n, double magnitude) {
  Case c{make_inputs(1, n, n, 2, 1, 32, 32, dtype, 17), {}};
  // Spread q to the requested magnitude: scores up to about magnitude^2.
  c.in.q = random_tensor(dtype, {1, n, 2, 32}, 23, -magnitude, magnitude);
  c.opt.causal = true;
  c.opt.return_lse = true;
  return c;
}

AttentionResult run(const Case& c, Backend backend) {
  AttentionOptions o = c.opt;
  o.backend = backend;
  if (backend == Backend::reference) {
    return attention(f64(c.in.q), f64(c.in.k), f64(c.in.v), o);
  }
  return attention(c.in.q, c.in.k, c.in.v, o);
}

TEST(ErrorBound, ForwardHoldsOnLargeScoresAndEveryBias) {
  for (const DType dtype : {DType::f32, DType::bf16, DType::f16}) {
    for (const double magnitude : {1.0, 4.0, 12.0}) {
      Case c = make_case(dtype, 150, magnitude);
      const std::vector<float> slopes = {0.5f, 0.0625f};
      c.opt.alibi_slopes = slopes;
      c.opt.softcap = magnitude > 4 ? 30.0 : 0.0;
      c.opt.window_left = 100;
      expect_matches_reference(
          c.in.q, c.in.k, c.in.v, c.opt,
          std::string(dtype_name(dtype)) + " magnitude " + std::to_string(magnitude),
          Rule::worst_case);
    }
  }
}

// Scores near 3.5e6 with D = 1 and a relative bias (a case fuzz_attention
// found): the score's
// rounding alone moves lse by 0.16, and the relative error of the sum is
// past 1, so the lse bound must say "nothing" (infinity), not a small number.
TEST(ErrorBound, LseBoundIsInfiniteWhenTheSumsBoundSaysNothing) {
  const std::int64_t n = 15;
  Tensor q(DType::f32, {1, n, 1, 1}), k(DType::f32, {1, n, 1, 1});
  const Tensor v = random_tensor(DType::f32, {1, n, 1, 1}, 5, -1.5, 1.5);
  for (std::int64_t i = 0; i < n; ++i) {
    q.set({0, i, 0, 0}, 369.644);
    k.set({0, i, 0, 0}, 9471.32 * std::sin(static_cast<double>(i) + 1.0));
  }
  const Tensor table = random_tensor(DType::f32, {1, 12}, 6, -30.0, 30.0);
  AttentionOptions opt;
  opt.relative_bias.table = table;
  opt.relative_bias.max_distance = 15;
  const ForwardErrorBound b = forward_error_bound(q, k, v, opt, 1.0);
  EXPECT_TRUE(std::isinf(b.lse)) << b.lse;
  expect_matches_reference(q, k, v, opt, "scores near 3.5e6", Rule::worst_case);
}

TEST(ErrorBound, BackwardHoldsWithSoftcapAndDropout) {
  for (const DType dtype : {DType::f32, DType::bf16}) {
    Case c = make_case(dtype, 70, 4.0);
    c.opt.softcap = 5.0;
    c.opt.dropout_p = 0.25;
    c.opt.dropout_seed = 3;
    expect_backward_matches(c.in.q, c.in.k, c.in.v, c.opt, std::string(dtype_name(dtype)), 9,
                            Rule::worst_case);
  }
}

// The distance of a wrong result from the reference, over the bound.
double ratio(const Case& wrong, const Case& right) {
  const AttentionResult w = run(wrong, Backend::fast);
  const AttentionResult r = run(right, Backend::reference);
  const ForwardErrorBound b =
      forward_error_bound(right.in.q, right.in.k, right.in.v, right.opt, max_abs(r.out));
  return max_abs_diff(w.out, r.out) / b.out;
}

TEST(ErrorBound, CatchesWrongResults) {
  const Case right = make_case(DType::f32, 96, 1.0);
  // One key too few for the rows whose window reaches back to key 0.
  Case dropped = right;
  dropped.opt.window_left = 94;
  EXPECT_GT(ratio(dropped, right), 10.0);
  // The scale 0.1% off.
  Case scaled = right;
  scaled.opt.scale = 1.001 / std::sqrt(32.0);
  EXPECT_GT(ratio(scaled, right), 1.0);
  // Causal alignment off by one row: over 97 keys, top-left admits one key
  // fewer than bottom-right for every row.
  Case longer = right;
  longer.in.k = random_tensor(DType::f32, {1, 97, 1, 32}, 18, -1.5, 1.5);
  longer.in.v = random_tensor(DType::f32, {1, 97, 1, 32}, 19, -1.0, 1.0);
  Case top_left = longer;
  top_left.opt.align = Align::top_left;
  EXPECT_GT(ratio(top_left, longer), 10.0);
}

// How loose the bound is on an ordinary problem: the fast error sits orders
// of magnitude below it (docs/numerics.md records the ratio), yet the bound
// stays below 1e-3 of the values, so a wrong mask or bias shows.
TEST(ErrorBound, IsBelowAThousandthOfTheValues) {
  const Case c = make_case(DType::f32, 256, 1.0);
  const AttentionResult r = run(c, Backend::reference);
  const ForwardErrorBound b = forward_error_bound(c.in.q, c.in.k, c.in.v, c.opt, max_abs(r.out));
  EXPECT_LT(b.out, 1e-3 * max_abs(c.in.v));
  EXPECT_LT(b.lse, 1e-3);
}

}  // namespace
}  // namespace qkv::test
