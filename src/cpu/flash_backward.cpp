// Dispatch of the fused backward pass: flash_backward-inl.h is compiled once
// per Highway target by re-including this file; one dynamic dispatch per
// call. The plan (units, block masks, bias table) is the forward's, made with
// the backward's tile sizes.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/flash_backward.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
// (foreach_target.h must come first: it re-includes this file per target.)
#include "hwy/highway.h"
// Per-target bodies, included after highway.h.
#include "cpu/flash_backward-inl.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::cpu {
namespace HWY_NAMESPACE {

void Tasks(BackwardPlan& bp) { BackwardTasks(bp); }
bool Backward(const BackwardPlan& bp) { return FlashBackwardImpl(bp); }
bool ReduceDq(const BackwardPlan& bp) { return FlashBackwardReduceDq(bp); }

}  // namespace HWY_NAMESPACE
}  // namespace qkv::cpu
HWY_AFTER_NAMESPACE();

#if HWY_ONCE

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/elements.hpp"
#include "core/mask_gradient.hpp"
#include "hwy/aligned_allocator.h"
#include "qkv/positional.hpp"

namespace qkv::cpu {

HWY_EXPORT(Tasks);
HWY_EXPORT(Backward);
HWY_EXPORT(ReduceDq);

bool flash_backward(const FlashPlan& plan, const BackwardArgs& args) {
  const detail::AttentionProblem& p = *plan.problem;
  BackwardPlan bp;
  bp.plan = &plan;
  bp.args = args;
  // Key chunks per head: enough that four tasks exist when there are fewer
  // than four (sequence, KV head) pairs, each adding one dQ buffer. A
  // property of the problem, so results do not depend on the thread count.
  const std::int64_t heads = std::max<std::int64_t>(p.sequences * p.hkv, 1);
  bp.chunks = std::clamp<std::int64_t>((4 + heads - 1) / heads, 1, 4);
  bp.dq_ld = (std::max<std::int64_t>(p.dq, 1) + 15) / 16 * 16;  // a multiple of any vector
  HWY_DYNAMIC_DISPATCH(Tasks)(bp);
  // Tasks come from query rows: the keys of a sequence without any get no
  // task, but their (overwritten) gradients are zero all the same.
  for (std::int64_t s = 0; s < p.sequences; ++s) {
    const detail::SequenceExtent seq = p.sequence(s);
    if (seq.nq > 0) continue;
    for (const TensorView& t : {args.grads.dk, args.grads.dv}) {
      detail::fill(t.slice(0, seq.batch, 1).slice(1, seq.k_begin, seq.nk_rows), 0.0);
    }
  }

  const auto dq_floats = static_cast<std::size_t>(bp.chunks * p.batch * p.nq * p.hq * bp.dq_ld);
  auto dq_partial = hwy::AllocateAligned<float>(std::max<std::size_t>(dq_floats, 1));
  std::fill_n(dq_partial.get(), dq_floats, 0.0f);
  bp.dq_partial = dq_partial.get();
  const std::int64_t width = 2 * plan.relative_radius + 1;
  std::vector<double> bias_partial;
  if (!plan.relative_bias.empty()) {
    bias_partial.assign(bp.tasks.size() * static_cast<std::size_t>(p.group() * width), 0.0);
    bp.bias_partial = bias_partial.data();
  }

  Tensor ds_full;
  if (args.grads.d_mask.defined()) {
    ds_full = detail::score_gradients(p, DType::f32);
    bp.ds_full = ds_full.data<float>();
  }

  bool finite = HWY_DYNAMIC_DISPATCH(Backward)(bp);
  finite = HWY_DYNAMIC_DISPATCH(ReduceDq)(bp) && finite;
  if (ds_full.defined()) finite = detail::sum_into_mask(ds_full, args.grads.d_mask) && finite;

  if (plan.relative_bias.empty()) return finite;
  // Distances to buckets, summing the tasks in order.
  const TensorView table = args.grads.d_relative_bias;
  const ConstTensorView bias = plan.params.relative_bias.table;
  std::vector<double> by_delta(static_cast<std::size_t>(p.hq * width), 0.0);
  for (std::size_t t = 0; t < bp.tasks.size(); ++t) {
    const Unit& u = plan.units[static_cast<std::size_t>(bp.tasks[t].unit_begin)];
    for (std::int64_t gi = 0; gi < p.group(); ++gi) {
      const std::int64_t h = u.hkv * p.group() + gi;
      for (std::int64_t x = 0; x < width; ++x) {
        by_delta[static_cast<std::size_t>(h * width + x)] +=
            bias_partial[t * static_cast<std::size_t>(p.group() * width) +
                         static_cast<std::size_t>(gi * width + x)];
      }
    }
  }
  std::vector<double> by_bucket(static_cast<std::size_t>(p.hq * bias.size(1)), 0.0);
  for (std::int64_t x = 0; x < width; ++x) {
    const std::int64_t bucket = t5_relative_bucket(x - plan.relative_radius, bias.size(1),
                                                   plan.params.relative_bias.max_distance,
                                                   plan.params.relative_bias.bidirectional);
    for (std::int64_t h = 0; h < p.hq; ++h) {
      by_bucket[static_cast<std::size_t>(h * bias.size(1) + bucket)] +=
          by_delta[static_cast<std::size_t>(h * width + x)];
    }
  }
  for (std::int64_t h = 0; h < p.hq; ++h) {
    for (std::int64_t bucket = 0; bucket < bias.size(1); ++bucket) {
      const double g = by_bucket[static_cast<std::size_t>(h * bias.size(1) + bucket)];
      table.set({h, bucket}, g);
      finite = finite && std::isfinite(g);
    }
  }
  return finite;
}

}  // namespace qkv::cpu

#endif  // HWY_ONCE
