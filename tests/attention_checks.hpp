// Checks of the fast kernels against the reference with the tolerance
// policy of docs/numerics.md, shared by the forward, backward and sparse
// tests. Forward: the fast path's largest error against the reference
// (computed in double) must be at most twice the error of the naive
// computation in the input precision (reference::naive_attention), plus half
// an ulp of the output's format at the output's magnitude. Backward: the
// same for each gradient against reference::naive_attention_backward, plus
// for dq and dk the cancellation in dS = P (dP - D): dP_ij = <dout_i, v_j>
// and D_i = <dout_i, out_i> are sums of Dv products computed in a different
// order by every implementation, so each dS_ij carries an error up to about
// (2 u + u_out) Dv |P_ij| max|dout| max|v| (r = 1 / (1 - p) more with
// dropout; u_out of the dtype `out` was rounded to, as D_i uses it) even
// where the exact dS is 0 (a row seeing a single key); through
// dq_i = scale sum_j dS_ij k_j (sum_j P_ij = 1) and dk_j = scale sum_i dS_ij
// q_i this bounds their error by that times scale max|k| (dq) or
// scale max|q| max_j sum_i P_ij (dk), and the relative-bias gradient, which
// sums dS_ij over a bucket, by that times the largest bucket's sum of P_ij.
//
// Both checks also hold the fast path to the worst-case bounds of
// error_bound.hpp, which no input may exceed. The statistical rule needs a
// problem large and random enough for the naive error to be representative;
// callers that draw problems by the hundred thousand (the fuzzers) pass
// `Rule::worst_case` to check the bound (and the exact part) alone.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "api/validate.hpp"
#include "core/mask_gradient.hpp"
#include "core/softmax_epilogue.hpp"
#include "error_bound.hpp"
#include "qkv/attention.hpp"
#include "qkv/backward.hpp"
#include "qkv/decode.hpp"
#include "qkv/kv_cache.hpp"
#include "qkv/positional.hpp"
#include "reference/attention.hpp"
#include "reference/backward.hpp"
#include "test_util.hpp"

namespace qkv::test {

inline constexpr double kInf = std::numeric_limits<double>::infinity();

// Largest |a - b| over elements where both are finite; the positions where
// either is not finite must agree exactly (same infinity, or both NaN).
inline double finite_diff(ConstTensorView a, ConstTensorView b, int* mismatches) {
  double worst = 0.0;
  qkv::detail::for_each_index(a.sizes(), a.rank(), [&](const qkv::Shape& idx) {
    const double x =
        qkv::detail::load(a.data(), a.dtype(), qkv::detail::offset(idx, a.strides(), a.rank()));
    const double y =
        qkv::detail::load(b.data(), b.dtype(), qkv::detail::offset(idx, b.strides(), b.rank()));
    if (std::isfinite(x) && std::isfinite(y)) {
      worst = std::max(worst, std::fabs(x - y));
    } else if (!(x == y || (std::isnan(x) && std::isnan(y)))) {
      ++*mismatches;
    }
  });
  return worst;
}

// Which error rules a check applies.
enum class Rule {
  policy,      // the tolerance policy and the worst-case bound
  worst_case,  // the worst-case bound alone
};

// The worst-case bound applies unless a score_mod of unknown behaviour runs.
inline bool bound_applies(const AttentionOptions& opt, const ScoreModBound& mod) {
  return !opt.score_mod || mod.roundings > 0;
}

struct Inputs {
  Tensor q, k, v;
};

inline Inputs make_inputs(std::int64_t b, std::int64_t nq, std::int64_t nk, std::int64_t hq,
                          std::int64_t hkv, std::int64_t dk, std::int64_t dv, DType dtype,
                          std::uint32_t seed) {
  // Values of order 1 with scores up to a few units: the regime of trained
  // models after the 1/sqrt(D) scale.
  return {random_tensor(dtype, {b, nq, hq, dk}, seed, -1.5, 1.5),
          random_tensor(dtype, {b, nk, hkv, dk}, seed + 1, -1.5, 1.5),
          random_tensor(dtype, {b, nk, hkv, dv}, seed + 2, -1.0, 1.0)};
}

// The loss L = sum out * dout of f64 inputs' forward with options o, in
// double: what finite differences of the parameters' gradients difference.
inline double output_loss(const Inputs& in, const Tensor& dout, AttentionOptions o) {
  o.return_lse = false;
  const Tensor out = qkv::attention(in.q, in.k, in.v, o).out;
  double l = 0;
  for (std::int64_t e = 0; e < out.numel(); ++e)
    l += out.data<double>()[e] * dout.data<double>()[e];
  return l;
}

// Decodes q_new, the last rows of sequences whose keys and values k and v
// fill `cache`, with options o, and checks out and lse against the causal
// forward's (bottom-right) in double by the tolerance policy: within twice
// the same rows' naive f32 error, plus an ulp of the result.
inline void expect_decode_matches_causal(ConstTensorView q_new, ConstTensorView k,
                                         ConstTensorView v, const qkv::KvCache& cache,
                                         AttentionOptions o, const std::string& label) {
  o.return_lse = true;
  const qkv::AttentionResult got = qkv::decode_attention(q_new, cache, o);
  AttentionOptions ref_opt = o;
  ref_opt.causal = true;
  ref_opt.backend = qkv::Backend::reference;
  const qkv::AttentionResult ref =
      qkv::attention(qkv::to_dtype(q_new, DType::f64), qkv::to_dtype(k, DType::f64),
                     qkv::to_dtype(v, DType::f64), ref_opt);
  const qkv::detail::AttentionProblem p = qkv::detail::check_attention_inputs(q_new, k, v, ref_opt);
  Tensor naive(DType::f32, ref.out.view().size_span());
  Tensor naive_lse(DType::f32, ref.lse.view().size_span());
  qkv::reference::naive_attention(p, q_new, k, v, {naive, naive_lse, {}}, ref_opt, DType::f32);
  const double u = unit_roundoff(DType::f32);
  EXPECT_LE(max_abs_diff(got.out, ref.out), 2 * max_abs_diff(naive, ref.out) + u * max_abs(ref.out))
      << label << ": out";
  EXPECT_LE(max_abs_diff(got.lse, ref.lse),
            2 * max_abs_diff(naive_lse, ref.lse) + u * std::max(1.0, max_abs(ref.lse)))
      << label << ": lse";
}

// Runs the fast backend and checks it against the reference with `rule`
// (`mod` describes opt.score_mod for the worst-case bound; without it a
// score_mod skips the bound); returns the fast result.
// t's values rounded to bf16, kept in t's dtype.
inline Tensor as_bf16_values(ConstTensorView t) {
  return qkv::to_dtype(qkv::to_dtype(t, DType::bf16), t.dtype());
}

inline qkv::AttentionResult expect_matches_reference(ConstTensorView q, ConstTensorView k,
                                                     ConstTensorView v, AttentionOptions opt,
                                                     const std::string& label,
                                                     Rule rule = Rule::policy,
                                                     const ScoreModBound& mod = {}) {
  opt.return_lse = true;
  AttentionOptions fast_opt = opt;
  fast_opt.backend = qkv::Backend::fast;
  const qkv::AttentionResult fast = qkv::attention(q, k, v, fast_opt);

  AttentionOptions ref_opt = opt;
  ref_opt.backend = qkv::Backend::reference;
  const qkv::AttentionResult ref =
      qkv::attention(qkv::to_dtype(q, DType::f64), qkv::to_dtype(k, DType::f64),
                     qkv::to_dtype(v, DType::f64), ref_opt);

  int mismatches = 0;
  const double err_fast = finite_diff(fast.out, ref.out, &mismatches);
  const double lse_fast = finite_diff(fast.lse, ref.lse, &mismatches);
  EXPECT_EQ(mismatches, 0) << label << ": infinities or NaNs differ from the reference";
  if (bound_applies(opt, mod)) {
    const ForwardErrorBound bound = forward_error_bound(q, k, v, opt, max_abs(ref.out), mod);
    EXPECT_LE(err_fast, bound.out)
        << label << ": fast error " << err_fast << " above the worst-case bound " << bound.out;
    EXPECT_LE(lse_fast, bound.lse)
        << label << ": lse error " << lse_fast << " above the worst-case bound " << bound.lse;
  }
  if (rule == Rule::worst_case) return fast;

  const qkv::detail::AttentionProblem problem = qkv::detail::check_attention_inputs(q, k, v, opt);
  Tensor naive_out(q.dtype(), fast.out.view().size_span());
  Tensor naive_lse(DType::f32, fast.lse.view().size_span());
  // The naive computation in the precision of the products: where the
  // call's f32 or f16 inputs are rounded to bf16 for an engine, on the
  // rounded inputs in bf16 (torch's bf16 math path on them).
  const bool rounds = engine_terms(q, k, v, opt).inputs > 0;
  const DType precision = rounds ? DType::bf16 : q.dtype();
  const Tensor qr = rounds ? as_bf16_values(q) : Tensor(),
               kr = rounds ? as_bf16_values(k) : Tensor(),
               vr = rounds ? as_bf16_values(v) : Tensor();
  qkv::reference::naive_attention(problem, rounds ? qr.view() : q, rounds ? kr.view() : k,
                                  rounds ? vr.view() : v, {naive_out, naive_lse, {}}, ref_opt,
                                  precision);

  // Score::additive: the fused kernel's tanh is Highway's vector Tanh, within
  // 4 ULP (8u of |tanh| <= 1), where the naive computation calls std::tanh;
  // each score may so carry up to 8u sum_a |v_a| more error, and a score
  // perturbation of at most d moves an output row by at most 2 d max|v| and
  // lse by d.
  double tanh_error = 0.0;
  if (opt.score == qkv::Score::additive) {
    const ConstTensorView a = opt.additive.v;
    for (std::int64_t i = 0; i < a.size(0); ++i) tanh_error += std::fabs(a.get({i}));
    tanh_error *= 8 * unit_roundoff(DType::f32);
  }
  const double err_naive = finite_diff(naive_out, ref.out, &mismatches);
  const double floor = unit_roundoff(q.dtype()) * max_abs(ref.out) + 2 * tanh_error * max_abs(v);
  EXPECT_LE(err_fast, 2 * err_naive + floor)
      << label << ": fast error " << err_fast << ", naive " << err_naive << ", floor " << floor;
  const double lse_naive = finite_diff(naive_lse, ref.lse, &mismatches);
  const double lse_floor =
      unit_roundoff(DType::f32) *
      std::max(1.0, max_abs([&] {
                 Tensor t = ref.lse;
                 qkv::detail::for_each_index(t.sizes(), t.rank(), [&](const qkv::Shape& i) {
                   const double x = t.get({i[0], i[1], i[2]});
                   if (!std::isfinite(x)) t.set({i[0], i[1], i[2]}, 0);
                 });
                 return t;
               }()));
  EXPECT_LE(lse_fast, 2 * lse_naive + lse_floor + tanh_error) << label << ": lse";
  EXPECT_EQ(mismatches, 0) << label << ": the naive computation's infinities or NaNs differ";
  return fast;
}

inline Tensor f64(ConstTensorView t) { return qkv::to_dtype(t, DType::f64); }

// d_sinks [Hq] in double from a forward's out and lse and dout, by the
// epilogue's formula (core/softmax_epilogue.hpp, sink_gradient).
inline Tensor sink_gradients_of(const qkv::detail::AttentionProblem& p, ConstTensorView out,
                                ConstTensorView dout, ConstTensorView lse,
                                const AttentionOptions& opt) {
  Tensor g(DType::f64, {p.hq});
  std::vector<double> o(static_cast<std::size_t>(p.dv)), d(static_cast<std::size_t>(p.dv));
  for (std::int64_t h = 0; h < p.hq; ++h) {
    double sum = 0;
    for (std::int64_t s = 0; s < p.sequences; ++s) {
      const qkv::detail::SequenceExtent seq = p.sequence(s);
      sum += qkv::detail::sink_gradient<double>(
          opt.sinks[static_cast<std::size_t>(h)], seq.nq, [&](std::int64_t i) {
            const std::int64_t row = seq.q_begin + i;
            for (std::int64_t c = 0; c < p.dv; ++c) {
              o[c] = out.get({seq.batch, row, h, c});
              d[c] = dout.get({seq.batch, row, h, c});
            }
            return std::pair<double, double>{lse.get({seq.batch, h, row}),
                                             qkv::detail::row_delta(d.data(), o.data(), p.dv)};
          });
    }
    g.set({h}, sum);
  }
  return g;
}

// max_j sum_i P_ij over the query heads of a KV head: the most weight one
// key (its dk and dv) receives. probs [B, Hq, Nq, Nk].
inline double key_mass(ConstTensorView probs, const qkv::detail::AttentionProblem& p) {
  double mass = 0.0;
  for (std::int64_t b = 0; b < probs.size(0); ++b)
    for (std::int64_t hk = 0; hk < p.hkv; ++hk)
      for (std::int64_t j = 0; j < probs.size(3); ++j) {
        double m = 0.0;
        for (std::int64_t h = hk * p.group(); h < (hk + 1) * p.group(); ++h)
          for (std::int64_t i = 0; i < probs.size(2); ++i) m += probs.get({b, h, i, j});
        mass = std::max(mass, m);
      }
  return mass;
}

// Runs forward and backward on the fast backend, as a training step would,
// and checks every gradient against the reference with `rule` (the
// worst-case bound for dot-product scores, whose backward is fused).
// Returns the fast gradients.
inline qkv::AttentionGradients expect_backward_matches(ConstTensorView q, ConstTensorView k,
                                                       ConstTensorView v, AttentionOptions opt,
                                                       const std::string& label,
                                                       std::uint32_t seed = 5,
                                                       Rule rule = Rule::policy) {
  const DType dtype = q.dtype();
  opt.return_lse = true;
  AttentionOptions fast_opt = opt;
  fast_opt.backend = qkv::Backend::fast;
  const qkv::AttentionResult fwd = qkv::attention(q, k, v, fast_opt);
  const Tensor dout = random_tensor(
      dtype, {fwd.out.size(0), fwd.out.size(1), fwd.out.size(2), fwd.out.size(3)}, seed, -1.0, 1.0);
  const qkv::AttentionGradients fast =
      qkv::attention_backward(q, k, v, fwd.out, dout, fwd.lse, fast_opt);

  // The reference: everything in double, from the same (rounded) inputs. The
  // relative bias table is converted too, so that no input is rounded twice.
  AttentionOptions ref_opt = opt;
  ref_opt.backend = qkv::Backend::reference;
  Tensor table64;
  if (opt.relative_bias.table.defined()) {
    table64 = f64(opt.relative_bias.table);
    ref_opt.relative_bias.table = table64;
  }
  const Tensor q64 = f64(q), k64 = f64(k), v64 = f64(v), dout64 = f64(dout);
  AttentionOptions probs_opt = ref_opt;
  probs_opt.return_probs = true;
  const qkv::AttentionResult ref_fwd = qkv::attention(q64, k64, v64, probs_opt);
  const qkv::AttentionGradients ref =
      qkv::attention_backward(q64, k64, v64, ref_fwd.out, dout64, ref_fwd.lse, ref_opt);

  const qkv::detail::AttentionProblem problem = qkv::detail::check_attention_inputs(q, k, v, opt);
  const ConstTensorView probs = ref_fwd.probs;
  const double key_mass = qkv::test::key_mass(probs, problem);
  // The largest sum of P_ij over the (b, i, j) of one relative-bias bucket
  // (packed sequences and key lengths move positions: a head's whole mass,
  // an upper bound).
  double bucket_mass = 0.0;
  if (fast.d_relative_bias.defined()) {
    const std::int64_t buckets = opt.relative_bias.table.size(1);
    const bool exact_buckets = opt.cu_seqlens_q.empty() && opt.key_lengths.empty();
    for (std::int64_t h = 0; h < probs.size(1); ++h) {
      std::vector<double> mass(static_cast<std::size_t>(buckets), 0.0);
      for (std::int64_t bb = 0; bb < probs.size(0); ++bb)
        for (std::int64_t i = 0; i < probs.size(2); ++i)
          for (std::int64_t j = 0; j < probs.size(3); ++j) {
            const std::int64_t pos =
                opt.align == qkv::Align::bottom_right ? i + probs.size(3) - probs.size(2) : i;
            const std::int64_t bucket =
                exact_buckets
                    ? qkv::t5_relative_bucket(j - pos, buckets, opt.relative_bias.max_distance,
                                              opt.relative_bias.bidirectional)
                    : 0;
            mass[static_cast<std::size_t>(bucket)] += probs.get({bb, h, i, j});
          }
      bucket_mass = std::max(bucket_mass, *std::max_element(mass.begin(), mass.end()));
    }
  }

  // The largest sum of P_bhij over the (b, h, i, j) that broadcast onto one
  // element of the mask, and how many do.
  double mask_mass = 0.0, mask_terms = 0.0;
  if (fast.d_mask.defined()) {
    Tensor mass(DType::f64, opt.mask.size_span());
    qkv::detail::sum_into_mask(probs, mass);
    mask_mass = max_abs(mass);
    mask_terms = static_cast<double>(probs.numel()) / static_cast<double>(mass.numel());
  }

  EXPECT_EQ(fast.d_mask.defined(), opt.mask_requires_grad) << label;
  EXPECT_EQ(fast.d_sinks.defined(), !opt.sinks.empty()) << label;
  EXPECT_EQ(ref.d_sinks.defined(), !opt.sinks.empty()) << label;
  EXPECT_EQ(fast.d_score_scale.defined(), !opt.score_scale.empty()) << label;
  for (const Tensor* g :
       {&fast.dq, &fast.dk, &fast.dv, &fast.d_relative_bias, &fast.d_sinks, &fast.d_mask}) {
    EXPECT_FALSE(g->defined() && has_non_finite(*g)) << label << ": a gradient has NaN or inf";
  }
  if (opt.score != qkv::Score::additive) {
    BackwardMagnitudes m;
    m.key_mass = key_mass;
    m.bucket_mass = bucket_mass;
    m.mask_mass = mask_mass;
    m.mask_terms = mask_terms;
    m.max_out = max_abs(fwd.out);
    m.out_error = max_abs_diff(fwd.out, ref_fwd.out);
    int mismatches = 0;
    m.lse_error = finite_diff(fwd.lse, ref_fwd.lse, &mismatches);
    EXPECT_EQ(mismatches, 0) << label
                             << ": the forward's lse is not finite where the reference's is";
    m.max_dq = max_abs(ref.dq);
    m.max_dk = max_abs(ref.dk);
    m.max_dv = max_abs(ref.dv);
    if (fast.d_relative_bias.defined()) m.max_d_bias = max_abs(ref.d_relative_bias);
    if (fast.d_mask.defined()) m.max_d_mask = max_abs(ref.d_mask);
    const BackwardErrorBound bound = backward_error_bound(q, k, v, dout, opt, m);
    const auto within = [&](const char* name, const Tensor& f, const Tensor& r, double b) {
      const double err = max_abs_diff(f, r);
      EXPECT_LE(err, b) << label << ": " << name << " error " << err
                        << " above the worst-case bound " << b;
    };
    within("dq", fast.dq, ref.dq, bound.dq);
    within("dk", fast.dk, ref.dk, bound.dk);
    within("dv", fast.dv, ref.dv, bound.dv);
    if (fast.d_relative_bias.defined()) {
      within("d_relative_bias", fast.d_relative_bias, ref.d_relative_bias, bound.d_relative_bias);
    }
    if (fast.d_mask.defined()) within("d_mask", fast.d_mask, ref.d_mask, bound.d_mask);
    if (fast.d_score_scale.defined()) {
      // d_score_scale[h] = sum_(b, i) <dq_i, q_i> / score_scale[h]
      // (core/score_scale.hpp, from dq' before dq's rounding): a linear
      // functional of dq, off by at most sum_(b, i) |q_i|_1 |dq error| /
      // |score_scale[h]|, plus its sum's roundings (f32 for f32 q).
      for (std::int64_t h = 0; h < problem.hq; ++h) {
        const double s =
            std::fabs(static_cast<double>(opt.score_scale[static_cast<std::size_t>(h)]));
        double q_sum = 0.0;
        for (std::int64_t b = 0; b < q.size(0); ++b)
          for (std::int64_t i = 0; i < q.size(1); ++i)
            for (std::int64_t c = 0; c < q.size(3); ++c) q_sum += std::fabs(q.get({b, i, h, c}));
        const double want = ref.d_score_scale.get({h}), got = fast.d_score_scale.get({h});
        const double b_h =
            s > 0 ? q_sum * bound.dq / s + unit_roundoff(DType::f32) * std::fabs(want) : kInf;
        EXPECT_LE(std::fabs(got - want), b_h) << label << ": d_score_scale[" << h << "]";
      }
    }
  }
  if (rule == Rule::worst_case) return fast;

  // The naive computation in the input precision, from its own forward.
  Tensor naive_out(dtype, fwd.out.view().size_span());
  Tensor naive_lse(DType::f32, fwd.lse.view().size_span());
  // In the precision of the products: where the call's f32 or f16 inputs
  // are rounded to bf16 for an engine, on the rounded inputs in bf16.
  const bool rounds = engine_terms(q, k, v, opt).inputs > 0;
  const DType precision = rounds ? DType::bf16 : dtype;
  const Tensor qr = rounds ? as_bf16_values(q) : Tensor(),
               kr = rounds ? as_bf16_values(k) : Tensor(),
               vr = rounds ? as_bf16_values(v) : Tensor(),
               dr = rounds ? as_bf16_values(dout) : Tensor();
  const ConstTensorView qn = rounds ? qr.view() : q, kn = rounds ? kr.view() : k,
                        vn = rounds ? vr.view() : v, dn = rounds ? dr.view() : dout.view();
  qkv::reference::naive_attention(problem, qn, kn, vn, {naive_out, naive_lse, {}}, ref_opt,
                                  precision);
  qkv::AttentionGradients naive;
  naive.dq = Tensor(dtype, fast.dq.view().size_span());
  naive.dk = Tensor(dtype, fast.dk.view().size_span());
  naive.dv = Tensor(dtype, fast.dv.view().size_span());
  if (fast.d_relative_bias.defined()) {
    naive.d_relative_bias = Tensor(DType::f32, fast.d_relative_bias.view().size_span());
  }
  if (fast.d_mask.defined()) naive.d_mask = Tensor(DType::f32, fast.d_mask.view().size_span());
  qkv::reference::naive_attention_backward(problem, qn, kn, vn, naive_out, dn, naive_lse,
                                           {.dq = naive.dq,
                                            .dk = naive.dk,
                                            .dv = naive.dv,
                                            .d_relative_bias = naive.d_relative_bias.view(),
                                            .d_mask = naive.d_mask.view()},
                                           ref_opt, precision);

  // The cancellation floor (see the top of this file): two f32 dot products
  // of length Dv, and D_i formed from `out` as the forward rounded it to the
  // input dtype (u of f16 for f16 inputs).
  const double ds_error = (2.0 * unit_roundoff(DType::f32) + unit_roundoff(dtype)) *
                          static_cast<double>(problem.dv) * max_abs(dout) * max_abs(v) /
                          (1.0 - opt.dropout_p);
  const double dq_cancel = ds_error * std::fabs(problem.scale) * max_abs(k);
  const double dk_cancel = ds_error * std::fabs(problem.scale) * max_abs(q) * key_mass;

  auto check = [&](const char* name, const Tensor& f, const Tensor& r, const Tensor& n,
                   DType out_dtype, double cancel = 0.0) {
    const double err_fast = max_abs_diff(f, r);
    const double err_naive = max_abs_diff(n, r);
    const double floor = unit_roundoff(out_dtype) * max_abs(r) + cancel;
    EXPECT_LE(err_fast, 2 * err_naive + floor)
        << label << ": " << name << " fast error " << err_fast << ", naive " << err_naive
        << ", floor " << floor;
  };
  check("dq", fast.dq, ref.dq, naive.dq, dtype, dq_cancel);
  check("dk", fast.dk, ref.dk, naive.dk, dtype, dk_cancel);
  check("dv", fast.dv, ref.dv, naive.dv, dtype);
  if (fast.d_relative_bias.defined()) {
    // d_table[h, bucket] sums dS_ij over the (b, i, j) in the bucket: the
    // cancellation floor is ds_error times the largest bucket mass sum P_ij.
    check("d_relative_bias", fast.d_relative_bias, ref.d_relative_bias, naive.d_relative_bias,
          DType::f32, ds_error * bucket_mass);
  }
  if (fast.d_mask.defined()) {
    // d_mask sums dS over the (b, h, i, j) of a mask element: as the bias.
    check("d_mask", fast.d_mask, ref.d_mask, naive.d_mask, DType::f32, ds_error * mask_mass);
  }
  if (fast.d_sinks.defined()) {
    // d_sinks[h] = -sum_i e^(S_h - lse_i) D_i over the head's rows, each
    // weight at most 1: D_i's cancellation (ds_error without its factor
    // |P_ij| <= 1) once per row.
    const Tensor naive_d_sinks = sink_gradients_of(problem, naive_out, dout, naive_lse, opt);
    const double rows = static_cast<double>(fwd.lse.size(0) * fwd.lse.size(2));
    check("d_sinks", fast.d_sinks, ref.d_sinks, naive_d_sinks, DType::f32, ds_error * rows);
  }
  return fast;
}

}  // namespace qkv::test
