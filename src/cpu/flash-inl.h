// The per-target body of the fused attention kernels (see flash.hpp). For
// each unit, Q rows of all heads sharing a KV head are packed once, then for
// each key block that any mask leaves open: pack K^T and V, S = Q K^T, apply
// biases and masks, online softmax (running max m, sum l, rescaled O), and
// O += P V. Memory: per-thread scratch of a few tiles, nothing of size
// Nq x Nk.
#if defined(QKV_CPU_FLASH_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_CPU_FLASH_INL_H_
#undef QKV_CPU_FLASH_INL_H_
#else
#define QKV_CPU_FLASH_INL_H_
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "core/elements.hpp"
#include "core/gemm.hpp"
#include "core/hwy_namespace.hpp"
#include "core/philox.hpp"
#include "core/softmax_epilogue.hpp"
#include "core/sparse.hpp"
#include "cpu/flash.hpp"
#include "cpu/flash_engine-inl.h"
#include "cpu/score_mods-inl.h"
#include "cpu/tile_gemm-inl.h"
#include "cpu/vec_math-inl.h"
#include "hwy/aligned_allocator.h"
#include "hwy/cache_control.h"
#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"

QKV_HWY_NAMESPACE_BEGIN(cpu);

// Rows fetched ahead when packing rows of a [B, N, H, D] tensor.
constexpr std::int64_t kRowsAhead = 8;

// Sizes of one thread's scratch, derived from the plan.
struct TileShape {
  std::int64_t rows_pad = 0;  // Q tile rows (group x positions), rounded up to the panel width
  std::int64_t keys = 0;      // keys per block
  std::int64_t dk = 0;        // max(Dq, Dk)
  std::int64_t dv_pad = 0;    // Dv rounded up to the panel width
  std::int64_t a_pad = 0;     // additive attention size rounded up to the vector
  bool engine = false;        // the products run on a bf16 engine (EngineOf)
  bool int8 = false;          // with int8 scores (FlashPlan::int8)
};

// Keys [begin, begin + n) of a task's KV head as f32: packed, K rows
// [n][Dk] and V column panels [dv_pad / NR][n][NR] (panel stride n * NR);
// or read in place from f32 tensors, K rows k_ld floats apart and V rows
// v_row floats apart, a panel being the next NR columns (panel stride NR).
// Keys [begin, packed) hold data: the task packs them as its units reach
// them (PackThrough). Null pointers: not cached, pack each block on the fly.
struct PackedKeys {
  const float* k = nullptr;
  const float* v = nullptr;
  std::int64_t begin = 0;
  std::int64_t packed = 0;
  std::int64_t k_ld = 0;   // floats from one K row to the next
  std::int64_t v_row = 0;  // floats from one V row to the next within a panel
  std::int64_t v_panel_stride = 0;
  // On an engine instead: its buffers (EngineBuffers) hold the keys from
  // `begin` (EngineCacheTask).
  bool engine = false;

  bool cached() const { return k != nullptr || engine; }
};

// Software prefetches of the `rows` K and V rows that the next unit will
// pack, a few rows per call of Next() so that they overlap the current
// unit's arithmetic: rows of a [B, N, H, D] tensor lie H * D elements apart,
// beyond what hardware prefetchers follow, and packing them unfetched stalls
// on memory.
struct RowPrefetch {
  const std::uint8_t* k = nullptr;          // first K row
  const std::uint8_t* v = nullptr;          // first V row
  std::int64_t k_stride = 0, v_stride = 0;  // bytes between rows
  std::int64_t k_span = 0, v_span = 0;      // bytes of each row
  std::int64_t rows = 0;
  std::int64_t per_call = 0;  // rows per call of Next
  std::int64_t row = 0;       // the next row

  HWY_INLINE void Next() {
    for (std::int64_t i = 0; i < per_call && row < rows; ++i, ++row) {
      for (std::int64_t x = 0; x < k_span; x += 64) hwy::Prefetch(k + row * k_stride + x);
      for (std::int64_t x = 0; x < v_span; x += 64) hwy::Prefetch(v + row * v_stride + x);
    }
  }
};

// One thread's buffers, allocated once per call. Shapes:
//   q    Q^T panels [rows_pad / NR][Dk][NR] (scaled), or Q rows [rows][Dq]
//   qa   additive: Q W_q^T [rows_pad][a_pad]
//   q_rows   Lanes query rows [Lanes][Dq] converted to f32 (allocated on
//            first use: f32 rows are read in place)
//   k    K block [keys][Dk], or additive: K W_k^T + b [keys][a_pad]
//   v    V block as panels [dv_pad / NR][keys][NR], or additive: K rows [keys][Dk]
//   s    S^T, then P^T [keys][rows_pad]
//   o    O [rows_pad][dv_pad]
//   m, l, alpha, block_sum   per row [rows_pad]
//   row_keys, panel_keys     keys of the current block each row / Q^T panel
//                            can see, when the range mask cuts into it
struct Scratch {
  explicit Scratch(const TileShape& t)
      : shape(t),
        q(AllocFloats(t.rows_pad * t.dk)),
        qa(AllocFloats(t.rows_pad * t.a_pad)),
        // One vector of slack: masks read-modify-write whole vectors that
        // may run past the last row of S^T.
        s(AllocFloats(t.keys * t.rows_pad + 64)),
        o(AllocFloats(t.rows_pad * t.dv_pad)),
        row(AllocFloats(std::max(t.dk, t.dv_pad))),
        m(AllocFloats(t.rows_pad)),
        l(AllocFloats(t.rows_pad)),
        alpha(AllocFloats(t.rows_pad)),
        row_keys(static_cast<std::size_t>(t.rows_pad)),
        panel_keys(static_cast<std::size_t>(t.rows_pad / PanelWidth())) {
    if (t.engine) eb.emplace(t.rows_pad, t.keys, t.dk, t.dv_pad, t.int8);
  }

  // k and v, allocated on first use (NeedBlockBuffers): a task whose keys
  // are cached or read in place never touches them.
  void NeedBlockBuffers() {
    if (eb) return;  // EngineBlockScores allocates its own
    if (k) return;
    k = AllocFloats(shape.keys * std::max(shape.dk, shape.a_pad));
    v = AllocFloats(shape.keys * std::max(shape.dv_pad, shape.dk));  // also additive K rows
  }

  TileShape shape;
  hwy::AlignedFreeUniquePtr<float[]> q, qa, s, q_rows, o, row, m, l, alpha, k, v;
  std::vector<KeySpan> row_keys, panel_keys;
  // A task's keys and values packed once for all its units (see PackedKeys).
  hwy::AlignedFreeUniquePtr<float[]> k_cache, v_cache;
  std::int64_t cache_capacity = 0;  // floats in each of k_cache and v_cache
  RowPrefetch ahead;                // rows the next unit of the task packs
  std::optional<EngineBuffers> eb;  // the bf16 engine's buffers, when it runs
};

// V rows of a key block for AccumulateValues: column panels of NR floats,
// `panel_stride` floats apart, starting at the block's first key, whose
// rows are `row_stride` floats apart.
struct ValuePanels {
  const float* v;
  std::int64_t row_stride;
  std::int64_t panel_stride;
};

// Rows [j0, j0 + n) of KV head h as f32 into dst [n][ld]; columns [width, ld)
// are set to zero. With panel_stride > 0 the rows go instead into column
// panels of NR = ValueWidth() floats, [ld / NR][panel_stride][NR] (ld a
// multiple of NR), staged through `row` (ld floats): the value kernel then
// reads each panel as one contiguous stream that stays in L1, where rows of
// ld floats would map a panel's column onto a few cache sets.
inline void PackRows(ConstTensorView t, const detail::SequenceExtent& seq, std::int64_t j0,
                     std::int64_t n, std::int64_t h, std::int64_t ld, float* HWY_RESTRICT dst,
                     std::int64_t panel_stride = 0, float* HWY_RESTRICT row = nullptr) {
  const std::int64_t width = t.size(3);
  const std::uint8_t* src = At(t, seq.batch, seq.k_begin + j0, h);
  const std::int64_t row_bytes = StepBytes(t, 1);
  // In [B, N, H, D] layouts consecutive keys are H * D elements apart, often
  // a page or more, where hardware prefetchers stop: fetch rows ahead.
  const std::int64_t line_span =
      std::min<std::int64_t>(RowSpanBytes(t, width), row_bytes > 0 ? row_bytes : 1);
  for (std::int64_t r = 0; r < n; ++r) {
    // A view without memory (head dim 0, null data) has rows of nothing:
    // no address may be formed from its null pointer.
    if (src != nullptr && r + kRowsAhead < n) {
      const std::uint8_t* ahead = src + (r + kRowsAhead) * row_bytes;
      for (std::int64_t b = 0; b < line_span; b += 64) hwy::Prefetch(ahead + b);
    }
    float* out = panel_stride > 0 ? row : dst + r * ld;
    LoadStridedRowF32(src == nullptr ? nullptr : src + r * row_bytes, t.dtype(), width, t.stride(3),
                      out);
    std::fill(out + width, out + ld, 0.0f);
    if (panel_stride == 0) continue;
    const std::int64_t nr = ValueWidth();
    for (std::int64_t c = 0; c < ld; c += nr) {
      std::copy_n(row + c, nr, dst + (c / nr) * panel_stride + r * nr);
    }
  }
}

// y[n][a_pad] = x[n][in] W^T (+ bias) for W [A][in] f32; pad columns zero.
// One GEMM on OpenBLAS (serial inside a unit's thread; summation order is
// OpenBLAS's, not left to right).
inline void Project(const float* HWY_RESTRICT x, std::int64_t n, std::int64_t in,
                    const std::vector<float>& w, const std::vector<float>& bias,
                    std::int64_t a_size, std::int64_t a_pad, float* HWY_RESTRICT y) {
  detail::gemm(DType::f32, false, true, n, a_size, in, 1.0, x, in, w.data(), in, 0.0, y, a_pad,
               bias.empty() ? nullptr : bias.data());
  for (std::int64_t r = 0; r < n; ++r) std::fill(y + r * a_pad + a_size, y + (r + 1) * a_pad, 0.0f);
}

// S^T[c][r] = sum_a v[a] tanh(qa[r][a] + ka[c][a]) (the additive score).
// qa and ka are the plan's aligned scratch; v lives in a std::vector, whose
// storage is only 16-byte aligned, so it is loaded unaligned.
inline void AdditiveScoresTransposed(const float* HWY_RESTRICT qa, std::int64_t rows,
                                     const float* HWY_RESTRICT ka, std::int64_t keys,
                                     const float* HWY_RESTRICT v, std::int64_t a_pad,
                                     float* HWY_RESTRICT s, std::int64_t rows_pad) {
  const hn::ScalableTag<float> d;
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(d));
  for (std::int64_t c = 0; c < keys; ++c) {
    for (std::int64_t r = 0; r < rows; ++r) {
      auto acc = hn::Zero(d);
      for (std::int64_t a = 0; a < a_pad; a += lanes) {
        const auto x = hn::Add(hn::Load(d, qa + r * a_pad + a), hn::Load(d, ka + c * a_pad + a));
        acc = hn::MulAdd(hn::LoadU(d, v + a), hn::Tanh(d, x), acc);
      }
      s[c * rows_pad + r] = hn::GetLane(hn::SumOfLanes(d, acc));
    }
  }
}

inline UnitGeometry GeometryOf(const FlashPlan& plan, const Unit& u) {
  UnitGeometry g;
  g.seq = plan.problem->sequence(u.s);
  g.group = plan.problem->group();
  g.positions = u.positions;
  g.offset = plan.params.keys.offset(g.seq.nq, g.seq.nk);
  return g;
}

// The dropout decisions of keys [j0, j0 + cols) for the unit's rows, from the
// counter-based generator of qkv::dropout_keep (one Philox call per 4 keys
// of a row): f(x, keep) for each element x = c * rows_pad + r of a tile
// S^T [keys][rows_pad]. The forward and the backward draw the same ones.
template <class F>
inline void ForEachDropoutDecision(const FlashPlan& plan, const Unit& u, const UnitGeometry& g,
                                   std::int64_t j0, std::int64_t cols, std::int64_t rows_pad,
                                   const F& f) {
  const DropoutParams& o = plan.params.dropout;
  const std::uint32_t threshold = detail::dropout_threshold(o.p);
  for (std::int64_t gi = 0; gi < g.group; ++gi) {
    const std::int64_t bh =
        detail::dropout_stream(o.shard, plan.problem->hq, u.s, u.hkv * g.group + gi);
    for (std::int64_t t = 0; t < g.positions; ++t) {
      const std::int64_t r = gi * g.positions + t;
      for (std::int64_t c = 0; c < cols;) {
        const std::int64_t j = j0 + c + o.shard.key;
        const detail::PhiloxCounter words =
            detail::dropout_words(o.seed, o.offset, bh, u.i0 + t + o.shard.row, j);
        for (std::int64_t w = j % 4; w < 4 && c < cols; ++w, ++c) {
          f(c * rows_pad + r, (words[static_cast<std::size_t>(w)] >> 8) >= threshold);
        }
      }
    }
  }
}

// Dropout of the weights P^T of keys [j0, j0 + cols) for the unit's rows:
// each is kept and scaled by 1 / (1 - p), or zeroed.
inline void ApplyDropout(const FlashPlan& plan, const Unit& u, const UnitGeometry& g,
                         std::int64_t j0, std::int64_t cols, float* HWY_RESTRICT s,
                         std::int64_t rows_pad) {
  const auto keep_scale = static_cast<float>(1.0 / (1.0 - plan.params.dropout.p));
  ForEachDropoutDecision(plan, u, g, j0, cols, rows_pad, [&](std::int64_t x, bool keep) {
    s[x] = keep ? s[x] * keep_scale : 0.0f;
  });
}

// K rows [j0, j0 + cols) of the unit's KV head as f32 [cols][Dk]: from the
// task's cache, or packed into scratch.
inline const float* KeyRows(const FlashPlan& plan, const Unit& u, const UnitGeometry& g,
                            const PackedKeys& cache, std::int64_t j0, std::int64_t cols,
                            Scratch& sc) {
  const std::int64_t dk = plan.problem->dk;
  if (cache.k != nullptr) return cache.k + (j0 - cache.begin) * cache.k_ld;
  float* dst = plan.params.score == Score::additive ? sc.v.get() : sc.k.get();
  PackRows(plan.k, g.seq, j0, cols, u.hkv, dk, dst);
  return dst;
}

// V rows [j0, j0 + cols) as f32 column panels, from the cache or packed.
inline ValuePanels ValueRows(const FlashPlan& plan, const Unit& u, const UnitGeometry& g,
                             const TileShape& shape, const PackedKeys& cache, std::int64_t j0,
                             std::int64_t cols, Scratch& sc) {
  if (cache.v != nullptr) {
    return {cache.v + (j0 - cache.begin) * cache.v_row, cache.v_row, cache.v_panel_stride};
  }
  const std::int64_t stride = shape.keys * ValueWidth();
  PackRows(plan.v, g.seq, j0, cols, u.hkv, shape.dv_pad, sc.v.get(), stride, sc.row.get());
  return {sc.v.get(), ValueWidth(), stride};
}

// The raw S^T of key block [j0, j0 + cols) into sc.s; with `panel_keys`,
// only the keys each Q^T panel can see.
inline void BlockScores(const FlashPlan& plan, const Unit& u, const UnitGeometry& g,
                        const TileShape& shape, const PackedKeys& cache, std::int64_t j0,
                        std::int64_t cols, const KeySpan* panel_keys, Scratch& sc) {
  const detail::AttentionProblem& p = *plan.problem;
  if (sc.eb) {
    return EngineBlockScores(plan, u, g, shape.rows_pad, cache.engine, cache.begin, j0, cols,
                             sc.row.get(), *sc.eb, sc.s.get());
  }
  const float* k_rows = KeyRows(plan, u, g, cache, j0, cols, sc);
  if (plan.params.score == Score::additive) {
    // Keys projected through W_k (+ bias) into [cols][a_pad].
    Project(k_rows, cols, p.dk, plan.additive_w_k, plan.additive_bias, p.attention_size,
            shape.a_pad, sc.k.get());
    AdditiveScoresTransposed(sc.qa.get(), g.rows(), sc.k.get(), cols, plan.additive_v.data(),
                             shape.a_pad, sc.s.get(), shape.rows_pad);
    return;
  }
  const std::int64_t ldk = cache.k != nullptr ? cache.k_ld : p.dk;
  ScoresTransposed(k_rows, ldk, cols, p.dk, sc.q.get(), g.rows(), shape.rows_pad, panel_keys,
                   sc.s.get());
}

inline TileShape ShapeOf(const FlashPlan& plan) {
  const detail::AttentionProblem& p = *plan.problem;
  const std::int64_t nr = PanelWidth();
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(hn::ScalableTag<float>()));
  TileShape t;
  t.rows_pad = RoundUp(std::max<std::int64_t>(p.group() * plan.max_positions, 1), nr);
  // Key capacity: a block's keys, or all of the longest sequence's when
  // fewer (rounded up to whole cache lines of slack for vector loops).
  t.keys = std::max<std::int64_t>(
      std::min(plan.config.keys, RoundUp(std::max<std::int64_t>(plan.max_key_rows, 1), 64)), 1);
  t.dk = std::max({p.dq, p.dk, std::int64_t{1}});
  t.dv_pad = RoundUp(std::max<std::int64_t>(p.dv, 1), ValueWidth());
  t.a_pad = RoundUp(std::max<std::int64_t>(p.attention_size, 1), lanes);
  t.engine = EngineOf(plan).has_value();
  t.int8 = t.engine && plan.int8.has_value();
  return t;
}

// The classification of the explicit masks for block `jb` of unit `u`.
inline BlockClass MaskClass(const FlashPlan& plan, const Unit& u, std::int64_t jb) {
  if (plan.block_class.empty()) return BlockClass::full;
  return plan.block_class[static_cast<std::size_t>(u.first_block + jb)];
}

// The address of query row r of the unit (head gi = r / positions, position
// t = r % positions) in q; null for a view without memory.
inline const std::uint8_t* QueryRow(const FlashPlan& plan, const Unit& u, const UnitGeometry& g,
                                    std::int64_t r) {
  return At(plan.q, g.seq.batch, g.seq.q_begin + u.i0 + r % g.positions,
            u.hkv * g.group + r / g.positions);
}

// Packs the unit's queries: Q^T panels scaled by the score scale, or for the
// additive score Q rows and their projections Q W_q^T. The panels are
// written a vector of rows at a time (Lanes rows by Lanes columns,
// transposed in registers), zeros in the rows past the unit's last; padding
// panels are zero, and the second vector of a last panel whose rows fit its
// first is left as it is (ScoresTransposed does not compute it).
inline void PrepareQueries(const FlashPlan& plan, const Unit& u, const UnitGeometry& g,
                           const TileShape& shape, Scratch& sc) {
  const detail::AttentionProblem& p = *plan.problem;
  const ConstTensorView q = plan.q;
  const std::int64_t rows = g.rows();
  const std::int64_t row_bytes = StepBytes(q, 1);
  const std::int64_t row_span = RowSpanBytes(q, p.dq);
  // Consecutive positions are H * D elements apart: fetch rows ahead, as
  // PackRows does for keys (not from a view without memory).
  auto prefetch_ahead = [&](std::int64_t r, const std::uint8_t* src) {
    if (src == nullptr || r % g.positions + kRowsAhead >= g.positions) return;
    const std::uint8_t* ahead = src + kRowsAhead * row_bytes;
    for (std::int64_t b = 0; b < row_span; b += 64) hwy::Prefetch(ahead + b);
  };
  if (sc.eb) return EnginePrepareQueries(plan, u, g, shape.rows_pad, sc.row.get(), *sc.eb);
  if (plan.params.score == Score::additive) {
    std::fill(sc.q.get() + rows * p.dq, sc.q.get() + shape.rows_pad * shape.dk, 0.0f);
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::uint8_t* src = QueryRow(plan, u, g, r);
      prefetch_ahead(r, src);
      LoadStridedRowF32(src, q.dtype(), p.dq, q.stride(3), sc.q.get() + r * p.dq);
    }
    Project(sc.q.get(), rows, p.dq, plan.additive_w_q, {}, p.attention_size, shape.a_pad,
            sc.qa.get());
    return;
  }

  const hn::ScalableTag<float> d;
  using V = hn::Vec<decltype(d)>;
  constexpr auto kLanes = static_cast<std::int64_t>(hn::MaxLanes(decltype(d)()));
  const std::int64_t nr = PanelWidth();
  const auto scale = hn::Set(d, static_cast<float>(plan.params.scale));
  std::fill(sc.q.get() + RoundUp(rows, nr) * p.dq, sc.q.get() + shape.rows_pad * shape.dk, 0.0f);
  // f32 rows with unit stride are read in place; others are converted into
  // sc.q_rows first ([Lanes][Dq]).
  const bool in_place = q.dtype() == DType::f32 && q.stride(3) == 1;
  const std::int64_t dq_vectors = p.dq / kLanes * kLanes;
  for (std::int64_t r0 = 0; r0 < rows; r0 += kLanes) {
    const float* x[kLanes];  // the vector's rows; null past the last
    for (std::int64_t i = 0; i < kLanes; ++i) {
      const std::int64_t r = r0 + i;
      x[i] = nullptr;
      if (r >= rows) continue;
      const std::uint8_t* src = QueryRow(plan, u, g, r);
      prefetch_ahead(r, src);
      if (in_place) {
        x[i] = reinterpret_cast<const float*>(src);
      } else {
        if (!sc.q_rows) sc.q_rows = AllocFloats(kLanes * shape.dk);
        float* staged = sc.q_rows.get() + i * p.dq;
        LoadStridedRowF32(src, q.dtype(), p.dq, q.stride(3), staged);
        x[i] = staged;
      }
    }
    float* panel = sc.q.get() + (r0 / nr) * p.dq * nr + r0 % nr;
    for (std::int64_t k0 = 0; k0 < dq_vectors; k0 += kLanes) {
      V block[kLanes];
      [&]<std::size_t... kRow>(std::index_sequence<kRow...>) {
        ((block[kRow] =
              x[kRow] != nullptr ? hn::Mul(hn::LoadU(d, x[kRow] + k0), scale) : hn::Zero(d)),
         ...);
        TransposeSquare(d, block);
        (hn::Store(block[kRow], d, panel + (k0 + static_cast<std::int64_t>(kRow)) * nr), ...);
      }
      (std::make_index_sequence<static_cast<std::size_t>(kLanes)>());
    }
    for (std::int64_t k = dq_vectors; k < p.dq; ++k) {
      for (std::int64_t i = 0; i < kLanes; ++i) {
        panel[k * nr + i] =
            x[i] != nullptr ? x[i][k] * static_cast<float>(plan.params.scale) : 0.0f;
      }
    }
  }
}

// The key blocks a unit visits: from the block holding its first row's
// lowest key to its last row's highest.
struct BlockSpan {
  detail::KeyRange first, last;
  std::int64_t begin, end;  // block indices
};
inline BlockSpan SpanOf(const FlashPlan& plan, const Unit& u, const UnitGeometry& g) {
  BlockSpan b;
  b.first = plan.params.keys.range(u.i0 + g.offset, g.seq.nk);
  b.last = plan.params.keys.range(u.i0 + u.positions - 1 + g.offset, g.seq.nk);
  const std::int64_t bk = plan.config.keys;
  b.begin = b.first.lo / bk;
  b.end = b.last.hi > b.first.lo ? (b.last.hi + bk - 1) / bk : b.begin;
  return b;
}

// The keys of block [j0, j0 + cols) that each row and each Q^T panel of the
// unit can see under causal, window and key lengths (and, with `pattern`,
// the sparse pattern), relative to j0, into sc.row_keys and sc.panel_keys;
// rows that see none (and padding rows) get the empty span {cols, 0}, which
// min/max unions ignore. Near the diagonal (or the pattern's edges) this
// lets the micro-kernels skip the keys no row of a panel or strip sees.
inline void BlockKeySpans(const FlashPlan& plan, const Unit& u, const UnitGeometry& g,
                          std::int64_t j0, std::int64_t cols, bool pattern, Scratch& sc) {
  const std::int64_t nr = PanelWidth();
  const std::int64_t rows = g.rows();
  const std::int64_t panels = RoundUp(rows, nr) / nr;
  for (std::int64_t pi = 0; pi < panels; ++pi) {
    KeySpan panel{cols, 0};
    for (std::int64_t r = pi * nr; r < (pi + 1) * nr; ++r) {
      KeySpan span{cols, 0};
      if (r < rows) {
        const std::int64_t i = u.i0 + r % g.positions;
        const detail::KeyRange kr = plan.params.keys.range(i + g.offset, g.seq.nk);
        std::int64_t begin = std::clamp<std::int64_t>(kr.lo - j0, 0, cols);
        std::int64_t end = std::clamp<std::int64_t>(kr.hi - j0, 0, cols);
        if (pattern) {
          const detail::KeyInterval keys = detail::row_key_span(
              plan.params.sparse, u.hkv * g.group + r / g.positions, i, i + g.offset, j0, cols);
          begin = std::max(begin, keys.begin - j0);
          end = std::min(end, keys.end - j0);
        }
        if (begin < end) span = {begin, end};
      }
      sc.row_keys[static_cast<std::size_t>(r)] = span;
      panel.begin = std::min(panel.begin, span.begin);
      panel.end = std::max(panel.end, span.end);
    }
    sc.panel_keys[static_cast<std::size_t>(pi)] = panel;
  }
}

// Calls f(j0, cols, row_keys) for each key block that the unit's masks leave
// open, with the block's scores, biased and masked, in sc.s as S^T. When the
// range mask or a sparse pattern cuts into the block, the block is narrowed
// to the keys some row sees, row_keys holds each row's visible keys
// (BlockKeySpans) and scores outside a panel's span are not computed (they
// are masked); otherwise it is null.
template <class F>
inline void ForEachOpenBlock(const FlashPlan& plan, const Unit& u, const UnitGeometry& g,
                             const TileShape& shape, const PackedKeys& cache, Scratch& sc, F&& f) {
  const std::int64_t bk = plan.config.keys;
  const BlockSpan span = SpanOf(plan, u, g);
  for (std::int64_t jb = span.begin; jb < span.end; ++jb) {
    // Keys of the block that some row of the unit may attend to. Trimming
    // changes no row's grouping of its admitted keys, so results stay the same.
    std::int64_t j0 = std::max(jb * bk, span.first.lo);
    std::int64_t cols = std::min({(jb + 1) * bk, g.seq.nk_rows, span.last.hi}) - j0;
    const BlockClass mask_class = MaskClass(plan, u, jb);
    if (mask_class == BlockClass::empty) continue;
    const bool range_partial = !(span.last.lo <= j0 && span.first.hi >= j0 + cols);
    const bool pattern_cut = plan.params.sparse.defined() && mask_class == BlockClass::partial;
    const bool spans = range_partial || pattern_cut;
    if (spans) {
      BlockKeySpans(plan, u, g, j0, cols, pattern_cut, sc);
      KeySpan used{cols, 0};
      for (std::int64_t pi = 0; pi < RoundUp(g.rows(), PanelWidth()) / PanelWidth(); ++pi) {
        const KeySpan panel = sc.panel_keys[static_cast<std::size_t>(pi)];
        used.begin = std::min(used.begin, panel.begin);
        used.end = std::max(used.end, panel.end);
      }
      if (used.begin >= used.end) continue;  // no row sees a key of the block
      if (used.begin > 0 || used.end < cols) {
        j0 += used.begin;
        cols = used.end - used.begin;
        BlockKeySpans(plan, u, g, j0, cols, pattern_cut, sc);
      }
    }
    sc.ahead.Next();
    BlockScores(plan, u, g, shape, cache, j0, cols, spans ? sc.panel_keys.data() : nullptr, sc);
    ModifyAndMask(plan, u, g, j0, cols, range_partial, mask_class == BlockClass::partial,
                  sc.s.get(), shape.rows_pad);
    sc.ahead.Next();
    f(j0, cols, spans ? sc.row_keys.data() : nullptr);
  }
}

// Returns whether every output row and logsumexp of the unit is finite (or
// -inf: a row without keys).
inline bool ForwardUnit(const FlashPlan& plan, const Unit& u, const TileShape& shape,
                        const PackedKeys& cache, Scratch& sc) {
  const UnitGeometry g = GeometryOf(plan, u);
  const std::int64_t rows = g.rows();
  const std::int64_t rows_pad = shape.rows_pad;
  const hn::ScalableTag<float> d;
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(d));
  const std::int64_t dv = plan.problem->dv;

  PrepareQueries(plan, u, g, shape, sc);
  float* m = sc.m.get();
  float* l = sc.l.get();
  float* alpha = sc.alpha.get();
  float* o = sc.o.get();
  std::fill_n(m, rows_pad, kNegInf);
  std::fill_n(l, rows_pad, 0.0f);

  // The vectors of S^T columns that hold the unit's rows; the softmax skips
  // the padding beyond them.
  const std::int64_t rows_used = RoundUp(rows, lanes);
  // O (the unit's rows; no product reads or writes padding rows) holds
  // nothing until the first open block: that block writes P V into it when
  // every row sees all its keys (the same sums as adding to zeros), else O
  // is cleared first; rescaling zeros by alpha is skipped.
  bool o_written = false;
  auto clear_o = [&] { std::fill_n(o, rows * shape.dv_pad, 0.0f); };
  ForEachOpenBlock(
      plan, u, g, shape, cache, sc,
      [&](std::int64_t j0, std::int64_t cols, const KeySpan* row_keys) {
        float* s = sc.s.get();
        // Online softmax, vectorized across queries (columns of S^T).
        if (row_keys == nullptr) {
          OnlineSoftmaxBlock(s, rows_pad, cols, rows_used, m, l, alpha);
        } else {
          // A vector of rows sees at most its Q^T panel's keys.
          OnlineSoftmaxBlock(s, rows_pad, cols, rows_used, m, l, alpha, [&](std::int64_t r) {
            const KeySpan k = sc.panel_keys[static_cast<std::size_t>(r / PanelWidth())];
            return std::pair<std::int64_t, std::int64_t>{k.begin, std::max(k.begin, k.end)};
          });
        }
        const bool overwrite = !o_written && row_keys == nullptr;
        if (o_written) {
          RescaleRows(o, rows, shape.dv_pad, shape.dv_pad, alpha);
        } else if (!overwrite) {
          clear_o();
        }
        o_written = true;
        if (plan.params.dropout.p > 0.0) ApplyDropout(plan, u, g, j0, cols, s, rows_pad);
        if (sc.eb) {
          EngineBlockValues(plan, s, rows_pad, rows, cols, row_keys, cache.engine, cache.begin, j0,
                            overwrite, *sc.eb, o);
          return;
        }
        const ValuePanels v = ValueRows(plan, u, g, shape, cache, j0, cols, sc);
        AccumulateValues(s, rows_pad, rows, cols, row_keys, v.v, v.row_stride, v.panel_stride,
                         shape.dv_pad, o, shape.dv_pad, overwrite);
      });
  if (!o_written) clear_o();  // no open block: every row is empty

  // The rows finished (core/softmax_epilogue.hpp): O scaled into out
  // (rounded once), the lse stored.
  const TensorView out = plan.out;
  const TensorView lse = plan.lse;
  bool finite = true;
  const std::span<const float> sinks = plan.params.sinks;
  for (std::int64_t gi = 0; gi < g.group; ++gi) {
    const std::int64_t h = u.hkv * g.group + gi;
    const float sink = detail::sink_of<float>(sinks.data(), sinks.size(), h);
    for (std::int64_t t = 0; t < g.positions; ++t) {
      const std::int64_t r = gi * g.positions + t;
      const std::int64_t qrow = g.seq.q_begin + u.i0 + t;
      float* orow = o + r * shape.dv_pad;
      const detail::RowFinish<float> row = detail::finish_row(m[r], l[r], sink);
      for (std::int64_t c = 0; c < shape.dv_pad; c += lanes) {
        hn::Store(hn::Mul(hn::Load(d, orow + c), hn::Set(d, row.scale)), d, orow + c);
      }
      StoreViewRow(orow, dv, out, g.seq.batch, qrow, h);
      static_cast<float*>(
          lse.data())[g.seq.batch * lse.stride(0) + h * lse.stride(1) + qrow * lse.stride(2)] =
          row.lse;
      finite =
          finite && AllFinite(orow, shape.dv_pad) && (row.lse == kNegInf || std::isfinite(row.lse));
      if (plan.row_max.defined()) {
        const std::int64_t at = g.seq.batch * plan.row_max.stride(0) + h * plan.row_max.stride(1) +
                                qrow * plan.row_max.stride(2);
        static_cast<float*>(plan.row_max.data())[at] = m[r];
        static_cast<float*>(plan.row_scale.data())[at] = row.scale;
      }
    }
  }
  return finite;
}

// P^T = exp(S^T - lse) in place for the first rows_used columns (queries)
// and `cols` keys: 0 for masked keys (-inf) and for rows without any key
// (lse = -inf). The backward's recomputation from the forward's lse: the
// vector form of detail::weight_from_lse (core/softmax_epilogue.hpp).
inline void ProbabilitiesFromLse(const float* HWY_RESTRICT lse, std::int64_t rows_used,
                                 std::int64_t cols, float* HWY_RESTRICT s, std::int64_t rows_pad) {
  const hn::ScalableTag<float> d;
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(d));
  for (std::int64_t r = 0; r < rows_used; r += lanes) {
    const auto v_lse = hn::Load(d, lse + r);
    const auto empty = hn::Eq(v_lse, hn::Set(d, kNegInf));
    for (std::int64_t c = 0; c < cols; ++c) {
      float* x = s + c * rows_pad + r;
      hn::Store(hn::IfThenZeroElse(empty, FastExp(d, hn::Sub(hn::Load(d, x), v_lse))), d, x);
    }
  }
}

// P^T = exp(S^T - m) scale in place for the first rows_used columns
// (queries) and `cols` keys, from each row's maximum m and the scale of its
// finish (detail::finish_row; scaling by the row's own sum, not by e^lse with
// lse rounded to f32, keeps each row normalized to the last ulps): 0 for
// masked keys (-inf) and for rows without any key (m = -inf, scale 0).
inline void ProbabilitiesFromRowStats(const float* HWY_RESTRICT m, const float* HWY_RESTRICT scale,
                                      std::int64_t rows_used, std::int64_t cols,
                                      float* HWY_RESTRICT s, std::int64_t rows_pad) {
  const hn::ScalableTag<float> d;
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(d));
  for (std::int64_t r = 0; r < rows_used; r += lanes) {
    const auto v_m = hn::Load(d, m + r);
    const auto v_scale = hn::Load(d, scale + r);
    const auto empty = hn::Or(hn::Eq(v_m, hn::Set(d, kNegInf)), hn::Eq(v_scale, hn::Zero(d)));
    for (std::int64_t c = 0; c < cols; ++c) {
      float* x = s + c * rows_pad + r;
      const auto p = hn::Mul(FastExp(d, hn::Sub(hn::Load(d, x), v_m)), v_scale);
      hn::Store(hn::IfThenZeroElse(empty, p), d, x);
    }
  }
}

// Probabilities of one unit: P = exp(S - m) scale per admitted key, 0
// elsewhere. Returns true (the forward checked the rows).
inline bool ProbabilitiesUnit(const FlashPlan& plan, const Unit& u, const TileShape& shape,
                              const PackedKeys& cache, Scratch& sc) {
  const UnitGeometry g = GeometryOf(plan, u);
  const std::int64_t rows_pad = shape.rows_pad;
  const TensorView probs = plan.probs;
  auto* pdata = static_cast<float*>(probs.data());
  auto prob_row = [&](std::int64_t gi, std::int64_t t) {
    return pdata + g.seq.batch * probs.stride(0) + (u.hkv * g.group + gi) * probs.stride(1) +
           (g.seq.q_begin + u.i0 + t) * probs.stride(2);
  };

  PrepareQueries(plan, u, g, shape, sc);
  // Zero every probability of the unit's rows, then fill the open blocks.
  float* row_max = sc.m.get();
  float* row_scale = sc.l.get();
  std::fill_n(row_max, rows_pad, kNegInf);
  std::fill_n(row_scale, rows_pad, 0.0f);
  for (std::int64_t gi = 0; gi < g.group; ++gi) {
    for (std::int64_t t = 0; t < g.positions; ++t) {
      float* prow = prob_row(gi, t);
      for (std::int64_t j = 0; j < probs.size(3); ++j) prow[j * probs.stride(3)] = 0.0f;
      const std::int64_t at = g.seq.batch * plan.row_max.stride(0) +
                              (u.hkv * g.group + gi) * plan.row_max.stride(1) +
                              (g.seq.q_begin + u.i0 + t) * plan.row_max.stride(2);
      row_max[gi * g.positions + t] = static_cast<const float*>(plan.row_max.data())[at];
      row_scale[gi * g.positions + t] = static_cast<const float*>(plan.row_scale.data())[at];
    }
  }
  const std::int64_t rows_used = RoundUp(g.rows(), PanelWidth());
  ForEachOpenBlock(plan, u, g, shape, cache, sc,
                   [&](std::int64_t j0, std::int64_t cols, const KeySpan* /*row_keys*/) {
                     float* s = sc.s.get();
                     ProbabilitiesFromRowStats(row_max, row_scale, rows_used, cols, s, rows_pad);
                     for (std::int64_t gi = 0; gi < g.group; ++gi) {
                       for (std::int64_t t = 0; t < g.positions; ++t) {
                         float* prow = prob_row(gi, t) + (g.seq.k_begin + j0) * probs.stride(3);
                         const float* col = s + gi * g.positions + t;
                         for (std::int64_t c = 0; c < cols; ++c)
                           prow[c * probs.stride(3)] = col[c * rows_pad];
                       }
                     }
                   });
  return true;
}

// Whether a task reads its keys [begin, begin + n) in place: f32 rows with
// unit stride (and whole value panels), one block of keys, used by a single
// unit of at most one Q^T panel of rows. Each key is then read a few times
// only, so packing would cost more than the strided reads it saves (a short
// sequence, a decoding step); larger tasks reuse their keys across units,
// row strips and panels, where packed rows stay in L1.
inline bool KeysInPlace(const FlashPlan& plan, const Task& task, std::int64_t n) {
  const ConstTensorView k = plan.k, v = plan.v;
  const detail::AttentionProblem& p = *plan.problem;
  if (task.unit_end - task.unit_begin != 1 || n > plan.config.keys ||
      plan.params.score == Score::additive) {
    return false;
  }
  const Unit& u = plan.units[static_cast<std::size_t>(task.unit_begin)];
  return p.group() * u.positions <= PanelWidth() && k.dtype() == DType::f32 &&
         v.dtype() == DType::f32 && k.stride(3) == 1 && v.stride(3) == 1 && k.data() != nullptr &&
         v.data() != nullptr && p.dk > 0 && p.dv % ValueWidth() == 0 && p.dv > 0;
}

// The keys and values a task needs: read in place (KeysInPlace), or
// buffers for them when they fit the per-thread budget: consecutive keys of
// a [B, N, H, D] tensor lie H * D elements apart, so packing them block by
// block for every unit would re-read every key from a different page each
// time. Nothing is packed yet.
inline PackedKeys CacheTask(const FlashPlan& plan, const Task& task, const TileShape& shape,
                            Scratch& sc) {
  const Unit& first_unit = plan.units[static_cast<std::size_t>(task.unit_begin)];
  const Unit& last_unit = plan.units[static_cast<std::size_t>(task.unit_end - 1)];
  const BlockSpan first = SpanOf(plan, first_unit, GeometryOf(plan, first_unit));
  const UnitGeometry g = GeometryOf(plan, last_unit);
  const BlockSpan last = SpanOf(plan, last_unit, g);
  const std::int64_t begin = std::min(first.begin * plan.config.keys, g.seq.nk_rows);
  const std::int64_t end = std::min(last.end * plan.config.keys, g.seq.nk_rows);
  const std::int64_t n = end - begin;
  if (sc.eb) {
    PackedKeys cache;
    cache.begin = cache.packed = begin;
    cache.engine = EngineCacheTask(plan, g.seq, first_unit.hkv, begin, end, sc.row.get(), *sc.eb);
    return cache;
  }
  if (n > 0 && KeysInPlace(plan, task, n)) {
    const std::int64_t hkv = first_unit.hkv;
    return {reinterpret_cast<const float*>(At(plan.k, g.seq.batch, g.seq.k_begin + begin, hkv)),
            reinterpret_cast<const float*>(At(plan.v, g.seq.batch, g.seq.k_begin + begin, hkv)),
            begin,
            end,
            plan.k.stride(1),
            plan.v.stride(1),
            ValueWidth()};
  }
  const std::int64_t floats = n * std::max(plan.problem->dk, shape.dv_pad);
  if (n <= 0 ||
      floats * 2 * static_cast<std::int64_t>(sizeof(float)) > plan.config.packed_keys_bytes) {
    return {};
  }
  if (floats > sc.cache_capacity) {
    sc.k_cache = AllocFloats(floats);
    sc.v_cache = AllocFloats(floats);
    sc.cache_capacity = floats;
  }
  return {sc.k_cache.get(), sc.v_cache.get(), begin,           begin,
          plan.problem->dk, ValueWidth(),     n * ValueWidth()};
}

// The end of the keys unit u reads: its last row's highest key.
inline std::int64_t KeysEnd(const FlashPlan& plan, const Unit& u) {
  const UnitGeometry g = GeometryOf(plan, u);
  return std::min(SpanOf(plan, u, g).last.hi, g.seq.nk_rows);
}

// Packs the cache's keys up to `end` (units visit keys in increasing order,
// so each key is packed once, just before its first use), then points
// sc.ahead at the rows up to `next_end` that the following unit will pack,
// spread over the calls of Next() that unit u makes (two per key block).
inline void PackThrough(const FlashPlan& plan, const Unit& u, const TileShape& shape,
                        std::int64_t end, std::int64_t next_end, PackedKeys& cache, Scratch& sc) {
  const UnitGeometry g = GeometryOf(plan, u);
  const BlockSpan span = SpanOf(plan, u, g);
  const std::int64_t calls = 2 * (span.end - span.begin);
  if (end > cache.packed && sc.eb) {
    EnginePackThrough(plan, g.seq, u.hkv, cache.begin, cache.packed, end, sc.row.get(), *sc.eb);
    cache.packed = end;
  } else if (end > cache.packed) {
    const std::int64_t n = end - cache.packed;
    const std::int64_t at = cache.packed - cache.begin;
    PackRows(plan.k, g.seq, cache.packed, n, u.hkv, plan.problem->dk,
             sc.k_cache.get() + at * plan.problem->dk);
    PackRows(plan.v, g.seq, cache.packed, n, u.hkv, shape.dv_pad,
             sc.v_cache.get() + at * ValueWidth(), cache.v_panel_stride, sc.row.get());
    cache.packed = end;
  }
  RowPrefetch& a = sc.ahead;
  a.rows = std::max<std::int64_t>(0, next_end - cache.packed);
  a.row = 0;
  if (a.rows == 0) return;
  a.k = At(plan.k, g.seq.batch, g.seq.k_begin + cache.packed, u.hkv);
  a.v = At(plan.v, g.seq.batch, g.seq.k_begin + cache.packed, u.hkv);
  a.k_stride = StepBytes(plan.k, 1);
  a.v_stride = StepBytes(plan.v, 1);
  a.k_span = RowSpanBytes(plan.k, plan.problem->dk);
  a.v_span = RowSpanBytes(plan.v, plan.problem->dv);
  a.per_call = (a.rows + calls - 1) / std::max<std::int64_t>(calls, 1);
}

// Runs `unit_fn` over all tasks on OpenMP threads with per-thread scratch;
// returns whether every call returned true.
// Threads only when the call is worth waking them: a few heads of a few
// rows (a decoding step, a short sequence) take microseconds on one thread,
// about what a parallel region's start and barrier cost (and far more when
// the other cores are busy). The threshold is about 5 us of work on one
// core: multiply-adds of Q K^T and P V over the rows and keys of each unit.
inline bool WorthThreads(const FlashPlan& plan) {
  constexpr std::int64_t kParallelWork = std::int64_t{1} << 17;
  const detail::AttentionProblem& p = *plan.problem;
  std::int64_t work = 0;
  for (const Unit& u : plan.units) {
    work += p.group() * u.positions * std::min(plan.max_key_rows, p.nk) * (p.dk + p.dv);
    if (work >= kParallelWork) return true;
  }
  return false;
}

template <class UnitFn>
bool ForEachTask(const FlashPlan& plan, UnitFn unit_fn) {
  const TileShape shape = ShapeOf(plan);
  const auto n = static_cast<std::int64_t>(plan.tasks.size());
  std::atomic<bool> all{true};
#pragma omp parallel if (WorthThreads(plan))
  {
    Scratch scratch(shape);
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t i = 0; i < n; ++i) {
      const Task& task = plan.tasks[static_cast<std::size_t>(i)];
      PackedKeys cache = CacheTask(plan, task, shape, scratch);
      if (!cache.cached() || plan.params.score == Score::additive) {
        scratch.NeedBlockBuffers();
      }
      scratch.ahead.rows = 0;
      std::int64_t end = KeysEnd(plan, plan.units[static_cast<std::size_t>(task.unit_begin)]);
      for (std::int64_t u = task.unit_begin; u < task.unit_end; ++u) {
        const Unit& unit = plan.units[static_cast<std::size_t>(u)];
        if (cache.cached()) {
          const std::int64_t next_end =
              u + 1 < task.unit_end ? KeysEnd(plan, plan.units[static_cast<std::size_t>(u + 1)])
                                    : end;
          PackThrough(plan, unit, shape, end, next_end, cache, scratch);
          end = next_end;
        }
        if (!unit_fn(plan, unit, shape, cache, scratch))
          all.store(false, std::memory_order_relaxed);
      }
    }
  }
  return all.load();
}

inline bool FlashForwardImpl(const FlashPlan& plan) { return ForEachTask(plan, ForwardUnit); }
inline void FlashProbabilitiesImpl(const FlashPlan& plan) { ForEachTask(plan, ProbabilitiesUnit); }

QKV_HWY_NAMESPACE_END(cpu);

#endif  // QKV_CPU_FLASH_INL_H_
