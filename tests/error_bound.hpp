// A-priori worst-case error bounds of the fused f32 kernels (forward and
// backward, dot-product and additive scores), from the magnitudes of the
// inputs alone. Where the tolerance policy of docs/numerics.md ("at most
// twice the naive error") is a statistical rule, these hold for every input:
// no correct kernel exceeds them, whatever the values, sizes or options.
// The fuzzers check them on every problem they compare; the derivation is
// in docs/numerics.md, "Worst-case bounds", term by term as below.
//
// Notation: u = 2^-24 (f32), g(n) = n u / (1 - n u) (n roundings in a sum or
// dot product, any order), t = 2^-150 (the absolute error an f32 operation
// may add when its result underflows), M = a bound on |score| after every
// modification, d = a bound on the error of every computed score. A bound
// that says nothing (a relative error of 1 or more) is infinite.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "cpu/flash.hpp"
#include "qkv/attention.hpp"
#include "test_util.hpp"

namespace qkv::test {

// What a user score_mod does to the bound: |f(s) - f(t)| <= lipschitz
// |s - t|, |f(s)| <= lipschitz |s| + offset, and the float arithmetic inside
// it rounds at most `roundings` times on values of size |s| + offset.
struct ScoreModBound {
  double lipschitz = 1.0;  // Lipschitz constant in the score
  double offset = 0.0;     // largest bias it adds
  double roundings = 0.0;  // roundings inside the callable (0: no score_mod)
};

inline constexpr double kU32 = 0x1p-24;
inline constexpr double kU16 = 0x1p-8;       // bf16's unit roundoff
inline constexpr double kTiny32 = 0x1p-150;  // underflow of one f32 operation

// Half the smallest subnormal of a format: what rounding a result to it may
// lose in absolute terms, beyond the relative unit roundoff.
inline double underflow(DType d) {
  switch (d) {
    case DType::f16:
      return 0x1p-25;
    case DType::bf16:
      return 0x1p-134;
    case DType::f32:
      return kTiny32;
    default:
      return 0x1p-1074;  // f64: below any result these checks compare
  }
}

// x, or infinity where x is not a bound (NaN or negative from a term >= 1).
inline double or_infinite(double x) { return x >= 0 ? x : std::numeric_limits<double>::infinity(); }

inline double gamma_n(double n) {
  const double nu = n * kU32;
  return nu < 1.0 ? nu / (1.0 - nu) : std::numeric_limits<double>::infinity();
}

// Largest finite |x| of a view (masks hold -inf for dropped keys).
inline double max_abs_finite(ConstTensorView t) {
  double m = 0.0;
  if (!t.defined()) return m;
  qkv::detail::for_each_index(t.sizes(), t.rank(), [&](const qkv::Shape& idx) {
    const double x =
        qkv::detail::load(t.data(), t.dtype(), qkv::detail::offset(idx, t.strides(), t.rank()));
    if (std::isfinite(x)) m = std::max(m, std::fabs(x));
  });
  return m;
}

// Whether the fused kernels compute a call's products on a bf16 engine
// (cpu::products_engine, docs/matrix-engines.md), and then the relative
// rounding of its inputs to bf16 (0 for bf16 inputs, which are exact).
// On an engine the bounds add: the inputs' rounding; the weights P (and the
// backward's dS) rounded to bf16 before their products (kU16 relative);
// bf16 subnormals read as zero and subnormal sums flushed (2^-126 absolute
// per operation). MatmulPrecision::int8 has no worst-case bound here (its
// scores' quantization is judged statistically): infinite.
struct EngineTerms {
  bool on = false;      // the products run on a bf16 engine
  bool int8 = false;    // and Q K^T in int8
  double inputs = 0.0;  // relative rounding of q, k, v, dout to bf16
};

inline EngineTerms engine_terms(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                                const AttentionOptions& o) {
  qkv::cpu::KernelParams params;
  params.score = o.score;
  params.matmul_precision = o.matmul_precision;
  EngineTerms t;
  const auto engine = qkv::cpu::products_engine(params, q, k, v);
  t.on = engine.has_value();
  t.int8 = t.on && qkv::cpu::scores_int8_engine(params, engine).has_value();
  const bool exact =
      q.dtype() == DType::bf16 && k.dtype() == DType::bf16 && v.dtype() == DType::bf16;
  t.inputs = t.on && !exact ? kU16 : 0.0;
  return t;
}

// options.score_scale (core/score_scale.hpp): the kernels run the queries
// times c = score_scale[h] (times ln n_i <= ln Nk), rounded to f32 once,
// and on an engine to bf16 (also for bf16 inputs); dq = c dq', dq' stored
// in f32 first.
struct ScoreScaleTerms {
  double c = 1.0;       // bound on |c|
  double rounding = 0;  // relative rounding of the scaled queries
};

inline ScoreScaleTerms score_scale_terms(const EngineTerms& engine, ConstTensorView k,
                                         const AttentionOptions& o) {
  ScoreScaleTerms t;
  if (o.score_scale.empty()) return t;
  t.c = 0.0;
  for (const float c : o.score_scale) t.c = std::max(t.c, std::fabs(static_cast<double>(c)));
  if (o.score_scale_log_n) t.c *= std::log(std::max(1.0, static_cast<double>(k.size(1))));
  t.rounding = engine.on ? (1 + kU32) * (1 + kU16) - 1 : kU32;
  return t;
}

struct ScoreErrorBound {
  double before_cap = 0.0;  // error of the score before the softcap
  double error = 0.0;       // d: error of the final score
  double magnitude = 0.0;   // M: bound on |final score|
  double raw = 0.0;         // bound on |score| before the softcap
};

// The error of each score the fused kernel computes (QK^T or the additive
// score, then softcap, ALiBi, relative bias, float mask and score_mod, in
// that order) against the exact score of the same (rounded) inputs.
inline ScoreErrorBound score_error_bound(ConstTensorView q, ConstTensorView k,
                                         const AttentionOptions& o, const ScoreModBound& mod = {}) {
  const double u = kU32;
  const double nq = static_cast<double>(q.size(1));
  const double nk = static_cast<double>(k.size(1));
  ScoreErrorBound b;
  if (o.score == Score::additive) {
    // q W_q^T and k W_k^T + bias in f32 (weights rounded to f32 once), their
    // sum, Highway's Tanh (4 ulp of |tanh| <= 1: 8u), v rounded to f32, and
    // the sum over A in any order.
    const double pq = static_cast<double>(q.size(3)) * max_abs(q) * max_abs(o.additive.w_q);
    const double pk = static_cast<double>(k.size(3)) * max_abs(k) * max_abs(o.additive.w_k) +
                      max_abs_finite(o.additive.bias);
    const double x_error = gamma_n(static_cast<double>(q.size(3)) + 1) * pq +
                           gamma_n(static_cast<double>(k.size(3)) + 2) * pk + u * (pq + pk);
    double va = 0.0;
    for (std::int64_t a = 0; a < o.additive.v.size(0); ++a) va += std::fabs(o.additive.v.get({a}));
    const double terms = static_cast<double>(o.additive.v.size(0));
    const double tiny = kTiny32 * (va * static_cast<double>(q.size(3) + k.size(3) + 4) + 2 * terms);
    b.error = va * (x_error + 8 * u) + gamma_n(terms + 1) * va + tiny;
    b.magnitude = va;
  } else {
    // scale rounded to f32 and folded into q (2 roundings), then a dot
    // product of length D; underflow in the scale, the scaled q and each
    // step of the product.
    const double scale = std::fabs(o.scale.value_or(
        o.score == Score::scaled_dot ? 1.0 / std::sqrt(static_cast<double>(q.size(3))) : 1.0));
    // With score_scale the queries are c q, rounded once more.
    const EngineTerms engine = engine_terms(q, k, k, o);  // v's dtype is k's (validated)
    const ScoreScaleTerms c = score_scale_terms(engine, k, o);
    const double d = static_cast<double>(q.size(3));
    const double q_max = c.c * max_abs(q);
    const double terms = scale * d * q_max * max_abs(k);
    b.error = (1 + gamma_n(d + 2)) * (1 + c.rounding) * terms - terms +
              kTiny32 * (d + 1) * (1 + max_abs(k) + q_max * max_abs(k));
    if (engine.on) {
      // q and k rounded to bf16 (scaled queries: in c.rounding); DAZ of
      // either operand and FTZ of each sum.
      const double q_in = o.score_scale.empty() ? engine.inputs : 0.0;
      b.error += ((1 + q_in) * (1 + engine.inputs) - 1) * terms +
                 scale * d * 0x1p-125 * (1 + q_max + max_abs(k));
    }
    if (engine.int8) b.error = std::numeric_limits<double>::infinity();
    b.magnitude = terms;
  }
  b.before_cap = b.error;
  b.raw = b.magnitude;
  if (o.softcap > 0.0) {
    // c tanh(s * fl(1/c)): the argument carries 2u relatively, tanh' <= 1,
    // Tanh is within 8u c, and the product rounds once more.
    b.error += 2 * u * b.magnitude + 9 * u * o.softcap + kTiny32 * (2 * o.softcap + 1);
    b.magnitude = std::min(b.magnitude, o.softcap);
  }
  // Biases: each is rounded to f32 (at most once) and added (once more);
  // ALiBi's product and sum round twice at most.
  const auto add_bias = [&](double bias) {
    b.error += u * bias + u * (b.magnitude + bias) + 2 * kTiny32;
    b.magnitude += bias;
  };
  if (!o.alibi_slopes.empty()) {
    double slope = 0.0;
    for (const float s : o.alibi_slopes) slope = std::max(slope, std::fabs(static_cast<double>(s)));
    add_bias(slope * 2 * (nq + nk));  // |p_i - j| <= 2 max(Nq, Nk)
  }
  if (o.relative_bias.table.defined()) add_bias(max_abs(o.relative_bias.table));
  if (o.mask.defined() && o.mask.dtype() != DType::boolean) add_bias(max_abs_finite(o.mask));
  if (mod.roundings > 0) {
    // Both backends call it on f32 scores: the reference's rounding of the
    // score to f32 and its own roundings count as well.
    b.error = mod.lipschitz * (b.error + u * b.magnitude + kTiny32) +
              2 * mod.roundings * (u * (b.magnitude + mod.offset) + kTiny32);
    b.magnitude = mod.lipschitz * b.magnitude + mod.offset;
  }
  return b;
}

// exp(x) - 1 for x >= 0, infinite when the bound says nothing.
inline double grow(double x) {
  return x < 80 ? std::expm1(x) : std::numeric_limits<double>::infinity();
}

// (1 + a) / (1 - a) - 1 for a relative error a of a numerator and a
// denominator, infinite for a >= 1.
inline double quotient(double a) {
  return a < 1 ? 2 * a / (1 - a) : std::numeric_limits<double>::infinity();
}

struct ForwardErrorBound {
  double out = 0.0;  // on max |out - exact| (out rounded to the output dtype)
  double lse = 0.0;  // on max |lse - exact| over finite entries
};

// The fused forward (online softmax over key blocks) against the exact
// result; `max_out` is max |exact out|.
inline ForwardErrorBound forward_error_bound(ConstTensorView q, ConstTensorView k,
                                             ConstTensorView v, const AttentionOptions& o,
                                             double max_out, const ScoreModBound& mod = {}) {
  const double u = kU32;
  const ScoreErrorBound s = score_error_bound(q, k, o, mod);
  const double nk = static_cast<double>(k.size(1));
  const double blocks = nk;  // rescales of the running sum: at most one per key
  const double keep = 1.0 / (1.0 - o.dropout_p);
  const double vmax = max_abs(v) * keep;
  // Weights relative to each other: the score errors (e^{2d} - 1), and
  // perturbations common to a weight's numerator and denominator use: the
  // rounded argument s - m (|s - m| <= 2M), the exponential (2 ulp = 4u)
  // and each rescale's factor exp(m_old - m_new), likewise.
  const double per_exp = 4 * u + 2 * u * s.magnitude;
  const double consistent = std::pow(1 + per_exp, blocks + 1) - 1;
  const double relative = (1 + grow(2 * s.error)) * (1 + quotient(consistent)) - 1;
  // Roundings apart: the sums of the numerator and of the denominator
  // (each key once, each rescale once), 1 / l, o * (1 / l), dropout's
  // factor and product; weights below 2^-126 flushed to 0 (l >= 1).
  const double sums = gamma_n(nk + blocks + 2);
  const double apart = quotient(sums) + 2 * u + (o.dropout_p > 0 ? 2 * u : 0.0) + nk * 0x1p-125;
  // Underflow in the products P V, the sums, the rescales and the division.
  double tiny = kTiny32 * (2 * nk + 2 * blocks + 4);
  double rounded = 0.0;  // P and v rounded to bf16 on an engine
  if (const EngineTerms engine = engine_terms(q, k, v, o); engine.on) {
    rounded = (1 + kU16) * (1 + engine.inputs) - 1;
    tiny += nk * 0x1p-125 * (1 + vmax);
  }
  const double before_store = ((1 + relative) * (1 + apart) * (1 + rounded) - 1) * vmax + tiny;
  ForwardErrorBound b;
  b.out = or_infinite(before_store + unit_roundoff(q.dtype()) * (max_out + before_store) +
                      underflow(q.dtype()));
  // lse = m + log l: the scores' error moves it by at most d, l's relative
  // error by -log(1 - e), log by 1 ulp of log(l) <= log(Nk + 1), the sum by
  // an ulp of |lse| <= M + log(Nk + 1).
  const double log_n = std::log(nk + 1);
  const double e = (1 + consistent) * (1 + gamma_n(nk + blocks)) - 1 + nk * 0x1p-125;
  b.lse =
      or_infinite(s.error + (e < 1 ? -std::log1p(-e) : std::numeric_limits<double>::infinity()) +
                  2 * u * log_n + u * (s.magnitude + log_n));
  return b;
}

// Sizes of the exact result a backward bound needs, from the reference.
struct BackwardMagnitudes {
  double key_mass = 0.0;     // max_j sum_i P_ij over a KV head's query heads
  double bucket_mass = 0.0;  // largest sum of P_ij over a relative-bias bucket
  double mask_mass = 0.0;    // largest sum of P_bhij over the (b, h, i, j) of a mask element
  double mask_terms = 0.0;   // how many (b, h, i, j) broadcast onto one mask element
  double max_out = 0.0;      // max |out| the backward is given
  double out_error = 0.0;    // max |out given - exact out|
  double lse_error = 0.0;    // max |lse given - exact lse| (finite entries)
  double max_dq = 0.0, max_dk = 0.0, max_dv = 0.0, max_d_bias = 0.0,
         max_d_mask = 0.0;  // exact gradients
};

struct BackwardErrorBound {
  double dq = 0.0, dk = 0.0, dv = 0.0, d_relative_bias = 0.0, d_mask = 0.0;
};

// The fused backward (dot-product scores; the additive score's backward is
// the reference's) against the exact gradients of the exact forward, when
// given `out` and `lse` with the errors in `m`.
inline BackwardErrorBound backward_error_bound(ConstTensorView q, ConstTensorView k,
                                               ConstTensorView v, ConstTensorView dout,
                                               const AttentionOptions& o,
                                               const BackwardMagnitudes& m) {
  const double u = kU32;
  const double tiny = kTiny32;
  const ScoreErrorBound s = score_error_bound(q, k, o);
  const double nq = static_cast<double>(q.size(1));
  const double nk = static_cast<double>(k.size(1));
  const double dv = static_cast<double>(v.size(3));
  const double rows = nq * static_cast<double>(q.size(2) / std::max<std::int64_t>(k.size(2), 1));
  const double keep = 1.0 / (1.0 - o.dropout_p);
  const double scale = std::fabs(o.scale.value_or(
      o.score == Score::scaled_dot ? 1.0 / std::sqrt(static_cast<double>(q.size(3))) : 1.0));
  const double dout_max = max_abs(dout);
  const double q_max = max_abs(q), k_max = max_abs(k);
  // P = exp(s - lse): the score's and the lse's errors, the rounded
  // argument (|s - lse| <= 2M + log(Nk + 1)), the exponential:
  // |P' - P| <= eta P + phi, phi for weights flushed to 0 below 2^-126.
  const double log_n = std::log(nk + 1);
  const double eta =
      (1 + grow(s.error + m.lse_error + u * (2 * s.magnitude + log_n))) * (1 + 4 * u) - 1;
  const double phi = 0x1p-126 + tiny;
  // dP = <dout_i, v_j>, times dropout's factor; D = <dout_i, out_i> from the
  // given out; g = dP - D.
  const double dp_max = dv * dout_max * max_abs(v);
  // On an engine: dout and v rounded to bf16 (dP), P and dS rounded to bf16
  // before their products, q and k rounded too (dK, dQ), and flushes.
  const EngineTerms engine = engine_terms(q, k, v, o);
  const ScoreScaleTerms c = score_scale_terms(engine, k, o);
  const double in = (1 + engine.inputs) * (1 + engine.inputs) - 1;
  const double flush = engine.on ? 0x1p-125 : 0.0;
  const double dp_error = keep * (gamma_n(dv) * dp_max + u * dp_max + 2 * dv * tiny + in * dp_max +
                                  dv * flush * (1 + dp_max));
  const double d_error =
      dv * dout_max * m.out_error + gamma_n(dv) * dv * dout_max * m.max_out + 2 * dv * tiny;
  const double g_max = keep * dp_max + dv * dout_max * m.max_out;
  const double g_error = dp_error + d_error + u * g_max + tiny;
  // dS_ij = P_ij g_ij: error at most P_ij e_s + phi_s (on an engine, dS
  // rounded to bf16 too: kU16 of |dS| more, subnormals flushed).
  const double ds_round = engine.on ? kU16 : 0.0;
  double e_s = eta * g_max + (1 + eta) * (g_error + u * g_max) +
               ds_round * (1 + eta) * (g_max + g_error + u * g_max);
  double phi_s = phi * (g_max + g_error + u * g_max) * (1 + ds_round) + tiny + flush;
  // The bias and mask gradients take dS before the cap.
  const double e_bias = e_s, phi_bias = phi_s;
  if (o.softcap > 0.0) {
    // (1 - t^2) with t = Tanh(raw fl(1/c)) off by e_t; |1 - t^2| <= 1.
    const double e_t = (s.before_cap + 2 * u * s.raw + tiny) / o.softcap + 8 * u + tiny;
    e_s += (1 + eta) * g_max * (2 * e_t + e_t * e_t + 2 * u);
    phi_s =
        phi_s * (1 + 2 * e_t + e_t * e_t + 2 * u) + phi * g_max * (2 * e_t + e_t * e_t) + 2 * tiny;
  }
  // Sums over keys (dq, and the four key chunks' buffers) or over a KV
  // head's query rows (dk, dv), then the scale in f32 (u relative, t
  // absolute on the sum), then the output rounding.
  const auto finish = [&](double err, double exact_max, DType out) {
    return or_infinite(err + unit_roundoff(out) * (exact_max + err) + underflow(out));
  };
  // With score_scale, dS is the scaled scores' (|c| times the raw scores'),
  // dk's x is c q (rounded by c.rounding instead of the engine's inputs) and
  // dq = c dq': both sums carry the factor c as if it were in the scale.
  const double scale_c = scale * c.c;
  const auto gradient = [&](double x_max, double x_rounding, double count, double mass,
                            double sum) {
    // x (q or k) rounded to bf16 on an engine: its size grows by `inputs`.
    const double x_err = x_rounding * x_max;
    const double raw = (x_max + x_err) * (mass * (e_s + sum * (1 + eta) * g_max) +
                                          count * phi_s * (1 + sum) + count * phi * g_max * sum) +
                       x_err * mass * (1 + eta) * g_max + 2 * count * tiny + count * flush;
    const double size = x_max * (mass * (1 + eta) * g_max + count * phi_s) + raw;
    return scale_c * raw + (u * scale_c + tiny) * size + tiny;
  };
  BackwardErrorBound b;
  const double sum_q = gamma_n(rows + 2);
  // On an engine P is rounded to bf16 before dV += P^T dout, and dout too.
  const double p_round = engine.on ? (1 + kU16) * (1 + engine.inputs) - 1 : 0.0;
  b.dv = finish(keep * dout_max *
                        (((1 + eta) * (1 + u) * (1 + sum_q) * (1 + p_round) - 1) * m.key_mass +
                         rows * phi * (1 + u) * (1 + sum_q) * (1 + p_round)) +
                    2 * rows * tiny + rows * flush,
                m.max_dv, dout.dtype());
  const double dq = gradient(k_max, engine.inputs, nk, 1.0, gamma_n(nk + 6));
  // dq' rounded to f32 before dq = c dq' (in double).
  const double dq_scaled = o.score_scale.empty() ? 0.0 : u * (m.max_dq + dq) + tiny;
  b.dq = finish(dq + dq_scaled, m.max_dq, q.dtype());
  b.dk = finish(
      gradient(q_max, o.score_scale.empty() ? engine.inputs : c.rounding, rows, m.key_mass, sum_q),
      m.max_dk, k.dtype());
  // Sums of dS over `terms` pairs whose weights add up to `mass`, in
  // double (bounded as f32 sums), rounded to f32.
  const auto summed = [&](double mass, double terms, double exact_max) {
    const double sum_b = gamma_n(terms + 2);
    return finish(mass * (e_bias + sum_b * (1 + eta) * g_max) +
                      terms * (phi_bias * (1 + sum_b) + phi * g_max * sum_b + 2 * tiny),
                  exact_max, DType::f32);
  };
  b.d_relative_bias = summed(m.bucket_mass, static_cast<double>(q.size(0)) * nq * nk, m.max_d_bias);
  b.d_mask = summed(m.mask_mass, m.mask_terms, m.max_d_mask);
  return b;
}

}  // namespace qkv::test
