// The per-target body of the fused backward pass (FlashAttention-2's form,
// see qkv/backward.hpp). Key blocks are the outer loop, so a task keeps its
// dK and dV accumulators in cache while the query tiles that see the block
// stream past; for each (key block, query tile) tile, with keys as rows:
//   S^T  = K Q^T (scaled), biased and masked as in the forward
//   P^T  = exp(S^T - lse)                       recomputed, nothing stored
//   dP^T = V dO^T
//   dS^T = P^T (Z r dP^T - D)                   D_i = <dout_i, out_i>
//   dV  += (Z r P^T) dO,  dK += dS^T Q,  dQ += dS K
// Memory: per-thread tiles, the f32 dQ buffers of the key chunks, for a
// relative bias its per-task gradient by distance, and for d_mask dS of
// every (b, h, i, j) (B * Hq * Nq * Nk floats).
#if defined(QKV_CPU_FLASH_BACKWARD_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_CPU_FLASH_BACKWARD_INL_H_
#undef QKV_CPU_FLASH_BACKWARD_INL_H_
#else
#define QKV_CPU_FLASH_BACKWARD_INL_H_
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <optional>
#include <vector>

#include "core/hwy_namespace.hpp"
#include "cpu/flash-inl.h"
#include "cpu/flash_backward_engine-inl.h"
#include "hwy/highway.h"

QKV_HWY_NAMESPACE_BEGIN(cpu);

// Per-thread budget for a task's packed query tiles (TileCache).
constexpr std::int64_t kTileCacheBytes = std::int64_t{16} << 20;

// Everything a (key block, query tile) step reads from the tile's query
// rows, packed (NR = PanelWidth() = ValueWidth()):
//   q_t      Q^T panels [rows_pad / NR][Dq][NR], scaled
//   q_cols   Q as column panels [dk_pad / NR][rows_pad][NR], unscaled
//   do_t     dO^T panels [rows_pad / NR][Dv][NR]
//   do_cols  dO as column panels [dv_pad / NR][rows_pad][NR]
//   lse, d   per row: the forward's lse (-inf for padding) and D = <dout, out>
struct QueryTile {
  float* q_t;
  float* q_cols;
  float* do_t;
  float* do_cols;
  float* lse;
  float* d;
};

// Floats of one packed QueryTile.
inline std::int64_t QueryTileFloats(const TileShape& t, std::int64_t dk_pad) {
  return t.rows_pad * (t.dk + dk_pad + 2 * t.dv_pad + 2);
}

// Carves a QueryTile out of `base` (QueryTileFloats floats).
inline QueryTile QueryTileAt(float* base, const TileShape& t, std::int64_t dk_pad) {
  QueryTile q;
  q.q_t = base;
  q.q_cols = q.q_t + t.rows_pad * t.dk;
  q.do_t = q.q_cols + t.rows_pad * dk_pad;
  q.do_cols = q.do_t + t.rows_pad * t.dv_pad;
  q.lse = q.do_cols + t.rows_pad * t.dv_pad;
  q.d = q.lse + t.rows_pad;
  return q;
}

// One thread's backward buffers besides the forward's Scratch (whose s holds
// the scores, then P^T). Shapes:
//   tile     one QueryTile, packed per step when the task's do not fit the cache
//   cache    a task's QueryTiles, one per unit, packed once (when they fit)
//   dp       dP^T, then dS^T [keys][rows_pad]
//   pd       dropout: P^T with the mask and 1 / (1 - p) applied [keys][rows_pad]
//   raw      softcap: S^T before the cap [keys][rows_pad]
//   k_rows   K block [keys][Dk];  k_cols  K as column panels [dk_pad / NR][keys][NR]
//   v_rows   V block [keys][Dv]
//   dk, dv   the block's accumulators [keys][dk_pad], [keys][dv_pad]
//   strip_rows  per strip of keys, the rows that see it (StripRows)
//   dq       the tile's dQ [rows_pad][dk_pad]
//   out_row, dout_row   one row of out / dout as f32
//   pack_row  staging row for packing K as column panels
struct BackwardScratch {
  BackwardScratch(const TileShape& t, std::int64_t dk_pad)
      : tile(AllocFloats(QueryTileFloats(t, dk_pad))),
        dp(AllocFloats(t.keys * t.rows_pad + 64)),
        pd(AllocFloats(t.keys * t.rows_pad)),
        raw(AllocFloats(t.keys * t.rows_pad)),
        k_rows(AllocFloats(t.keys * t.dk)),
        k_cols(AllocFloats(t.keys * dk_pad)),
        v_rows(AllocFloats(t.keys * t.dv_pad)),
        dk(AllocFloats(t.keys * dk_pad)),
        dv(AllocFloats(t.keys * t.dv_pad)),
        dq(AllocFloats(t.rows_pad * dk_pad)),
        out_row(AllocFloats(t.dv_pad)),
        dout_row(AllocFloats(t.dv_pad)),
        pack_row(AllocFloats(std::max({dk_pad, t.dv_pad, t.dk}))),
        strip_rows(static_cast<std::size_t>(t.keys / kValueStrip + 1)) {}

  hwy::AlignedFreeUniquePtr<float[]> tile, dp, pd, raw, k_rows, k_cols, v_rows, dk, dv, dq, out_row,
      dout_row, pack_row;
  std::vector<KeySpan> strip_rows;
  hwy::AlignedFreeUniquePtr<float[]> cache;
  std::int64_t cache_capacity = 0;  // floats
  // On a bf16 engine (flash_backward_engine-inl.h): the buffers, and the
  // bf16 operands of the task's query tiles (one per unit when cached, else
  // the first reused).
  std::optional<EngineBackwardBuffers> eb;
  std::vector<EngineTile> engine_tiles;
};

// Rows of the tile from `t` ([B, N, H, width]): as transposed panels
// [rows_pad / NR][width][NR] scaled by `scale` (null: skipped), and as
// column panels [width_pad / NR][rows_pad][NR] unscaled. Padding is zero.
inline void PackTile(ConstTensorView t, const Unit& u, const UnitGeometry& g, std::int64_t rows_pad,
                     float scale, float* HWY_RESTRICT panels_t, float* HWY_RESTRICT cols,
                     float* HWY_RESTRICT row) {
  const std::int64_t width = t.size(3);
  const std::int64_t nr = PanelWidth();
  const std::int64_t width_pad = RoundUp(std::max<std::int64_t>(width, 1), nr);
  if (panels_t != nullptr) std::fill_n(panels_t, rows_pad * width, 0.0f);
  std::fill_n(cols, width_pad * rows_pad, 0.0f);
  for (std::int64_t gi = 0; gi < g.group; ++gi) {
    for (std::int64_t pos = 0; pos < g.positions; ++pos) {
      const std::int64_t r = gi * g.positions + pos;
      LoadStridedRowF32(At(t, g.seq.batch, g.seq.q_begin + u.i0 + pos, u.hkv * g.group + gi),
                        t.dtype(), width, t.stride(3), row);
      if (panels_t != nullptr) {
        float* panel = panels_t + (r / nr) * width * nr + r % nr;
        for (std::int64_t c = 0; c < width; ++c) panel[c * nr] = row[c] * scale;
      }
      for (std::int64_t c = 0; c < width; ++c) {
        cols[(c / nr) * rows_pad * nr + r * nr + c % nr] = row[c];
      }
    }
  }
}

// Packs everything a tile needs from its query rows into `dst`: Q^T (scaled)
// and Q panels, dO^T and dO panels, and the backward's row terms
// (core/softmax_epilogue.hpp): per row lse (-inf for padding, so its P is 0)
// and D = <dout, out>, summed here a vector at a time.
inline void PrepareTile(const BackwardPlan& bp, const Unit& u, const UnitGeometry& g,
                        const TileShape& shape, const QueryTile& dst, BackwardScratch& b) {
  const FlashPlan& plan = *bp.plan;
  const detail::AttentionProblem& p = *plan.problem;
  const hn::ScalableTag<float> d;
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(d));
  // On an engine the products read EnginePrepareTile's bf16 operands
  // instead: only the row terms below are needed here.
  if (!b.eb) {
    PackTile(plan.q, u, g, shape.rows_pad, static_cast<float>(plan.params.scale), dst.q_t,
             dst.q_cols, b.pack_row.get());
    PackTile(bp.args.dout, u, g, shape.rows_pad, 1.0f, dst.do_t, dst.do_cols, b.pack_row.get());
  }
  float* lse = dst.lse;
  float* dsum = dst.d;
  std::fill_n(lse, shape.rows_pad, kNegInf);
  std::fill_n(dsum, shape.rows_pad, 0.0f);
  const ConstTensorView lse_view = bp.args.lse;
  const ConstTensorView out = bp.args.out;
  const auto* lse_data = static_cast<const float*>(lse_view.data());
  for (std::int64_t gi = 0; gi < g.group; ++gi) {
    const std::int64_t h = u.hkv * g.group + gi;
    for (std::int64_t pos = 0; pos < g.positions; ++pos) {
      const std::int64_t r = gi * g.positions + pos;
      const std::int64_t row = g.seq.q_begin + u.i0 + pos;
      lse[r] = lse_data[g.seq.batch * lse_view.stride(0) + h * lse_view.stride(1) +
                        row * lse_view.stride(2)];
      float* o = b.out_row.get();
      float* dout = b.dout_row.get();
      std::fill_n(o, shape.dv_pad, 0.0f);
      std::fill_n(dout, shape.dv_pad, 0.0f);
      LoadStridedRowF32(At(out, g.seq.batch, row, h), out.dtype(), p.dv, out.stride(3), o);
      LoadStridedRowF32(At(bp.args.dout, g.seq.batch, row, h), bp.args.dout.dtype(), p.dv,
                        bp.args.dout.stride(3), dout);
      auto acc = hn::Zero(d);
      for (std::int64_t c = 0; c < shape.dv_pad; c += lanes) {
        acc = hn::MulAdd(hn::Load(d, o + c), hn::Load(d, dout + c), acc);
      }
      dsum[r] = hn::GetLane(hn::SumOfLanes(d, acc));
    }
  }
}

// Dropout in the backward: regenerates the forward's mask Z for the tile and
// turns dP^T into Z r dP^T and P^T (kept in sc.s for dS) into pd = Z r P^T.
inline void DropoutTile(const FlashPlan& plan, const Unit& u, const UnitGeometry& g,
                        std::int64_t j0, std::int64_t cols, std::int64_t rows_pad,
                        const float* HWY_RESTRICT p_t, float* HWY_RESTRICT dp,
                        float* HWY_RESTRICT pd) {
  const auto keep_scale = static_cast<float>(1.0 / (1.0 - plan.params.dropout.p));
  std::fill_n(pd, cols * rows_pad, 0.0f);
  ForEachDropoutDecision(plan, u, g, j0, cols, rows_pad, [&](std::int64_t x, bool keep) {
    dp[x] = keep ? dp[x] * keep_scale : 0.0f;
    pd[x] = keep ? p_t[x] * keep_scale : 0.0f;
  });
}

// One (key block, query tile) step: adds to the block's dK, dV and to the
// chunk's dQ buffer. Keys [j0, j0 + cols) lie `off` keys into the block.
inline void BackwardTile(const BackwardPlan& bp, const BackwardTask& task, const Unit& u,
                         const UnitGeometry& g, const TileShape& shape, std::int64_t dk_pad,
                         const QueryTile& tile, std::int64_t j0, std::int64_t cols,
                         std::int64_t off, bool range_partial, bool mask_partial, Scratch& sc,
                         BackwardScratch& b, double* bias_partial, const EngineTile* engine_tile) {
  const FlashPlan& plan = *bp.plan;
  const KernelParams& o = plan.params;
  const detail::AttentionProblem& p = *plan.problem;
  const hn::ScalableTag<float> d;
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(d));
  const std::int64_t rows = g.rows();
  const std::int64_t rows_pad = shape.rows_pad;
  const std::int64_t rows_used = RoundUp(rows, PanelWidth());

  // Only the keys each row sees are computed (the rest are masked).
  const bool pattern_cut = o.sparse.defined() && mask_partial;
  const bool spans = range_partial || pattern_cut;
  if (spans) BlockKeySpans(plan, u, g, j0, cols, pattern_cut, sc);
  const KeySpan* panel_keys = spans ? sc.panel_keys.data() : nullptr;
  const KeySpan* row_keys = spans ? sc.row_keys.data() : nullptr;

  float* s = sc.s.get();
  float* dp = b.dp.get();
  if (engine_tile != nullptr) {
    EngineScoresAndDp(*EngineOf(plan), *b.eb, *engine_tile, off, cols, rows, rows_pad,
                      static_cast<float>(o.scale), s, dp);
    if (o.softcap > 0.0) std::copy_n(s, cols * rows_pad, b.raw.get());
    ModifyAndMask(plan, u, g, j0, cols, range_partial, mask_partial, s, rows_pad);
  } else {
    ScoresTransposed(b.k_rows.get() + off * p.dk, p.dk, cols, p.dk, tile.q_t, rows, rows_pad,
                     panel_keys, s);
    if (o.softcap > 0.0) std::copy_n(s, cols * rows_pad, b.raw.get());
    ModifyAndMask(plan, u, g, j0, cols, range_partial, mask_partial, s, rows_pad);
    ScoresTransposed(b.v_rows.get() + off * shape.dv_pad, shape.dv_pad, cols, p.dv, tile.do_t, rows,
                     rows_pad, panel_keys, dp);
  }

  // P = exp(S - lse): 0 for masked keys and for rows without any key.
  ProbabilitiesFromLse(tile.lse, rows_used, cols, s, rows_pad);
  const float* dsum = tile.d;
  const bool dropout = o.dropout.p > 0.0;
  if (dropout) DropoutTile(plan, u, g, j0, cols, rows_pad, s, dp, b.pd.get());
  // dS = P (dP - D), exactly 0 where P is (whatever dP holds there).
  for (std::int64_t r = 0; r < rows_used; r += lanes) {
    const auto v_d = hn::Load(d, dsum + r);
    for (std::int64_t c = 0; c < cols; ++c) {
      const auto pv = hn::Load(d, s + c * rows_pad + r);
      float* x = dp + c * rows_pad + r;
      const auto ds = hn::Mul(pv, hn::Sub(hn::Load(d, x), v_d));
      hn::Store(hn::IfThenZeroElse(hn::Eq(pv, hn::Zero(d)), ds), d, x);
    }
  }
  if (bias_partial != nullptr)
    AccumulateBiasGradient(plan, u, g, j0, cols, rows_pad, dp, bias_partial);
  if (bp.ds_full != nullptr) StoreScoreGradient(plan, u, g, j0, cols, rows_pad, dp, bp.ds_full);
  if (o.softcap > 0.0) SoftcapGradient(o.softcap, b.raw.get(), cols, rows_used, rows_pad, dp);

  float* dq = b.dq.get();
  if (engine_tile != nullptr) {
    EngineGradients(*EngineOf(plan), *b.eb, *engine_tile, dropout ? b.pd.get() : s, dp, off, cols,
                    rows, rows_pad, dk_pad, shape.dv_pad, b.dk.get(), b.dv.get(), dq);
  } else {
    const KeySpan* strip_rows = nullptr;
    if (row_keys != nullptr) {
      StripRows(row_keys, rows, cols, b.strip_rows.data());
      strip_rows = b.strip_rows.data();
    }
    AccumulateTransposed(dropout ? b.pd.get() : s, rows_pad, rows, cols, strip_rows, tile.do_cols,
                         shape.dv_pad, b.dv.get() + off * shape.dv_pad, shape.dv_pad);
    AccumulateTransposed(dp, rows_pad, rows, cols, strip_rows, tile.q_cols, dk_pad,
                         b.dk.get() + off * dk_pad, dk_pad);
    std::fill_n(dq, rows_pad * dk_pad, 0.0f);
    AccumulateValues(dp, rows_pad, rows, cols, row_keys, b.k_cols.get() + off * ValueWidth(),
                     ValueWidth(), shape.keys * ValueWidth(), dk_pad, dq, dk_pad);
  }
  // Into the chunk's dQ buffer, row (batch, query row, head) of q's layout;
  // the columns up to Dq rounded to the vector, which both rows have.
  float* partial = bp.dq_partial + task.chunk * p.batch * p.nq * p.hq * bp.dq_ld;
  const std::int64_t dq_used = RoundUp(p.dq, lanes);
  for (std::int64_t gi = 0; gi < g.group; ++gi) {
    const std::int64_t h = u.hkv * g.group + gi;
    for (std::int64_t t = 0; t < g.positions; ++t) {
      const std::int64_t row = (g.seq.batch * p.nq + g.seq.q_begin + u.i0 + t) * p.hq + h;
      float* dst = partial + row * bp.dq_ld;
      const float* src = dq + (gi * g.positions + t) * dk_pad;
      for (std::int64_t c = 0; c < dq_used; c += lanes) {
        hn::Store(hn::Add(hn::Load(d, dst + c), hn::Load(d, src + c)), d, dst + c);
      }
    }
  }
}

// One task: for each of its key blocks, pack K and V, visit every query tile
// that some mask leaves open, and write the block's dk and dv rows. Returns
// whether they are all finite.
inline bool BackwardTaskRun(const BackwardPlan& bp, const BackwardTask& task,
                            const TileShape& shape, std::int64_t dk_pad, Scratch& sc,
                            BackwardScratch& b, double* bias_partial) {
  const FlashPlan& plan = *bp.plan;
  const detail::AttentionProblem& p = *plan.problem;
  const std::int64_t bk = plan.config.keys;
  const Unit& first = plan.units[static_cast<std::size_t>(task.unit_begin)];
  const UnitGeometry head = GeometryOf(plan, first);
  const GradientOutputs& grads = bp.args.grads;
  bool finite = true;
  // Every key block of the task meets the same query tiles: pack them once
  // when they fit the per-thread budget, else once per step.
  const std::int64_t tile_floats = QueryTileFloats(shape, dk_pad);
  const std::int64_t cached_floats = (task.unit_end - task.unit_begin) * tile_floats;
  const bool cached = cached_floats * static_cast<std::int64_t>(sizeof(float)) <= kTileCacheBytes;
  const std::int64_t units = task.unit_end - task.unit_begin;
  if (b.eb) {
    const auto needed = static_cast<std::size_t>(cached ? units : 1);
    while (b.engine_tiles.size() < needed) {
      b.engine_tiles.emplace_back(shape.rows_pad, b.eb->dk2, b.eb->dv2, dk_pad, shape.dv_pad);
    }
  }
  if (cached) {
    if (cached_floats > b.cache_capacity) {
      b.cache = AllocFloats(cached_floats);
      b.cache_capacity = cached_floats;
    }
    for (std::int64_t ui = task.unit_begin; ui < task.unit_end; ++ui) {
      const Unit& u = plan.units[static_cast<std::size_t>(ui)];
      const UnitGeometry g = GeometryOf(plan, u);
      PrepareTile(bp, u, g, shape,
                  QueryTileAt(b.cache.get() + (ui - task.unit_begin) * tile_floats, shape, dk_pad),
                  b);
      if (b.eb) {
        EnginePrepareTile(bp, u, g, shape.rows_pad, dk_pad, shape.dv_pad, *b.eb, b.pack_row.get(),
                          b.engine_tiles[static_cast<std::size_t>(ui - task.unit_begin)]);
      }
    }
  }
  for (std::int64_t kb = task.block_begin; kb < task.block_end; ++kb) {
    const std::int64_t kj0 = kb * bk;
    const std::int64_t kcols = std::min(bk, head.seq.nk_rows - kj0);
    if (b.eb) {
      EnginePackBlock(plan, head.seq, kj0, kcols, first.hkv, dk_pad, *b.eb, b.pack_row.get());
    } else {
      PackRows(plan.k, head.seq, kj0, kcols, first.hkv, p.dk, b.k_rows.get());
      PackRows(plan.k, head.seq, kj0, kcols, first.hkv, dk_pad, b.k_cols.get(),
               shape.keys * ValueWidth(), b.pack_row.get());
      PackRows(plan.v, head.seq, kj0, kcols, first.hkv, shape.dv_pad, b.v_rows.get());
    }
    std::fill_n(b.dk.get(), shape.keys * dk_pad, 0.0f);
    std::fill_n(b.dv.get(), shape.keys * shape.dv_pad, 0.0f);
    for (std::int64_t ui = task.unit_begin; ui < task.unit_end; ++ui) {
      const Unit& u = plan.units[static_cast<std::size_t>(ui)];
      const UnitGeometry g = GeometryOf(plan, u);
      const BlockSpan span = SpanOf(plan, u, g);
      if (kb < span.begin || kb >= span.end) continue;
      const BlockClass mask_class = MaskClass(plan, u, kb);
      if (mask_class == BlockClass::empty) continue;
      const std::int64_t j0 = std::max(kj0, span.first.lo);
      const std::int64_t cols = std::min({kj0 + kcols, span.last.hi}) - j0;
      if (cols <= 0) continue;
      const bool range_partial = !(span.last.lo <= j0 && span.first.hi >= j0 + cols);
      QueryTile tile;
      EngineTile* engine_tile = nullptr;
      if (b.eb) {
        engine_tile = &b.engine_tiles[static_cast<std::size_t>(cached ? ui - task.unit_begin : 0)];
      }
      if (cached) {
        tile = QueryTileAt(b.cache.get() + (ui - task.unit_begin) * tile_floats, shape, dk_pad);
      } else {
        tile = QueryTileAt(b.tile.get(), shape, dk_pad);
        PrepareTile(bp, u, g, shape, tile, b);
        if (b.eb) {
          EnginePrepareTile(bp, u, g, shape.rows_pad, dk_pad, shape.dv_pad, *b.eb, b.pack_row.get(),
                            *engine_tile);
        }
      }
      BackwardTile(bp, task, u, g, shape, dk_pad, tile, j0, cols, j0 - kj0, range_partial,
                   mask_class == BlockClass::partial, sc, b, bias_partial, engine_tile);
    }
    const auto scale = static_cast<float>(plan.params.scale);
    for (std::int64_t j = 0; j < kcols; ++j) {
      float* dk_row = b.dk.get() + j * dk_pad;
      for (std::int64_t c = 0; c < p.dk; ++c) dk_row[c] *= scale;
      StoreViewRow(dk_row, p.dk, grads.dk, head.seq.batch, head.seq.k_begin + kj0 + j, first.hkv);
      StoreViewRow(b.dv.get() + j * shape.dv_pad, p.dv, grads.dv, head.seq.batch,
                   head.seq.k_begin + kj0 + j, first.hkv);
    }
    finite = finite && AllFinite(b.dk.get(), kcols * dk_pad) &&
             AllFinite(b.dv.get(), kcols * shape.dv_pad);
  }
  return finite;
}

// Work of each key block of the (sequence, KV head) whose units are
// [unit_begin, unit_end): the (query row, key) pairs of the tiles that visit
// it, as the task loop below visits them.
inline std::vector<double> BlockWork(const FlashPlan& plan, std::int64_t unit_begin,
                                     std::int64_t unit_end, std::int64_t blocks) {
  std::vector<double> work(static_cast<std::size_t>(blocks), 0.0);
  const std::int64_t bk = plan.config.keys;
  for (std::int64_t ui = unit_begin; ui < unit_end; ++ui) {
    const Unit& u = plan.units[static_cast<std::size_t>(ui)];
    const UnitGeometry g = GeometryOf(plan, u);
    const BlockSpan span = SpanOf(plan, u, g);
    for (std::int64_t kb = span.begin; kb < std::min(span.end, blocks); ++kb) {
      if (MaskClass(plan, u, kb) == BlockClass::empty) continue;
      const std::int64_t j0 = std::max(kb * bk, span.first.lo);
      const std::int64_t cols = std::min({(kb + 1) * bk, g.seq.nk_rows, span.last.hi}) - j0;
      if (cols > 0) work[static_cast<std::size_t>(kb)] += static_cast<double>(g.rows() * cols);
    }
  }
  return work;
}

// Splits each (sequence, KV head) into at most bp.chunks runs of key blocks
// of about equal work (so causal heads split evenly too).
inline void BackwardTasks(BackwardPlan& bp) {
  const FlashPlan& plan = *bp.plan;
  const std::int64_t bk = plan.config.keys;
  const auto n = static_cast<std::int64_t>(plan.units.size());
  for (std::int64_t begin = 0, end = 0; begin < n; begin = end) {
    const Unit& first = plan.units[static_cast<std::size_t>(begin)];
    end = begin;
    while (end < n && plan.units[static_cast<std::size_t>(end)].s == first.s &&
           plan.units[static_cast<std::size_t>(end)].hkv == first.hkv) {
      ++end;
    }
    const detail::SequenceExtent seq = plan.problem->sequence(first.s);
    const std::int64_t blocks = (seq.nk_rows + bk - 1) / bk;
    const std::vector<double> work = BlockWork(plan, begin, end, blocks);
    double total = 0.0;
    for (const double w : work) total += w;
    // Chunk c ends at the first block where the running work reaches
    // (c + 1) / chunks of the total; the last chunk takes the rest.
    std::int64_t block = 0;
    double done = 0.0;
    for (std::int64_t c = 0; c < bp.chunks && block < blocks; ++c) {
      const std::int64_t block_begin = block;
      const double target = total * static_cast<double>(c + 1) / static_cast<double>(bp.chunks);
      if (c + 1 == bp.chunks) {
        block = blocks;
      } else {
        while (block < blocks && (block == block_begin || done < target)) {
          done += work[static_cast<std::size_t>(block)];
          ++block;
        }
      }
      bp.tasks.push_back({begin, end, block_begin, block, c});
    }
  }
}

// Returns whether every dk and dv row is finite.
inline bool FlashBackwardImpl(const BackwardPlan& bp) {
  const FlashPlan& plan = *bp.plan;
  const TileShape shape = ShapeOf(plan);
  const std::int64_t dk_pad = RoundUp(std::max<std::int64_t>(plan.problem->dk, 1), ValueWidth());
  const std::int64_t bias_width =
      plan.relative_bias.empty() ? 0 : plan.problem->group() * (2 * plan.relative_radius + 1);
  const auto n = static_cast<std::int64_t>(bp.tasks.size());
  std::atomic<bool> finite{true};
#pragma omp parallel
  {
    Scratch sc(shape);
    BackwardScratch b(shape, dk_pad);
    if (shape.engine) {
      b.eb.emplace(shape.rows_pad, shape.keys, plan.problem->dk, plan.problem->dv, dk_pad,
                   shape.dv_pad);
    }
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t i = 0; i < n; ++i) {
      if (!BackwardTaskRun(bp, bp.tasks[static_cast<std::size_t>(i)], shape, dk_pad, sc, b,
                           bias_width > 0 ? bp.bias_partial + i * bias_width : nullptr)) {
        finite.store(false, std::memory_order_relaxed);
      }
    }
  }
  return finite.load();
}

// dq = scale * (sum of the chunks' dQ buffers, in chunk order), rounded once.
// Returns whether every row is finite.
inline bool FlashBackwardReduceDq(const BackwardPlan& bp) {
  const detail::AttentionProblem& p = *bp.plan->problem;
  const hn::ScalableTag<float> d;
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(d));
  const std::int64_t rows = p.batch * p.nq * p.hq;
  const std::int64_t chunk_stride = rows * bp.dq_ld;
  const auto scale = hn::Set(d, static_cast<float>(bp.plan->params.scale));
  std::atomic<bool> finite{true};
#pragma omp parallel
  {
    auto sum = hwy::AllocateAligned<float>(static_cast<std::size_t>(bp.dq_ld));
#pragma omp for schedule(static)
    for (std::int64_t r = 0; r < rows; ++r) {
      for (std::int64_t c = 0; c < bp.dq_ld; c += lanes) {
        auto acc = hn::Load(d, bp.dq_partial + r * bp.dq_ld + c);
        for (std::int64_t k = 1; k < bp.chunks; ++k) {
          acc = hn::Add(acc, hn::Load(d, bp.dq_partial + k * chunk_stride + r * bp.dq_ld + c));
        }
        hn::Store(hn::Mul(acc, scale), d, sum.get() + c);
      }
      StoreViewRow(sum.get(), p.dq, bp.args.grads.dq, r / (p.nq * p.hq), (r / p.hq) % p.nq,
                   r % p.hq);
      if (!AllFinite(sum.get(), bp.dq_ld)) finite.store(false, std::memory_order_relaxed);
    }
  }
  return finite.load();
}

QKV_HWY_NAMESPACE_END(cpu);

#endif  // QKV_CPU_FLASH_BACKWARD_INL_H_
