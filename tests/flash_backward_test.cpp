// The fused backward against the reference backward, with the tolerance
// policy of docs/numerics.md (see attention_checks.hpp).
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "api/validate.hpp"
#include "attention_checks.hpp"
#include "cpu/flash.hpp"
#include "hwy/targets.h"
#include "reference/attention.hpp"
#include "reference/backward.hpp"
#include "sweep_sample.hpp"
#include "test_util.hpp"

namespace {

using qkv::AttentionOptions;
using qkv::ConstTensorView;
using qkv::DType;
using qkv::Tensor;
using qkv::test::expect_backward_matches;
using qkv::test::f64;
using qkv::test::has_non_finite;
using qkv::test::Inputs;
using qkv::test::make_inputs;
using qkv::test::max_abs;
using qkv::test::max_abs_diff;
using qkv::test::random_tensor;
using qkv::test::SweepSample;
using qkv::test::unit_roundoff;

struct SweepCase {
  std::int64_t nq, nk, hq, hkv, d;
};

// Sizes around tile (64 rows, 256 keys) and vector boundaries, and the head
// dims docs/architecture.md lists ("Rules the tests rely on").
const SweepCase kSweep[] = {
    {1, 1, 1, 1, 1},     {1, 300, 8, 1, 64},   {17, 17, 2, 2, 8},    {17, 97, 4, 2, 59},
    {97, 17, 8, 8, 111}, {97, 129, 8, 1, 128}, {64, 257, 2, 1, 256}, {300, 300, 1, 1, 64},
};

class FlashBackwardSweep : public ::testing::TestWithParam<DType> {};

TEST_P(FlashBackwardSweep, ShapesAndRangeMasks) {
  const DType dtype = GetParam();
  const SweepSample sample(std::size(kSweep));
  SCOPED_TRACE(sample.note());
  std::uint32_t seed = 200;
  for (std::size_t i = 0; i < std::size(kSweep); ++i) {
    const SweepCase& c = kSweep[i];
    seed += 3;
    if (!sample.runs(i)) continue;
    const Inputs x = make_inputs(1, c.nq, c.nk, c.hq, c.hkv, c.d, c.d, dtype, seed);
    const std::string shape = "Nq=" + std::to_string(c.nq) + " Nk=" + std::to_string(c.nk) +
                              " Hq=" + std::to_string(c.hq) + " Hkv=" + std::to_string(c.hkv) +
                              " D=" + std::to_string(c.d);
    expect_backward_matches(x.q, x.k, x.v, {}, shape + " full");
    AttentionOptions causal;
    causal.causal = true;
    expect_backward_matches(x.q, x.k, x.v, causal, shape + " causal bottom-right");
    causal.align = qkv::Align::top_left;
    expect_backward_matches(x.q, x.k, x.v, causal, shape + " causal top-left");
    AttentionOptions window;
    window.window_left = 5;
    window.window_right = 3;
    expect_backward_matches(x.q, x.k, x.v, window, shape + " window");
  }
}

TEST_P(FlashBackwardSweep, EveryFeatureAloneAndCombined) {
  const DType dtype = GetParam();
  const std::int64_t b = 2, nq = 70, nk = 300, hq = 4, hkv = 2, d = 40;
  const Inputs x = make_inputs(b, nq, nk, hq, hkv, d, 24, dtype, 7);
  const std::vector<float> slopes = qkv::alibi_slopes(hq);
  const Tensor table = random_tensor(DType::f32, {hq, 32}, 8, -1.0, 1.0);
  Tensor bool_mask(DType::boolean, {b, 1, nq, nk});
  Tensor float_mask(DType::f32, {nq, nk});
  for (std::int64_t i = 0; i < nq; ++i)
    for (std::int64_t j = 0; j < nk; ++j) {
      for (std::int64_t bb = 0; bb < b; ++bb)
        bool_mask.set({bb, 0, i, j}, (i + 3 * j + bb) % 7 != 0);
      float_mask.set({i, j}, j % 11 == 0 ? -std::numeric_limits<double>::infinity()
                                         : 0.25 * std::sin(double(i * j)));
    }
  const std::int64_t lengths[] = {300, 129};

  std::vector<std::pair<std::string, AttentionOptions>> cases;
  auto add = [&](const std::string& name, auto&& set) {
    AttentionOptions o;
    set(o);
    cases.emplace_back(name, o);
  };
  add("dot", [](auto& o) { o.score = qkv::Score::dot; });
  add("scale", [](auto& o) { o.scale = 0.3; });
  add("key lengths", [&](auto& o) { o.key_lengths = lengths; });
  add("bool mask", [&](auto& o) { o.mask = bool_mask; });
  add("float mask", [&](auto& o) { o.mask = float_mask; });
  add("alibi", [&](auto& o) { o.alibi_slopes = slopes; });
  add("relative bias", [&](auto& o) { o.relative_bias = {table, 64, true}; });
  add("causal relative bias", [&](auto& o) {
    o.relative_bias = {table, 64, false};
    o.causal = true;
  });
  add("softcap", [](auto& o) { o.softcap = 1.5; });
  add("mask_mod", [](auto& o) {
    o.mask_mod = [](std::int64_t, std::int64_t h, std::int64_t i, std::int64_t j) {
      return (i / 16 + h) % 3 != (j / 32) % 3;
    };
  });
  add("dropout", [](auto& o) {
    o.dropout_p = 0.2;
    o.dropout_seed = 1234;
    o.dropout_offset = 7;
  });
  add("everything", [&](auto& o) {
    o.causal = true;
    o.window_left = 100;
    o.key_lengths = lengths;
    o.mask = bool_mask;
    o.alibi_slopes = slopes;
    o.softcap = 5.0;
    o.dropout_p = 0.1;
    o.mask_mod = [](std::int64_t, std::int64_t, std::int64_t i, std::int64_t j) {
      return (i + j) % 13 != 0;
    };
  });
  add("window, float mask and relative bias", [&](auto& o) {
    o.window_left = 40;
    o.window_right = 40;
    o.mask = float_mask;
    o.relative_bias = {table, 64, true};
  });
  const SweepSample sample(cases.size());
  SCOPED_TRACE(sample.note());
  for (std::size_t i = 0; i < cases.size(); ++i) {
    if (sample.runs(i)) expect_backward_matches(x.q, x.k, x.v, cases[i].second, cases[i].first);
  }
}

TEST_P(FlashBackwardSweep, PackedSequences) {
  const DType dtype = GetParam();
  const std::int64_t cu_q[] = {0, 5, 5, 150, 151};
  const std::int64_t cu_k[] = {0, 300, 301, 420, 420};
  const Inputs x = make_inputs(1, 151, 420, 6, 3, 32, 32, dtype, 11);
  AttentionOptions o;
  o.cu_seqlens_q = cu_q;
  o.cu_seqlens_k = cu_k;
  expect_backward_matches(x.q, x.k, x.v, o, "varlen");
  o.causal = true;
  const std::int64_t lengths[] = {250, 0, 100, 0};
  o.key_lengths = lengths;
  o.dropout_p = 0.3;
  expect_backward_matches(x.q, x.k, x.v, o, "varlen causal key lengths dropout");
}

// d_mask (options.mask_requires_grad) for masks broadcast along each
// dimension, with the options that change dS, and packed sequences; the same
// bits on one thread as on two.
TEST_P(FlashBackwardSweep, FloatMaskGradient) {
  const DType dtype = GetParam();
  const Inputs x = make_inputs(2, 37, 70, 4, 2, 24, 24, dtype, 71);
  const std::vector<std::vector<std::int64_t>> shapes = {{2, 4, 37, 70}, {37, 70}, {1, 4, 1, 70},
                                                         {2, 1, 37, 1},  {70},     {1}};
  const float sinks[] = {0.5f, -1.0f, 0.0f, 2.0f};
  const float scales[] = {1.5f, 0.5f, -1.0f, 2.0f};
  for (std::size_t s = 0; s < shapes.size(); ++s) {
    const Tensor mask =
        random_tensor(DType::f32, shapes[s], 80 + static_cast<std::uint32_t>(s), -2.0, 2.0);
    AttentionOptions o;
    o.mask = mask;
    o.mask_requires_grad = true;
    std::string shape = "mask";
    for (const std::int64_t n : shapes[s]) shape.append(" ").append(std::to_string(n));
    expect_backward_matches(x.q, x.k, x.v, o, shape);
    if (s > 1) continue;
    o.causal = true;
    o.softcap = 3.0;
    expect_backward_matches(x.q, x.k, x.v, o, shape + " causal softcap");
    o.dropout_p = 0.25;
    o.dropout_seed = 9;
    o.sinks = sinks;
    o.score_scale = scales;
    const auto two = expect_backward_matches(x.q, x.k, x.v, o, shape + " dropout sinks scales");
    const int threads = omp_get_max_threads();
    omp_set_num_threads(1);
    const auto one = expect_backward_matches(x.q, x.k, x.v, o, shape + " one thread");
    omp_set_num_threads(threads);
    EXPECT_EQ(max_abs_diff(one.d_mask, two.d_mask), 0.0) << shape;
  }
  const std::int64_t cu_q[] = {0, 5, 5, 37};
  const std::int64_t cu_k[] = {0, 30, 41, 70};
  const Inputs packed = make_inputs(1, 37, 70, 4, 2, 24, 24, dtype, 72);
  const Tensor mask = random_tensor(DType::f32, {1, 4, 37, 70}, 90, -2.0, 2.0);
  AttentionOptions o;
  o.cu_seqlens_q = cu_q;
  o.cu_seqlens_k = cu_k;
  o.mask = mask;
  o.mask_requires_grad = true;
  o.causal = true;
  const auto g = expect_backward_matches(packed.q, packed.k, packed.v, o, "packed");
  // Pairs of different sequences are never admitted: zero gradient.
  EXPECT_EQ(max_abs(g.d_mask.view().slice(2, 0, 5).slice(3, 30, 40)), 0.0);
}

TEST_P(FlashBackwardSweep, FullyMaskedRowsAndKeys) {
  const DType dtype = GetParam();
  const Inputs x = make_inputs(1, 40, 20, 2, 1, 16, 16, dtype, 31);
  AttentionOptions o;
  o.causal = true;  // bottom-right with Nq > Nk: the first 20 rows see nothing
  const auto g = expect_backward_matches(x.q, x.k, x.v, o, "empty rows");
  EXPECT_EQ(max_abs(g.dq.view().slice(1, 0, 20)), 0.0);
  const std::int64_t lengths[] = {12};
  AttentionOptions padded;
  padded.key_lengths = lengths;
  const auto p = expect_backward_matches(x.q, x.k, x.v, padded, "padded keys");
  EXPECT_EQ(max_abs(p.dk.view().slice(1, 12, 8)), 0.0);
  EXPECT_EQ(max_abs(p.dv.view().slice(1, 12, 8)), 0.0);
}

TEST_P(FlashBackwardSweep, StridedViews) {
  const DType dtype = GetParam();
  // [B, H, N, D] storage read through transposed views, gradients written the same way.
  const Tensor q = random_tensor(dtype, {2, 4, 33, 24}, 41);
  const Tensor k = random_tensor(dtype, {2, 2, 50, 24}, 42);
  const Tensor v = random_tensor(dtype, {2, 2, 50, 24}, 43);
  AttentionOptions o;
  o.causal = true;
  const auto contiguous =
      expect_backward_matches(q.view().transpose(1, 2), k.view().transpose(1, 2),
                              v.view().transpose(1, 2), o, "BHND views");
  o.backend = qkv::Backend::fast;
  o.return_lse = true;
  const auto fwd = qkv::attention(q.view().transpose(1, 2), k.view().transpose(1, 2),
                                  v.view().transpose(1, 2), o);
  const Tensor dout = random_tensor(dtype, {2, 33, 4, 24}, 5, -1.0, 1.0);
  Tensor dq(dtype, {2, 4, 33, 24}), dk(dtype, {2, 2, 50, 24}), dv(dtype, {2, 2, 50, 24});
  qkv::attention_backward_into(
      q.view().transpose(1, 2), k.view().transpose(1, 2), v.view().transpose(1, 2), fwd.out, dout,
      fwd.lse, {dq.view().transpose(1, 2), dk.view().transpose(1, 2), dv.view().transpose(1, 2)},
      o);
  EXPECT_EQ(max_abs_diff(dq.view().transpose(1, 2), contiguous.dq), 0.0);
  EXPECT_EQ(max_abs_diff(dk.view().transpose(1, 2), contiguous.dk), 0.0);
  EXPECT_EQ(max_abs_diff(dv.view().transpose(1, 2), contiguous.dv), 0.0);
}

// A task's query tiles beyond the per-thread budget (16 MiB) take the path
// that packs them at every step: 8 query heads on one KV head of D = 256 give
// 65 tiles of 8 positions, 263 KB each.
TEST_P(FlashBackwardSweep, QueryTilesPackedPerStep) {
  const DType dtype = GetParam();
  const Inputs x = make_inputs(1, 520, 70, 8, 1, 256, 256, dtype, 61);
  AttentionOptions o;
  o.causal = true;
  o.align = qkv::Align::top_left;
  expect_backward_matches(x.q, x.k, x.v, o, "tiles packed per step");
}

INSTANTIATE_TEST_SUITE_P(FlashBackward, FlashBackwardSweep,
                         ::testing::Values(DType::f32, DType::bf16, DType::f16),
                         [](const auto& p) { return std::string(qkv::dtype_name(p.param)); });

// Gradients are bitwise identical for any thread count, including one head
// (B * Hkv = 1), where the keys are split into chunks so that threads share
// the work.
TEST(FlashBackward, BitwiseIdenticalForAnyThreadCount) {
  for (const std::int64_t hkv : {1, 2}) {
    const Inputs x = make_inputs(1, 333, 600, 2 * hkv, hkv, 64, 64, DType::f32, 71);
    AttentionOptions o;
    o.backend = qkv::Backend::fast;
    o.causal = true;
    o.return_lse = true;
    const auto fwd = qkv::attention(x.q, x.k, x.v, o);
    const Tensor dout = random_tensor(DType::f32, {1, 333, 2 * hkv, 64}, 72);
    const int saved = omp_get_max_threads();
    std::vector<qkv::AttentionGradients> results;
    for (int threads : {1, 2, 3, 4}) {
      omp_set_num_threads(threads);
      results.push_back(qkv::attention_backward(x.q, x.k, x.v, fwd.out, dout, fwd.lse, o));
    }
    omp_set_num_threads(saved);
    auto same = [](const Tensor& a, const Tensor& b) {
      return std::memcmp(a.data<float>(), b.data<float>(),
                         sizeof(float) * static_cast<std::size_t>(a.numel())) == 0;
    };
    for (std::size_t t = 1; t < results.size(); ++t) {
      EXPECT_TRUE(same(results[0].dq, results[t].dq)) << "Hkv=" << hkv << " run " << t;
      EXPECT_TRUE(same(results[0].dk, results[t].dk)) << "Hkv=" << hkv << " run " << t;
      EXPECT_TRUE(same(results[0].dv, results[t].dv)) << "Hkv=" << hkv << " run " << t;
    }
  }
}

// Without out and lse the backward runs the forward for them: the gradients
// are bitwise those of the call given that forward's out and lse, on both
// backends.
TEST(FlashBackward, WithoutOutAndLseRunsTheForward) {
  const Inputs x = make_inputs(2, 37, 50, 4, 2, 24, 16, DType::f32, 81);
  for (const qkv::Backend backend : {qkv::Backend::fast, qkv::Backend::reference}) {
    AttentionOptions o;
    o.backend = backend;
    o.causal = true;
    o.window_left = 9;
    o.return_lse = true;
    const auto fwd = qkv::attention(x.q, x.k, x.v, o);
    const Tensor dout = random_tensor(DType::f32, {2, 37, 4, 16}, 82);
    const auto given = qkv::attention_backward(x.q, x.k, x.v, fwd.out, dout, fwd.lse, o);
    const auto recomputed = qkv::attention_backward(x.q, x.k, x.v, {}, dout, {}, o);
    EXPECT_EQ(max_abs_diff(given.dq, recomputed.dq), 0.0);
    EXPECT_EQ(max_abs_diff(given.dk, recomputed.dk), 0.0);
    EXPECT_EQ(max_abs_diff(given.dv, recomputed.dv), 0.0);
  }
}

TEST(FlashBackward, EveryHighwayTargetThisCpuRuns) {
  const Inputs x = make_inputs(2, 45, 130, 4, 2, 36, 20, DType::f32, 81);
  AttentionOptions o;
  o.causal = true;
  o.softcap = 2.0;
  std::vector<std::string> ran;
  for (const std::int64_t target : hwy::SupportedAndGeneratedTargets()) {
    hwy::SetSupportedTargetsForTest(target);
    ran.push_back(qkv::cpu::flash_target());
    expect_backward_matches(x.q, x.k, x.v, o, ran.back());
    const Inputs h = make_inputs(1, 20, 33, 4, 1, 16, 16, DType::bf16, 82);
    expect_backward_matches(h.q, h.k, h.v, o, ran.back() + " bf16");
  }
  hwy::SetSupportedTargetsForTest(0);
  EXPECT_GE(ran.size(), 2u) << "expected the native target and at least one fallback";
}

}  // namespace
