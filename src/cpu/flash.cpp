// Dispatch of the fused attention kernels: flash-inl.h is compiled once per
// Highway target by re-including this file; one dynamic dispatch per call
// picks the best target the CPU supports. The plan (units, block masks,
// bias tables) is built once, in plain C++, outside the per-target code.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/flash.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
// (foreach_target.h must come first: it re-includes this file per target.)
#include "hwy/highway.h"
// Per-target bodies, included after highway.h.
#include "cpu/flash-inl.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::cpu {
namespace HWY_NAMESPACE {

bool Forward(const FlashPlan& plan) { return FlashForwardImpl(plan); }
const char* Target() { return hwy::TargetName(HWY_TARGET); }
void StoreRow(const float* src, std::int64_t n, void* dst, DType dtype) {
  StoreRowFromF32(src, n, dst, dtype);
}
void ExpRow(const float* src, std::int64_t n, float* dst) {
  const hn::ScalableTag<float> d;
  const auto lanes = static_cast<std::int64_t>(hn::Lanes(d));
  std::int64_t i = 0;
  for (; i + lanes <= n; i += lanes) hn::StoreU(FastExp(d, hn::LoadU(d, src + i)), d, dst + i);
  for (; i < n; ++i) {
    const hn::CappedTag<float, 1> d1;
    hn::StoreU(FastExp(d1, hn::LoadU(d1, src + i)), d1, dst + i);
  }
}
void Probabilities(const FlashPlan& plan) { FlashProbabilitiesImpl(plan); }

}  // namespace HWY_NAMESPACE
}  // namespace qkv::cpu
HWY_AFTER_NAMESPACE();

#if HWY_ONCE

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "core/elements.hpp"
#include "core/key_range.hpp"
#include "core/sparse.hpp"
#include "cpu/engines/select.hpp"
#include "qkv/positional.hpp"

namespace qkv::cpu {

HWY_EXPORT(Forward);
HWY_EXPORT(Probabilities);
HWY_EXPORT(Target);
HWY_EXPORT(StoreRow);
HWY_EXPORT(ExpRow);

void store_row(const float* src, std::int64_t n, void* dst, DType dtype) {
  HWY_DYNAMIC_DISPATCH(StoreRow)(src, n, dst, dtype);
}
void exp_row(const float* src, std::int64_t n, float* dst) {
  HWY_DYNAMIC_DISPATCH(ExpRow)(src, n, dst);
}
const char* flash_target() { return HWY_DYNAMIC_DISPATCH(Target)(); }

std::optional<engines::Int8Engine> scores_int8_engine(const KernelParams& params,
                                                      std::optional<engines::Bf16Engine> engine) {
  if (!engine || params.matmul_precision != MatmulPrecision::int8) return std::nullopt;
  return engines::int8_engine();
}

std::optional<engines::Bf16Engine> products_engine(const KernelParams& params, ConstTensorView q,
                                                   ConstTensorView k, ConstTensorView v) {
  if (params.score == Score::additive) return std::nullopt;
  const auto all = [&](auto&& pred) {
    return pred(q.dtype()) && pred(k.dtype()) && pred(v.dtype());
  };
  const bool bf16 = all([](DType t) { return t == DType::bf16; });
  const bool medium = params.matmul_precision != MatmulPrecision::highest && all([](DType t) {
                        return t == DType::bf16 || t == DType::f32 || t == DType::f16;
                      });
  if (!bf16 && !medium) return std::nullopt;
  return engines::bf16_engine();
}
bool flash_forward(const FlashPlan& plan) { return HWY_DYNAMIC_DISPATCH(Forward)(plan); }
void flash_probabilities(const FlashPlan& plan) { HWY_DYNAMIC_DISPATCH(Probabilities)(plan); }

namespace {

std::vector<float> to_floats(ConstTensorView t, std::size_t padded_size = 0) {
  std::vector<float> x(std::max(static_cast<std::size_t>(t.defined() ? t.numel() : 0), padded_size),
                       0.0f);
  if (!t.defined()) return x;
  std::size_t n = 0;
  detail::for_each_index(t.sizes(), t.rank(), [&](const Shape& idx) {
    x[n++] = static_cast<float>(
        detail::load(t.data(), t.dtype(), detail::offset(idx, t.strides(), t.rank())));
  });
  return x;
}

// Classifies the explicit masks (bool mask, mask_mod, sparse pattern) over
// one block of one unit: empty if they admit nothing, full if they admit
// everything.
BlockClass classify(const detail::AttentionProblem& p, const KernelParams& o,
                    const detail::TileMods& mods, const detail::SequenceExtent& seq, const Unit& u,
                    std::int64_t j0, std::int64_t cols) {
  const std::int64_t group = p.group();
  const std::int64_t total = u.positions * cols;
  bool all_empty = true;
  bool all_full = true;
  for (std::int64_t g = 0; g < group; ++g) {
    const std::int64_t h = u.hkv * group + g;
    std::int64_t admitted = total;
    if (o.bool_mask.defined()) {
      const ConstTensorView m = o.bool_mask;
      std::int64_t n = 0;
      const std::int64_t js = detail::mask_key_stride(m);
      for (std::int64_t t = 0; t < u.positions; ++t) {
        const std::int64_t base = detail::mask_row_offset(m, seq.batch, h, seq.q_begin + u.i0 + t);
        const auto* bits = static_cast<const std::uint8_t*>(m.data());
        for (std::int64_t c = 0; c < cols; ++c) n += bits[base + (seq.k_begin + j0 + c) * js] != 0;
      }
      admitted = std::min(admitted, n);
    }
    if (mods.admitted != nullptr) {
      const std::int64_t n =
          mods.admitted(mods.context, {nullptr, 0, 0, u.s, h, u.i0, u.positions, j0, cols});
      if (n == 0) admitted = 0;
      if (n < total) all_full = false;
    }
    if (o.sparse.defined()) {
      // From the pattern's parameters: no element is evaluated here.
      const std::int64_t offset = o.keys.offset(seq.nq, seq.nk);
      const detail::Coverage c =
          detail::coverage(o.sparse, {h, u.i0, u.positions, u.i0 + offset, j0, cols});
      if (c == detail::Coverage::none) admitted = 0;
      if (c != detail::Coverage::all) all_full = false;
    }
    if (admitted > 0) all_empty = false;
    if (admitted < total) all_full = false;
  }
  if (all_empty) return BlockClass::empty;
  return all_full ? BlockClass::full : BlockClass::partial;
}

// Positive integer from the environment, or `fallback`.
std::int64_t env_size(const char* name, std::int64_t fallback) {
  const char* text = std::getenv(name);
  if (text == nullptr) return fallback;
  const long long value = std::atoll(text);
  return value > 0 ? value : fallback;
}

}  // namespace

FlashConfig flash_backward_config() {
  static const FlashConfig config = [] {
    FlashConfig c{64, 256};
    c.rows = env_size("QKV_FLASH_BWD_ROWS", c.rows);
    c.keys = env_size("QKV_FLASH_BWD_KEYS", c.keys);
    return c;
  }();
  return config;
}

FlashConfig flash_config() {
  // Read once: the tile sizes are a property of the machine, not of a call.
  static const FlashConfig config = [] {
    FlashConfig c;
    c.rows = env_size("QKV_FLASH_ROWS", c.rows);
    c.keys = env_size("QKV_FLASH_KEYS", c.keys);
    return c;
  }();
  // Read on each call, so that a test can turn the packing per block on.
  FlashConfig c = config;
  c.packed_keys_bytes = env_size("QKV_FLASH_PACKED_KEYS_BYTES", c.packed_keys_bytes);
  return c;
}

FlashPlan make_plan(const detail::AttentionProblem& problem, const KernelParams& params,
                    const detail::TileMods& mods, ConstTensorView q, ConstTensorView k,
                    ConstTensorView v, TensorView out, TensorView lse, TensorView probs,
                    const FlashConfig& config) {
  FlashPlan plan;
  plan.problem = &problem;
  plan.params = params;
  plan.mods = &mods;
  plan.q = q;
  plan.k = k;
  plan.v = v;
  plan.out = out;
  plan.lse = lse;
  plan.probs = probs;
  plan.config = config;
  const std::int64_t group = std::max<std::int64_t>(problem.group(), 1);
  plan.positions_per_unit = std::max<std::int64_t>(1, plan.config.rows / group);

  const bool classify_blocks =
      params.bool_mask.defined() || mods.admitted != nullptr || params.sparse.defined();
  std::int64_t blocks = 0;
  const std::int64_t threads = omp_get_max_threads();
  const std::int64_t heads = std::max<std::int64_t>(problem.sequences * problem.hkv, 1);
  for (std::int64_t s = 0; s < problem.sequences; ++s) {
    const detail::SequenceExtent seq = problem.sequence(s);
    const std::int64_t seq_blocks = (seq.nk_rows + plan.config.keys - 1) / plan.config.keys;
    plan.max_key_rows = std::max(plan.max_key_rows, seq.nk_rows);
    plan.max_positions = std::max(plan.max_positions, std::min(plan.positions_per_unit, seq.nq));
    for (std::int64_t hkv = 0; hkv < problem.hkv; ++hkv) {
      const auto head_begin = static_cast<std::int64_t>(plan.units.size());
      for (std::int64_t i0 = 0; i0 < seq.nq; i0 += plan.positions_per_unit) {
        plan.units.push_back({s, hkv, i0, std::min(plan.positions_per_unit, seq.nq - i0), blocks});
        if (classify_blocks) blocks += seq_blocks;
      }
      // Split the head's units into tasks: as few as keep every thread busy
      // (each task packs its keys once, and the first unit of a task packs
      // its whole window without the previous unit's prefetch), and under a
      // window few enough rows (16 windows) that the task's packed keys stay
      // well inside the per-thread budget. Results do not depend on the split.
      const auto head_units = static_cast<std::int64_t>(plan.units.size()) - head_begin;
      std::int64_t chunks = (4 * threads + heads - 1) / heads;
      if (params.keys.window_left >= 0) {
        // Sides capped at 2^57 keep 16 * window inside int64 (a side may be
        // up to 2^63 - 1); a window that wide spans every unit anyway.
        constexpr std::int64_t kSide = std::int64_t{1} << 57;
        const std::int64_t window = std::min(params.keys.window_left, kSide) + 1 +
                                    std::clamp<std::int64_t>(params.keys.window_right, 0, kSide);
        const std::int64_t task_units =
            std::max<std::int64_t>(1, 16 * window / plan.positions_per_unit);
        chunks = std::max(chunks, (head_units + task_units - 1) / task_units);
      }
      chunks = std::clamp<std::int64_t>(chunks, 1, std::max<std::int64_t>(head_units, 1));
      for (std::int64_t c = 0; c < chunks && head_units > 0; ++c) {
        plan.tasks.push_back(
            {head_begin + head_units * c / chunks, head_begin + head_units * (c + 1) / chunks});
      }
    }
  }
  if (classify_blocks) {
    plan.block_class.resize(static_cast<std::size_t>(blocks));
    const auto n = static_cast<std::int64_t>(plan.units.size());
#pragma omp parallel for schedule(dynamic, 1)
    for (std::int64_t i = 0; i < n; ++i) {
      const Unit& u = plan.units[static_cast<std::size_t>(i)];
      const detail::SequenceExtent seq = problem.sequence(u.s);
      for (std::int64_t j0 = 0, jb = 0; j0 < seq.nk_rows; j0 += plan.config.keys, ++jb) {
        plan.block_class[static_cast<std::size_t>(u.first_block + jb)] = classify(
            problem, params, mods, seq, u, j0, std::min(plan.config.keys, seq.nk_rows - j0));
      }
    }
  }

  if (params.relative_bias.table.defined()) {
    const ConstTensorView table = params.relative_bias.table;
    plan.relative_radius = problem.nq + problem.nk;
    const std::int64_t width = 2 * plan.relative_radius + 1;
    plan.relative_bias.resize(static_cast<std::size_t>(problem.hq * width));
    for (std::int64_t delta = -plan.relative_radius; delta <= plan.relative_radius; ++delta) {
      const std::int64_t bucket =
          t5_relative_bucket(delta, table.size(1), params.relative_bias.max_distance,
                             params.relative_bias.bidirectional);
      for (std::int64_t h = 0; h < problem.hq; ++h) {
        plan.relative_bias[static_cast<std::size_t>(h * width + delta + plan.relative_radius)] =
            static_cast<float>(table.get({h, bucket}));
      }
    }
  }

  if (params.score == Score::additive) {
    const auto a_size = static_cast<std::size_t>(problem.attention_size);
    plan.additive_w_q = to_floats(params.additive.w_q);
    plan.additive_w_k = to_floats(params.additive.w_k);
    plan.additive_bias = to_floats(params.additive.bias);
    plan.additive_v = to_floats(params.additive.v, (a_size + 15) / 16 * 16);
  }
  return plan;
}

}  // namespace qkv::cpu

#endif  // HWY_ONCE
