// A learned per-head logit scale (options.score_scale, with
// score_scale_log_n the Scalable-Softmax form): the reference against the
// same logits written as a score_mod, the fast paths against the reference,
// the gradients against central differences, and the validation.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "attention_checks.hpp"
#include "qkv/attention.hpp"
#include "qkv/backward.hpp"
#include "qkv/kv_cache.hpp"
#include "test_util.hpp"

namespace {

using qkv::AttentionOptions;
using qkv::DType;
using qkv::Tensor;
using qkv::test::Inputs;
using qkv::test::make_inputs;
using qkv::test::max_abs;
using qkv::test::max_abs_diff;
using qkv::test::random_tensor;

// The keys of row i's range for nq queries and nk keys, bottom-right aligned.
double keys_of_row(std::int64_t i, std::int64_t nq, std::int64_t nk, bool causal) {
  return causal ? static_cast<double>(std::min(nk, i + nk - nq + 1)) : static_cast<double>(nk);
}

TEST(ScoreScale, ReferenceEqualsTheSameLogitsAsAScoreMod) {
  constexpr std::int64_t kNq = 11, kNk = 14;
  const Inputs in = make_inputs(2, kNq, kNk, 4, 2, 8, 8, DType::f64, 51);
  const std::vector<float> scales = {0.8f, 1.3f, -0.4f, 2.0f};
  for (const bool causal : {false, true}) {
    for (const bool log_n : {false, true}) {
      SCOPED_TRACE(std::string(causal ? "causal" : "full") + (log_n ? " log_n" : ""));
      AttentionOptions o;
      o.backend = qkv::Backend::reference;
      o.causal = causal;
      AttentionOptions by_mod = o;
      o.score_scale = scales;
      o.score_scale_log_n = log_n;
      by_mod.score_mod = [&](double s, std::int64_t, std::int64_t h, std::int64_t i, std::int64_t) {
        const double n = keys_of_row(i, kNq, kNk, causal);
        return s * static_cast<double>(scales[h]) * (log_n ? std::log(n) : 1.0);
      };
      const Tensor got = qkv::attention(in.q, in.k, in.v, o).out;
      const Tensor want = qkv::attention(in.q, in.k, in.v, by_mod).out;
      EXPECT_LT(max_abs_diff(got, want), 1e-12);
    }
  }
}

// The fused paths (forward, backward, each precision; sizes around the
// vector widths and key blocks) against the reference in double, within
// the worst-case bounds and the policy's twice-the-naive-error rule
// (attention_checks.hpp; d_score_scale from dq's bound).
TEST(ScoreScale, FastPathsMatchTheReference) {
  const std::vector<float> scales = {0.8f, 1.3f, -0.4f, 0.6f};
  for (const DType dtype : {DType::f32, DType::bf16, DType::f16}) {
    for (const auto& [nq, nk] : {std::pair{37, 53}, std::pair{16, 16}, std::pair{1, 70}}) {
      for (const bool log_n : {false, true}) {
        for (const auto precision : {qkv::MatmulPrecision::highest, qkv::MatmulPrecision::medium}) {
          const std::string label = std::string(qkv::dtype_name(dtype)) + " " + std::to_string(nq) +
                                    "x" + std::to_string(nk) + (log_n ? " log_n" : "") +
                                    (precision == qkv::MatmulPrecision::medium ? " medium" : "");
          SCOPED_TRACE(label);
          const Inputs in = make_inputs(2, nq, nk, 4, 2, 32, 32, dtype, 61);
          AttentionOptions o;
          o.causal = true;
          o.score_scale = scales;
          o.score_scale_log_n = log_n;
          o.matmul_precision = precision;
          qkv::test::expect_matches_reference(in.q, in.k, in.v, o, label);
          qkv::test::expect_backward_matches(in.q, in.k, in.v, o, label);
        }
      }
    }
  }
}

// Decoding runs the scaled queries too: each new row's keys are its
// sequence's cached tokens up to its own, as the causal forward's last rows
// have them.
TEST(ScoreScale, DecodeMatchesTheCausalForward) {
  constexpr std::int64_t kTokens = 21;
  const std::vector<float> scales = {0.8f, 1.3f, -0.4f, 2.0f};
  for (const bool log_n : {false, true}) {
    SCOPED_TRACE(log_n ? "log_n" : "plain");
    const Inputs in = make_inputs(2, kTokens, kTokens, 4, 2, 16, 16, DType::f32, 91);
    qkv::KvCacheConfig config;
    config.batch = 2;
    config.kv_heads = 2;
    config.head_dim = 16;
    config.capacity = kTokens;
    qkv::KvCache cache(config);
    cache.append(in.k, in.v);
    AttentionOptions o;
    o.score_scale = scales;
    o.score_scale_log_n = log_n;
    const qkv::ConstTensorView q_new = in.q.view().slice(1, kTokens - 3, 3);
    for (const auto backend : {qkv::Backend::fast, qkv::Backend::reference}) {
      o.backend = backend;
      qkv::test::expect_decode_matches_causal(q_new, in.k, in.v, cache, o,
                                              backend == qkv::Backend::fast ? "fast" : "reference");
    }
  }
}

TEST(ScoreScale, GradientsMatchCentralDifferences) {
  for (const bool log_n : {false, true}) {
    SCOPED_TRACE(log_n ? "log_n" : "plain");
    Inputs in = make_inputs(2, 9, 12, 4, 2, 8, 8, DType::f64, 71);
    const Tensor dout = random_tensor(DType::f64, {2, 9, 4, 8}, 72);
    std::vector<float> scales = {0.8f, 1.3f, -0.4f, 2.0f};
    AttentionOptions o;
    o.backend = qkv::Backend::reference;
    o.causal = true;
    o.score_scale = scales;
    o.score_scale_log_n = log_n;
    o.return_lse = true;
    const auto fwd = qkv::attention(in.q, in.k, in.v, o);
    const auto g = qkv::attention_backward(in.q, in.k, in.v, fwd.out, dout, fwd.lse, o);
    ASSERT_EQ(g.d_score_scale.dtype(), DType::f64);
    o.return_lse = false;
    for (std::size_t h = 0; h < scales.size(); ++h) {
      // Steps the f32 scale can take: 1e-6 rounded to f32.
      const float s = scales[h], up = s + 1e-6f, down = s - 1e-6f;
      scales[h] = up;
      const double l_up = qkv::test::output_loss(in, dout, o);
      scales[h] = down;
      const double l_down = qkv::test::output_loss(in, dout, o);
      scales[h] = s;
      const double fd = (l_up - l_down) / (static_cast<double>(up) - static_cast<double>(down));
      const double got = g.d_score_scale.get({static_cast<std::int64_t>(h)});
      EXPECT_LT(std::fabs(got - fd), 1e-6 * (1.0 + std::fabs(fd))) << "head " << h;
    }
    // dq through the scale: a few entries of q, steps of 1e-6 in f64.
    for (const std::int64_t e : {std::int64_t{3}, std::int64_t{77}, std::int64_t{250}}) {
      double& x = in.q.data<double>()[e];
      const double keep = x;
      x = keep + 1e-6;
      const double l_up = qkv::test::output_loss(in, dout, o);
      x = keep - 1e-6;
      const double l_down = qkv::test::output_loss(in, dout, o);
      x = keep;
      const double fd = (l_up - l_down) / 2e-6;
      EXPECT_LT(std::fabs(g.dq.data<double>()[e] - fd), 1e-6 * (1.0 + std::fabs(fd)))
          << "q element " << e;
    }
  }
}

std::string error_of(const Inputs& in, const AttentionOptions& o) {
  try {
    qkv::attention(in.q, in.k, in.v, o);
  } catch (const qkv::Error& e) {
    return e.what();
  }
  return "";
}

TEST(ScoreScale, ValidationNamesTheProblem) {
  const Inputs in = make_inputs(1, 4, 4, 2, 1, 8, 8, DType::f32, 81);
  const std::vector<float> one = {1.0f}, nan = {1.0f, std::nanf("")}, two = {1.0f, 0.5f};
  AttentionOptions o;
  o.score_scale = one;
  EXPECT_NE(error_of(in, o).find("options.score_scale: expected Hq = 2 scales, got 1"),
            std::string::npos);
  o.score_scale = nan;
  EXPECT_NE(error_of(in, o).find("options.score_scale[1]: expected a finite scale, got nan"),
            std::string::npos);
  o = {};
  o.score_scale_log_n = true;
  EXPECT_NE(error_of(in, o).find("options.score_scale_log_n: scales score_scale, which is empty"),
            std::string::npos);
  o = {};
  Tensor w_q = random_tensor(DType::f32, {4, 8}, 1), w_k = random_tensor(DType::f32, {4, 8}, 2),
         w_v = random_tensor(DType::f32, {4}, 3);
  o.score = qkv::Score::additive;
  o.additive = {w_q, w_k, w_v, {}};
  o.score_scale = two;
  EXPECT_NE(error_of(in, o).find("options.score_scale: scales dot-product scores"),
            std::string::npos);
}

}  // namespace
