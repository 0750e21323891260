// The reference backward (the specification of every fast backward) against
// central finite differences of the reference forward, in f64, for every
// feature of qkv/attention.hpp alone and combined. The loss is
// L = sum(out * G) for a fixed random G, so dout = G, and every gradient
// element, parameters included, is compared with
//   (L(x + h) - L(x - h)) / ((x + h) - (x - h)).
//
// Error model. The central difference differs from dL/dx by
//   truncation  h^2 / 6 * |L'''|, and
//   rounding    E / (2h), E the rounding error of L(x + h) - L(x - h).
// Inputs, G and parameters lie in [-1, 1], so every derivative of a score with
// respect to one input is at most ~1 (scale * |k| for dot products, |W| |v_a|
// for the additive score), and softmax, tanh and softcap have third
// derivatives of order 1 (2 / c^2 for softcap c = 0.8 is ~3). One input
// reaches at most the B * Nq * Hq * Dv = 200 outputs, each weighted by
// |G| <= 1, so |L'''| <= M3 ~ 500. L(x + h) - L(x - h) is summed as
// sum G (out+ - out-), so outputs the input does not reach cancel exactly;
// each reached output is computed in double with a relative error below
// ~50 u (u = 2^-53, sums of at most Nk + D + A terms and one exp / log), so
// E <= 2 * 200 * 50 u ~ 2.2e-12. With h = 1e-5: truncation <= 8e-9 and
// rounding <= 1.1e-7, both worst cases (rounding errors of random sign add
// up like a random walk, and observed differences are ~1e-10). A wrong term
// in a gradient formula shows up as an error of order 1e-2 or more.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "test_util.hpp"

namespace {

using qkv::AttentionOptions;
using qkv::ConstTensorView;
using qkv::DType;
using qkv::Tensor;
using qkv::TensorView;
using qkv::test::has_non_finite;
using qkv::test::max_abs;
using qkv::test::max_abs_diff;
using qkv::test::random_tensor;

constexpr double kStep = 1e-5;       // h
constexpr double kTolerance = 2e-7;  // truncation + rounding bounds above
constexpr double kInf = std::numeric_limits<double>::infinity();

// Shapes of q [B, Nq, Hq, Dq], k [B, Nk, Hkv, Dk], v [B, Nk, Hkv, Dv].
struct Sizes {
  std::int64_t b = 2, nq = 5, nk = 7, hq = 4, hkv = 2, dq = 6, dk = 6, dv = 5;
};

// Inputs, parameters and options of one call; the options view tensors and
// spans owned here, so a Problem stays where it is built.
struct Problem {
  explicit Problem(const Sizes& s)
      : sizes(s),
        q(random_tensor(DType::f64, {s.b, s.nq, s.hq, s.dq}, 1)),
        k(random_tensor(DType::f64, {s.b, s.nk, s.hkv, s.dk}, 2)),
        v(random_tensor(DType::f64, {s.b, s.nk, s.hkv, s.dv}, 3)) {}
  Problem(const Problem&) = delete;
  Problem& operator=(const Problem&) = delete;

  void use_additive(std::int64_t a, bool with_bias) {
    options.score = qkv::Score::additive;
    w_q = random_tensor(DType::f64, {a, sizes.dq}, 4);
    w_k = random_tensor(DType::f64, {a, sizes.dk}, 5);
    additive_v = random_tensor(DType::f64, {a}, 6);
    options.additive = {w_q, w_k, additive_v, {}};
    if (with_bias) {
      additive_bias = random_tensor(DType::f64, {a}, 7);
      options.additive.bias = additive_bias;
    }
  }
  void use_relative_bias(std::int64_t buckets, std::int64_t max_distance, bool bidirectional) {
    table = random_tensor(DType::f64, {sizes.hq, buckets}, 8);
    options.relative_bias = {table, max_distance, bidirectional};
  }
  void use_key_lengths(std::vector<std::int64_t> lengths) {
    key_lengths = std::move(lengths);
    options.key_lengths = key_lengths;
  }
  void use_packed(std::vector<std::int64_t> cu_q, std::vector<std::int64_t> cu_k) {
    cu_seqlens_q = std::move(cu_q);
    cu_seqlens_k = std::move(cu_k);
    options.cu_seqlens_q = cu_seqlens_q;
    options.cu_seqlens_k = cu_seqlens_k;
  }
  void use_alibi(std::vector<float> slopes) {
    alibi = std::move(slopes);
    options.alibi_slopes = alibi;
  }
  // A bool mask of the given sizes that drops about one element in `period`.
  void use_bool_mask(std::initializer_list<std::int64_t> mask_sizes, int period) {
    mask = Tensor(DType::boolean, mask_sizes);
    std::int64_t n = 0;
    const TensorView m = mask.view();
    qkv::detail::for_each_index(m.sizes(), m.rank(), [&](const qkv::Shape& idx) {
      qkv::detail::store(m.data(), m.dtype(), qkv::detail::offset(idx, m.strides(), m.rank()),
                         (n++ * 7 + 3) % period != 0);
    });
    options.mask = mask;
  }
  // A float mask of the given sizes, uniform in [-1, 1] with -inf at about
  // one element in `period`, and its gradient asked.
  void use_float_mask(std::initializer_list<std::int64_t> mask_sizes, int period) {
    mask = random_tensor(DType::f64, mask_sizes, 9);
    std::int64_t n = 0;
    const TensorView m = mask.view();
    qkv::detail::for_each_index(m.sizes(), m.rank(), [&](const qkv::Shape& idx) {
      if ((n++ * 7 + 3) % period == 0) {
        qkv::detail::store(m.data(), m.dtype(), qkv::detail::offset(idx, m.strides(), m.rank()),
                           -kInf);
      }
    });
    options.mask = mask;
    options.mask_requires_grad = true;
  }

  Sizes sizes;
  Tensor q, k, v;
  Tensor w_q, w_k, additive_v, additive_bias, table, mask;
  std::vector<std::int64_t> key_lengths, cu_seqlens_q, cu_seqlens_k;
  std::vector<float> alibi;
  AttentionOptions options;
};

// out of the reference forward for the problem's current values.
Tensor forward_out(const Problem& x, AttentionOptions opt) {
  opt.backend = qkv::Backend::reference;
  return qkv::attention(x.q, x.k, x.v, opt).out;
}

// Compares grad with central differences of L = sum(out * g) over every
// element of `param` (which the problem's options or inputs view).
void expect_matches_finite_differences(const Problem& x, const AttentionOptions& opt,
                                       const char* name, Tensor& param, ConstTensorView grad,
                                       const Tensor& g) {
  ASSERT_TRUE(grad.defined()) << name;
  ASSERT_EQ(grad.sizes(), param.sizes()) << name;
  EXPECT_FALSE(has_non_finite(grad)) << name;
  const TensorView p = param.view();
  const double* gd = g.data<double>();
  double worst = 0.0;
  std::string where;
  qkv::detail::for_each_index(p.sizes(), p.rank(), [&](const qkv::Shape& idx) {
    const std::int64_t off = qkv::detail::offset(idx, p.strides(), p.rank());
    const double x0 = qkv::detail::load(p.data(), DType::f64, off);
    if (std::isinf(x0)) {
      // A mask's -inf drops its pair: no difference quotient, zero gradient.
      EXPECT_EQ(qkv::detail::load(grad.data(), grad.dtype(),
                                  qkv::detail::offset(idx, grad.strides(), p.rank())),
                0.0)
          << name << ": the gradient of an infinite element";
      return;
    }
    const double xp = x0 + kStep;
    const double xm = x0 - kStep;
    qkv::detail::store(p.data(), DType::f64, off, xp);
    const Tensor plus = forward_out(x, opt);
    qkv::detail::store(p.data(), DType::f64, off, xm);
    const Tensor minus = forward_out(x, opt);
    qkv::detail::store(p.data(), DType::f64, off, x0);
    // sum G (out+ - out-): outputs that x does not reach cancel exactly.
    double dl = 0.0;
    const double* pd = plus.data<double>();
    const double* md = minus.data<double>();
    for (std::int64_t e = 0; e < g.numel(); ++e) dl += gd[e] * (pd[e] - md[e]);
    const double numeric = dl / (xp - xm);
    const double analytic = qkv::detail::load(grad.data(), grad.dtype(),
                                              qkv::detail::offset(idx, grad.strides(), p.rank()));
    const double err = std::fabs(analytic - numeric);
    if (!(err <= worst) && !std::isnan(worst)) {  // a NaN stays the worst
      worst = err;
      std::ostringstream text;
      text << "[" << idx[0];
      for (int d = 1; d < p.rank(); ++d) text << ", " << idx[d];
      text << "]: analytic " << analytic << ", finite difference " << numeric;
      where = text.str();
    }
  });
  EXPECT_LE(worst, kTolerance) << name << " worst at " << where;
}

// Runs the reference forward and backward and checks every gradient the
// options define against finite differences; returns the forward's lse and
// the gradients for further checks.
struct Checked {
  Tensor lse;
  qkv::AttentionGradients grads;
};
Checked expect_gradients_match(Problem& x) {
  AttentionOptions opt = x.options;
  opt.backend = qkv::Backend::reference;
  opt.return_lse = true;
  const qkv::AttentionResult fwd = qkv::attention(x.q, x.k, x.v, opt);
  const Tensor g =
      random_tensor(DType::f64, {x.q.size(0), x.q.size(1), x.sizes.hq, x.sizes.dv}, 10);
  qkv::AttentionGradients grads = qkv::attention_backward(x.q, x.k, x.v, fwd.out, g, fwd.lse, opt);
  opt.return_lse = false;
  expect_matches_finite_differences(x, opt, "dq", x.q, grads.dq, g);
  expect_matches_finite_differences(x, opt, "dk", x.k, grads.dk, g);
  expect_matches_finite_differences(x, opt, "dv", x.v, grads.dv, g);
  if (x.options.score == qkv::Score::additive) {
    expect_matches_finite_differences(x, opt, "d_additive_w_q", x.w_q, grads.d_additive_w_q, g);
    expect_matches_finite_differences(x, opt, "d_additive_w_k", x.w_k, grads.d_additive_w_k, g);
    expect_matches_finite_differences(x, opt, "d_additive_v", x.additive_v, grads.d_additive_v, g);
    if (x.additive_bias.defined()) {
      expect_matches_finite_differences(x, opt, "d_additive_bias", x.additive_bias,
                                        grads.d_additive_bias, g);
    } else {
      EXPECT_FALSE(grads.d_additive_bias.defined());
    }
  }
  if (x.table.defined()) {
    expect_matches_finite_differences(x, opt, "d_relative_bias", x.table, grads.d_relative_bias, g);
  }
  if (x.options.mask_requires_grad) {
    expect_matches_finite_differences(x, opt, "d_mask", x.mask, grads.d_mask, g);
  }
  return {fwd.lse, std::move(grads)};
}

struct Case {
  const char* name;
  Sizes sizes;
  void (*setup)(Problem&);
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

constexpr Sizes kDefault{};
constexpr Sizes kPacked{1, 6, 8, 4, 2, 6, 6, 5};  // cu_seqlens {0, 2, 2, 6} / {0, 3, 5, 8}

void packed(Problem& x) { x.use_packed({0, 2, 2, 6}, {0, 3, 5, 8}); }

const Case kCases[] = {
    {"ScaledDotGroupedQuery", kDefault, [](Problem&) {}},
    {"MultiHead", {2, 5, 7, 4, 4, 6, 6, 5}, [](Problem&) {}},
    {"MultiQuery", {2, 5, 7, 4, 1, 6, 6, 5}, [](Problem&) {}},
    {"PlainDot", kDefault, [](Problem& x) { x.options.score = qkv::Score::dot; }},
    {"ExplicitScale", kDefault, [](Problem& x) { x.options.scale = 0.7; }},
    {"Additive", {2, 5, 7, 4, 2, 4, 6, 5}, [](Problem& x) { x.use_additive(3, true); }},
    {"AdditiveWithoutBias", kDefault, [](Problem& x) { x.use_additive(3, false); }},
    {"CausalBottomRight", kDefault, [](Problem& x) { x.options.causal = true; }},
    {"CausalTopLeft", kDefault,
     [](Problem& x) {
       x.options.causal = true;
       x.options.align = qkv::Align::top_left;
     }},
    {"CausalMoreQueriesThanKeys",
     {2, 7, 5, 4, 2, 6, 6, 5},
     [](Problem& x) { x.options.causal = true; }},
    {"SlidingWindow", kDefault,
     [](Problem& x) {
       x.options.window_left = 2;
       x.options.window_right = 1;
     }},
    {"KeyLengths", kDefault,
     [](Problem& x) {
       x.use_key_lengths({7, 4});
     }},
    {"Packed", kPacked, packed},
    {"BoolMaskBroadcast", kDefault,
     [](Problem& x) {
       x.use_bool_mask({5, 7}, 3);
     }},
    {"FloatMaskBroadcast", kDefault,
     [](Problem& x) {
       x.use_float_mask({2, 1, 5, 7}, 5);
     }},
    {"FloatMaskFullCausalSoftcap", kDefault,
     [](Problem& x) {
       x.use_float_mask({2, 4, 5, 7}, 6);
       x.options.causal = true;
       x.options.softcap = 0.8;
     }},
    {"FloatMaskKeysDropout", kDefault,
     [](Problem& x) {
       x.use_float_mask({7}, 4);
       x.options.dropout_p = 0.3;
       x.options.dropout_seed = 77;
     }},
    {"FloatMaskAdditive", kDefault,
     [](Problem& x) {
       x.use_additive(3, true);
       x.use_float_mask({4, 1, 1}, 3);
     }},
    {"FloatMaskPacked", kPacked,
     [](Problem& x) {
       packed(x);
       x.use_float_mask({1, 1, 6, 8}, 7);
     }},
    {"Alibi", kDefault, [](Problem& x) { x.use_alibi(qkv::alibi_slopes(4)); }},
    {"AlibiPerBatchTopLeft", kDefault,
     [](Problem& x) {
       std::vector<float> slopes = qkv::alibi_slopes(4);
       for (float s : qkv::alibi_slopes(4)) slopes.push_back(0.5f * s);
       x.use_alibi(slopes);
       x.options.align = qkv::Align::top_left;
     }},
    {"Softcap", kDefault,
     [](Problem& x) {
       x.options.score = qkv::Score::dot;  // scores up to ~3: the cap bends them
       x.options.softcap = 0.8;
     }},
    {"RelativeBiasBidirectional", kDefault, [](Problem& x) { x.use_relative_bias(8, 5, true); }},
    {"RelativeBiasUnidirectional", kDefault, [](Problem& x) { x.use_relative_bias(6, 5, false); }},
    {"MaskMod", kDefault,
     [](Problem& x) {
       x.options.mask_mod = [](std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) {
         return (b + 2 * h + i + 3 * j) % 4 != 0;
       };
     }},
    {"SparsePatterns", kDefault,
     [](Problem& x) {
       x.options.sparse =
           qkv::SparsePattern::dilated_window(2, 1, 2) | qkv::SparsePattern::global_tokens({1});
     }},
    {"Dropout", kDefault,
     [](Problem& x) {
       x.options.dropout_p = 0.3;
       x.options.dropout_seed = 0x123456789abcdefULL;
       x.options.dropout_offset = 5;
     }},
    {"CausalWindowGroupedKeyLengths", kDefault,
     [](Problem& x) {
       x.options.causal = true;
       x.options.window_left = 2;
       x.use_key_lengths({6, 4});
     }},
    {"PackedBoolMask", kPacked,
     [](Problem& x) {
       packed(x);
       x.use_bool_mask({1, 4, 6, 8}, 4);
       x.options.causal = true;
     }},
    {"AdditiveFloatMask",
     {2, 5, 7, 4, 2, 4, 6, 5},
     [](Problem& x) {
       x.use_additive(3, true);
       x.use_float_mask({5, 7}, 6);
       x.options.causal = true;
       x.options.align = qkv::Align::top_left;
     }},
    {"SoftcapAlibiRelativeBias", kDefault,
     [](Problem& x) {
       x.options.softcap = 0.8;
       x.options.score = qkv::Score::dot;
       x.use_alibi(qkv::alibi_slopes(4));
       x.use_relative_bias(8, 5, true);
     }},
    {"DropoutPackedCausal", kPacked,
     [](Problem& x) {
       packed(x);
       x.options.causal = true;
       x.options.dropout_p = 0.5;
       x.options.dropout_seed = 42;
     }},
    {"AllFeatures",
     {2, 5, 7, 4, 2, 4, 6, 5},
     [](Problem& x) {
       x.use_additive(3, true);
       x.options.causal = true;
       x.options.window_left = 4;
       x.use_key_lengths({7, 6});
       x.use_float_mask({2, 4, 5, 7}, 7);
       x.use_alibi(qkv::alibi_slopes(4));
       x.use_relative_bias(8, 5, true);
       x.options.softcap = 1.5;
       x.options.mask_mod = [](std::int64_t, std::int64_t h, std::int64_t i, std::int64_t j) {
         return (h + i + j) % 5 != 0;
       };
       x.options.dropout_p = 0.2;
       x.options.dropout_seed = 7;
       x.options.dropout_offset = 3;
     }},
};

class BackwardReference : public ::testing::TestWithParam<Case> {};

TEST_P(BackwardReference, MatchesFiniteDifferences) {
  Problem x(GetParam().sizes);
  GetParam().setup(x);
  expect_gradients_match(x);
}

INSTANTIATE_TEST_SUITE_P(Features, BackwardReference, ::testing::ValuesIn(kCases),
                         [](const ::testing::TestParamInfo<Case>& param_info) {
                           return std::string(param_info.param.name);
                         });

// Expects dq[b, i, h, :] == 0 exactly for every row with lse = -inf (no key
// admitted, or all admitted scores -inf); returns how many such rows exist.
int expect_masked_rows_zero(const Tensor& lse, const Tensor& dq) {
  int rows = 0;
  for (std::int64_t b = 0; b < lse.size(0); ++b)
    for (std::int64_t h = 0; h < lse.size(1); ++h)
      for (std::int64_t i = 0; i < lse.size(2); ++i) {
        if (lse.get({b, h, i}) != -kInf) continue;
        ++rows;
        for (std::int64_t c = 0; c < dq.size(3); ++c) {
          EXPECT_EQ(dq.get({b, i, h, c}), 0.0) << "b=" << b << " h=" << h << " i=" << i;
        }
      }
  return rows;
}

TEST(BackwardReference, FullyMaskedRowsGiveZeroGradient) {
  // Batch 1 has no keys at all; in batch 0, row 2 of head 1 admits none (bool
  // mask) and keys 5 and 6 are padding.
  Problem x(kDefault);
  x.use_key_lengths({5, 0});
  x.mask = Tensor(DType::boolean, {2, 4, 5, 7});
  qkv::detail::for_each_index(x.mask.sizes(), 4, [&](const qkv::Shape& i) {
    x.mask.set({i[0], i[1], i[2], i[3]}, !(i[0] == 0 && i[1] == 1 && i[2] == 2));
  });
  x.options.mask = x.mask;
  const Checked r = expect_gradients_match(x);
  EXPECT_EQ(expect_masked_rows_zero(r.lse, r.grads.dq), 1 + 4 * 5);
  for (const Tensor* t : {&r.grads.dq, &r.grads.dk, &r.grads.dv}) EXPECT_FALSE(has_non_finite(*t));
  // Padding keys and every key of batch 1 get exactly zero.
  EXPECT_EQ(max_abs(r.grads.dk.view().slice(0, 0, 1).slice(1, 5, 2)), 0.0);
  EXPECT_EQ(max_abs(r.grads.dv.view().slice(0, 0, 1).slice(1, 5, 2)), 0.0);
  EXPECT_EQ(max_abs(r.grads.dk.view().slice(0, 1, 1)), 0.0);
  EXPECT_EQ(max_abs(r.grads.dv.view().slice(0, 1, 1)), 0.0);
}

TEST(BackwardReference, RowsOfInfiniteFloatMaskGiveZeroGradient) {
  // Row 3 admits every key but the float mask makes all its scores -inf, so
  // lse = -inf although keys are admitted; with a relative bias and softcap
  // the parameter gradients must stay finite too.
  Problem x(kDefault);
  x.mask = random_tensor(DType::f64, {5, 7}, 20);
  for (std::int64_t j = 0; j < 7; ++j) x.mask.set({3, j}, -kInf);
  x.options.mask = x.mask;
  x.use_relative_bias(8, 5, true);
  x.options.softcap = 2.0;
  const Checked r = expect_gradients_match(x);
  EXPECT_EQ(expect_masked_rows_zero(r.lse, r.grads.dq), 2 * 4);
  EXPECT_FALSE(has_non_finite(r.grads.d_relative_bias));
}

TEST(BackwardReference, CausalFirstRowsWithoutKeysGiveZeroGradient) {
  // Bottom-right causal with Nq > Nk: rows 0 and 1 see no key.
  Problem x({2, 7, 5, 4, 2, 6, 6, 5});
  x.use_additive(3, true);
  x.options.causal = true;
  const Checked r = expect_gradients_match(x);
  EXPECT_EQ(expect_masked_rows_zero(r.lse, r.grads.dq), 2 * 4 * 2);
  EXPECT_FALSE(has_non_finite(r.grads.d_additive_w_q));
}

TEST(BackwardReference, IntoStridedViewsOverwrites) {
  // Gradients written through [B, H, N, D] buffers viewed as [B, N, H, D],
  // pre-filled with garbage: the result equals the allocating call's.
  Problem x({2, 5, 7, 4, 2, 4, 6, 5});
  x.use_additive(3, true);
  x.use_relative_bias(8, 5, true);
  x.options.causal = true;
  x.options.backend = qkv::Backend::reference;
  x.options.return_lse = true;
  const qkv::AttentionResult fwd = qkv::attention(x.q, x.k, x.v, x.options);
  const Tensor g = random_tensor(DType::f64, {2, 5, 4, 5}, 11);
  const qkv::AttentionGradients want =
      qkv::attention_backward(x.q, x.k, x.v, fwd.out, g, fwd.lse, x.options);
  Tensor dq = random_tensor(DType::f64, {2, 4, 5, 4}, 12, 5.0, 6.0);
  Tensor dk = random_tensor(DType::f64, {2, 2, 7, 6}, 13, 5.0, 6.0);
  Tensor dv = random_tensor(DType::f64, {2, 2, 7, 5}, 14, 5.0, 6.0);
  Tensor d_table = random_tensor(DType::f64, {8, 4}, 15, 5.0, 6.0);  // transposed [buckets, Hq]
  Tensor d_w_q = random_tensor(DType::f64, {3, 4}, 16, 5.0, 6.0);
  Tensor d_w_k = random_tensor(DType::f64, {3, 6}, 17, 5.0, 6.0);
  Tensor d_v = random_tensor(DType::f64, {3}, 18, 5.0, 6.0);
  Tensor d_bias = random_tensor(DType::f64, {3}, 19, 5.0, 6.0);
  qkv::attention_backward_into(
      x.q, x.k, x.v, fwd.out, g, fwd.lse,
      {dq.view().transpose(1, 2), dk.view().transpose(1, 2), dv.view().transpose(1, 2),
       d_table.view().transpose(0, 1), d_w_q, d_w_k, d_v, d_bias},
      x.options);
  EXPECT_EQ(max_abs_diff(dq.view().transpose(1, 2), want.dq), 0.0);
  EXPECT_EQ(max_abs_diff(dk.view().transpose(1, 2), want.dk), 0.0);
  EXPECT_EQ(max_abs_diff(dv.view().transpose(1, 2), want.dv), 0.0);
  EXPECT_EQ(max_abs_diff(d_table.view().transpose(0, 1), want.d_relative_bias), 0.0);
  EXPECT_EQ(max_abs_diff(d_w_q, want.d_additive_w_q), 0.0);
  EXPECT_EQ(max_abs_diff(d_w_k, want.d_additive_w_k), 0.0);
  EXPECT_EQ(max_abs_diff(d_v, want.d_additive_v), 0.0);
  EXPECT_EQ(max_abs_diff(d_bias, want.d_additive_bias), 0.0);
}

}  // namespace
