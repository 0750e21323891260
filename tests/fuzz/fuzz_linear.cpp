// Fuzzes linear attention: linear_attention, linear_attention_into (with a
// final state), linear_attention_step[_into] from a state, and
// linear_attention_backward[_into], over the feature maps (elu + 1, relu, a
// custom map with and without its vjp), causal and not, normalize, eps,
// chunk, backends, any dtype and layout, and bad input (shapes, states,
// out-of-range enums, aliasing and malformed outputs).
//
// Checks: only qkv::Error escapes; a rejected call leaves outputs and the
// state bitwise unchanged, and one that must be rejected is; inputs are
// never written, nor output memory outside the views; finite inputs with
// the built-in maps give finite results; on small problems the fast forward
// meets the tolerance policy against the reference in double
// (reference::naive_linear_attention as the naive computation), and every
// fast result is bitwise the same on another thread count.
#include "api/validate.hpp"
#include "fuzz_common.hpp"
#include "reference/linear.hpp"

namespace {

using qkv::ConstTensorView;
using qkv::DType;
using qkv::FeatureMap;
using qkv::LinearAttentionOptions;
using qkv::LinearAttentionState;
using qkv::Tensor;
using qkv::fuzz::Arg;
using qkv::fuzz::finding;
using qkv::fuzz::Input;
using qkv::fuzz::require;

// A custom map with positive features: phi(x) = (x_0^2, ..., x_{D-1}^2, 1).
qkv::CustomFeatureMap squares(std::int64_t d, bool with_vjp) {
  qkv::CustomFeatureMap m;
  m.features = d + 1;
  m.map = [](std::span<const double> x, std::span<double> phi) {
    for (std::size_t i = 0; i < x.size(); ++i) phi[i] = x[i] * x[i];
    phi[x.size()] = 1.0;
  };
  if (with_vjp) {
    m.vjp = [](std::span<const double> x, std::span<const double> dphi, std::span<double> dx) {
      for (std::size_t i = 0; i < x.size(); ++i) dx[i] = 2.0 * x[i] * dphi[i];
    };
  }
  return m;
}

struct Case {
  DType dtype = DType::f32;
  std::int64_t batch = 1, nq = 1, nk = 1, hq = 1, hkv = 1, d = 1, dv = 1;
  Arg q, k, v, dout;
  LinearAttentionOptions opt;
  std::string must_reject;
  bool finite_expected = true;
  double magnitude = 1.0;

  void reject(const std::string& why) {
    if (must_reject.empty()) must_reject = why;
  }
  std::int64_t features() const { return opt.feature_map == FeatureMap::custom ? d + 1 : d; }
  // A description for findings.
  std::string text() const {
    return std::string(qkv::dtype_name(dtype)) + " B=" + std::to_string(batch) +
           " Nq=" + std::to_string(nq) + " Nk=" + std::to_string(nk) + " Hq=" + std::to_string(hq) +
           " Hkv=" + std::to_string(hkv) + " D=" + std::to_string(d) + " Dv=" + std::to_string(dv) +
           " map=" + std::to_string(static_cast<int>(opt.feature_map)) +
           " causal=" + std::to_string(opt.causal) + " normalize=" + std::to_string(opt.normalize) +
           " eps=" + std::to_string(opt.eps) + " chunk=" + std::to_string(opt.chunk) +
           " backend=" + std::to_string(static_cast<int>(opt.backend)) +
           " magnitude=" + std::to_string(magnitude);
  }
};

void fuzz_case(Input& in, Case& c) {
  static constexpr DType kTypes[] = {DType::f32, DType::f32, DType::bf16, DType::f16, DType::f64};
  c.dtype = in.pick(kTypes);
  c.hkv = in.range(1, 2);
  c.hq = c.hkv * in.range(1, 3);
  c.d = in.size(16, 40);
  c.dv = in.coin() ? c.d : in.size(16, 40);
  c.batch = in.size(2, 4);
  c.nq = in.size(24, 90);
  c.opt.causal = in.coin();
  c.nk = c.opt.causal || in.coin() ? c.nq : in.size(24, 90);
  switch (in.range(0, 3)) {
    case 0:
      c.opt.feature_map = FeatureMap::relu;
      break;
    case 1:
      c.opt.feature_map = FeatureMap::custom;
      c.opt.custom = squares(c.d, in.coin());
      if (in.one_in(10)) {
        c.opt.custom.features = in.param(0, 3);
        if (c.opt.custom.features != c.d + 1) {
          // Either rejected or a map writing past M: the map writes D + 1.
          c.opt.custom = squares(c.d, false);
          c.opt.custom.map = nullptr;
          c.reject("custom map without its callable");
        }
      }
      break;
    default:
      break;
  }
  if (c.opt.feature_map != FeatureMap::custom && in.one_in(8)) {
    c.opt.custom = squares(c.d, true);
    c.reject("a custom map with a built-in one");
  }
  c.opt.normalize = !in.one_in(4);
  if (in.one_in(6)) {
    c.opt.eps = in.one_in(3) ? in.extreme_real() : 1e-3;
    if (!(c.opt.eps >= 0.0) || !std::isfinite(c.opt.eps)) c.reject("eps");
    if (c.opt.eps > 1e30) c.finite_expected = false;
  }
  if (in.one_in(5)) {
    c.opt.chunk = in.param(1, 80);
    if (c.opt.chunk < 1 || c.opt.chunk > 1024) c.reject("chunk");
  }
  static constexpr qkv::Backend kBackends[] = {qkv::Backend::automatic, qkv::Backend::fast,
                                               qkv::Backend::reference};
  c.opt.backend = in.pick(kBackends);
  if (c.opt.backend == qkv::Backend::fast && c.dtype == DType::f64) c.reject("fast with f64");
  if (in.one_in(30)) {
    if (in.coin()) {
      c.opt.feature_map = static_cast<FeatureMap>(in.range(3, 255));
    } else {
      c.opt.backend = static_cast<qkv::Backend>(in.range(3, 255));
    }
    c.reject("out-of-range enum");
  }
  if (c.opt.causal && in.one_in(20)) {
    c.nk = c.nq + 1;
    c.reject("causal with Nq != Nk");
  }
  const qkv::fuzz::Values vals = qkv::fuzz::values(in, true, c.dtype == DType::f16 ? 8.0 : 30.0);
  c.magnitude = vals.magnitude;
  c.q = qkv::fuzz::make_input(in, {c.batch, c.nq, c.hq, c.d}, c.dtype, vals);
  c.k = qkv::fuzz::make_input(in, {c.batch, c.nk, c.hkv, c.d}, c.dtype, vals);
  c.v = qkv::fuzz::make_input(in, {c.batch, c.nk, c.hkv, c.dv}, c.dtype,
                              qkv::fuzz::values(in, true, c.dtype == DType::f16 ? 8.0 : 1e4));
  if (in.one_in(20)) {
    Arg* const args[] = {&c.q, &c.k, &c.v};
    Arg& victim = *args[in.range(0, 2)];
    const bool empty = victim.view.numel() == 0;
    const qkv::fuzz::BadView bad = qkv::fuzz::bad_view(in);
    qkv::fuzz::make_bad(in, victim, bad);
    if (bad == qkv::fuzz::BadView::undefined || bad == qkv::fuzz::BadView::overflow ||
        (bad == qkv::fuzz::BadView::null_data && !empty)) {
      c.reject("bad q, k or v view");
    }
  }
  // A custom map squares its inputs (features up to 900 * D); with relu and
  // no keys seen, the normalizer is eps.
  if (c.opt.feature_map == FeatureMap::custom && c.magnitude > 8.0) c.finite_expected = false;
  // Unnormalized sums sum_j <a_i, b_j> v_j pass f16's 65504 at these sizes.
  if (!c.opt.normalize && c.dtype == DType::f16) c.finite_expected = false;
  if (c.opt.feature_map == FeatureMap::relu && c.opt.normalize && c.opt.eps < 1e-30) {
    c.finite_expected = false;
  }
}

bool inputs_finite(const Case& c) { return c.q.finite && c.k.finite && c.v.finite; }

// An output view, sometimes made bad; returns whether that must be rejected.
bool maybe_bad_output(Input& in, Arg& out, const Arg& input) {
  if (!in.one_in(10) || !out.view.defined()) return false;
  switch (in.range(0, 2)) {
    case 0: {
      const bool empty = out.view.numel() == 0;
      const qkv::fuzz::BadView bad = qkv::fuzz::bad_view(in);
      qkv::fuzz::make_bad(in, out, bad);
      return bad == qkv::fuzz::BadView::overflow || bad == qkv::fuzz::BadView::undefined ||
             out.aliased || (bad == qkv::fuzz::BadView::null_data && !empty);
    }
    case 1:
      qkv::fuzz::alias_into(out, input);
      return out.aliased;
    default: {
      std::vector<std::int64_t> sizes(out.view.size_span().begin(), out.view.size_span().end());
      sizes.back() += 1;
      out = qkv::fuzz::make_output(in, sizes, out.view.dtype());
      return true;
    }
  }
}

// The forward's policy check (small problems in the statistical regime) and
// its exact part (non-finite exactly where the reference) otherwise.
void check_forward(const Case& c, ConstTensorView out) {
  if (c.dtype == DType::f64 || !inputs_finite(c) || !c.finite_expected) return;
  if (!qkv::fuzz::small_enough({c.batch, c.hq, c.nq, c.nk, c.features() + c.dv}, 400000)) return;
  LinearAttentionOptions ref_opt = c.opt;
  ref_opt.backend = qkv::Backend::reference;
  ref_opt.return_state = false;
  const Tensor ref = qkv::linear_attention(qkv::test::f64(c.q.cview()), qkv::test::f64(c.k.cview()),
                                           qkv::test::f64(c.v.cview()), ref_opt)
                         .out;
  const qkv::detail::LinearProblem p = qkv::detail::check_linear_inputs(c.q, c.k, c.v, c.opt);
  Tensor naive(c.dtype, out.size_span());
  qkv::reference::naive_linear_attention(p, c.q, c.k, c.v, naive, c.opt, c.dtype);
  // The naive computation rounds features, weights and sums to f16 for f16
  // inputs: the policy applies while they stay inside its range.
  const double feature =
      c.opt.feature_map == FeatureMap::custom ? c.magnitude * c.magnitude : c.magnitude + 1.0;
  const double sums = static_cast<double>(c.nk * c.features()) * feature * feature *
                      std::max(1.0, qkv::test::max_abs(c.v.cview()));
  const bool representable = c.dtype != DType::f16 || sums < 3e4;
  // The policy is a statistical rule for random data: on structured values
  // (q = k = 0 makes every elu + 1 feature exactly 1, ties, small integers,
  // mostly zeros) the naive computation may round almost nothing and is no
  // yardstick, so only the exact part applies there.
  const bool random_values = !c.q.structured && !c.k.structured && !c.v.structured;
  const bool statistical = c.batch * c.nq * c.hq * c.dv >= 256 && c.nk >= 8 && c.magnitude <= 8.0 &&
                           random_values && representable;
  if (statistical) {
    // Normalized outputs are convex combinations of v rows (the built-in
    // and the squares maps have non-negative weights): a tiny output that is
    // a mean of larger values carries rounding at the values' magnitude. The
    // fused kernels associate them as phi(q)^T (sum_j phi(k_j) v_j^T) over
    // phi(q)^T sum_j phi(k_j) + eps, in f32: each term of the numerator's
    // sums over Nk keys and then F features is at most its share of the
    // denominator times max|v|, so the numerator is off by at most
    // g(Nk + F) den max|v|, and the quotient (with the denominator's own
    // sums and the division) by at most 2 g(Nk + F + 2) max|v|, plus the
    // output's rounding. The naive computation weighs each key separately
    // and may round far less, so the policy's rule alone would hold the
    // fused kernels to less than their association allows.
    const double max_v = qkv::test::max_abs(c.v.cview());
    const double roundings = static_cast<double>(c.nk + c.features() + 2);
    const double floor =
        c.opt.normalize
            ? (qkv::test::unit_roundoff(c.dtype) + 2 * qkv::test::gamma_n(roundings)) * max_v
            : 0.0;
    qkv::fuzz::expect_within_policy(out, ref, naive, c.dtype, floor,
                                    "linear_attention: " + c.text());
  } else {
    int mismatches = 0;
    qkv::test::finite_diff(out, ref, &mismatches);
    require(mismatches == 0, "linear_attention: infinities or NaNs differ from the reference");
  }
}

void run_forward(Input& in, Case& c) {
  const bool into = in.coin();
  Arg out;
  LinearAttentionState state;
  bool with_state = false;
  if (into) {
    out = qkv::fuzz::make_output(in, {c.batch, c.nq, c.hq, c.dv}, c.dtype);
    if (maybe_bad_output(in, out, c.q)) c.reject("bad out view");
    with_state = in.coin();
    if (with_state) {
      const DType sd = c.dtype == DType::f64 ? DType::f64 : DType::f32;
      state = qkv::linear_attention_state(c.batch, c.hkv, c.features(), c.dv, sd);
      if (!c.opt.causal) c.reject("a final state without causal");
    }
  } else {
    c.opt.return_state = in.coin();
    if (c.opt.return_state && !c.opt.causal) c.reject("return_state without causal");
  }
  const qkv::fuzz::Snapshot inputs{&c.q, &c.k, &c.v};
  const qkv::fuzz::Snapshot outputs{&out};
  const Tensor s_before = state.s, z_before = state.z;
  qkv::LinearAttentionResult r;
  const bool ok = qkv::fuzz::accepted("linear_attention", [&] {
    if (into) {
      qkv::linear_attention_into(c.q, c.k, c.v, out, c.opt, with_state ? &state : nullptr);
    } else {
      r = qkv::linear_attention(c.q, c.k, c.v, c.opt);
    }
  });
  inputs.require_unchanged("linear_attention (inputs)");
  if (!ok) {
    outputs.require_unchanged("linear_attention that threw (out)");
    require(!with_state || (qkv::fuzz::same_values(state.s, s_before) &&
                            qkv::fuzz::same_values(state.z, z_before)),
            "linear_attention that threw changed the state");
    return;
  }
  require(c.must_reject.empty(), "linear_attention accepted " + c.must_reject);
  require(qkv::fuzz::gaps_untouched(out), "linear_attention wrote outside out");
  const ConstTensorView o = into ? out.cview() : ConstTensorView(r.out);
  if (inputs_finite(c) && c.finite_expected) {
    qkv::fuzz::require_finite(o, "linear_attention out: " + c.text());
    if (with_state) qkv::fuzz::require_finite(state.s, "linear_attention state");
  }
  qkv::fuzz::fuzz_threads(in);
  LinearAttentionOptions again = c.opt;
  again.return_state = false;
  const Tensor o2 = qkv::linear_attention(c.q, c.k, c.v, again).out;
  require(qkv::fuzz::same_values(o, o2),
          "linear_attention differs for another thread count or the allocating call");
  check_forward(c, o);
}

void run_step(Input& in, Case& c) {
  const DType sd = c.dtype == DType::f64 ? DType::f64 : DType::f32;
  LinearAttentionState state;
  if (!qkv::fuzz::accepted("linear_attention_state", [&] {
        state = qkv::linear_attention_state(c.batch, c.hkv, c.features(), c.dv, sd);
      })) {
    finding("linear_attention_state rejected a valid shape");
  }
  if (in.one_in(12)) {
    state = qkv::linear_attention_state(c.batch, c.hkv + 1, c.features(), c.dv, sd);
    c.reject("a state of the wrong shape");
  }
  if (!c.opt.causal) c.reject("a step without causal");
  if (c.nq != c.nk) c.reject("a step with Nq != Nk");
  const bool into = in.coin();
  Arg out;
  if (into) {
    out = qkv::fuzz::make_output(in, {c.batch, c.nq, c.hq, c.dv}, c.dtype);
    if (maybe_bad_output(in, out, c.q)) c.reject("bad out view");
  }
  const Tensor s_before = state.s, z_before = state.z;
  const qkv::fuzz::Snapshot inputs{&c.q, &c.k, &c.v};
  const qkv::fuzz::Snapshot outputs{&out};
  Tensor r;
  const bool ok = qkv::fuzz::accepted("linear_attention_step", [&] {
    if (into) {
      qkv::linear_attention_step_into(c.q, c.k, c.v, state, out, c.opt);
    } else {
      r = qkv::linear_attention_step(c.q, c.k, c.v, state, c.opt);
    }
  });
  inputs.require_unchanged("linear_attention_step (inputs)");
  if (!ok) {
    outputs.require_unchanged("linear_attention_step that threw (out)");
    require(qkv::fuzz::same_values(state.s, s_before) && qkv::fuzz::same_values(state.z, z_before),
            "linear_attention_step that threw changed the state");
    return;
  }
  require(c.must_reject.empty(), "linear_attention_step accepted " + c.must_reject);
  require(qkv::fuzz::gaps_untouched(out), "linear_attention_step wrote outside out");
  if (inputs_finite(c) && c.finite_expected) {
    qkv::fuzz::require_finite(into ? out.cview() : ConstTensorView(r), "linear_attention_step out");
    qkv::fuzz::require_finite(state.s, "linear_attention_step state s");
    qkv::fuzz::require_finite(state.z, "linear_attention_step state z");
  }
}

void run_backward(Input& in, Case& c) {
  c.dout =
      qkv::fuzz::make_input(in, {c.batch, c.nq, c.hq, c.dv}, c.dtype, qkv::fuzz::values(in, true));
  if (c.opt.feature_map == FeatureMap::custom && !c.opt.custom.vjp) {
    c.reject("a custom map without its vjp");
  }
  const bool into = in.coin();
  Arg dq, dk, dv;
  if (into) {
    dq = qkv::fuzz::make_output(in, {c.batch, c.nq, c.hq, c.d}, c.dtype);
    dk = qkv::fuzz::make_output(in, {c.batch, c.nk, c.hkv, c.d}, c.dtype);
    dv = qkv::fuzz::make_output(in, {c.batch, c.nk, c.hkv, c.dv}, c.dtype);
    Arg* const grads[] = {&dq, &dk, &dv};
    Arg& victim = *grads[in.range(0, 2)];
    // Aliasing an input, or another gradient (never itself).
    const Arg& other = in.coin() ? c.q : (&victim == &dq ? dk : dq);
    if (maybe_bad_output(in, victim, other)) {
      c.reject("bad gradient view");
    }
  }
  const qkv::fuzz::Snapshot inputs{&c.q, &c.k, &c.v, &c.dout};
  const qkv::fuzz::Snapshot outputs{&dq, &dk, &dv};
  qkv::LinearAttentionGradients r;
  const bool ok = qkv::fuzz::accepted("linear_attention_backward", [&] {
    if (into) {
      qkv::linear_attention_backward_into(c.q, c.k, c.v, c.dout, {dq, dk, dv}, c.opt);
    } else {
      r = qkv::linear_attention_backward(c.q, c.k, c.v, c.dout, c.opt);
    }
  });
  inputs.require_unchanged("linear_attention_backward (inputs)");
  if (!ok) {
    outputs.require_unchanged("linear_attention_backward that threw (gradients)");
    return;
  }
  require(c.must_reject.empty(), "linear_attention_backward accepted " + c.must_reject);
  for (const Arg* g : {&dq, &dk, &dv}) {
    require(qkv::fuzz::gaps_untouched(*g), "linear_attention_backward wrote outside a gradient");
  }
  const ConstTensorView gq = into ? dq.cview() : ConstTensorView(r.dq);
  const ConstTensorView gk = into ? dk.cview() : ConstTensorView(r.dk);
  const ConstTensorView gv = into ? dv.cview() : ConstTensorView(r.dv);
  // Gradients grow with max|v| max|dout| over the normalizer; finite for
  // the moderate regimes.
  if (inputs_finite(c) && c.dout.finite && c.finite_expected && c.magnitude <= 8.0 &&
      c.dtype != DType::f16) {
    qkv::fuzz::require_finite(gq, "linear_attention_backward dq");
    qkv::fuzz::require_finite(gk, "linear_attention_backward dk");
    qkv::fuzz::require_finite(gv, "linear_attention_backward dv");
  }
  qkv::fuzz::fuzz_threads(in);
  const qkv::LinearAttentionGradients r2 =
      qkv::linear_attention_backward(c.q, c.k, c.v, c.dout, c.opt);
  require(qkv::fuzz::same_values(gq, r2.dq) && qkv::fuzz::same_values(gk, r2.dk) &&
              qkv::fuzz::same_values(gv, r2.dv),
          "linear_attention_backward differs for another thread count or the allocating call");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Input in(data, size);
  qkv::fuzz::fuzz_threads(in);
  Case c;
  fuzz_case(in, c);
  switch (in.range(0, 3)) {
    case 0:
    case 1:
      run_forward(in, c);
      break;
    case 2:
      run_step(in, c);
      break;
    default:
      run_backward(in, c);
      break;
  }
  return 0;
}
