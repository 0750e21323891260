// The fused forward's products on a bf16 engine (cpu/engines/): Q K^T and
// P V as bf16 tile products with f32 sums, for bf16 inputs and for f32 and
// f16 inputs under MatmulPrecision::medium (FlashPlan::engine). Softmax,
// scaling, biases, masks and dropout stay in f32 (flash-inl.h); P is rounded
// to bf16 before its product, as FlashAttention does.
//
// Layouts (bf16_product.hpp's A rows and B pairs):
//   Q  B of the scores: the unit's rows unscaled (the scale multiplies S in
//      f32, so bf16 inputs are not rounded again), in pairs of the head dim:
//      q[(x / 2) * 2 rows_pad + 2 r + x % 2], dk2 = Dk rounded up to even;
//   K  A of the scores: rows [key][dk2], zero past Dk;
//   V  B of P V: pairs of keys, v[(t / 2) * 2 dv_pad + 2 j + t % 2] for key
//      t of the task's cache (or of the block) and column j < dv_pad;
//   P  A of P V: rows [row][2 pairs], the block's weights from the pair
//      holding its first key, zero outside the block and outside each
//      row's visible keys.
// A task packs K and V once for all its units (and so for every query head
// of a KV group, whose rows a unit holds together) when they fit the
// per-thread budget, else each block as it comes. A block that starts at an
// odd key of the cache begins with its neighbour's half pair, weighted 0.
#if defined(QKV_CPU_FLASH_ENGINE_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_CPU_FLASH_ENGINE_INL_H_
#undef QKV_CPU_FLASH_ENGINE_INL_H_
#else
#define QKV_CPU_FLASH_ENGINE_INL_H_
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>

#include "cpu/engines/bf16_product.hpp"
#include "cpu/flash.hpp"
#include "cpu/score_mods-inl.h"
#include "cpu/tile_gemm-inl.h"
#include "cpu/vec_math-inl.h"
#include "hwy/aligned_allocator.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::cpu {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using Bf16Buffer = hwy::AlignedFreeUniquePtr<std::uint16_t[]>;
inline Bf16Buffer AllocBf16(std::int64_t n) {
  return hwy::AllocateAligned<std::uint16_t>(
      static_cast<std::size_t>(std::max<std::int64_t>(n, 1)));
}

// The engine the plan's products run on, where this target's panels hold a
// whole number of the engines' 16 columns (every target with AVX2 or more).
inline std::optional<engines::Bf16Engine> EngineOf(const FlashPlan& plan) {
  if (PanelWidth() % 16 != 0 || ValueWidth() % 16 != 0) return std::nullopt;
  return plan.engine;
}

// One thread's bf16 buffers (the header's layouts), for `keys` keys per
// block: the block's P rows and, when the task does not cache them, its K
// rows and V pairs (one pair more: a block may start at an odd key).
struct EngineBuffers {
  EngineBuffers(std::int64_t rows_pad, std::int64_t keys, std::int64_t dk, std::int64_t dv_pad)
      : dk2(RoundUp(std::max<std::int64_t>(dk, 1), 2)),
        key_pairs(keys / 2 + 1),
        q(AllocBf16(dk2 * rows_pad)),
        p(AllocBf16(rows_pad * 2 * key_pairs)),
        row16(AllocBf16(std::max(dk2, dv_pad))) {}

  void NeedBlockBuffers(std::int64_t keys, std::int64_t dv_pad) {
    if (k) return;
    k = AllocBf16(keys * dk2);
    v = AllocBf16(key_pairs * 2 * dv_pad);
  }

  std::int64_t dk2;        // Dk rounded up to even
  std::int64_t key_pairs;  // pairs of a block's keys, with one spare
  Bf16Buffer q, p, row16, k, v;
  Bf16Buffer k_cache, v_cache;      // a task's keys (see PackedKeys)
  std::int64_t cache_capacity = 0;  // keys the caches hold
};

// Row r of a [B, N, H, D] tensor at (seq.batch, seq.k_begin + j, h) as bf16
// into dst[0, ld): converted through f32 (`row`), rounded once, zero past
// the tensor's width.
inline void LoadRowBf16(ConstTensorView t, const detail::SequenceExtent& seq, std::int64_t j,
                        std::int64_t h, std::int64_t ld, float* HWY_RESTRICT row,
                        std::uint16_t* HWY_RESTRICT dst) {
  const std::int64_t width = t.size(3);
  const std::uint8_t* src = At(t, seq.batch, seq.k_begin + j, h);
  if (t.dtype() == DType::bf16 && t.stride(3) == 1 && src != nullptr) {
    std::memcpy(dst, src, static_cast<std::size_t>(width) * 2);
  } else {
    LoadStridedRowF32(src, t.dtype(), width, t.stride(3), row);
    StoreRowFromF32(row, width, dst, DType::bf16);
  }
  std::fill(dst + width, dst + ld, std::uint16_t{0});
}

// Keys [j0, j0 + n) of KV head h: K rows into k_rows [n][dk2] and V into
// the pair slots of keys t0 .. t0 + n - 1 of v_pairs (the header's V).
inline void PackKeysBf16(const FlashPlan& plan, const detail::SequenceExtent& seq, std::int64_t j0,
                         std::int64_t n, std::int64_t h, std::int64_t dv_pad, std::int64_t t0,
                         float* HWY_RESTRICT row, EngineBuffers& eb,
                         std::uint16_t* HWY_RESTRICT k_rows, std::uint16_t* HWY_RESTRICT v_pairs) {
  for (std::int64_t r = 0; r < n; ++r) {
    LoadRowBf16(plan.k, seq, j0 + r, h, eb.dk2, row, k_rows + r * eb.dk2);
    LoadRowBf16(plan.v, seq, j0 + r, h, dv_pad, row, eb.row16.get());
    const std::int64_t t = t0 + r;
    std::uint16_t* slots = v_pairs + (t / 2) * 2 * dv_pad + t % 2;
    for (std::int64_t c = 0; c < dv_pad; ++c) slots[2 * c] = eb.row16[static_cast<std::size_t>(c)];
    // The last key's partner slot, until its own key is packed there: 0.
    if (r == n - 1 && t % 2 == 0) {
      for (std::int64_t c = 0; c < dv_pad; ++c) slots[2 * c + 1] = 0;
    }
  }
}

// The unit's query rows, unscaled, as the scores' B operand (the header's Q).
inline void EnginePrepareQueries(const FlashPlan& plan, const Unit& u, const UnitGeometry& g,
                                 std::int64_t rows_pad, float* HWY_RESTRICT row,
                                 EngineBuffers& eb) {
  const detail::AttentionProblem& p = *plan.problem;
  std::uint16_t* q = eb.q.get();
  std::fill_n(q, eb.dk2 * rows_pad, std::uint16_t{0});
  std::uint16_t* row16 = eb.row16.get();
  for (std::int64_t r = 0; r < g.rows(); ++r) {
    const std::uint8_t* src = At(plan.q, g.seq.batch, g.seq.q_begin + u.i0 + r % g.positions,
                                 u.hkv * g.group + r / g.positions);
    LoadStridedRowF32(src, plan.q.dtype(), p.dq, plan.q.stride(3), row);
    StoreRowFromF32(row, p.dq, row16, DType::bf16);
    for (std::int64_t x = 0; x < p.dq; ++x) {
      q[(x / 2) * 2 * rows_pad + 2 * r + x % 2] = row16[x];
    }
  }
}

// S^T[cols][rows_pad] = scale (K Q^T) for the first RoundUp(rows, 16)
// columns, K rows of the block at k_rows.
inline void EngineScores(engines::Bf16Engine engine, const std::uint16_t* k_rows, std::int64_t cols,
                         std::int64_t rows, std::int64_t rows_pad, float scale,
                         const EngineBuffers& eb, float* HWY_RESTRICT s) {
  const std::int64_t n = RoundUp(std::max<std::int64_t>(rows, 1), 16);
  engines::bf16_product(
      engine, {k_rows, eb.dk2, eb.q.get(), rows_pad, s, rows_pad, cols, n, eb.dk2, false});
  const hn::ScalableTag<float> d;
  const auto v_scale = hn::Set(d, scale);
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(d));
  for (std::int64_t c = 0; c < cols; ++c) {
    for (std::int64_t r = 0; r < n; r += lanes) {
      float* x = s + c * rows_pad + r;
      hn::StoreU(hn::Mul(hn::LoadU(d, x), v_scale), d, x);
    }
  }
}

// O[rows][dv_pad] (+)= P V for the block's P^T[cols][rows_pad] (f32) and
// V pairs from the pair holding the block's first key, which is key `off`
// (0 or 1) of that pair; row_keys (when set) limits each row to its keys.
inline void EngineValues(engines::Bf16Engine engine, const float* HWY_RESTRICT p_t,
                         std::int64_t rows_pad, std::int64_t rows, std::int64_t cols,
                         const KeySpan* row_keys, const std::uint16_t* v_pairs, std::int64_t off,
                         std::int64_t dv_pad, bool overwrite, EngineBuffers& eb,
                         float* HWY_RESTRICT o) {
  const std::int64_t depth = RoundUp(off + cols, 2);
  std::uint16_t* p = eb.p.get();
  for (std::int64_t r = 0; r < rows; ++r) {
    std::uint16_t* pr = p + r * depth;
    std::fill_n(pr, depth, std::uint16_t{0});
    const KeySpan span = row_keys != nullptr ? row_keys[r] : KeySpan{0, cols};
    for (std::int64_t c = span.begin; c < span.end; ++c) {
      pr[off + c] = to_bf16(p_t[c * rows_pad + r]).bits;
    }
  }
  engines::bf16_product(engine,
                        {p, depth, v_pairs, dv_pad, o, dv_pad, rows, dv_pad, depth, !overwrite});
}

}  // namespace HWY_NAMESPACE
}  // namespace qkv::cpu
HWY_AFTER_NAMESPACE();

#endif  // QKV_CPU_FLASH_ENGINE_INL_H_
