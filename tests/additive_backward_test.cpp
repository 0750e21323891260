// The fast backward of Score::additive (cpu/additive_backward.cpp) against
// the reference backward, over shapes around the vector width (16 floats),
// GQA and MQA, key lengths, causal and window masks, bool and float masks,
// ALiBi, mask_mod and packed sequences; its dispatch; thread-count
// independence.
//
// Tolerance (docs/numerics.md, "The tolerance policy"): the fast error
// against the reference is at most twice the error of the naive computation
// in the input precision (naive_attention_backward, which uses std::tanh),
// plus one output rounding at the gradient's magnitude, plus what the one
// difference the naive computation does not share can add: the fast path's
// tanh is Highway's, within 4 ULP (|dt| <= eps = 8u of |t| <= 1), in the
// forward that gives P and in the backward's chain. First order in eps, with
// M = Dv max|dO| max|V| bounding |dP| and |D|:
//   scores  |ds| <= delta = eps sum_a |v_a|, so |dP_ij| <= 2 delta P_ij
//   dS_ij = P_ij (dP_ij - D_i):  |d dS_ij| <= sigma P_ij, sigma = 4 M delta
//           (+ the cancellation floor of forming dP - D, as in flash_backward_test)
//   du = dS v (1 - t^2):  |d du| <= max|v| (sigma + 4 M eps) P_ij =: E P_ij
//   dUQ_i = sum_j du: E;  dUK_j = sum_i du: E mass_j (mass_j = sum_i P_ij)
//   dq = dUQ W_q: E A max|W_q|;  dk = dUK W_k: E mass A max|W_k|
//   dW_q = dUQ^T Q: E rows max|q|;  dW_k = dUK^T K: E rows max|k|
//   d_bias = sum_i dUQ_i: E rows;  d_v = sum dS t: rows (sigma + 2 M eps)
//   dv = P^T dO: 2 delta mass max|dO|
// where rows counts the query rows of every head (sum_ij P_ij <= rows).
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "api/validate.hpp"
#include "attention_checks.hpp"
#include "reference/attention.hpp"
#include "reference/backward.hpp"
#include "test_util.hpp"

namespace {

using qkv::AttentionOptions;
using qkv::ConstTensorView;
using qkv::DType;
using qkv::Tensor;
using qkv::test::f64;
using qkv::test::has_non_finite;
using qkv::test::Inputs;
using qkv::test::make_inputs;
using qkv::test::max_abs;
using qkv::test::max_abs_diff;
using qkv::test::random_tensor;
using qkv::test::unit_roundoff;

// The additive score's parameters for attention size A.
struct Params {
  Tensor w_q, w_k, v, bias;
  Params(std::int64_t a, std::int64_t dq, std::int64_t dk, DType dtype, std::uint32_t seed,
         bool with_bias = true)
      : w_q(random_tensor(dtype, {a, dq}, seed, -0.5, 0.5)),
        w_k(random_tensor(dtype, {a, dk}, seed + 1, -0.5, 0.5)),
        v(random_tensor(dtype, {a}, seed + 2, -1.0, 1.0)),
        bias(with_bias ? random_tensor(dtype, {a}, seed + 3, -0.5, 0.5) : Tensor()) {}
  // Score::additive with these parameters, returning the lse.
  AttentionOptions options() const {
    AttentionOptions o;
    o.score = qkv::Score::additive;
    o.additive = {w_q, w_k, v, bias};
    o.return_lse = true;
    return o;
  }
};

double sum_abs(ConstTensorView t) {
  double s = 0.0;
  for (std::int64_t i = 0; i < t.size(0); ++i) s += std::fabs(t.get({i}));
  return s;
}

// Forward and backward on Backend::fast against the reference in double,
// every gradient (q, k, v and the four parameters) with the tolerance above.
void expect_additive_backward_matches(const Inputs& x, const Params& w, AttentionOptions opt,
                                      const std::string& label, std::uint32_t seed = 5) {
  SCOPED_TRACE(label);
  const DType dtype = x.q.dtype();
  opt.score = qkv::Score::additive;
  opt.additive = w.options().additive;
  opt.return_lse = true;
  AttentionOptions fast_opt = opt;
  fast_opt.backend = qkv::Backend::fast;
  const qkv::AttentionResult fwd = qkv::attention(x.q, x.k, x.v, fast_opt);
  const Tensor dout = random_tensor(
      dtype, {fwd.out.size(0), fwd.out.size(1), fwd.out.size(2), fwd.out.size(3)}, seed, -1.0, 1.0);
  const qkv::AttentionGradients fast =
      qkv::attention_backward(x.q, x.k, x.v, fwd.out, dout, fwd.lse, fast_opt);
  // Without out and lse (the module's call): the weights and lse from the
  // kernel's own projections and D_i = sum_j P_ij dP_ij where key_lengths is
  // the one mask, else the forward first. The same error model holds: D_i's
  // two forms differ by roundings below the cancellation floor of dP - D.
  const qkv::AttentionGradients recomputed =
      qkv::attention_backward(x.q, x.k, x.v, {}, dout, {}, fast_opt);

  AttentionOptions ref_opt = opt;
  ref_opt.backend = qkv::Backend::reference;
  const Tensor q64 = f64(x.q), k64 = f64(x.k), v64 = f64(x.v), dout64 = f64(dout);
  const Tensor wq64 = f64(w.w_q), wk64 = f64(w.w_k), va64 = f64(w.v);
  const Tensor b64 = w.bias.defined() ? f64(w.bias) : Tensor();
  ref_opt.additive = {wq64, wk64, va64, b64};
  AttentionOptions probs_opt = ref_opt;
  probs_opt.return_probs = true;
  const qkv::AttentionResult ref_fwd = qkv::attention(q64, k64, v64, probs_opt);
  const qkv::AttentionGradients ref =
      qkv::attention_backward(q64, k64, v64, ref_fwd.out, dout64, ref_fwd.lse, ref_opt);

  // The naive computation in the input precision, from its own forward.
  const qkv::detail::AttentionProblem p = qkv::detail::check_attention_inputs(x.q, x.k, x.v, opt);
  Tensor naive_out(dtype, fwd.out.view().size_span());
  Tensor naive_lse(DType::f32, fwd.lse.view().size_span());
  qkv::reference::naive_attention(p, x.q, x.k, x.v, {naive_out, naive_lse, {}}, ref_opt, dtype);
  qkv::AttentionGradients naive;
  naive.dq = Tensor(dtype, fast.dq.view().size_span());
  naive.dk = Tensor(dtype, fast.dk.view().size_span());
  naive.dv = Tensor(dtype, fast.dv.view().size_span());
  naive.d_additive_w_q = Tensor(DType::f32, fast.d_additive_w_q.view().size_span());
  naive.d_additive_w_k = Tensor(DType::f32, fast.d_additive_w_k.view().size_span());
  naive.d_additive_v = Tensor(DType::f32, fast.d_additive_v.view().size_span());
  if (w.bias.defined()) naive.d_additive_bias = Tensor(DType::f32, {p.attention_size});
  qkv::reference::naive_attention_backward(p, x.q, x.k, x.v, naive_out, dout, naive_lse,
                                           {naive.dq,
                                            naive.dk,
                                            naive.dv,
                                            {},
                                            naive.d_additive_w_q,
                                            naive.d_additive_w_k,
                                            naive.d_additive_v,
                                            naive.d_additive_bias.view()},
                                           ref_opt, dtype);

  // Magnitudes of the tanh error model (see the top of this file).
  const double mass = qkv::test::key_mass(ref_fwd.probs, p);
  const double u32 = unit_roundoff(DType::f32), eps = 8 * u32;
  const double rows = static_cast<double>(p.batch * p.nq * p.hq);
  const double big_m = static_cast<double>(p.dv) * max_abs(dout) * max_abs(x.v);
  const double delta = eps * sum_abs(w.v);
  const double ds_cancel = (2.0 * u32 + unit_roundoff(dtype)) * big_m;
  const double sigma = 4 * big_m * delta + ds_cancel;
  const double e = max_abs(w.v) * (sigma + 4 * big_m * eps);
  const double a = static_cast<double>(p.attention_size);

  for (const Tensor* g : {&fast.dq, &fast.dk, &fast.dv, &fast.d_additive_w_q, &fast.d_additive_w_k,
                          &fast.d_additive_v}) {
    EXPECT_FALSE(has_non_finite(*g)) << "a gradient has NaN or inf";
  }
  // f from out and lse, g without them; r the reference, n the naive.
  const auto check = [&](const char* name, const Tensor& f, const Tensor& g, const Tensor& r,
                         const Tensor& n, DType out_dtype, double tanh_floor) {
    const double err_naive = max_abs_diff(n, r);
    const double floor = unit_roundoff(out_dtype) * max_abs(r) + tanh_floor;
    const double err_fast = max_abs_diff(f, r);
    EXPECT_LE(err_fast, 2 * err_naive + floor)
        << name << " fast error " << err_fast << ", naive " << err_naive << ", floor " << floor;
    const double err_recomputed = max_abs_diff(g, r);
    EXPECT_LE(err_recomputed, 2 * err_naive + floor)
        << name << " without out and lse: error " << err_recomputed << ", naive " << err_naive
        << ", floor " << floor;
  };
  check("dq", fast.dq, recomputed.dq, ref.dq, naive.dq, dtype, e * a * max_abs(w.w_q));
  check("dk", fast.dk, recomputed.dk, ref.dk, naive.dk, dtype, e * mass * a * max_abs(w.w_k));
  check("dv", fast.dv, recomputed.dv, ref.dv, naive.dv, dtype, 2 * delta * mass * max_abs(dout));
  check("d_additive_w_q", fast.d_additive_w_q, recomputed.d_additive_w_q, ref.d_additive_w_q,
        naive.d_additive_w_q, DType::f32, e * rows * max_abs(x.q));
  check("d_additive_w_k", fast.d_additive_w_k, recomputed.d_additive_w_k, ref.d_additive_w_k,
        naive.d_additive_w_k, DType::f32, e * rows * max_abs(x.k));
  check("d_additive_v", fast.d_additive_v, recomputed.d_additive_v, ref.d_additive_v,
        naive.d_additive_v, DType::f32, rows * (sigma + 2 * big_m * eps));
  if (w.bias.defined()) {
    check("d_additive_bias", fast.d_additive_bias, recomputed.d_additive_bias, ref.d_additive_bias,
          naive.d_additive_bias, DType::f32, e * rows);
  } else {
    EXPECT_FALSE(fast.d_additive_bias.defined());
  }
}

struct Shape {
  std::int64_t nq, nk, hq, hkv, d, dv, a;
};

// Around the vector width (16 floats) in every dimension, GQA and MQA.
const Shape kShapes[] = {
    {1, 1, 1, 1, 1, 1, 1},     {1, 16, 1, 1, 16, 16, 16},  {1, 17, 2, 1, 15, 17, 17},
    {17, 15, 2, 2, 16, 8, 15}, {16, 33, 4, 2, 17, 16, 16}, {5, 40, 4, 1, 9, 31, 33},
    {33, 16, 3, 3, 32, 1, 31},
};

std::string name_of(const Shape& s) {
  return "Nq=" + std::to_string(s.nq) + " Nk=" + std::to_string(s.nk) +
         " Hq=" + std::to_string(s.hq) + " Hkv=" + std::to_string(s.hkv) +
         " D=" + std::to_string(s.d) + " Dv=" + std::to_string(s.dv) + " A=" + std::to_string(s.a);
}

TEST(AdditiveBackward, ShapesAndRangeMasks) {
  std::uint32_t seed = 300;
  for (const Shape& s : kShapes) {
    const Inputs x = make_inputs(2, s.nq, s.nk, s.hq, s.hkv, s.d, s.dv, DType::f32, seed += 7);
    const Params w(s.a, s.d, s.d, DType::f32, seed + 4, s.a % 2 == 1);
    const std::string shape = name_of(s);
    expect_additive_backward_matches(x, w, {}, shape + " full");
    AttentionOptions o;
    o.causal = true;
    expect_additive_backward_matches(x, w, o, shape + " causal bottom-right");
    o.align = qkv::Align::top_left;
    expect_additive_backward_matches(x, w, o, shape + " causal top-left");
    AttentionOptions window;
    window.window_left = 3;
    window.window_right = 2;
    expect_additive_backward_matches(x, w, window, shape + " window");
    const std::int64_t lengths[] = {s.nk, s.nk / 2};
    AttentionOptions lens;
    lens.key_lengths = lengths;
    expect_additive_backward_matches(x, w, lens, shape + " key lengths");
  }
}

TEST(AdditiveBackward, MasksAndBiases) {
  const std::int64_t b = 2, nq = 9, nk = 37, hq = 4, hkv = 2, d = 16;
  const Inputs x = make_inputs(b, nq, nk, hq, hkv, d, 12, DType::f32, 41);
  const Params w(17, d, d, DType::f32, 45);
  Tensor bool_mask(DType::boolean, {b, 1, nq, nk});
  Tensor float_mask(DType::f32, {nq, nk});
  for (std::int64_t i = 0; i < nq; ++i)
    for (std::int64_t j = 0; j < nk; ++j) {
      for (std::int64_t bb = 0; bb < b; ++bb) bool_mask.set({bb, 0, i, j}, (i + 3 * j + bb) % 5);
      float_mask.set({i, j}, j % 7 == 0 ? -INFINITY : 0.25 * std::sin(double(i * j)));
    }
  const std::vector<float> slopes = qkv::alibi_slopes(hq);
  const std::int64_t lengths[] = {30, 0};  // the second sequence has no keys
  AttentionOptions o;
  o.mask = bool_mask;
  expect_additive_backward_matches(x, w, o, "bool mask");
  o = {};
  o.mask = float_mask;
  expect_additive_backward_matches(x, w, o, "float mask");
  o = {};
  o.alibi_slopes = slopes;
  expect_additive_backward_matches(x, w, o, "alibi");
  o = {};
  o.mask_mod = [](std::int64_t, std::int64_t h, std::int64_t i, std::int64_t j) {
    return (i + h) % 3 != j % 3;
  };
  expect_additive_backward_matches(x, w, o, "mask_mod");
  o = {};
  o.causal = true;
  o.key_lengths = lengths;
  o.mask = bool_mask;
  o.alibi_slopes = slopes;
  expect_additive_backward_matches(x, w, o, "everything");
}

TEST(AdditiveBackward, PackedSequences) {
  const Inputs x = make_inputs(1, 30, 40, 2, 1, 16, 16, DType::f32, 51);
  const Params w(16, 16, 16, DType::f32, 55);
  const std::int64_t cu_q[] = {0, 1, 13, 30}, cu_k[] = {0, 17, 17, 40};
  AttentionOptions o;
  o.cu_seqlens_q = cu_q;
  o.cu_seqlens_k = cu_k;
  expect_additive_backward_matches(x, w, o, "packed");
  o.causal = true;
  expect_additive_backward_matches(x, w, o, "packed causal");
}

TEST(AdditiveBackward, SixteenBitInputs) {
  for (const DType dtype : {DType::bf16, DType::f16}) {
    const Inputs x = make_inputs(2, 7, 33, 2, 1, 16, 16, dtype, 61);
    const Params w(16, 16, 16, dtype, 65);
    AttentionOptions o;
    o.causal = true;
    expect_additive_backward_matches(x, w, o, std::string(qkv::dtype_name(dtype)));
  }
}

// With one key a row's weight is exactly 1, so dv sums dout over the rows
// that see the key. The backward's own weights (key_lengths the one mask)
// were exp(s - lse) of its own scores s and the forward's lse: it added the
// bias to the query projection where the forward adds it to the key
// projection, and its projections are other GEMMs than the forward's, so s
// came out a rounding off the forward's. An independent float64 check found
// dv = 0.99999994 dout in the first case below; 8 of the 20 problems of the
// second and the third failed too.
TEST(AdditiveBackward, OneKeyHasWeightExactlyOne) {
  const float q[] = {-0.47677574f}, k[] = {-0.4030177f}, v[] = {0.75f}, dout[] = {1.0f};
  const float w_q[] = {-0.8161681f}, w_k[] = {0.20020105f}, v_a[] = {1.3713632f},
              bias[] = {-0.62419784f};
  AttentionOptions o;
  o.score = qkv::Score::additive;
  o.additive = {ConstTensorView(w_q, {1, 1}), ConstTensorView(w_k, {1, 1}),
                ConstTensorView(v_a, {1}), ConstTensorView(bias, {1})};
  o.return_lse = true;
  o.backend = qkv::Backend::fast;
  const ConstTensorView q1(q, {1, 1, 1, 1}), k1(k, {1, 1, 1, 1}), v1(v, {1, 1, 1, 1});
  const qkv::AttentionResult fwd = qkv::attention(q1, k1, v1, o);
  const auto g =
      qkv::attention_backward(q1, k1, v1, fwd.out, ConstTensorView(dout, {1, 1, 1, 1}), fwd.lse, o);
  EXPECT_EQ(g.dv.get({0, 0, 0, 0}), 1.0);
  // Wider projections, one query row: dv is dout itself.
  for (std::uint32_t seed = 0; seed < 20; ++seed) {
    const Inputs x = make_inputs(1, 1, 1, 1, 1, 31, 8, DType::f32, 1000 + 10 * seed);
    const Params w(21, 31, 31, DType::f32, 1005 + 10 * seed);
    AttentionOptions wide = w.options();
    wide.backend = qkv::Backend::fast;
    const qkv::AttentionResult f = qkv::attention(x.q, x.k, x.v, wide);
    const Tensor d = random_tensor(DType::f32, {1, 1, 1, 8}, seed);
    const auto gw = qkv::attention_backward(x.q, x.k, x.v, f.out, d, f.lse, wide);
    EXPECT_EQ(max_abs_diff(gw.dv, d), 0.0) << "seed " << seed;
  }
  // Grouped heads and rows: the weights of the probabilities pass (taken
  // with a mask that admits everything) are exactly 1 too, so dv is the same
  // sum of dout, bit for bit.
  const Inputs x = make_inputs(2, 15, 1, 2, 1, 31, 31, DType::f32, 7);
  const Params w(21, 31, 31, DType::f32, 8);
  AttentionOptions own = w.options();
  own.backend = qkv::Backend::fast;
  const qkv::AttentionResult f = qkv::attention(x.q, x.k, x.v, own);
  const Tensor d = random_tensor(DType::f32, {2, 15, 2, 31}, 9);
  Tensor all(DType::boolean, {1, 1});
  all.set({0, 0}, 1.0);
  AttentionOptions masked = own;
  masked.mask = all;
  const auto by_own = qkv::attention_backward(x.q, x.k, x.v, f.out, d, f.lse, own);
  const auto by_pass = qkv::attention_backward(x.q, x.k, x.v, f.out, d, f.lse, masked);
  EXPECT_EQ(max_abs_diff(by_own.dv, by_pass.dv), 0.0);
}

// A piece of a larger call (shard.partial_keys) holds some of each row's
// keys: its weights are exp(s - lse) with the whole rows' lse, which no
// normalization over the piece's own keys gives.
TEST(AdditiveBackward, PieceOfALargerCallUsesTheWholeRowsLse) {
  const Inputs x = make_inputs(2, 6, 9, 2, 1, 16, 12, DType::f32, 21);
  const Params w(17, 16, 16, DType::f32, 25);
  AttentionOptions whole = w.options();
  whole.backend = qkv::Backend::reference;
  const qkv::AttentionResult all = qkv::attention(x.q, x.k, x.v, whole);
  const Tensor dout = random_tensor(DType::f32, {2, 6, 2, 12}, 26);
  AttentionOptions piece = whole;
  piece.shard.partial_keys = true;
  const ConstTensorView k = x.k.view().slice(1, 0, 5), v = x.v.view().slice(1, 0, 5);
  const auto ref = qkv::attention_backward(x.q, k, v, all.out, dout, all.lse, piece);
  piece.backend = qkv::Backend::fast;
  const auto fast = qkv::attention_backward(x.q, k, v, all.out, dout, all.lse, piece);
  // Of order 1; a piece normalized over its 5 keys alone is off by 0.1 or more.
  EXPECT_LE(max_abs_diff(fast.dv, ref.dv), 1e-5);
  EXPECT_LE(max_abs_diff(fast.dk, ref.dk), 1e-5);
  EXPECT_LE(max_abs_diff(fast.dq, ref.dq), 1e-5);
  EXPECT_LE(max_abs_diff(fast.d_additive_v, ref.d_additive_v), 1e-4);
}

// Keys no row admits never reach a gradient, whatever they hold.
TEST(AdditiveBackward, NonFiniteMaskedKeysGiveFiniteGradients) {
  Inputs x = make_inputs(1, 3, 20, 1, 1, 16, 16, DType::f32, 71);
  const Params w(16, 16, 16, DType::f32, 75);
  for (std::int64_t j = 12; j < 20; ++j) {
    x.k.set({0, j, 0, 0}, NAN);
    x.v.set({0, j, 0, 1}, INFINITY);
  }
  const std::int64_t lengths[] = {12};
  AttentionOptions o;
  o.key_lengths = lengths;
  expect_additive_backward_matches(x, w, o, "non-finite padding");
}

TEST(AdditiveBackward, ResultsDoNotDependOnTheThreadCount) {
  const Inputs x = make_inputs(3, 20, 50, 4, 2, 16, 16, DType::f32, 81);
  const Params w(24, 16, 16, DType::f32, 85);
  AttentionOptions o = w.options();
  o.causal = true;
  o.backend = qkv::Backend::fast;
  const auto fwd = qkv::attention(x.q, x.k, x.v, o);
  const Tensor dout = random_tensor(DType::f32, {3, 20, 4, 16}, 86);
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  const auto one = qkv::attention_backward(x.q, x.k, x.v, fwd.out, dout, fwd.lse, o);
  omp_set_num_threads(std::max(saved, 3));
  const auto many = qkv::attention_backward(x.q, x.k, x.v, fwd.out, dout, fwd.lse, o);
  omp_set_num_threads(saved);
  EXPECT_EQ(max_abs_diff(one.dq, many.dq), 0.0);
  EXPECT_EQ(max_abs_diff(one.dk, many.dk), 0.0);
  EXPECT_EQ(max_abs_diff(one.dv, many.dv), 0.0);
  EXPECT_EQ(max_abs_diff(one.d_additive_w_q, many.d_additive_w_q), 0.0);
  EXPECT_EQ(max_abs_diff(one.d_additive_w_k, many.d_additive_w_k), 0.0);
  EXPECT_EQ(max_abs_diff(one.d_additive_v, many.d_additive_v), 0.0);
  EXPECT_EQ(max_abs_diff(one.d_additive_bias, many.d_additive_bias), 0.0);
}

// Backend::automatic runs the fast backward for f32 and the reference for
// what the fast backward does not differentiate (dropout, softcap, relative
// bias), which Backend::fast refuses.
TEST(AdditiveBackward, Dispatch) {
  const Inputs x = make_inputs(1, 5, 9, 2, 1, 6, 4, DType::f32, 91);
  const Params w(3, 6, 6, DType::f32, 92);
  const AttentionOptions o = w.options();
  const auto fwd = qkv::attention(x.q, x.k, x.v, o);
  const Tensor dout = random_tensor(DType::f32, {1, 5, 2, 4}, 95);
  const auto backward = [&](const AttentionOptions& opt) {
    return qkv::attention_backward(x.q, x.k, x.v, fwd.out, dout, fwd.lse, opt);
  };
  AttentionOptions fast = o, reference = o;
  fast.backend = qkv::Backend::fast;
  reference.backend = qkv::Backend::reference;
  EXPECT_EQ(max_abs_diff(backward(o).dq, backward(fast).dq), 0.0);
  const Tensor table = random_tensor(DType::f32, {2, 8}, 96);
  for (const auto& [name, set] :
       std::vector<std::pair<std::string, std::function<void(AttentionOptions&)>>>{
           {"softcap", [](AttentionOptions& a) { a.softcap = 2.0; }},
           {"dropout", [](AttentionOptions& a) { a.dropout_p = 0.25; }},
           {"relative bias", [&](AttentionOptions& a) { a.relative_bias.table = table; }}}) {
    SCOPED_TRACE(name);
    AttentionOptions automatic = o, ref = reference;
    set(automatic);
    set(ref);
    const auto forward = qkv::attention(x.q, x.k, x.v, automatic);
    const auto a =
        qkv::attention_backward(x.q, x.k, x.v, forward.out, dout, forward.lse, automatic);
    const auto r = qkv::attention_backward(x.q, x.k, x.v, forward.out, dout, forward.lse, ref);
    EXPECT_EQ(max_abs_diff(a.dq, r.dq), 0.0) << "automatic must run the reference";
    automatic.backend = qkv::Backend::fast;
    EXPECT_THROW(qkv::attention_backward(x.q, x.k, x.v, forward.out, dout, forward.lse, automatic),
                 qkv::Error);
  }
}

}  // namespace
