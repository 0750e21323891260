// Dispatch of decode attention: decode-inl.h is compiled once per Highway
// target by re-including this file; one dynamic dispatch per call. The plan
// (work items, split count) is plain C++.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/decode.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
// (foreach_target.h must come first: it re-includes this file per target.)
#include "hwy/highway.h"
// Per-target bodies, included after highway.h.
#include "cpu/decode-inl.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::cpu {
namespace HWY_NAMESPACE {

void Decode(DecodePlan& plan) { DecodeImpl(plan); }

}  // namespace HWY_NAMESPACE
}  // namespace qkv::cpu
HWY_AFTER_NAMESPACE();

#if HWY_ONCE

#include <algorithm>
#include <cmath>

namespace qkv::cpu {

HWY_EXPORT(Decode);

namespace {

// Keys per split at least: below this, merging costs more than it saves.
constexpr std::int64_t kMinSplitKeys = 512;
// Work items the split count aims for; enough for the cores of a typical
// CPU, and fixed so that results do not depend on the thread count.
constexpr std::int64_t kTargetItems = 16;

}  // namespace

DecodePlan make_decode_plan(const cache::KvView& cache, const KernelParams& params,
                            ConstTensorView q, TensorView out, TensorView lse) {
  DecodePlan plan;
  plan.cache = &cache;
  plan.params = params;
  plan.q = q;
  plan.out = out;
  plan.lse = lse;
  plan.batch = q.size(0);
  plan.n = q.size(1);
  plan.hq = q.size(2);
  plan.dk = q.size(3);
  plan.hkv = cache.kv_heads;
  plan.dv = cache.value_dim;
  plan.scale = static_cast<float>(params.scale);
  plan.rows = plan.hq * plan.n;
  plan.dv_pad = (plan.dv + 15) / 16 * 16;  // a multiple of any vector width

  std::int64_t longest = 0;
  for (std::int64_t b = 0; b < plan.batch; ++b) longest = std::max(longest, cache.length(b));
  plan.splits = std::clamp<std::int64_t>((kTargetItems + plan.batch - 1) / plan.batch, 1,
                                         std::max<std::int64_t>(1, longest / kMinSplitKeys));
  for (std::int64_t b = 0; b < plan.batch; ++b) {
    const std::int64_t length = cache.length(b);
    // Keys before the first row's window are never read.
    const std::int64_t first = decode_key_range(plan, length, 0).lo;
    for (std::int64_t s = 0; s < plan.splits; ++s) {
      const std::int64_t span = length - first;
      plan.items.push_back({b, first + span * s / plan.splits, first + span * (s + 1) / plan.splits,
                            static_cast<std::int64_t>(plan.items.size())});
    }
  }
  const auto slots = plan.items.size();
  plan.partial_o.resize(slots * static_cast<std::size_t>(plan.rows * plan.dv_pad));
  plan.partial_m.resize(slots * static_cast<std::size_t>(plan.rows));
  plan.partial_l.resize(slots * static_cast<std::size_t>(plan.rows));
  return plan;
}

void decode(DecodePlan& plan) { HWY_DYNAMIC_DISPATCH(Decode)(plan); }

}  // namespace qkv::cpu

#endif  // HWY_ONCE
