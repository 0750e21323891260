// The fused backward's five products on a bf16 engine (cpu/engines/), when
// the plan's forward runs there (FlashPlan::engine):
//   S^T  = K Q^T     A: K rows [keys][dk2]     B: Q in pairs of its head dim
//   dP^T = V dO^T    A: V rows [keys][dv2]     B: dO in pairs of its head dim
//   dV  += P^T dO    A: P^T rows [keys][rows]  B: dO in pairs of query rows
//   dK  += dS^T Q    A: dS^T rows              B: Q in pairs of query rows
//   dQ   = dS K      A: dS rows [rows][keys]   B: K in pairs of keys
// (bf16_product.hpp's layouts). P and dS are rounded to bf16 before their
// products, as FlashAttention does; the softmax, dropout, biases' and
// softcap's gradients stay in f32 (flash_backward-inl.h). Q, K, V and dO are
// rounded to bf16 once (exact for bf16 inputs): the query tile's pairs when
// it is packed, the key block's when its keys are.
#if defined(QKV_CPU_FLASH_BACKWARD_ENGINE_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_CPU_FLASH_BACKWARD_ENGINE_INL_H_
#undef QKV_CPU_FLASH_BACKWARD_ENGINE_INL_H_
#else
#define QKV_CPU_FLASH_BACKWARD_ENGINE_INL_H_
#endif

#include <algorithm>
#include <cstdint>

#include "core/hwy_namespace.hpp"
#include "cpu/engines/bf16_product.hpp"
#include "cpu/flash_engine-inl.h"
#include "hwy/highway.h"

QKV_HWY_NAMESPACE_BEGIN(cpu);

// A query tile's bf16 operands (the header's B operands).
struct EngineTile {
  EngineTile(std::int64_t rows_pad, std::int64_t dk2, std::int64_t dv2, std::int64_t dk_pad,
             std::int64_t dv_pad)
      : q_dims(AllocBf16(dk2 * rows_pad)),
        do_dims(AllocBf16(dv2 * rows_pad)),
        q_rows(AllocBf16(rows_pad * dk_pad)),
        do_rows(AllocBf16(rows_pad * dv_pad)) {}

  Bf16Buffer q_dims;   // Q pairs of the head dim: [dk2 / 2][rows_pad][2]
  Bf16Buffer do_dims;  // dO likewise: [dv2 / 2][rows_pad][2]
  Bf16Buffer q_rows;   // Q in pairs of rows: [rows_pad / 2][dk_pad][2]
  Bf16Buffer do_rows;  // dO likewise: [rows_pad / 2][dv_pad][2]
};

// One thread's bf16 buffers of the backward: a key block's operands and a
// step's rounded P^T, dS^T and dS.
struct EngineBackwardBuffers {
  EngineBackwardBuffers(std::int64_t rows_pad, std::int64_t keys, std::int64_t dk, std::int64_t dv,
                        std::int64_t dk_pad, std::int64_t dv_pad)
      : dk2(RoundUp(std::max<std::int64_t>(dk, 1), 2)),
        dv2(RoundUp(std::max<std::int64_t>(dv, 1), 2)),
        key_pairs(keys / 2 + 1),
        k_rows(AllocBf16(keys * dk2)),
        v_rows(AllocBf16(keys * dv2)),
        k_pairs(AllocBf16(key_pairs * 2 * dk_pad)),
        p_t(AllocBf16(keys * rows_pad)),
        ds_t(AllocBf16(keys * rows_pad)),
        ds(AllocBf16(rows_pad * 2 * key_pairs)),
        row16(AllocBf16(std::max({dk2, dv2, dk_pad, dv_pad}))) {}

  std::int64_t dk2, dv2, key_pairs;
  Bf16Buffer k_rows, v_rows, k_pairs, p_t, ds_t, ds, row16;
};

// Row `row` of `t` ([B, N, H, width] at (seq.batch, n, h)) as bf16 into
// dst[0, width), through f32 staging.
inline void RowBf16(ConstTensorView t, std::int64_t batch, std::int64_t n, std::int64_t h,
                    float* HWY_RESTRICT row, std::uint16_t* HWY_RESTRICT dst) {
  const std::int64_t width = t.size(3);
  LoadStridedRowF32(At(t, batch, n, h), t.dtype(), width, t.stride(3), row);
  StoreRowFromF32(row, width, dst, DType::bf16);
}

// The tile's bf16 operands from q and dout (padding zero).
inline void EnginePrepareTile(const BackwardPlan& bp, const Unit& u, const UnitGeometry& g,
                              std::int64_t rows_pad, std::int64_t dk_pad, std::int64_t dv_pad,
                              EngineBackwardBuffers& eb, float* HWY_RESTRICT row, EngineTile& t) {
  const FlashPlan& plan = *bp.plan;
  std::fill_n(t.q_dims.get(), eb.dk2 * rows_pad, std::uint16_t{0});
  std::fill_n(t.do_dims.get(), eb.dv2 * rows_pad, std::uint16_t{0});
  std::fill_n(t.q_rows.get(), rows_pad * dk_pad, std::uint16_t{0});
  std::fill_n(t.do_rows.get(), rows_pad * dv_pad, std::uint16_t{0});
  const struct {
    ConstTensorView view;
    std::uint16_t* dims;
    std::uint16_t* rows;
    std::int64_t width_pad;
  } operands[] = {{plan.q, t.q_dims.get(), t.q_rows.get(), dk_pad},
                  {bp.args.dout, t.do_dims.get(), t.do_rows.get(), dv_pad}};
  std::uint16_t* r16 = eb.row16.get();
  for (const auto& op : operands) {
    const std::int64_t width = op.view.size(3);
    for (std::int64_t r = 0; r < g.rows(); ++r) {
      RowBf16(op.view, g.seq.batch, g.seq.q_begin + u.i0 + r % g.positions,
              u.hkv * g.group + r / g.positions, row, r16);
      for (std::int64_t x = 0; x < width; ++x) {
        op.dims[(x / 2) * 2 * rows_pad + 2 * r + x % 2] = r16[x];
        op.rows[(r / 2) * 2 * op.width_pad + 2 * x + r % 2] = r16[x];
      }
    }
  }
}

// The key block [kj0, kj0 + kcols) of KV head h: K and V rows, K in pairs
// of keys from kj0 (a zero partner after an odd last key).
inline void EnginePackBlock(const FlashPlan& plan, const detail::SequenceExtent& seq,
                            std::int64_t kj0, std::int64_t kcols, std::int64_t h,
                            std::int64_t dk_pad, EngineBackwardBuffers& eb,
                            float* HWY_RESTRICT row) {
  std::fill_n(eb.k_pairs.get(), eb.key_pairs * 2 * dk_pad, std::uint16_t{0});
  for (std::int64_t j = 0; j < kcols; ++j) {
    std::uint16_t* k = eb.k_rows.get() + j * eb.dk2;
    std::uint16_t* v = eb.v_rows.get() + j * eb.dv2;
    RowBf16(plan.k, seq.batch, seq.k_begin + kj0 + j, h, row, k);
    RowBf16(plan.v, seq.batch, seq.k_begin + kj0 + j, h, row, v);
    std::fill(k + plan.k.size(3), k + eb.dk2, std::uint16_t{0});
    std::fill(v + plan.v.size(3), v + eb.dv2, std::uint16_t{0});
    for (std::int64_t x = 0; x < plan.k.size(3); ++x) {
      eb.k_pairs[static_cast<std::size_t>((j / 2) * 2 * dk_pad + 2 * x + j % 2)] = k[x];
    }
  }
}

// S^T (scaled) and dP^T of keys [off, off + cols) of the block for the
// tile's first `rows` rows, into s and dp ([cols][rows_pad]).
inline void EngineScoresAndDp(engines::Bf16Engine engine, const EngineBackwardBuffers& eb,
                              const EngineTile& t, std::int64_t off, std::int64_t cols,
                              std::int64_t rows, std::int64_t rows_pad, float scale,
                              float* HWY_RESTRICT s, float* HWY_RESTRICT dp) {
  const std::int64_t n = RoundUp(std::max<std::int64_t>(rows, 1), 16);
  engines::bf16_product(engine, {eb.k_rows.get() + off * eb.dk2, eb.dk2, t.q_dims.get(), rows_pad,
                                 s, rows_pad, cols, n, eb.dk2, false});
  engines::bf16_product(engine, {eb.v_rows.get() + off * eb.dv2, eb.dv2, t.do_dims.get(), rows_pad,
                                 dp, rows_pad, cols, n, eb.dv2, false});
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

// dV += P^T dO, dK += dS^T Q and dq = dS K for keys [off, off + cols) of
// the block: p_t (f32, dropout applied) and ds_t ([cols][rows_pad]) rounded
// to bf16; dS also as rows [rows][pairs of keys from the block's pair
// holding key off]. dk and dv are the block's [keys][dk_pad] and
// [keys][dv_pad]; dq is [rows_pad][dk_pad].
inline void EngineGradients(engines::Bf16Engine engine, EngineBackwardBuffers& eb,
                            const EngineTile& t, const float* HWY_RESTRICT p_t,
                            const float* HWY_RESTRICT ds_t, std::int64_t off, std::int64_t cols,
                            std::int64_t rows, std::int64_t rows_pad, std::int64_t dk_pad,
                            std::int64_t dv_pad, float* HWY_RESTRICT dk, float* HWY_RESTRICT dv,
                            float* HWY_RESTRICT dq) {
  const std::int64_t depth_rows = RoundUp(std::max<std::int64_t>(rows, 1), 2);
  StoreRowFromF32(p_t, cols * rows_pad, eb.p_t.get(), DType::bf16);
  StoreRowFromF32(ds_t, cols * rows_pad, eb.ds_t.get(), DType::bf16);
  engines::bf16_product(engine, {eb.p_t.get(), rows_pad, t.do_rows.get(), dv_pad, dv + off * dv_pad,
                                 dv_pad, cols, dv_pad, depth_rows, true});
  engines::bf16_product(engine, {eb.ds_t.get(), rows_pad, t.q_rows.get(), dk_pad, dk + off * dk_pad,
                                 dk_pad, cols, dk_pad, depth_rows, true});
  // dS rows: from the pair of keys holding `off` (the pairs of k_pairs
  // start at the block's first key).
  const std::int64_t lead = off % 2;
  const std::int64_t depth = RoundUp(lead + cols, 2);
  std::uint16_t* ds = eb.ds.get();
  TransposeToBf16Rows(ds_t, rows_pad, rows, cols, lead, depth, nullptr, ds);
  engines::bf16_product(engine, {ds, depth, eb.k_pairs.get() + (off / 2) * 2 * dk_pad, dk_pad, dq,
                                 dk_pad, rows, dk_pad, depth, false});
}

QKV_HWY_NAMESPACE_END(cpu);

#endif  // QKV_CPU_FLASH_BACKWARD_ENGINE_INL_H_
