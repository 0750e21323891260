// Dispatch of the linear attention kernels: linear-inl.h (forward) and
// linear_backward-inl.h are compiled once per Highway target by re-including
// this file; one dynamic dispatch per call picks the best target the CPU
// supports. The plan is built in plain C++.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/linear.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
// (foreach_target.h must come first: it re-includes this file per target.)
#include "hwy/highway.h"
// Per-target bodies, included after highway.h.
#include "cpu/linear-inl.h"
#include "cpu/linear_backward-inl.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::cpu {
namespace HWY_NAMESPACE {

void LinearForward(const LinearPlan& plan) { LinearForwardImpl(plan); }
void LinearBackward(const LinearPlan& plan, ConstTensorView dout,
                    const LinearAttentionGradientOutputs& grads) {
  LinearBackwardImpl(plan, dout, grads);
}

}  // namespace HWY_NAMESPACE
}  // namespace qkv::cpu
HWY_AFTER_NAMESPACE();

#if HWY_ONCE

#include <omp.h>

#include <algorithm>

namespace qkv::cpu {

HWY_EXPORT(LinearForward);
HWY_EXPORT(LinearBackward);

namespace {

// Heads per causal forward unit at most: the heads of a [B, N, 8, 64] f32
// row share its 2 KiB, and their states (16 KiB each at M = Dv = 64) stay in
// L2.
constexpr std::int64_t kMaxUnitHeads = 8;

}  // namespace

void linear_forward(const LinearPlan& plan) { HWY_DYNAMIC_DISPATCH(LinearForward)(plan); }

void linear_backward(const LinearPlan& plan, ConstTensorView dout,
                     const LinearAttentionGradientOutputs& grads) {
  HWY_DYNAMIC_DISPATCH(LinearBackward)(plan, dout, grads);
}

LinearPlan make_linear_plan(const detail::LinearProblem& problem,
                            const LinearAttentionOptions& options, ConstTensorView q,
                            ConstTensorView k, ConstTensorView v, TensorView out,
                            const detail::LinearStates& states) {
  LinearPlan plan;
  plan.problem = &problem;
  plan.options = &options;
  plan.q = q;
  plan.k = k;
  plan.v = v;
  plan.out = out;
  // Validation made the state tensors f32 and contiguous.
  if (states.s_in.defined()) plan.s_in = static_cast<const float*>(states.s_in.data());
  if (states.z_in.defined()) {
    const auto* z = static_cast<const float*>(states.z_in.data());
    plan.z_in.assign(z, z + states.z_in.numel());
  }
  if (states.s_out.defined()) plan.s_out = static_cast<float*>(states.s_out.data());
  if (states.z_out.defined()) plan.z_out = static_cast<float*>(states.z_out.data());
  // The causal forward's units: as many as threads, from blocks of heads
  // (at most kMaxUnitHeads), or when there are fewer heads than threads from
  // value-column blocks (each recomputes the chunk's intra products).
  const std::int64_t heads = std::max<std::int64_t>(problem.batch * problem.hkv, 1);
  const std::int64_t threads = omp_get_max_threads();
  if (options.causal) {
    plan.column_blocks = std::max<std::int64_t>(1, (threads + heads - 1) / heads);
    plan.unit_heads = std::clamp<std::int64_t>((heads + threads - 1) / threads, 1, kMaxUnitHeads);
  }
  return plan;
}

}  // namespace qkv::cpu

#endif  // HWY_ONCE
