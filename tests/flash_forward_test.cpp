// The fused CPU kernels against the reference, with the tolerance policy of
// docs/numerics.md (see attention_checks.hpp).
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
#include "qkv/flex.hpp"
#include "reference/attention.hpp"
#include "sweep_sample.hpp"
#include "test_util.hpp"

namespace {

using qkv::AttentionOptions;
using qkv::ConstTensorView;
using qkv::DType;
using qkv::Tensor;
using qkv::test::expect_matches_reference;
using qkv::test::finite_diff;
using qkv::test::Inputs;
using qkv::test::kInf;
using qkv::test::make_inputs;
using qkv::test::max_abs;
using qkv::test::max_abs_diff;
using qkv::test::random_tensor;
using qkv::test::SweepSample;
using qkv::test::unit_roundoff;

struct SweepCase {
  std::int64_t nq, nk, hq, hkv, d;
};

// Sizes around tile and vector boundaries and the head dims
// docs/architecture.md lists ("Rules the tests rely on").
const SweepCase kSweep[] = {
    {1, 1, 1, 1, 1},      {1, 300, 8, 1, 64},     {17, 17, 2, 2, 8},
    {17, 97, 4, 2, 59},   {97, 17, 8, 8, 111},    {97, 97, 8, 1, 128},
    {64, 257, 2, 1, 256}, {1000, 1000, 1, 1, 64}, {1000, 33, 2, 2, 8},
};

class FlashSweep : public ::testing::TestWithParam<DType> {};

TEST_P(FlashSweep, ShapesAndMasks) {
  const DType dtype = GetParam();
  const SweepSample sample(std::size(kSweep));
  SCOPED_TRACE(sample.note());
  std::uint32_t seed = 100;
  for (std::size_t i = 0; i < std::size(kSweep); ++i) {
    const SweepCase& c = kSweep[i];
    seed += 3;
    if (!sample.runs(i)) continue;
    const Inputs x = make_inputs(1, c.nq, c.nk, c.hq, c.hkv, c.d, c.d, dtype, seed);
    const std::string shape = "Nq=" + std::to_string(c.nq) + " Nk=" + std::to_string(c.nk) +
                              " Hq=" + std::to_string(c.hq) + " Hkv=" + std::to_string(c.hkv) +
                              " D=" + std::to_string(c.d);
    expect_matches_reference(x.q, x.k, x.v, {}, shape + " full");
    AttentionOptions causal;
    causal.causal = true;
    expect_matches_reference(x.q, x.k, x.v, causal, shape + " causal bottom-right");
    causal.align = qkv::Align::top_left;
    expect_matches_reference(x.q, x.k, x.v, causal, shape + " causal top-left");
    AttentionOptions window;
    window.window_left = 5;
    window.window_right = 3;
    expect_matches_reference(x.q, x.k, x.v, window, shape + " window");
  }
}

TEST_P(FlashSweep, EveryFeatureAloneAndCombined) {
  const DType dtype = GetParam();
  const std::int64_t b = 2, nq = 70, nk = 300, hq = 4, hkv = 2, d = 40;
  const Inputs x = make_inputs(b, nq, nk, hq, hkv, d, 24, dtype, 7);
  const std::vector<float> slopes = qkv::alibi_slopes(hq);
  const Tensor table = random_tensor(DType::f32, {hq, 32}, 8, -1.0, 1.0);
  const Tensor table_in = qkv::to_dtype(table, dtype);
  Tensor bool_mask(DType::boolean, {b, 1, nq, nk});
  Tensor float_mask(DType::f32, {nq, nk});
  for (std::int64_t i = 0; i < nq; ++i)
    for (std::int64_t j = 0; j < nk; ++j) {
      for (std::int64_t bb = 0; bb < b; ++bb)
        bool_mask.set({bb, 0, i, j}, (i + 3 * j + bb) % 7 != 0);
      float_mask.set({i, j}, j % 11 == 0 ? -kInf : 0.25 * std::sin(double(i * j)));
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
  add("relative bias", [&](auto& o) { o.relative_bias = {table_in, 64, true}; });
  add("causal relative bias", [&](auto& o) {
    o.relative_bias = {table_in, 64, false};
    o.causal = true;
  });
  add("softcap", [](auto& o) { o.softcap = 1.5; });
  add("score_mod", [](auto& o) {
    o.score_mod = [](double s, std::int64_t bb, std::int64_t h, std::int64_t i, std::int64_t j) {
      return s + 0.01 * double((bb + h + i - j) % 5);
    };
  });
  add("mask_mod", [](auto& o) {
    o.mask_mod = [](std::int64_t, std::int64_t h, std::int64_t i, std::int64_t j) {
      return (i / 16 + h) % 3 != (j / 32) % 3;
    };
  });
  add("dropout", [](auto& o) {
    o.dropout_p = 0.25;
    o.dropout_seed = 99;
    o.dropout_offset = 3;
  });
  add("everything", [&](auto& o) {
    o.causal = true;
    o.dropout_p = 0.1;
    o.window_left = 100;
    o.key_lengths = lengths;
    o.mask = bool_mask;
    o.alibi_slopes = slopes;
    o.softcap = 5.0;
    o.mask_mod = [](std::int64_t, std::int64_t, std::int64_t i, std::int64_t j) {
      return (i + j) % 13 != 0;
    };
  });
  add("window and float mask", [&](auto& o) {
    o.window_left = 40;
    o.window_right = 40;
    o.mask = float_mask;
    o.relative_bias = {table_in, 64, true};
  });
  const SweepSample sample(cases.size());
  SCOPED_TRACE(sample.note());
  for (std::size_t i = 0; i < cases.size(); ++i) {
    if (sample.runs(i)) expect_matches_reference(x.q, x.k, x.v, cases[i].second, cases[i].first);
  }
}

TEST_P(FlashSweep, PackedSequences) {
  const DType dtype = GetParam();
  const std::int64_t cu_q[] = {0, 5, 5, 150, 151};
  const std::int64_t cu_k[] = {0, 300, 301, 420, 420};
  const Inputs x = make_inputs(1, 151, 420, 6, 3, 32, 32, dtype, 11);
  AttentionOptions o;
  o.cu_seqlens_q = cu_q;
  o.cu_seqlens_k = cu_k;
  expect_matches_reference(x.q, x.k, x.v, o, "varlen");
  o.causal = true;
  expect_matches_reference(x.q, x.k, x.v, o, "varlen causal");
  const std::int64_t lengths[] = {250, 0, 100, 0};
  o.key_lengths = lengths;
  expect_matches_reference(x.q, x.k, x.v, o, "varlen causal key lengths");
  // Explicit masks are indexed by packed rows and columns; mask_mod by
  // positions inside each sequence.
  Tensor mask(DType::boolean, {1, 1, 151, 420});
  for (std::int64_t i = 0; i < 151; ++i)
    for (std::int64_t j = 0; j < 420; ++j) mask.set({0, 0, i, j}, (i * 7 + j) % 5 != 0 && j < 380);
  AttentionOptions masked;
  masked.cu_seqlens_q = cu_q;
  masked.cu_seqlens_k = cu_k;
  masked.mask = mask;
  masked.mask_mod = [](std::int64_t b, std::int64_t, std::int64_t i, std::int64_t j) {
    return b != 2 || j <= i + 40;
  };
  expect_matches_reference(x.q, x.k, x.v, masked, "varlen bool mask and mask_mod");
}

// Keys beyond the per-thread budget of a task's packed K/V (16 MiB) take
// the path that packs each block for each unit.
TEST_P(FlashSweep, LongKeysPackedPerBlock) {
  const DType dtype = GetParam();
  const Inputs x = make_inputs(1, 5, 17000, 2, 1, 128, 128, dtype, 91);
  AttentionOptions o;
  expect_matches_reference(x.q, x.k, x.v, o, "long keys");
  o.window_left = 3000;
  o.causal = true;
  expect_matches_reference(x.q, x.k, x.v, o, "long keys, window");
  const Tensor w_q = qkv::to_dtype(random_tensor(DType::f32, {7, 128}, 92, -0.2, 0.2), dtype);
  const Tensor w_k = qkv::to_dtype(random_tensor(DType::f32, {7, 128}, 93, -0.2, 0.2), dtype);
  const Tensor v_a = qkv::to_dtype(random_tensor(DType::f32, {7}, 94), dtype);
  AttentionOptions additive;
  additive.score = qkv::Score::additive;
  additive.additive = {w_q, w_k, v_a, {}};
  const Inputs small_v = make_inputs(1, 3, 17000, 1, 1, 128, 8, dtype, 95);
  expect_matches_reference(small_v.q, small_v.k, small_v.v, additive, "long keys, additive");
}

TEST_P(FlashSweep, AdditiveScore) {
  const DType dtype = GetParam();
  const Inputs x = make_inputs(2, 9, 40, 2, 1, 12, 10, dtype, 21);
  const Tensor w_q = qkv::to_dtype(random_tensor(DType::f32, {19, 12}, 22, -0.5, 0.5), dtype);
  const Tensor w_k = qkv::to_dtype(random_tensor(DType::f32, {19, 12}, 23, -0.5, 0.5), dtype);
  const Tensor v_a = qkv::to_dtype(random_tensor(DType::f32, {19}, 24), dtype);
  const Tensor bias = qkv::to_dtype(random_tensor(DType::f32, {19}, 25), dtype);
  AttentionOptions o;
  o.score = qkv::Score::additive;
  o.additive = {w_q, w_k, v_a, bias};
  expect_matches_reference(x.q, x.k, x.v, o, "additive");
  o.causal = true;
  expect_matches_reference(x.q, x.k, x.v, o, "additive causal");
}

TEST_P(FlashSweep, FullyMaskedRows) {
  const DType dtype = GetParam();
  const Inputs x = make_inputs(1, 40, 20, 2, 1, 16, 16, dtype, 31);
  AttentionOptions o;
  o.causal = true;  // bottom-right with Nq > Nk: the first 20 rows see nothing
  const auto r = expect_matches_reference(x.q, x.k, x.v, o, "empty rows");
  EXPECT_EQ(max_abs(r.out.view().slice(1, 0, 20)), 0.0);
  EXPECT_EQ(r.lse.get({0, 1, 19}), -kInf);
  EXPECT_FALSE(qkv::test::has_non_finite(r.out));
}

TEST_P(FlashSweep, StridedViews) {
  const DType dtype = GetParam();
  // [B, H, N, D] storage read through transposed views; output written the same way.
  const Tensor q = random_tensor(dtype, {2, 4, 33, 24}, 41);
  const Tensor k = random_tensor(dtype, {2, 2, 50, 24}, 42);
  const Tensor v = random_tensor(dtype, {2, 2, 50, 24}, 43);
  AttentionOptions o;
  o.causal = true;
  expect_matches_reference(q.view().transpose(1, 2), k.view().transpose(1, 2),
                           v.view().transpose(1, 2), o, "BHND views");
  Tensor out(dtype, {2, 4, 33, 24});
  o.backend = qkv::Backend::fast;
  qkv::attention_into(q.view().transpose(1, 2), k.view().transpose(1, 2), v.view().transpose(1, 2),
                      {out.view().transpose(1, 2)}, o);
  const auto contiguous = qkv::attention(qkv::to_dtype(q.view().transpose(1, 2), dtype),
                                         qkv::to_dtype(k.view().transpose(1, 2), dtype),
                                         qkv::to_dtype(v.view().transpose(1, 2), dtype), o);
  EXPECT_EQ(max_abs_diff(out.view().transpose(1, 2), contiguous.out), 0.0);
  // A head dim with a stride (every other element).
  const Tensor wide = random_tensor(dtype, {1, 20, 2, 32}, 44);
  const ConstTensorView every_other(wide.view().data(), dtype, {1, 20, 2, 16}, {1280, 64, 32, 2});
  expect_matches_reference(every_other, every_other, every_other, {}, "strided head dim");
}

TEST_P(FlashSweep, ProbabilitiesMatchReference) {
  const DType dtype = GetParam();
  const Inputs x = make_inputs(1, 50, 700, 2, 1, 32, 32, dtype, 51);
  AttentionOptions o;
  o.causal = true;
  o.window_left = 300;
  o.return_probs = true;
  o.backend = qkv::Backend::fast;
  const auto fast = qkv::attention(x.q, x.k, x.v, o);
  o.backend = qkv::Backend::reference;
  const auto ref = qkv::attention(qkv::to_dtype(x.q, DType::f64), qkv::to_dtype(x.k, DType::f64),
                                  qkv::to_dtype(x.v, DType::f64), o);
  // Weights are exp(s - lse) in f32: each within a few f32 ulps of the score
  // error (|s| <= 1.5^2 * 32 / sqrt(32) ~ 13) times the weight.
  const double tolerance = 64 * unit_roundoff(DType::f32) * 13.0;
  EXPECT_LE(max_abs_diff(fast.probs, ref.probs), tolerance);
  // Dropped keys are exactly zero.
  for (std::int64_t i = 0; i < 50; ++i) {
    EXPECT_EQ(fast.probs.get({0, 0, i, 0}), i + 650 - 300 > 0 ? 0.0 : fast.probs.get({0, 0, i, 0}));
    EXPECT_EQ(fast.probs.get({0, 1, i, 699}), i == 49 ? fast.probs.get({0, 1, i, 699}) : 0.0);
  }
}

INSTANTIATE_TEST_SUITE_P(Flash, FlashSweep, ::testing::Values(DType::f32, DType::bf16, DType::f16),
                         [](const auto& p) { return std::string(qkv::dtype_name(p.param)); });

TEST(Flash, FlexCallablesMatchStdFunctionOptions) {
  const Inputs x = make_inputs(1, 100, 260, 4, 1, 32, 32, DType::f32, 61);
  auto score_mod = [](float s, std::int64_t, std::int64_t h, std::int64_t i, std::int64_t j) {
    return s - 0.05f * float(h) * float(std::abs(i - j) % 7);
  };
  auto mask_mod = [](std::int64_t, std::int64_t, std::int64_t i, std::int64_t j) {
    return j / 64 <= i / 25;  // block-causal: whole 64-key blocks skipped
  };
  AttentionOptions fast;
  fast.backend = qkv::Backend::fast;
  const auto flex = qkv::flex_attention(x.q, x.k, x.v, score_mod, mask_mod, fast);
  AttentionOptions with_functions = fast;
  with_functions.score_mod = [&](double s, std::int64_t b, std::int64_t h, std::int64_t i,
                                 std::int64_t j) {
    return double(score_mod(float(s), b, h, i, j));
  };
  with_functions.mask_mod = mask_mod;
  EXPECT_EQ(max_abs_diff(flex.out, qkv::attention(x.q, x.k, x.v, with_functions).out), 0.0);
  expect_matches_reference(x.q, x.k, x.v, with_functions, "flex callables");
  // The reference backend runs the same callables.
  AttentionOptions ref;
  ref.backend = qkv::Backend::reference;
  const auto flex_ref = qkv::flex_attention(x.q, x.k, x.v, score_mod, mask_mod, ref);
  EXPECT_LT(max_abs_diff(flex.out, flex_ref.out), 1e-5);
  AttentionOptions both = fast;
  both.mask_mod = mask_mod;
  EXPECT_THROW(qkv::flex_attention(x.q, x.k, x.v, qkv::no_score_mod, mask_mod, both), qkv::Error);
}

TEST(Flash, BitwiseIdenticalForAnyThreadCount) {
  const Inputs x = make_inputs(1, 333, 600, 8, 2, 64, 64, DType::f32, 71);
  AttentionOptions o;
  o.backend = qkv::Backend::fast;
  o.causal = true;
  o.return_lse = true;
  const int saved = omp_get_max_threads();
  std::vector<qkv::AttentionResult> results;
  for (int threads : {1, 2, 3, 4}) {
    omp_set_num_threads(threads);
    results.push_back(qkv::attention(x.q, x.k, x.v, o));
  }
  omp_set_num_threads(saved);
  for (std::size_t t = 1; t < results.size(); ++t) {
    EXPECT_EQ(std::memcmp(results[0].out.data<float>(), results[t].out.data<float>(),
                          sizeof(float) * static_cast<std::size_t>(results[0].out.numel())),
              0);
    EXPECT_EQ(std::memcmp(results[0].lse.data<float>(), results[t].lse.data<float>(),
                          sizeof(float) * static_cast<std::size_t>(results[0].lse.numel())),
              0);
  }
}

// A unit's scratch is sized from the largest unit and key range of the
// call, so a short sequence runs in a small tile alone and in a large one
// beside a long sequence: its rows must come out the same to the bit.
TEST(Flash, ScratchSizeChangesNoBit) {
  constexpr std::int64_t kShort = 5, kLong = 700;
  const Inputs x = make_inputs(1, kShort + kLong, kShort + kLong, 6, 2, 40, 24, DType::f32, 73);
  const std::int64_t cu[] = {0, kShort, kShort + kLong};
  AttentionOptions o;
  o.backend = qkv::Backend::fast;
  o.causal = true;
  o.return_lse = true;
  AttentionOptions packed = o;
  packed.cu_seqlens_q = cu;
  packed.cu_seqlens_k = cu;
  const auto both = qkv::attention(x.q, x.k, x.v, packed);
  const ConstTensorView q = x.q.view().slice(1, 0, kShort), k = x.k.view().slice(1, 0, kShort),
                        v = x.v.view().slice(1, 0, kShort);
  const auto alone = qkv::attention(q, k, v, o);
  const Tensor dout = random_tensor(DType::f32, {1, kShort + kLong, 6, 24}, 74);
  const auto grads_both = qkv::attention_backward(x.q, x.k, x.v, both.out, dout, both.lse, packed);
  const auto grads_alone =
      qkv::attention_backward(q, k, v, alone.out, dout.view().slice(1, 0, kShort), alone.lse, o);
  // Rows [0, kShort) of dimension `dim` of a (packed) result against `alone`.
  auto same_rows = [](const Tensor& packed_result, const Tensor& single, int dim) {
    const ConstTensorView p = packed_result.view().slice(dim, 0, kShort), s = single.view();
    for (std::int64_t a = 0; a < s.size(0); ++a)
      for (std::int64_t b = 0; b < s.size(1); ++b)
        for (std::int64_t c = 0; c < s.size(2); ++c)
          for (std::int64_t d = 0; d < (s.rank() > 3 ? s.size(3) : 1); ++d) {
            const bool equal = s.rank() > 3 ? p.get({a, b, c, d}) == s.get({a, b, c, d})
                                            : p.get({a, b, c}) == s.get({a, b, c});
            if (!equal) return false;
          }
    return true;
  };
  EXPECT_TRUE(same_rows(both.out, alone.out, 1));
  EXPECT_TRUE(same_rows(both.lse, alone.lse, 2));
  EXPECT_TRUE(same_rows(grads_both.dq, grads_alone.dq, 1));
  EXPECT_TRUE(same_rows(grads_both.dk, grads_alone.dk, 1));
  EXPECT_TRUE(same_rows(grads_both.dv, grads_alone.dv, 1));
}

TEST(Flash, EveryHighwayTargetThisCpuRuns) {
  const Inputs x = make_inputs(2, 45, 130, 4, 2, 36, 20, DType::f32, 81);
  AttentionOptions o;
  o.causal = true;
  const std::vector<float> slopes = qkv::alibi_slopes(4);  // outlives the options' span
  o.alibi_slopes = slopes;
  std::vector<std::string> ran;
  for (const std::int64_t target : hwy::SupportedAndGeneratedTargets()) {
    hwy::SetSupportedTargetsForTest(target);
    ran.push_back(qkv::cpu::flash_target());
    EXPECT_EQ(ran.back(), hwy::TargetName(target));
    expect_matches_reference(x.q, x.k, x.v, o, ran.back());
    const Inputs h = make_inputs(1, 20, 33, 4, 1, 16, 16, DType::f16, 82);
    expect_matches_reference(h.q, h.k, h.v, o, ran.back() + " f16");
  }
  hwy::SetSupportedTargetsForTest(0);
  EXPECT_GE(ran.size(), 2u) << "expected the native target and at least one fallback";
}

// One unit per head (a short sequence, a decoding step): keys and values
// read in place when they are f32 rows with unit stride and whole value
// panels, queries transposed into their panels a vector of rows at a time.
// On every target, rows (Hq / Hkv x Nq) and head dims around the vector
// widths (4, 8, 16 floats), f32 and bf16 (staged), and K and V as
// [B, H, N, D] tensors viewed as [B, N, H, D].
TEST(Flash, SmallProblemsOnEveryTarget) {
  struct Case {
    std::int64_t nq, nk, hq, hkv, dk, dv;
  };
  const Case cases[] = {{1, 1, 1, 1, 1, 1},     {16, 16, 8, 8, 64, 64}, {17, 33, 2, 1, 17, 32},
                        {5, 9, 4, 2, 16, 16},   {7, 64, 2, 2, 3, 8},    {16, 256, 1, 1, 64, 128},
                        {32, 16, 1, 1, 48, 64}, {3, 20, 8, 1, 33, 48}};
  AttentionOptions causal;
  causal.causal = true;
  for (const std::int64_t target : hwy::SupportedAndGeneratedTargets()) {
    hwy::SetSupportedTargetsForTest(target);
    std::uint32_t seed = 300;
    for (const Case& c : cases) {
      const std::string shape = std::string(hwy::TargetName(target)) +
                                " Nq=" + std::to_string(c.nq) + " Nk=" + std::to_string(c.nk) +
                                " Hq=" + std::to_string(c.hq) + " Hkv=" + std::to_string(c.hkv) +
                                " Dk=" + std::to_string(c.dk) + " Dv=" + std::to_string(c.dv);
      for (const DType dtype : {DType::f32, DType::bf16}) {
        const Inputs x = make_inputs(1, c.nq, c.nk, c.hq, c.hkv, c.dk, c.dv, dtype, seed += 3);
        const std::string label = shape + (dtype == DType::f32 ? " f32" : " bf16");
        expect_matches_reference(x.q, x.k, x.v, {}, label);
        expect_matches_reference(x.q, x.k, x.v, causal, label + " causal");
      }
      const Tensor k = random_tensor(DType::f32, {1, c.hkv, c.nk, c.dk}, seed += 3, -1.5, 1.5);
      const Tensor v = random_tensor(DType::f32, {1, c.hkv, c.nk, c.dv}, seed += 3);
      const Inputs x = make_inputs(1, c.nq, c.nk, c.hq, c.hkv, c.dk, c.dv, DType::f32, seed += 3);
      expect_matches_reference(x.q, k.view().transpose(1, 2), v.view().transpose(1, 2), {},
                               shape + " K, V transposed");
    }
  }
  hwy::SetSupportedTargetsForTest(0);
}

}  // namespace
