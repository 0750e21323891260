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
// With int8 scores (MatmulPrecision::int8, FlashPlan::int8) K is instead
// int8 rows of the key minus the task's mean key with a scale per key, and
// Q int8 quads with a scale per row (EngineBuffers).
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
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#include "core/hwy_namespace.hpp"
#include "cpu/engines/bf16_product.hpp"
#include "cpu/engines/int8_product.hpp"
#include "cpu/flash.hpp"
#include "cpu/score_mods-inl.h"
#include "cpu/tile_gemm-inl.h"
#include "cpu/vec_math-inl.h"
#include "hwy/aligned_allocator.h"
#include "hwy/highway.h"

QKV_HWY_NAMESPACE_BEGIN(cpu);

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

// One thread's engine buffers (the header's layouts), for `keys` keys per
// block: Q's and the block's P rows, and the keys: the task's cache when it
// fits the budget (EngineCacheTask), else the block's, packed as it comes.
// With int8 scores, K is int8 rows with a scale per key, smoothed by the
// task's mean key, and Q int8 pairs of quads with a scale per row.
struct EngineBuffers {
  EngineBuffers(std::int64_t rows_pad, std::int64_t keys_, std::int64_t dk, std::int64_t dv_pad_,
                bool int8_)
      : int8(int8_),
        dk2(RoundUp(std::max<std::int64_t>(dk, 1), 2)),
        dk4(RoundUp(std::max<std::int64_t>(dk, 1), 4)),
        dv_pad(dv_pad_),
        keys(keys_),
        key_pairs(keys_ / 2 + 1),
        q(AllocBf16(dk2 * rows_pad)),
        p(AllocBf16(rows_pad * 2 * key_pairs)),
        row16(AllocBf16(std::max(dk2, dv_pad_))) {
    if (!int8) return;
    q8 = hwy::AllocateAligned<std::int8_t>(static_cast<std::size_t>(dk4 * rows_pad));
    q_scale = AllocFloats(rows_pad);
    q_bias = AllocFloats(rows_pad);
    row8 = hwy::AllocateAligned<std::int8_t>(static_cast<std::size_t>(dk4));
    mean = AllocFloats(dk);
    scores = hwy::AllocateAligned<std::int32_t>(static_cast<std::size_t>(keys_ * rows_pad));
  }

  // The block's K and V (when the task does not cache them).
  void NeedBlockBuffers() {
    if (v) return;
    Allocate(keys, v, k, k8, k_scale);
  }
  // Room for a task's n keys in the cache.
  void NeedCache(std::int64_t n) {
    if (n <= cache_capacity) return;
    Allocate(n, v_cache, k_cache, k8_cache, k_scale_cache);
    cache_capacity = n;
  }
  // Bytes of n keys' K and V as packed here.
  std::int64_t Bytes(std::int64_t n) const {
    return 2 * (n / 2 + 1) * 2 * dv_pad + (int8 ? n * (dk4 + 4) : 2 * n * dk2);
  }

  bool int8;               // int8 scores (MatmulPrecision::int8)
  std::int64_t dk2, dk4;   // Dk rounded up to even / to a multiple of 4
  std::int64_t dv_pad;     // Dv rounded up to the panel width
  std::int64_t keys;       // keys per block
  std::int64_t key_pairs;  // pairs of a block's keys, with one spare
  Bf16Buffer q, p, row16;
  Bf16Buffer k, v, k_cache, v_cache;  // bf16 K rows, V pairs: a block's, a task's
  hwy::AlignedFreeUniquePtr<std::int8_t[]> q8, k8, k8_cache;  // int8 Q quads, K rows
  hwy::AlignedFreeUniquePtr<std::int8_t[]> row8;              // one row quantized
  Floats q_scale, q_bias;         // per query row: scale s_q, and scale <q, mean>
  Floats k_scale, k_scale_cache;  // per key: s_k (a block's, a task's)
  Floats mean;                    // the task's mean key [Dk] (int8)
  hwy::AlignedFreeUniquePtr<std::int32_t[]> scores;  // the int8 product [keys][rows_pad]
  std::int64_t cache_capacity = 0;                   // keys the caches hold

 private:
  void Allocate(std::int64_t n, Bf16Buffer& v_pairs, Bf16Buffer& k_rows,
                hwy::AlignedFreeUniquePtr<std::int8_t[]>& k8_rows, Floats& scales) {
    v_pairs = AllocBf16((n / 2 + 1) * 2 * dv_pad);
    if (int8) {
      k8_rows = hwy::AllocateAligned<std::int8_t>(static_cast<std::size_t>(n * dk4));
      scales = AllocFloats(n);
    } else {
      k_rows = AllocBf16(n * dk2);
    }
  }
};

// Row j of a [B, N, H, D] tensor at (seq.batch, seq.k_begin + j, h) as bf16
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

// Row j of a [B, N, H, D] tensor at (seq.batch, seq.k_begin + j, h) as f32
// into row[0, width).
inline const float* KeyRowF32(ConstTensorView t, const detail::SequenceExtent& seq, std::int64_t j,
                              std::int64_t h, float* HWY_RESTRICT row) {
  LoadStridedRowF32(At(t, seq.batch, seq.k_begin + j, h), t.dtype(), t.size(3), t.stride(3), row);
  return row;
}

// x[0, width) as int8 with one scale: q8 = round(x / s), s = max|x| / 127
// (0 for a row of zeros). Returns s; for a row holding a NaN or an
// infinity, NaN (and zeros in q8), so that its scores are NaN, as the f32
// path's would be.
inline float QuantizeRow(const float* HWY_RESTRICT x, std::int64_t width,
                         std::int8_t* HWY_RESTRICT q8) {
  float amax = 0.0f;
  bool finite = true;
  for (std::int64_t i = 0; i < width; ++i) {
    finite = finite && std::isfinite(x[i]);
    amax = std::max(amax, std::abs(x[i]));
  }
  if (!finite) {
    std::fill_n(q8, width, std::int8_t{0});
    return std::numeric_limits<float>::quiet_NaN();
  }
  const float s = amax / 127.0f;
  const float inv = s > 0.0f ? 1.0f / s : 0.0f;
  for (std::int64_t i = 0; i < width; ++i) {
    q8[i] = static_cast<std::int8_t>(std::clamp(std::nearbyint(x[i] * inv), -127.0f, 127.0f));
  }
  return s;
}

// Keys [j0, j0 + n) of KV head h into key slots t0 .. t0 + n - 1 of the
// buffers: K as bf16 rows (k_rows [.][dk2]) or, with int8 scores, int8 rows
// of the key minus the task's mean (k8 [.][dk4]) with their scales; V into
// the pair slots of v_pairs (the header's V).
inline void PackKeys(const FlashPlan& plan, const detail::SequenceExtent& seq, std::int64_t j0,
                     std::int64_t n, std::int64_t h, std::int64_t t0, float* HWY_RESTRICT row,
                     EngineBuffers& eb, std::uint16_t* HWY_RESTRICT k_rows,
                     std::int8_t* HWY_RESTRICT k8, float* HWY_RESTRICT k_scale,
                     std::uint16_t* HWY_RESTRICT v_pairs) {
  const std::int64_t dk = plan.k.size(3);
  const std::int64_t dv_pad = eb.dv_pad;
  for (std::int64_t r = 0; r < n; ++r) {
    const std::int64_t t = t0 + r;
    if (eb.int8) {
      float* x = row;
      KeyRowF32(plan.k, seq, j0 + r, h, x);
      for (std::int64_t c = 0; c < dk; ++c) x[c] -= eb.mean[static_cast<std::size_t>(c)];
      std::int8_t* dst = k8 + t * eb.dk4;
      k_scale[t] = QuantizeRow(x, dk, dst);
      std::fill(dst + dk, dst + eb.dk4, std::int8_t{0});
    } else {
      LoadRowBf16(plan.k, seq, j0 + r, h, eb.dk2, row, k_rows + t * eb.dk2);
    }
    LoadRowBf16(plan.v, seq, j0 + r, h, dv_pad, row, eb.row16.get());
    std::uint16_t* slots = v_pairs + (t / 2) * 2 * dv_pad + t % 2;
    for (std::int64_t c = 0; c < dv_pad; ++c) slots[2 * c] = eb.row16[static_cast<std::size_t>(c)];
    // The last key's partner slot, until its own key is packed there: 0.
    if (r == n - 1 && t % 2 == 0) {
      for (std::int64_t c = 0; c < dv_pad; ++c) slots[2 * c + 1] = 0;
    }
  }
}

// A task's keys [begin, end) of KV head h: with int8 scores, their mean
// first; then whether they fit the budget, in which case the caches are
// made ready (zero pairs: slots past the last packed key weigh 0 in P V)
// for EnginePackThrough.
inline bool EngineCacheTask(const FlashPlan& plan, const detail::SequenceExtent& seq,
                            std::int64_t h, std::int64_t begin, std::int64_t end,
                            float* HWY_RESTRICT row, EngineBuffers& eb) {
  const std::int64_t n = end - begin;
  if (eb.int8) {
    const std::int64_t dk = plan.k.size(3);
    // Any vector shared by all keys keeps the softmax: the mean of each
    // channel's finite values, so that a non-finite key spoils its own
    // scores only.
    std::vector<double> sum(static_cast<std::size_t>(dk), 0.0);
    std::vector<std::int64_t> count(static_cast<std::size_t>(dk), 0);
    for (std::int64_t j = begin; j < end; ++j) {
      const float* x = KeyRowF32(plan.k, seq, j, h, row);
      for (std::int64_t c = 0; c < dk; ++c) {
        if (!std::isfinite(x[c])) continue;
        sum[static_cast<std::size_t>(c)] += x[c];
        ++count[static_cast<std::size_t>(c)];
      }
    }
    for (std::int64_t c = 0; c < dk; ++c) {
      const auto i = static_cast<std::size_t>(c);
      eb.mean[i] = count[i] > 0 ? static_cast<float>(sum[i] / static_cast<double>(count[i])) : 0.0f;
    }
  }
  if (n <= 0 || eb.Bytes(n) > plan.config.packed_keys_bytes) return false;
  eb.NeedCache(n);
  std::fill_n(eb.v_cache.get(), (n / 2 + 1) * 2 * eb.dv_pad, std::uint16_t{0});
  return true;
}

// Packs the task's cached keys [from, to) (the cache starting at `begin`).
inline void EnginePackThrough(const FlashPlan& plan, const detail::SequenceExtent& seq,
                              std::int64_t h, std::int64_t begin, std::int64_t from,
                              std::int64_t to, float* HWY_RESTRICT row, EngineBuffers& eb) {
  PackKeys(plan, seq, from, to - from, h, from - begin, row, eb, eb.k_cache.get(),
           eb.k8_cache.get(), eb.k_scale_cache.get(), eb.v_cache.get());
}

// The unit's query rows as the scores' B operand (the header's Q): bf16
// pairs, unscaled; or with int8 scores, int8 quads of q with a scale per row
// (times the score scale) and the row's bias scale <q, mean>, which adds
// back what smoothing K took off each score.
inline void EnginePrepareQueries(const FlashPlan& plan, const Unit& u, const UnitGeometry& g,
                                 std::int64_t rows_pad, float* HWY_RESTRICT row,
                                 EngineBuffers& eb) {
  const detail::AttentionProblem& p = *plan.problem;
  const auto scale = static_cast<float>(plan.params.scale);
  if (eb.int8) {
    std::fill_n(eb.q8.get(), eb.dk4 * rows_pad, std::int8_t{0});
    std::fill_n(eb.q_scale.get(), rows_pad, 0.0f);
    std::fill_n(eb.q_bias.get(), rows_pad, 0.0f);
  } else {
    std::fill_n(eb.q.get(), eb.dk2 * rows_pad, std::uint16_t{0});
  }
  std::uint16_t* row16 = eb.row16.get();
  for (std::int64_t r = 0; r < g.rows(); ++r) {
    const std::uint8_t* src = At(plan.q, g.seq.batch, g.seq.q_begin + u.i0 + r % g.positions,
                                 u.hkv * g.group + r / g.positions);
    LoadStridedRowF32(src, plan.q.dtype(), p.dq, plan.q.stride(3), row);
    if (!eb.int8) {
      StoreRowFromF32(row, p.dq, row16, DType::bf16);
      for (std::int64_t x = 0; x < p.dq; ++x) {
        eb.q[static_cast<std::size_t>((x / 2) * 2 * rows_pad + 2 * r + x % 2)] = row16[x];
      }
      continue;
    }
    double bias = 0.0;
    for (std::int64_t x = 0; x < p.dq; ++x)
      bias += double{row[x]} * eb.mean[static_cast<std::size_t>(x)];
    eb.q_bias[static_cast<std::size_t>(r)] = static_cast<float>(bias * scale);
    std::int8_t* row8 = eb.row8.get();
    eb.q_scale[static_cast<std::size_t>(r)] = QuantizeRow(row, p.dq, row8) * scale;
    for (std::int64_t x = 0; x < p.dq; ++x) {
      eb.q8[static_cast<std::size_t>((x / 4) * 4 * rows_pad + 4 * r + x % 4)] = row8[x];
    }
  }
}

// S^T[cols][rows_pad] of keys [j0, j0 + cols) for the first RoundUp(rows,
// 16) columns: scale (K Q^T) on the bf16 engine, or with int8 scores
// s_q s_k (K8 Q8) + scale <q, mean> from the int8 product. The keys come
// from the task's cache (cached, from `begin`) or are packed here (V too).
inline void EngineBlockScores(const FlashPlan& plan, const Unit& u, const UnitGeometry& g,
                              std::int64_t rows_pad, bool cached, std::int64_t begin,
                              std::int64_t j0, std::int64_t cols, float* HWY_RESTRICT row,
                              EngineBuffers& eb, float* HWY_RESTRICT s) {
  const std::int64_t rows = g.rows();
  const std::int64_t n = RoundUp(std::max<std::int64_t>(rows, 1), 16);
  std::int64_t at = j0 - begin;  // the block's first key slot
  if (!cached) {
    eb.NeedBlockBuffers();
    PackKeys(plan, g.seq, j0, cols, u.hkv, 0, row, eb, eb.k.get(), eb.k8.get(), eb.k_scale.get(),
             eb.v.get());
    at = 0;
  }
  const hn::ScalableTag<float> d;
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(d));
  if (!eb.int8) {
    const std::uint16_t* k_rows = (cached ? eb.k_cache.get() : eb.k.get()) + at * eb.dk2;
    engines::bf16_product(
        *plan.engine, {k_rows, eb.dk2, eb.q.get(), rows_pad, s, rows_pad, cols, n, eb.dk2, false});
    const auto v_scale = hn::Set(d, static_cast<float>(plan.params.scale));
    for (std::int64_t c = 0; c < cols; ++c) {
      for (std::int64_t r = 0; r < n; r += lanes) {
        float* x = s + c * rows_pad + r;
        hn::StoreU(hn::Mul(hn::LoadU(d, x), v_scale), d, x);
      }
    }
    return;
  }
  const std::int8_t* k8 = (cached ? eb.k8_cache.get() : eb.k8.get()) + at * eb.dk4;
  const float* k_scale = (cached ? eb.k_scale_cache.get() : eb.k_scale.get()) + at;
  std::int32_t* i32 = eb.scores.get();
  engines::int8_product(*plan.int8,
                        {k8, eb.dk4, eb.q8.get(), rows_pad, i32, rows_pad, cols, n, eb.dk4, false});
  const hn::RebindToSigned<decltype(d)> di;
  for (std::int64_t c = 0; c < cols; ++c) {
    const auto ks = hn::Set(d, k_scale[c]);
    for (std::int64_t r = 0; r < n; r += lanes) {
      const auto product = hn::ConvertTo(d, hn::LoadU(di, i32 + c * rows_pad + r));
      const auto factor = hn::Mul(hn::LoadU(d, eb.q_scale.get() + r), ks);
      hn::StoreU(hn::MulAdd(product, factor, hn::LoadU(d, eb.q_bias.get() + r)), d,
                 s + c * rows_pad + r);
    }
  }
}

// dst[r][off + c] = bf16(src_t[c][r]) for rows r < rows and keys c < cols
// (src_t [cols][rows_pad], f32), zero at [0, off) and [off + cols, depth)
// and, with row_keys, outside each row's keys: a block's P^T (or dS^T)
// turned into A rows of pairs of keys. A vector of keys of a vector of rows
// at a time, transposed in registers, rounded to nearest even.
inline void TransposeToBf16Rows(const float* HWY_RESTRICT src_t, std::int64_t rows_pad,
                                std::int64_t rows, std::int64_t cols, std::int64_t off,
                                std::int64_t depth, const KeySpan* row_keys,
                                std::uint16_t* HWY_RESTRICT dst) {
  const hn::ScalableTag<float> d;
  const hn::RebindToSigned<decltype(d)> di;
  const hn::Rebind<std::uint16_t, decltype(d)> d16;
  using V = hn::Vec<decltype(d)>;
  constexpr auto kLanes = static_cast<std::int64_t>(hn::MaxLanes(decltype(d)()));
  HWY_ALIGN std::uint16_t tail[kLanes];
  for (std::int64_t r0 = 0; r0 < rows; r0 += kLanes) {
    const std::int64_t n = std::min(kLanes, rows - r0);
    for (std::int64_t j = 0; j < n; ++j) {
      std::uint16_t* row = dst + (r0 + j) * depth;
      std::fill(row, row + off, std::uint16_t{0});
      std::fill(row + off + cols, row + depth, std::uint16_t{0});
    }
    for (std::int64_t c0 = 0; c0 < cols; c0 += kLanes) {
      V block[kLanes];
      for (std::int64_t i = 0; i < kLanes; ++i) {
        block[i] = c0 + i < cols ? hn::LoadU(d, src_t + (c0 + i) * rows_pad + r0) : hn::Zero(d);
      }
      TransposeSquare(d, block);
      const std::int64_t width = std::min(kLanes, cols - c0);
      for (std::int64_t j = 0; j < n; ++j) {
        const auto bits = hn::DemoteTo(d16, hn::BitCast(di, Bf16Bits(d, block[j])));
        std::uint16_t* out = dst + (r0 + j) * depth + off + c0;
        if (width == kLanes) {
          hn::StoreU(bits, d16, out);
        } else {
          hn::Store(bits, d16, tail);
          std::copy_n(tail, width, out);
        }
      }
    }
    if (row_keys == nullptr) continue;
    for (std::int64_t j = 0; j < n; ++j) {
      const KeySpan span = row_keys[r0 + j];
      std::uint16_t* row = dst + (r0 + j) * depth + off;
      if (span.begin >= span.end) {
        std::fill(row, row + cols, std::uint16_t{0});
        continue;
      }
      std::fill(row, row + span.begin, std::uint16_t{0});
      std::fill(row + span.end, row + cols, std::uint16_t{0});
    }
  }
}

// O[rows][dv_pad] (+)= P V for the block's P^T[cols][rows_pad] (f32) and
// keys [j0, j0 + cols), V from the task's cache (from `begin`) or the
// block's pairs: P rows start at the pair holding key j0 (`off` = 1 when it
// is that pair's second key); row_keys (when set) limits each row to its
// keys.
inline void EngineBlockValues(const FlashPlan& plan, const float* HWY_RESTRICT p_t,
                              std::int64_t rows_pad, std::int64_t rows, std::int64_t cols,
                              const KeySpan* row_keys, bool cached, std::int64_t begin,
                              std::int64_t j0, bool overwrite, EngineBuffers& eb,
                              float* HWY_RESTRICT o) {
  const std::int64_t t = cached ? j0 - begin : 0;
  const std::int64_t off = t % 2;
  const std::uint16_t* v_pairs = (cached ? eb.v_cache.get() : eb.v.get()) + (t / 2) * 2 * eb.dv_pad;
  const std::int64_t depth = RoundUp(off + cols, 2);
  std::uint16_t* p = eb.p.get();
  TransposeToBf16Rows(p_t, rows_pad, rows, cols, off, depth, row_keys, p);
  engines::bf16_product(*plan.engine, {p, depth, v_pairs, eb.dv_pad, o, eb.dv_pad, rows, eb.dv_pad,
                                       depth, !overwrite});
}

QKV_HWY_NAMESPACE_END(cpu);

#endif  // QKV_CPU_FLASH_ENGINE_INL_H_
