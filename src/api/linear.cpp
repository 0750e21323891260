// Entry points of linear attention: validate (every problem gathered into one
// qkv::Error), allocate, dispatch once to the reference or the fast kernels.
#include "cpu/linear.hpp"

#include <cmath>
#include <string>
#include <vector>

#include "api/dispatch.hpp"
#include "api/validate.hpp"
#include "core/elements.hpp"
#include "reference/linear.hpp"

namespace qkv {
namespace detail {
namespace {

using std::to_string;

// The longest chunk the fast kernels take: their per-thread scratch holds a
// few chunk x chunk tiles.
constexpr std::int64_t kMaxChunk = 1024;

void check_tensors(ConstTensorView q, ConstTensorView k, ConstTensorView v, LinearProblem& p,
                   Reasons& r) {
  const bool q_ok = check_view("q", q, {.rank = 4}, r);
  const bool k_ok = check_view("k", k, {.rank = 4}, r);
  const bool v_ok = check_view("v", v, {.rank = 4}, r);
  if (q.defined()) check_floating("q", q.dtype(), r);
  for (auto [name, t] : {std::pair{"k", k}, {"v", v}}) {
    if (t.defined() && q.defined() && t.dtype() != q.dtype()) {
      r.push_back(std::string(name) + ": expected dtype " + str(q.dtype()) +
                  " (the dtype of q), got " + str(t.dtype()));
    }
  }
  if (!(q_ok && k_ok && v_ok)) return;
  p.batch = q.size(0);
  p.nq = q.size(1);
  p.hq = q.size(2);
  p.d = q.size(3);
  p.nk = k.size(1);
  p.hkv = k.size(2);
  p.dv = v.size(3);
  p.dtype = q.dtype();
  p.state_dtype = q.dtype() == DType::f64 ? DType::f64 : DType::f32;
  const std::string qb = "q's batch " + to_string(p.batch);
  check_dim("k", k, 0, "batch size", p.batch, qb, r);
  check_dim("v", v, 0, "batch size", p.batch, qb, r);
  check_dim("k", k, 3, "head dim", p.d, "q's " + to_string(p.d), r);
  check_dim("v", v, 1, "sequence length", p.nk, "k's " + to_string(p.nk), r);
  check_dim("v", v, 2, "KV heads", p.hkv, "k's " + to_string(p.hkv), r);
  if (p.dv == 0) {
    r.push_back("v: expected head dim Dv (dim 3) >= 1, got 0 (sizes " + shape_of(v) + ")");
  }
  check_head_groups(k, p.hq, p.hkv, r);
}

void check_options(const LinearAttentionOptions& o, LinearProblem& p, Reasons& r) {
  const CustomFeatureMap& c = o.custom;
  switch (o.feature_map) {
    case FeatureMap::elu_plus_one:
    case FeatureMap::relu:
      p.features = p.d;
      if (c.features != 0 || c.map || c.vjp) {
        r.push_back(
            "options.custom: given, but feature_map is not FeatureMap::custom (set "
            "feature_map = FeatureMap::custom to use it)");
      }
      if (p.d == 0) {
        r.push_back(
            "q: head dim D = 0 leaves the built-in feature maps without features (M = D); "
            "expected D >= 1");
      }
      break;
    case FeatureMap::custom:
      p.features = c.features;
      if (c.features < 1) {
        r.push_back("options.custom.features: expected the feature count M >= 1, got " +
                    to_string(c.features));
      }
      if (!c.map) r.push_back("options.custom.map: required for FeatureMap::custom, got none");
      break;
    default:
      r.push_back("options.feature_map: unknown value " +
                  to_string(static_cast<int>(o.feature_map)));
  }
  if (o.causal && p.nq != p.nk) {
    r.push_back("options.causal: causal linear attention needs as many queries as keys, got Nq = " +
                to_string(p.nq) + " and Nk = " + to_string(p.nk) +
                " (to continue after a prefix of keys, run the prefix causally for its state "
                "and use linear_attention_step)");
  }
  if (!std::isfinite(o.eps) || o.eps < 0.0) {
    r.push_back("options.eps: expected a finite number >= 0, got " + num(o.eps));
  }
  if (o.chunk < 1 || o.chunk > kMaxChunk) {
    r.push_back("options.chunk: expected 1 to " + to_string(kMaxChunk) + ", got " +
                to_string(o.chunk));
  }
  switch (o.backend) {
    case Backend::automatic:
    case Backend::reference:
      break;
    case Backend::fast:
      check_fast_dtype(o.backend, p.dtype, r);
      break;
    default:
      r.push_back("options.backend: unknown value " + to_string(static_cast<int>(o.backend)));
  }
}

// The sizes of a validated problem's state: s, then z.
std::vector<std::int64_t> state_sizes(const LinearProblem& p) {
  return {p.batch, p.hkv, p.features, p.dv};
}
std::vector<std::int64_t> sum_sizes(const LinearProblem& p) { return {p.batch, p.hkv, p.features}; }

// out, and the state when given, against a validated problem.
void check_outputs(const LinearProblem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                   ConstTensorView out, const LinearAttentionState* state, Reasons& r) {
  Aliasing aliasing;
  aliasing.input("q", q);
  aliasing.input("k", k);
  aliasing.input("v", v);
  const std::int64_t out_sizes[] = {p.batch, p.nq, p.hq, p.dv};
  check_output("out", out, {.sizes = out_sizes, .dtype = p.dtype}, aliasing, r);
  if (state == nullptr) return;
  const std::vector<std::int64_t> s_sizes = state_sizes(p), z_sizes = sum_sizes(p);
  check_output("state.s", state->s, {.sizes = s_sizes, .dtype = p.state_dtype}, aliasing, r);
  check_output("state.z", state->z, {.sizes = z_sizes, .dtype = p.state_dtype}, aliasing, r);
}

// Checks q, k, v and the options, appending reasons; false when the shapes of
// q, k and v are unusable, so that no later check may read them.
bool check_inputs(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                  const LinearAttentionOptions& options, LinearProblem& p, Reasons& r) {
  const std::size_t before = r.size();
  check_tensors(q, k, v, p, r);
  if (r.size() != before) return false;
  check_options(options, p, r);
  return true;
}

}  // namespace

LinearProblem check_linear_inputs(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                                  const LinearAttentionOptions& options) {
  LinearProblem p;
  Reasons r;
  check_inputs(q, k, v, options, p, r);
  throw_if(r);
  return p;
}

}  // namespace detail

namespace {

using detail::LinearProblem;
using detail::LinearStates;

void run_forward(const LinearProblem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                 TensorView out, const LinearAttentionOptions& o, const LinearStates& states) {
  if (!detail::use_fast_linear(o, p.dtype)) {
    reference::linear_attention(p, q, k, v, out, o, states);
    return;
  }
  cpu::linear_forward(cpu::make_linear_plan(p, o, q, k, v, out, states));
}

LinearStates final_state_of(LinearAttentionState* state) {
  if (state == nullptr) return {};
  return {{}, {}, state->s, state->z};
}

}  // namespace

LinearAttentionState linear_attention_state(std::int64_t batch, std::int64_t kv_heads,
                                            std::int64_t features, std::int64_t value_dim,
                                            DType dtype) {
  if (dtype != DType::f32 && dtype != DType::f64) {
    throw Error("linear_attention_state: expected dtype f32 (f64 for f64 inputs), got " +
                std::string(dtype_name(dtype)));
  }
  return {Tensor(dtype, {batch, kv_heads, features, value_dim}),
          Tensor(dtype, {batch, kv_heads, features})};
}

LinearAttentionResult linear_attention(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                                       const LinearAttentionOptions& options) {
  LinearProblem p;
  detail::Reasons r;
  if (detail::check_inputs(q, k, v, options, p, r) && options.return_state && !options.causal) {
    r.push_back(
        "options.return_state: only a causal pass has a state to continue from (set causal = "
        "true, or return_state = false)");
  }
  detail::throw_if(r);
  LinearAttentionResult result;
  result.out = Tensor(p.dtype, {p.batch, p.nq, p.hq, p.dv});
  if (options.return_state) {
    result.state = linear_attention_state(p.batch, p.hkv, p.features, p.dv, p.state_dtype);
  }
  run_forward(p, q, k, v, result.out, options,
              final_state_of(options.return_state ? &result.state : nullptr));
  return result;
}

void linear_attention_into(ConstTensorView q, ConstTensorView k, ConstTensorView v, TensorView out,
                           const LinearAttentionOptions& options,
                           LinearAttentionState* final_state) {
  LinearProblem p;
  detail::Reasons r;
  if (detail::check_inputs(q, k, v, options, p, r)) {
    if (final_state != nullptr && !options.causal) {
      r.push_back(
          "final_state: only a causal pass has a state to continue from (set options.causal = "
          "true, or pass no state)");
    }
    detail::check_outputs(p, q, k, v, out, final_state, r);
  }
  detail::throw_if(r);
  run_forward(p, q, k, v, out, options, final_state_of(final_state));
}

void linear_attention_step_into(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                                LinearAttentionState& state, TensorView out,
                                const LinearAttentionOptions& options) {
  LinearProblem p;
  detail::Reasons r;
  if (detail::check_inputs(q, k, v, options, p, r)) {
    if (!options.causal) {
      r.push_back(
          "options.causal: linear_attention_step continues a causal pass; expected causal = "
          "true (the options of the prefill)");
    }
    detail::check_outputs(p, q, k, v, out, &state, r);
  }
  detail::throw_if(r);
  run_forward(p, q, k, v, out, options, {state.s, state.z, state.s, state.z});
}

Tensor linear_attention_step(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                             LinearAttentionState& state, const LinearAttentionOptions& options) {
  const LinearProblem p = detail::check_linear_inputs(q, k, v, options);
  Tensor out(p.dtype, {p.batch, p.nq, p.hq, p.dv});
  linear_attention_step_into(q, k, v, state, out, options);
  return out;
}

namespace {

void run_backward(const LinearProblem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                  ConstTensorView dout, const LinearAttentionGradientOutputs& g,
                  const LinearAttentionOptions& o) {
  if (!detail::use_fast_linear(o, p.dtype)) {
    reference::linear_attention_backward(p, q, k, v, dout, g, o);
    return;
  }
  cpu::linear_backward(cpu::make_linear_plan(p, o, q, k, v, {}, {}), dout, g);
}

// The inputs, dout and the options' derivative; with `grads`, the gradient
// views too. Throws qkv::Error listing every problem.
LinearProblem check_backward(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                             ConstTensorView dout, const LinearAttentionGradientOutputs* grads,
                             const LinearAttentionOptions& o) {
  LinearProblem p;
  detail::Reasons r;
  if (!detail::check_inputs(q, k, v, o, p, r)) detail::throw_if(r);
  const std::int64_t out_sizes[] = {p.batch, p.nq, p.hq, p.dv};
  detail::check_view("dout", dout, {.sizes = out_sizes, .dtype = p.dtype}, r);
  if (o.feature_map == FeatureMap::custom && !o.custom.vjp) {
    r.push_back(
        "options.custom.vjp: the backward needs the feature map's vector-Jacobian product "
        "(dx = J_phi(x)^T dphi), got none");
  }
  if (grads != nullptr) {
    detail::Aliasing aliasing;
    aliasing.input("q", q);
    aliasing.input("k", k);
    aliasing.input("v", v);
    aliasing.input("dout", dout);
    const std::int64_t dq_sizes[] = {p.batch, p.nq, p.hq, p.d};
    const std::int64_t dk_sizes[] = {p.batch, p.nk, p.hkv, p.d};
    const std::int64_t dv_sizes[] = {p.batch, p.nk, p.hkv, p.dv};
    detail::check_output("dq", grads->dq, {.sizes = dq_sizes, .dtype = p.dtype}, aliasing, r);
    detail::check_output("dk", grads->dk, {.sizes = dk_sizes, .dtype = p.dtype}, aliasing, r);
    detail::check_output("dv", grads->dv, {.sizes = dv_sizes, .dtype = p.dtype}, aliasing, r);
  }
  detail::throw_if(r);
  return p;
}

}  // namespace

LinearAttentionGradients linear_attention_backward(ConstTensorView q, ConstTensorView k,
                                                   ConstTensorView v, ConstTensorView dout,
                                                   const LinearAttentionOptions& options) {
  const LinearProblem p = check_backward(q, k, v, dout, nullptr, options);
  LinearAttentionGradients g{Tensor(p.dtype, {p.batch, p.nq, p.hq, p.d}),
                             Tensor(p.dtype, {p.batch, p.nk, p.hkv, p.d}),
                             Tensor(p.dtype, {p.batch, p.nk, p.hkv, p.dv})};
  run_backward(p, q, k, v, dout, {g.dq, g.dk, g.dv}, options);
  return g;
}

void linear_attention_backward_into(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                                    ConstTensorView dout,
                                    const LinearAttentionGradientOutputs& grads,
                                    const LinearAttentionOptions& options) {
  const LinearProblem p = check_backward(q, k, v, dout, &grads, options);
  run_backward(p, q, k, v, dout, grads, options);
}

}  // namespace qkv
