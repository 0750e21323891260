// Fuzzes qkv::attention_backward and attention_backward_into: a fuzzed
// forward (every differentiable option of AttentionOptions, any dtype and
// layout) gives out and lse (or neither, for the backward to compute),
// then the backward runs with a fuzzed dout, strided gradient views, and
// sometimes bad input (missing, extra, aliasing or malformed gradient views,
// wrong dout or lse).
//
// Checks: only qkv::Error escapes; a rejected call leaves every gradient view
// bitwise unchanged and a call that must be rejected is; inputs are never
// written, nor gradient memory outside the views; finite inputs give finite
// gradients (every element written: the views start as NaN sentinels); on
// small problems the fast backward is within the worst-case error bound of
// the reference (error_bound.hpp) and equals, bitwise, the allocating call on another
// thread count; the reference backward from the forward's f32 lse stays
// within rounding of the reference in double.
#include "core/capabilities.hpp"
#include "fuzz_common.hpp"

namespace {

using qkv::AttentionOptions;
using qkv::AttentionResult;
using qkv::ConstTensorView;
using qkv::DType;
using qkv::Tensor;
using qkv::fuzz::Arg;
using qkv::fuzz::AttentionCase;
using qkv::fuzz::finding;
using qkv::fuzz::Input;
using qkv::fuzz::require;

// The parameter rows' gradient fields (QKV_ATTENTION_PARAMETERS), in order.
constexpr const char* kParameterNames[] = {
#define QKV_FUZZ_NAME(gradient, sizes, used, option, doc) #gradient,
    QKV_ATTENTION_PARAMETERS(QKV_FUZZ_NAME)
#undef QKV_FUZZ_NAME
};
constexpr qkv::TensorView qkv::GradientOutputs::*kParameterViews[] = {
#define QKV_FUZZ_VIEW(gradient, sizes, used, option, doc) &qkv::GradientOutputs::gradient,
    QKV_ATTENTION_PARAMETERS(QKV_FUZZ_VIEW)
#undef QKV_FUZZ_VIEW
};
constexpr Tensor qkv::AttentionGradients::*kParameterTensors[] = {
#define QKV_FUZZ_TENSOR(gradient, sizes, used, option, doc) &qkv::AttentionGradients::gradient,
    QKV_ATTENTION_PARAMETERS(QKV_FUZZ_TENSOR)
#undef QKV_FUZZ_TENSOR
};
constexpr std::size_t kParameters = std::size(kParameterNames);

// The gradient views of an _into call, each an Arg (sentinel-filled): dq,
// dk, dv and one per parameter row (undefined where not given).
struct Grads {
  Arg dq, dk, dv;
  std::array<Arg, kParameters> parameters;
  std::vector<Arg*> all() {
    std::vector<Arg*> a = {&dq, &dk, &dv};
    for (Arg& p : parameters) a.push_back(&p);
    return a;
  }
  qkv::GradientOutputs views() const {
    qkv::GradientOutputs g{.dq = dq.view, .dk = dk.view, .dv = dv.view};
    for (std::size_t i = 0; i < kParameters; ++i) g.*kParameterViews[i] = parameters[i].view;
    return g;
  }
};

Grads make_grads(Input& in, AttentionCase& c) {
  const DType stat = c.dtype == DType::f64 ? DType::f64 : DType::f32;
  Grads g;
  g.dq = qkv::fuzz::make_output(in, {c.batch, c.nq, c.hq, c.dq}, c.dtype);
  g.dk = qkv::fuzz::make_output(in, {c.batch, c.nk, c.hkv, c.dk}, c.dtype);
  g.dv = qkv::fuzz::make_output(in, {c.batch, c.nk, c.hkv, c.dv}, c.dtype);
  // The parameter gradients the call needs, as the library lists them.
  std::vector<qkv::ParameterGradient> used;
  qkv::fuzz::accepted("parameter_gradients",
                      [&] { used = qkv::parameter_gradients(c.q, c.k, c.v, c.opt); });
  for (const qkv::ParameterGradient& u : used) {
    for (std::size_t i = 0; i < kParameters; ++i) {
      if (std::string_view(u.name) == kParameterNames[i]) {
        g.parameters[i] = qkv::fuzz::make_output(in, u.sizes, stat);
      }
    }
  }
  if (!in.one_in(8)) return g;
  const std::vector<Arg*> views = g.all();
  Arg& victim =
      *views[static_cast<std::size_t>(in.range(0, static_cast<std::int64_t>(views.size()) - 1))];
  switch (in.range(0, 2)) {
    case 0:
      if (victim.view.defined()) {
        // Missing where required.
        victim = Arg();
        c.reject("a required gradient view missing");
      } else {
        // Given where the options have no such parameter.
        victim = qkv::fuzz::make_output(in, {2}, stat);
        c.reject("a gradient view the options do not use");
      }
      break;
    case 1: {
      const Arg* const inputs[] = {&c.q, &c.k, &c.v, &g.dq};
      qkv::fuzz::alias_into(victim, *inputs[in.range(0, 3)]);
      if (victim.aliased) c.reject("a gradient view aliasing an input or another gradient");
      break;
    }
    default: {
      const bool empty = victim.view.numel() == 0;
      const qkv::fuzz::BadView bad = qkv::fuzz::bad_view(in);
      const bool defined = victim.view.defined();
      qkv::fuzz::make_bad(in, victim, bad);
      if (defined && (bad == qkv::fuzz::BadView::overflow || victim.aliased ||
                      bad == qkv::fuzz::BadView::undefined ||
                      (bad == qkv::fuzz::BadView::null_data && !empty))) {
        c.reject("a bad gradient view");
      }
      break;
    }
  }
  return g;
}

// A copy of a forward result in a fuzzed (non-overlapping) layout.
Arg relayout(Input& in, ConstTensorView t) {
  Arg a = qkv::fuzz::make_output(in, t.size_span(), t.dtype());
  qkv::copy(t, a.view);
  return a;
}

// Whether the backward ran a fast kernel (automatic runs the reference for
// f64, and for additive scores with dropout, softcap or a relative bias:
// the dispatch of src/api/backward.cpp).
bool runs_fast(const AttentionCase& c) {
  return c.opt.backend == qkv::Backend::fast ||
         (c.opt.backend == qkv::Backend::automatic && c.dtype != DType::f64 &&
          (c.opt.score != qkv::Score::additive ||
           qkv::detail::supports_all(qkv::detail::Path::additive_backward, c.opt)));
}

// Gradients of 16-bit formats overflow legitimately when the inputs are
// large: every bound below must stay inside the format.
bool gradients_bounded(const AttentionCase& c, double dout_magnitude) {
  if (c.dtype == DType::f32 || c.dtype == DType::f64) return true;
  const double scale = std::max(1.0, std::fabs(c.opt.scale.value_or(1.0)));
  const double bound = scale * static_cast<double>(c.nq + c.nk + 1) * 2.0 *
                       static_cast<double>(c.dv + 1) * dout_magnitude * c.v_magnitude *
                       std::max(1.0, c.qk_magnitude) / (1.0 - c.opt.dropout_p) *
                       (c.opt.score == qkv::Score::additive ? 1e3 : 1.0);
  return bound < (c.dtype == DType::f16 ? 3e4 : 1e30);
}

// The reference backward is fed the forward's out and lse (rounded to the
// dtype and f32, and carrying the forward's own error, which the fast
// forward's is); it accumulates in double and rounds once, so its gradients
// stay within what those inputs' errors move them by, plus rounding, of the
// reference computed in double throughout.
void check_reference_rounding(const AttentionCase& c, ConstTensorView out, ConstTensorView lse,
                              ConstTensorView dout, const qkv::AttentionGradients& g) {
  AttentionOptions o = c.opt;
  o.backend = qkv::Backend::reference;
  o.return_lse = true;
  const Tensor q = qkv::test::f64(c.q.cview()), k = qkv::test::f64(c.k.cview()),
               v = qkv::test::f64(c.v.cview());
  const AttentionResult fwd = qkv::attention(q, k, v, o);
  const qkv::AttentionGradients ref =
      qkv::attention_backward(q, k, v, fwd.out, qkv::test::f64(dout), fwd.lse, o);
  // Rounding of the result, plus the double computation's own cancellation.
  const double base = std::ldexp(1.0, -40) * (1.0 + qkv::test::max_abs(dout)) *
                      (1.0 + c.v_magnitude) * (1.0 + c.qk_magnitude) *
                      static_cast<double>(c.nq + c.nk + c.dv + 1);
  // The given out and lse differ from the exact ones by what was measured:
  // P_ij = exp(s_ij - lse_i) moves by a factor e^{lse error}, and
  // D_i = <dout_i, out_i> by Dv max|dout| (out error). Every dS_ij =
  // P_ij (dP_ij - D_i), |dP_ij - D_i| <= Dv max|dout| (max|v| + max|out|),
  // inherits both, and dq, dk take them through the score's partial
  // derivatives: scale |k| or scale |q| for dot products, sum_a |v_a| |W|
  // (tanh' <= 1) for the additive score, summed over a column's
  // probability mass (at most Nq per query head of the KV head's group) for
  // dk; dv = sum_i P_ij dout_i takes the first over the same mass.
  int mismatches = 0;
  const double out_error = qkv::test::finite_diff(out, fwd.out, &mismatches);
  const double lse_error = qkv::test::finite_diff(lse, fwd.lse, &mismatches);
  const double dout_max = qkv::test::max_abs(dout);
  const double dv = static_cast<double>(c.dv);
  const double p_error = std::expm1(lse_error);
  const double ds_error = dv * dout_max * (c.v_magnitude + qkv::test::max_abs(out)) * p_error +
                          dv * dout_max * out_error;
  const double scale = std::fabs(c.opt.scale.value_or(
      c.opt.score == qkv::Score::scaled_dot && c.dk > 0 ? 1.0 / std::sqrt(static_cast<double>(c.dk))
                                                        : 1.0));
  const double partials =
      c.opt.score == qkv::Score::additive
          ? static_cast<double>(c.add_v.view.numel()) * qkv::test::max_abs(c.add_v.cview()) *
                std::max(qkv::test::max_abs(c.w_q.cview()), qkv::test::max_abs(c.w_k.cview()))
          : scale * c.qk_magnitude;
  const double rows = static_cast<double>((c.nq + 1) * (c.hq / c.hkv));
  const auto check = [&](const char* name, const Tensor& got, const Tensor& want, double floor) {
    const double err = qkv::test::max_abs_diff(got, want);
    const double bound = 2.0 * qkv::test::unit_roundoff(c.dtype) * qkv::test::max_abs(want) + floor;
    require(err <= bound, std::string("reference backward ") + name + " is " + std::to_string(err) +
                              " from the reference in double (bound " + std::to_string(bound) +
                              "; out error " + std::to_string(out_error) + ", lse error " +
                              std::to_string(lse_error) + "): " + c.text);
  };
  check("dq", g.dq, ref.dq, base + ds_error * partials * rows);
  check("dk", g.dk, ref.dk, base + ds_error * partials * rows);
  check("dv", g.dv, ref.dv, base + p_error * rows * dout_max);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Input in(data, size);
  qkv::fuzz::fuzz_threads(in);
  AttentionCase c;
  qkv::fuzz::fuzz_case(in, c, true);
  AttentionOptions fwd_opt = c.opt;
  fwd_opt.return_lse = true;
  AttentionResult fwd;
  const bool forward_ok = qkv::fuzz::accepted(
      "attention (forward)", [&] { fwd = qkv::attention(c.q, c.k, c.v, fwd_opt); });
  if (!forward_ok) {
    // The backward validates on its own: give it stand-ins of the right
    // shapes when they are cheap to make.
    if (!qkv::fuzz::small_enough({c.batch, c.nq, c.hq, c.dv}, 1 << 16) || c.batch < 0 || c.nq < 0 ||
        c.hq < 0 || c.dv < 0 || !qkv::is_floating(c.dtype)) {
      return 0;
    }
    fwd.out = Tensor(c.dtype, {c.batch, c.nq, c.hq, c.dv});
    fwd.lse = Tensor(c.dtype == DType::f64 ? DType::f64 : DType::f32, {c.batch, c.hq, c.nq});
  }
  Arg out = relayout(in, fwd.out);
  Arg lse = relayout(in, fwd.lse);
  qkv::fuzz::Values vd = qkv::fuzz::values(in, true, 30.0);
  Arg dout = qkv::fuzz::make_input(in, fwd.out.view().size_span(), c.dtype, vd);
  // Whether out, dout or lse was replaced by a malformed view (which
  // validation may accept: then it is not the forward's).
  bool replaced = false;
  if (in.one_in(16)) {
    replaced = true;
    Arg* const extras[] = {&out, &dout, &lse};
    Arg& victim = *extras[in.range(0, 2)];
    const bool empty = victim.view.numel() == 0;
    const qkv::fuzz::BadView bad = qkv::fuzz::bad_view(in);
    qkv::fuzz::make_bad(in, victim, bad);
    if (bad == qkv::fuzz::BadView::overflow || bad == qkv::fuzz::BadView::undefined ||
        (bad == qkv::fuzz::BadView::null_data && !empty)) {
      c.reject("a bad out, dout or lse view");
    }
  }
  // Or neither out nor lse: the backward computes them (without a forward
  // for the additive score with key_lengths only, so not bitwise the
  // given-out call's gradients; only the accuracy check below applies).
  const bool recompute = !replaced && in.one_in(8);
  if (recompute) out = lse = Arg{};
  const bool into = in.coin();
  Grads g;
  if (into) g = make_grads(in, c);

  qkv::fuzz::Snapshot inputs;
  for (const Arg* a : c.inputs()) inputs.add(*a);
  for (const Arg* a : {&out, &lse, &dout}) inputs.add(*a);
  qkv::fuzz::Snapshot outputs;
  for (const Arg* a : g.all()) outputs.add(*a);

  qkv::AttentionGradients r;
  const bool ok = qkv::fuzz::accepted("attention_backward", [&] {
    if (into) {
      qkv::attention_backward_into(c.q, c.k, c.v, out, dout, lse, g.views(), c.opt);
    } else {
      r = qkv::attention_backward(c.q, c.k, c.v, out, dout, lse, c.opt);
    }
  });
  if (ok && !c.must_reject.empty()) {
    finding("attention_backward accepted " + c.must_reject + ": " + c.text);
  }
  inputs.require_unchanged("attention_backward (inputs): " + c.text);
  if (!ok) {
    outputs.require_unchanged("attention_backward that threw qkv::Error (gradients): " + c.text);
    return 0;
  }
  for (const Arg* a : g.all()) {
    require(qkv::fuzz::gaps_untouched(*a),
            "attention_backward wrote outside a gradient view: " + c.text);
  }
  if (into) {
    // The checks below read the allocating overload's result type.
    r.dq = qkv::to_dtype(g.dq.view, c.dtype);
    r.dk = qkv::to_dtype(g.dk.view, c.dtype);
    r.dv = qkv::to_dtype(g.dv.view, c.dtype);
    for (std::size_t i = 0; i < kParameters; ++i) {
      const Arg& a = g.parameters[i];
      if (a.view.defined()) r.*kParameterTensors[i] = qkv::to_dtype(a.view, a.view.dtype());
    }
  }
  const bool finite = forward_ok && c.finite_expected && c.inputs_finite() && dout.finite &&
                      gradients_bounded(c, vd.magnitude);
  if (finite) {
    for (const Arg* a : g.all()) qkv::fuzz::require_finite(a->view, "gradient: " + c.text);
    for (const Tensor* t : {&r.dq, &r.dk, &r.dv}) {
      qkv::fuzz::require_finite(t->view(), "gradient: " + c.text);
    }
    for (Tensor qkv::AttentionGradients::*t : kParameterTensors) {
      qkv::fuzz::require_finite((r.*t).view(), "gradient: " + c.text);
    }
  }
  const bool small = qkv::fuzz::small_enough({c.batch, c.hq, c.nq, c.nk, c.dq + c.dv}, 50000);
  if (!finite || !small || !c.comparable) return 0;
  if (runs_fast(c)) {
    qkv::test::expect_backward_matches(c.q, c.k, c.v, c.opt, c.text, 5,
                                       qkv::test::Rule::worst_case);
    if (recompute) return 0;
    // The same call, allocating, on another thread count.
    qkv::fuzz::fuzz_threads(in);
    AttentionOptions o = c.opt;
    o.backend = qkv::Backend::fast;
    const qkv::AttentionGradients again = qkv::attention_backward(c.q, c.k, c.v, out, dout, lse, o);
    bool same = qkv::fuzz::same_values(again.dq, r.dq) && qkv::fuzz::same_values(again.dk, r.dk) &&
                qkv::fuzz::same_values(again.dv, r.dv);
    for (std::size_t i = 0; i < kParameters; ++i) {
      same = same && qkv::fuzz::same_values(again.*kParameterTensors[i], r.*kParameterTensors[i]);
    }
    require(same,
            "fast backward differs from the same call made allocating on another thread "
            "count: " +
                c.text);
  } else if (c.dtype != DType::f64 && !replaced && !recompute) {
    check_reference_rounding(c, out, lse, dout, r);
  }
  return 0;
}
