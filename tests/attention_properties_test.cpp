// Properties of the math that every attention must satisfy, checked on the
// reference backend (the specification) with random data. Inputs are f64 so differences measure
// the semantics, not rounding: the bounds are a few ulps of double, and
// "exact" comparisons are used where both sides do the same operations.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "test_util.hpp"

namespace {

using qkv::ConstTensorView;
using qkv::DType;
using qkv::Tensor;
using qkv::test::max_abs_diff;
using qkv::test::random_tensor;

constexpr double kInf = std::numeric_limits<double>::infinity();

struct Qkv {
  Tensor q, k, v;
};

// q [B, Nq, Hq, D], k and v [B, Nk, Hkv, D] (v's last dim Dv).
Qkv random_qkv(std::int64_t b, std::int64_t nq, std::int64_t nk, std::int64_t hq, std::int64_t hkv,
               std::int64_t d, std::int64_t dv, std::uint32_t seed, DType dtype = DType::f64) {
  return {random_tensor(dtype, {b, nq, hq, d}, seed),
          random_tensor(dtype, {b, nk, hkv, d}, seed + 1),
          random_tensor(dtype, {b, nk, hkv, dv}, seed + 2)};
}

qkv::AttentionResult run(const Qkv& x, qkv::AttentionOptions opt) {
  opt.backend = qkv::Backend::reference;  // these tests state the specification
  opt.return_lse = true;
  opt.return_probs = true;
  return qkv::attention(x.q, x.k, x.v, opt);
}

// Expects probs[b, h, i, j] != 0 exactly when admitted(b, h, i, j).
template <class Admitted>
void expect_pattern(const Tensor& probs, Admitted admitted) {
  for (std::int64_t b = 0; b < probs.size(0); ++b)
    for (std::int64_t h = 0; h < probs.size(1); ++h)
      for (std::int64_t i = 0; i < probs.size(2); ++i)
        for (std::int64_t j = 0; j < probs.size(3); ++j)
          EXPECT_EQ(probs.get({b, h, i, j}) != 0.0, admitted(b, h, i, j))
              << "b=" << b << " h=" << h << " i=" << i << " j=" << j;
}

TEST(AttentionProperties, WeightsSumToOne) {
  const Qkv x = random_qkv(2, 9, 11, 4, 2, 16, 16, 1);
  const auto r = run(x, {});
  for (std::int64_t b = 0; b < 2; ++b)
    for (std::int64_t h = 0; h < 4; ++h)
      for (std::int64_t i = 0; i < 9; ++i) {
        double sum = 0;
        for (std::int64_t j = 0; j < 11; ++j) sum += r.probs.get({b, h, i, j});
        EXPECT_NEAR(sum, 1.0, 1e-14);
      }
}

TEST(AttentionProperties, OutputIsWeightsTimesValues) {
  const Qkv x = random_qkv(1, 5, 7, 2, 1, 8, 3, 2);
  const auto r = run(x, {});
  for (std::int64_t h = 0; h < 2; ++h)
    for (std::int64_t i = 0; i < 5; ++i)
      for (std::int64_t c = 0; c < 3; ++c) {
        double acc = 0;
        for (std::int64_t j = 0; j < 7; ++j)
          acc += r.probs.get({0, h, i, j}) * x.v.get({0, j, 0, c});
        EXPECT_NEAR(r.out.get({0, i, h, c}), acc, 1e-14);
      }
}

TEST(AttentionProperties, PermutingKeysWithValuesChangesNothing) {
  const Qkv x = random_qkv(2, 6, 9, 2, 2, 8, 5, 3);
  const std::vector<std::int64_t> perm = {4, 0, 8, 2, 7, 1, 6, 3, 5};
  Qkv y = x;
  for (std::int64_t b = 0; b < 2; ++b)
    for (std::int64_t j = 0; j < 9; ++j)
      for (std::int64_t h = 0; h < 2; ++h) {
        for (std::int64_t c = 0; c < 8; ++c) y.k.set({b, j, h, c}, x.k.get({b, perm[j], h, c}));
        for (std::int64_t c = 0; c < 5; ++c) y.v.set({b, j, h, c}, x.v.get({b, perm[j], h, c}));
      }
  EXPECT_LT(max_abs_diff(qkv::attention(x.q, x.k, x.v).out, qkv::attention(y.q, y.k, y.v).out),
            1e-14);
}

TEST(AttentionProperties, GqaEqualsMhaOnRepeatedKv) {
  for (std::int64_t hkv : {1, 2, 8}) {
    const Qkv x = random_qkv(2, 5, 6, 8, hkv, 4, 3, 4);
    Qkv rep{x.q, Tensor(DType::f64, {2, 6, 8, 4}), Tensor(DType::f64, {2, 6, 8, 3})};
    for (std::int64_t b = 0; b < 2; ++b)
      for (std::int64_t j = 0; j < 6; ++j)
        for (std::int64_t h = 0; h < 8; ++h) {
          const std::int64_t g = h / (8 / hkv);
          for (std::int64_t c = 0; c < 4; ++c) rep.k.set({b, j, h, c}, x.k.get({b, j, g, c}));
          for (std::int64_t c = 0; c < 3; ++c) rep.v.set({b, j, h, c}, x.v.get({b, j, g, c}));
        }
    EXPECT_EQ(
        max_abs_diff(qkv::attention(x.q, x.k, x.v).out, qkv::attention(rep.q, rep.k, rep.v).out),
        0.0)
        << "Hkv = " << hkv;
  }
}

TEST(AttentionProperties, CausalRowIgnoresLaterKeys) {
  const Qkv x = random_qkv(1, 8, 8, 2, 1, 4, 4, 5);
  qkv::AttentionOptions opt;
  opt.causal = true;
  const auto r = run(x, opt);
  expect_pattern(r.probs, [](auto, auto, auto i, auto j) { return j <= i; });
  // Changing keys and values after row 3 leaves rows 0..3 bit-identical.
  Qkv y = x;
  for (std::int64_t j = 4; j < 8; ++j)
    for (std::int64_t c = 0; c < 4; ++c) {
      y.k.set({0, j, 0, c}, 100.0);
      y.v.set({0, j, 0, c}, -100.0);
    }
  const auto ry = run(y, opt);
  EXPECT_EQ(max_abs_diff(r.out.view().slice(1, 0, 4), ry.out.view().slice(1, 0, 4)), 0.0);
  EXPECT_GT(max_abs_diff(r.out.view().slice(1, 4, 4), ry.out.view().slice(1, 4, 4)), 0.1);
}

TEST(AttentionProperties, CausalAlignments) {
  const Qkv x = random_qkv(1, 3, 5, 1, 1, 4, 4, 6);
  qkv::AttentionOptions opt;
  opt.causal = true;
  opt.align = qkv::Align::bottom_right;  // row i sees keys j <= i + (5 - 3)
  expect_pattern(run(x, opt).probs, [](auto, auto, auto i, auto j) { return j <= i + 2; });
  opt.align = qkv::Align::top_left;  // row i sees keys j <= i
  expect_pattern(run(x, opt).probs, [](auto, auto, auto i, auto j) { return j <= i; });
  // More queries than keys, bottom-right: the first rows see nothing.
  const Qkv y = random_qkv(1, 5, 3, 1, 1, 4, 4, 7);
  opt.align = qkv::Align::bottom_right;
  const auto r = run(y, opt);
  expect_pattern(r.probs, [](auto, auto, auto i, auto j) { return j <= i - 2; });
  EXPECT_EQ(r.lse.get({0, 0, 0}), -kInf);
  EXPECT_EQ(r.out.get({0, 1, 0, 2}), 0.0);
}

TEST(AttentionProperties, SlidingWindow) {
  const Qkv x = random_qkv(1, 10, 10, 1, 1, 4, 4, 8);
  qkv::AttentionOptions opt;
  opt.window_left = 2;
  opt.window_right = 1;
  expect_pattern(run(x, opt).probs,
                 [](auto, auto, auto i, auto j) { return j >= i - 2 && j <= i + 1; });
  opt.window_right = -1;  // unbounded to the right
  expect_pattern(run(x, opt).probs, [](auto, auto, auto i, auto j) { return j >= i - 2; });
  opt.window_left = 0;  // (0, 0): each row sees only its diagonal key
  opt.window_right = 0;
  expect_pattern(run(x, opt).probs, [](auto, auto, auto i, auto j) { return j == i; });
  opt.window_left = 2;  // with causal: the local causal window of Mistral
  opt.causal = true;
  expect_pattern(run(x, opt).probs,
                 [](auto, auto, auto i, auto j) { return j >= i - 2 && j <= i; });
}

TEST(AttentionProperties, PaddedKeysChangeNothing) {
  const Qkv x = random_qkv(2, 4, 6, 2, 1, 4, 3, 9);
  Qkv padded = x;
  // Garbage in the padding of sequence 1 (valid length 3) must not leak.
  for (std::int64_t j = 3; j < 6; ++j)
    for (std::int64_t c = 0; c < 3; ++c) {
      padded.k.set({1, j, 0, c}, 1e30);
      padded.v.set({1, j, 0, c}, std::nan(""));
    }
  const std::int64_t lengths[] = {6, 3};
  for (bool causal : {false, true}) {
    qkv::AttentionOptions opt;
    opt.key_lengths = lengths;
    opt.causal = causal;  // bottom-right aligned to the valid length
    const auto r = run(padded, opt);
    // Sequence 1 alone, truncated to its 3 keys.
    const Qkv alone{to_dtype(x.q.view().slice(0, 1, 1), DType::f64),
                    to_dtype(x.k.view().slice(0, 1, 1).slice(1, 0, 3), DType::f64),
                    to_dtype(x.v.view().slice(0, 1, 1).slice(1, 0, 3), DType::f64)};
    qkv::AttentionOptions alone_opt;
    alone_opt.causal = causal;
    EXPECT_EQ(max_abs_diff(r.out.view().slice(0, 1, 1), run(alone, alone_opt).out), 0.0);
    for (std::int64_t j = 3; j < 6; ++j) EXPECT_EQ(r.probs.get({1, 1, 2, j}), 0.0);
  }
}

TEST(AttentionProperties, PackedSequencesEqualSeparateCalls) {
  // Three sequences (3, 0 and 5 queries; 4, 2 and 6 keys) packed back to back.
  const std::int64_t cu_q[] = {0, 3, 3, 8};
  const std::int64_t cu_k[] = {0, 4, 6, 12};
  const Qkv x = random_qkv(1, 8, 12, 4, 2, 8, 5, 10);
  for (bool causal : {false, true}) {
    qkv::AttentionOptions opt;
    opt.cu_seqlens_q = cu_q;
    opt.cu_seqlens_k = cu_k;
    opt.causal = causal;
    opt.window_left = 3;
    const auto r = run(x, opt);
    for (int s = 0; s < 3; ++s) {
      const std::int64_t nq = cu_q[s + 1] - cu_q[s];
      const std::int64_t nk = cu_k[s + 1] - cu_k[s];
      const Qkv one{to_dtype(x.q.view().slice(1, cu_q[s], nq), DType::f64),
                    to_dtype(x.k.view().slice(1, cu_k[s], nk), DType::f64),
                    to_dtype(x.v.view().slice(1, cu_k[s], nk), DType::f64)};
      qkv::AttentionOptions one_opt;
      one_opt.causal = causal;
      one_opt.window_left = 3;
      const auto ro = run(one, one_opt);
      EXPECT_EQ(max_abs_diff(r.out.view().slice(1, cu_q[s], nq), ro.out), 0.0) << s;
      EXPECT_EQ(max_abs_diff(r.lse.view().slice(2, cu_q[s], nq), ro.lse), 0.0) << s;
      EXPECT_EQ(max_abs_diff(r.probs.view().slice(2, cu_q[s], nq).slice(3, cu_k[s], nk), ro.probs),
                0.0)
          << s;
    }
    // Weights across sequences are zero (block-diagonal).
    for (int s = 0; s < 3; ++s)
      for (int t = 0; t < 3; ++t) {
        if (s == t || cu_q[s] == cu_q[s + 1] || cu_k[t] == cu_k[t + 1]) continue;
        const auto block = r.probs.view()
                               .slice(2, cu_q[s], cu_q[s + 1] - cu_q[s])
                               .slice(3, cu_k[t], cu_k[t + 1] - cu_k[t]);
        EXPECT_EQ(qkv::test::max_abs(block), 0.0) << s << ", " << t;
      }
  }
}

TEST(AttentionProperties, BoolMaskEqualsAdditiveMaskAndBroadcasts) {
  const Qkv x = random_qkv(2, 5, 6, 2, 2, 4, 4, 11);
  Tensor bool_mask(DType::boolean, {5, 6});
  Tensor float_mask(DType::f64, {5, 6});
  Tensor full_mask(DType::boolean, {2, 2, 5, 6});
  for (std::int64_t i = 0; i < 5; ++i)
    for (std::int64_t j = 0; j < 6; ++j) {
      const bool keep = (i * 7 + j * 3) % 4 != 0;
      bool_mask.set({i, j}, keep);
      float_mask.set({i, j}, keep ? 0.0 : -kInf);
      for (std::int64_t b = 0; b < 2; ++b)
        for (std::int64_t h = 0; h < 2; ++h) full_mask.set({b, h, i, j}, keep);
    }
  qkv::AttentionOptions a, b, c, d;
  a.mask = bool_mask;
  b.mask = float_mask;
  c.mask = full_mask;
  // A [1, 1, 5, 6] mask given with stride-0 batch and head dimensions.
  d.mask = ConstTensorView(bool_mask.view().data(), DType::boolean, {2, 2, 5, 6}, {0, 0, 6, 1});
  const auto ra = run(x, a);
  EXPECT_EQ(max_abs_diff(ra.out, run(x, b).out), 0.0);
  EXPECT_EQ(max_abs_diff(ra.out, run(x, c).out), 0.0);
  EXPECT_EQ(max_abs_diff(ra.out, run(x, d).out), 0.0);
  expect_pattern(ra.probs, [&](auto, auto, auto i, auto j) { return bool_mask.get({i, j}) != 0; });
}

TEST(AttentionProperties, KeyPaddingMaskEqualsKeyLengths) {
  const Qkv x = random_qkv(2, 3, 5, 2, 1, 4, 4, 12);
  Tensor mask(DType::boolean, {2, 1, 1, 5});  // [B, 1, 1, Nk], as PyTorch users build it
  const std::int64_t lengths[] = {5, 2};
  for (std::int64_t b = 0; b < 2; ++b)
    for (std::int64_t j = 0; j < 5; ++j) mask.set({b, 0, 0, j}, j < lengths[b]);
  qkv::AttentionOptions by_mask, by_length;
  by_mask.mask = mask;
  by_length.key_lengths = lengths;
  EXPECT_EQ(max_abs_diff(run(x, by_mask).out, run(x, by_length).out), 0.0);
}

TEST(AttentionProperties, AlibiEqualsItsAdditiveMask) {
  const Qkv x = random_qkv(2, 4, 6, 4, 2, 8, 8, 13);
  const std::vector<float> slopes = qkv::alibi_slopes(4);
  for (auto align : {qkv::Align::bottom_right, qkv::Align::top_left}) {
    Tensor bias(DType::f64, {1, 4, 4, 6});
    const std::int64_t offset = align == qkv::Align::bottom_right ? 2 : 0;
    for (std::int64_t h = 0; h < 4; ++h)
      for (std::int64_t i = 0; i < 4; ++i)
        for (std::int64_t j = 0; j < 6; ++j)
          bias.set({0, h, i, j}, -double(slopes[h]) * double(std::llabs(i + offset - j)));
    qkv::AttentionOptions with_alibi, with_mask;
    with_alibi.alibi_slopes = slopes;
    with_alibi.align = with_mask.align = align;
    with_mask.mask = bias;
    EXPECT_LT(max_abs_diff(run(x, with_alibi).out, run(x, with_mask).out), 1e-15);
  }
  // Per-batch slopes [B * Hq]: batch 1 uses different slopes than batch 0.
  std::vector<float> per_batch(slopes);
  for (float s : slopes) per_batch.push_back(2 * s);
  qkv::AttentionOptions pb, doubled;
  pb.alibi_slopes = per_batch;
  std::vector<float> twice;
  for (float s : slopes) twice.push_back(2 * s);
  doubled.alibi_slopes = twice;
  const auto r_pb = run(x, pb);
  const auto r_2 = run(x, doubled);
  EXPECT_EQ(max_abs_diff(r_pb.out.view().slice(0, 1, 1), r_2.out.view().slice(0, 1, 1)), 0.0);
  EXPECT_EQ(max_abs_diff(r_pb.out.view().slice(0, 0, 1), run(x,
                                                             [&] {
                                                               qkv::AttentionOptions o;
                                                               o.alibi_slopes = slopes;
                                                               return o;
                                                             }())
                                                             .out.view()
                                                             .slice(0, 0, 1)),
            0.0);
}

TEST(AttentionProperties, RelativeBiasEqualsItsAdditiveMask) {
  const Qkv x = random_qkv(1, 5, 9, 2, 1, 4, 4, 14);
  const Tensor table = random_tensor(DType::f64, {2, 8}, 15, -2.0, 2.0);
  for (bool bidirectional : {true, false}) {
    qkv::AttentionOptions with_bias, with_mask;
    with_bias.relative_bias = {table, 6, bidirectional};
    Tensor bias(DType::f64, {2, 5, 9});
    for (std::int64_t h = 0; h < 2; ++h)
      for (std::int64_t i = 0; i < 5; ++i)
        for (std::int64_t j = 0; j < 9; ++j) {
          const std::int64_t bucket = qkv::t5_relative_bucket(j - (i + 4), 8, 6, bidirectional);
          bias.set({h, i, j}, table.get({h, bucket}));
        }
    with_mask.mask = bias;
    EXPECT_LT(max_abs_diff(run(x, with_bias).out, run(x, with_mask).out), 1e-15);
  }
}

TEST(AttentionProperties, SoftcapEqualsItsScoreMod) {
  const Qkv x = random_qkv(1, 4, 5, 1, 1, 8, 8, 16, DType::f64);
  Qkv big = x;  // large logits make the cap matter
  for (std::int64_t i = 0; i < 4; ++i)
    for (std::int64_t c = 0; c < 8; ++c) big.q.set({0, i, 0, c}, 20 * x.q.get({0, i, 0, c}));
  qkv::AttentionOptions capped, modded;
  capped.softcap = 2.0;
  modded.score_mod = [](double s, auto, auto, auto, auto) { return 2.0 * std::tanh(s / 2.0); };
  const auto rc = run(big, capped);
  EXPECT_EQ(max_abs_diff(rc.out, run(big, modded).out), 0.0);
  // Capped scores lie in (-2, 2): no weight ratio within a row exceeds e^4.
  for (std::int64_t i = 0; i < 4; ++i)
    for (std::int64_t j = 0; j < 5; ++j)
      for (std::int64_t l = 0; l < 5; ++l)
        EXPECT_LT(rc.probs.get({0, 0, i, j}) / rc.probs.get({0, 0, i, l}), std::exp(4.0));
}

TEST(AttentionProperties, ScoreModAndMaskModSeeSequenceCoordinates) {
  const std::int64_t cu_q[] = {0, 2, 5};
  const std::int64_t cu_k[] = {0, 3, 7};
  const Qkv x = random_qkv(1, 5, 7, 2, 1, 4, 4, 17);
  qkv::AttentionOptions mods;
  mods.cu_seqlens_q = cu_q;
  mods.cu_seqlens_k = cu_k;
  mods.score_mod = [](double s, std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) {
    return s + 0.5 * double(b) - 0.25 * double(h) + 0.1 * double(i) - 0.2 * double(j);
  };
  mods.mask_mod = [](std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) {
    return (b + h + i + j) % 3 != 0;
  };
  // The same as an explicit float bias plus bool mask in packed coordinates.
  Tensor bias(DType::f64, {1, 2, 5, 7});
  Tensor keep(DType::boolean, {1, 2, 5, 7});
  for (std::int64_t s = 0; s < 2; ++s)
    for (std::int64_t h = 0; h < 2; ++h)
      for (std::int64_t i = 0; i < cu_q[s + 1] - cu_q[s]; ++i)
        for (std::int64_t j = 0; j < cu_k[s + 1] - cu_k[s]; ++j) {
          bias.set({0, h, cu_q[s] + i, cu_k[s] + j},
                   0.5 * double(s) - 0.25 * double(h) + 0.1 * double(i) - 0.2 * double(j));
          keep.set({0, h, cu_q[s] + i, cu_k[s] + j}, (s + h + i + j) % 3 != 0);
        }
  qkv::AttentionOptions masks = mods;
  masks.score_mod = nullptr;
  masks.mask_mod = nullptr;
  masks.mask = bias;
  qkv::AttentionOptions both = masks;
  both.mask = keep;
  both.score_mod = mods.score_mod;
  const auto r_mods = run(x, mods);
  EXPECT_LT(max_abs_diff(r_mods.out, run(x, both).out), 1e-15);
  EXPECT_LT(max_abs_diff(r_mods.out,
                         [&] {
                           qkv::AttentionOptions o = masks;  // float bias + mask_mod
                           o.mask_mod = mods.mask_mod;
                           return run(x, o).out;
                         }()),
            1e-15);
}

TEST(AttentionProperties, ScaleOptions) {
  const Qkv x = random_qkv(1, 3, 4, 1, 1, 9, 2, 18);
  qkv::AttentionOptions dot, unit_scale, default_scale, explicit_scale;
  dot.score = qkv::Score::dot;
  unit_scale.scale = 1.0;
  explicit_scale.scale = 1.0 / 3.0;  // 1 / sqrt(9)
  EXPECT_EQ(max_abs_diff(run(x, dot).out, run(x, unit_scale).out), 0.0);
  EXPECT_EQ(max_abs_diff(run(x, default_scale).out, run(x, explicit_scale).out), 0.0);
  EXPECT_GT(max_abs_diff(run(x, dot).out, run(x, default_scale).out), 1e-3);
}

TEST(AttentionProperties, LargeLogitsStayFinite) {
  Qkv x = random_qkv(1, 4, 6, 1, 1, 4, 4, 19, DType::f32);
  for (std::int64_t i = 0; i < 4; ++i)
    for (std::int64_t c = 0; c < 4; ++c) x.q.set({0, i, 0, c}, 1e4 * x.q.get({0, i, 0, c}));
  const auto r = run(x, {});
  EXPECT_FALSE(qkv::test::has_non_finite(r.out));
  EXPECT_FALSE(qkv::test::has_non_finite(r.lse));
  qkv::AttentionOptions dot;
  dot.score = qkv::Score::dot;
  Qkv y = x;  // scores of order 1e8 with plain dot
  for (std::int64_t j = 0; j < 6; ++j)
    for (std::int64_t c = 0; c < 4; ++c) y.k.set({0, j, 0, c}, 1e4 * x.k.get({0, j, 0, c}));
  const auto ry = run(y, dot);
  EXPECT_FALSE(qkv::test::has_non_finite(ry.out));
  EXPECT_FALSE(qkv::test::has_non_finite(ry.lse));
}

TEST(AttentionProperties, DifferentKeyAndValueDims) {
  const Qkv x = random_qkv(1, 3, 4, 2, 1, 5, 11, 20);
  const auto r = run(x, {});
  EXPECT_EQ(r.out.size(3), 11);
  EXPECT_FALSE(qkv::test::has_non_finite(r.out));
}

TEST(AttentionProperties, StridedViewsEqualContiguousCopies) {
  // [B, H, N, D] storage passed through transposed views, output written into
  // a [B, H, N, D] buffer the same way.
  const Tensor q_bhnd = random_tensor(DType::f32, {2, 4, 7, 8}, 21);
  const Tensor k_bhnd = random_tensor(DType::f32, {2, 2, 9, 8}, 22);
  const Tensor v_bhnd = random_tensor(DType::f32, {2, 2, 9, 6}, 23);
  Tensor out_bhnd(DType::f32, {2, 4, 7, 6});
  Tensor lse(DType::f32, {2, 4, 7});
  qkv::AttentionOptions opt;
  opt.backend = qkv::Backend::reference;
  opt.causal = true;
  qkv::attention_into(q_bhnd.view().transpose(1, 2), k_bhnd.view().transpose(1, 2),
                      v_bhnd.view().transpose(1, 2),
                      {out_bhnd.view().transpose(1, 2), lse.view(), {}}, opt);
  opt.return_lse = true;
  const auto r = qkv::attention(qkv::to_dtype(q_bhnd.view().transpose(1, 2), DType::f32),
                                qkv::to_dtype(k_bhnd.view().transpose(1, 2), DType::f32),
                                qkv::to_dtype(v_bhnd.view().transpose(1, 2), DType::f32), opt);
  EXPECT_EQ(max_abs_diff(out_bhnd.view().transpose(1, 2), r.out), 0.0);
  EXPECT_EQ(max_abs_diff(lse, r.lse), 0.0);
}

TEST(AttentionProperties, EmptyShapes) {
  // No queries: nothing to compute. No keys: every row is fully masked.
  const Qkv none_q = random_qkv(2, 0, 3, 2, 1, 4, 4, 24);
  EXPECT_EQ(run(none_q, {}).out.numel(), 0);
  const Qkv none_k = random_qkv(1, 3, 0, 2, 1, 4, 4, 25);
  const auto r = run(none_k, {});
  EXPECT_EQ(qkv::test::max_abs(r.out), 0.0);
  EXPECT_EQ(r.lse.get({0, 1, 2}), -kInf);
}

TEST(AttentionProperties, NanInputPoisonsOnlyItsRow) {
  Qkv x = random_qkv(1, 3, 4, 1, 1, 4, 4, 26);
  x.q.set({0, 1, 0, 2}, std::nan(""));
  const auto r = run(x, {});
  EXPECT_TRUE(std::isnan(r.out.get({0, 1, 0, 0})));
  EXPECT_TRUE(std::isnan(r.lse.get({0, 0, 1})));
  EXPECT_FALSE(std::isnan(r.out.get({0, 0, 0, 0})));
  EXPECT_FALSE(std::isnan(r.out.get({0, 2, 0, 0})));
}

TEST(AttentionProperties, AttentionIntoMatchesAllocatingCall) {
  const Qkv x = random_qkv(2, 5, 6, 4, 2, 8, 8, 27, DType::f32);
  Tensor out(DType::f32, {2, 5, 4, 8});
  Tensor lse(DType::f32, {2, 4, 5});
  Tensor probs(DType::f32, {2, 4, 5, 6});
  qkv::AttentionOptions opt;
  opt.backend = qkv::Backend::reference;
  qkv::attention_into(x.q, x.k, x.v, {out, lse, probs}, opt);
  const auto r = run(x, {});
  EXPECT_EQ(max_abs_diff(out, r.out), 0.0);
  EXPECT_EQ(max_abs_diff(lse, r.lse), 0.0);
  EXPECT_EQ(max_abs_diff(probs, r.probs), 0.0);
}

}  // namespace
