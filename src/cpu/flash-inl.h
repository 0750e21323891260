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
#include <cmath>
#include <limits>

#include "core/elements.hpp"
#include "cpu/flash.hpp"
#include "cpu/tile_gemm-inl.h"
#include "cpu/vec_math-inl.h"
#include "hwy/aligned_allocator.h"
#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::cpu {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline std::int64_t RoundUp(std::int64_t x, std::int64_t m) { return (x + m - 1) / m * m; }

// Sizes of one thread's scratch, derived from the plan.
struct TileShape {
  std::int64_t rows = 0;      // Q tile rows (group x positions)
  std::int64_t keys_pad = 0;  // key tile width rounded up to the panel width
  std::int64_t dk = 0;
  std::int64_t dv_pad = 0;  // Dv rounded up to the panel width
  std::int64_t a_pad = 0;   // additive attention size rounded up to the vector
};

// One thread's buffers, allocated once per call.
struct Scratch {
  explicit Scratch(const TileShape& t)
      : q(Alloc(t.rows * std::max(t.dk, t.a_pad))),
        qa(Alloc(t.rows * t.a_pad)),
        k(Alloc(t.keys_pad * std::max(t.dk, t.a_pad))),
        v(Alloc(t.keys_pad * t.dv_pad)),
        s(Alloc(t.rows * t.keys_pad)),
        o(Alloc(t.rows * t.dv_pad)),
        row(Alloc(std::max({t.dk, t.dv_pad, t.keys_pad}))),
        m(Alloc(t.rows)),
        l(Alloc(t.rows)) {}

  static hwy::AlignedFreeUniquePtr<float[]> Alloc(std::int64_t n) {
    auto p = hwy::AllocateAligned<float>(static_cast<std::size_t>(std::max<std::int64_t>(n, 1)));
    std::fill_n(p.get(), std::max<std::int64_t>(n, 1), 0.0f);  // pad lanes must never hold NaN
    return p;
  }

  hwy::AlignedFreeUniquePtr<float[]> q, qa, k, v, s, o, row, m, l;
};

// The key range [lo, hi) that causal, window and key lengths leave to the
// query at position `pos` (hi <= lo: none).
struct KeyRange {
  std::int64_t lo, hi;
};
inline KeyRange RangeFor(const AttentionOptions& o, std::int64_t pos, std::int64_t nk) {
  std::int64_t lo = 0, hi = nk;
  if (o.window_left >= 0) lo = std::max<std::int64_t>(0, pos - o.window_left);
  if (o.causal) hi = std::min(hi, pos + 1);
  if (o.window_right >= 0) hi = std::min(hi, pos + o.window_right + 1);
  return {std::min(lo, nk), std::max(hi, std::min(lo, nk))};
}

// Everything a unit needs to address its rows.
struct UnitGeometry {
  detail::SequenceExtent seq;
  std::int64_t group = 0;      // query heads per KV head
  std::int64_t positions = 0;  // query positions in the unit
  std::int64_t offset = 0;     // p_i = i + offset
  std::int64_t rows() const { return group * positions; }
};

inline std::int64_t ElementBytes(DType d) { return d == DType::f32 ? 4 : 2; }

inline const std::uint8_t* At(ConstTensorView t, std::int64_t a, std::int64_t b, std::int64_t c) {
  return static_cast<const std::uint8_t*>(t.data()) +
         (a * t.stride(0) + b * t.stride(1) + c * t.stride(2)) * ElementBytes(t.dtype());
}

// Packs the unit's query rows (row g * positions + t is head hkv * G + g at
// position i0 + t), multiplied by `scale`.
inline void PackQueries(const FlashPlan& plan, const Unit& u, const UnitGeometry& g, float scale,
                        float* HWY_RESTRICT dst) {
  const ConstTensorView q = plan.q;
  const std::int64_t dq = q.size(3);
  const hn::ScalableTag<float> d;
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(d));
  for (std::int64_t gi = 0; gi < g.group; ++gi) {
    for (std::int64_t t = 0; t < g.positions; ++t) {
      float* row = dst + (gi * g.positions + t) * dq;
      LoadStridedRowF32(At(q, g.seq.batch, g.seq.q_begin + u.i0 + t, u.hkv * g.group + gi),
                        q.dtype(), dq, q.stride(3), row);
      if (scale == 1.0f) continue;
      std::int64_t c = 0;
      for (; c + lanes <= dq; c += lanes) {
        hn::StoreU(hn::Mul(hn::LoadU(d, row + c), hn::Set(d, scale)), d, row + c);
      }
      for (; c < dq; ++c) row[c] *= scale;
    }
  }
}

// y[n][a_pad] = x[n][in] W^T (+ bias) for W [A][in] f32; pad columns zero.
inline void Project(const float* HWY_RESTRICT x, std::int64_t n, std::int64_t in,
                    const std::vector<float>& w, const std::vector<float>& bias,
                    std::int64_t a_size, std::int64_t a_pad, float* HWY_RESTRICT y) {
  for (std::int64_t r = 0; r < n; ++r) {
    for (std::int64_t a = 0; a < a_pad; ++a) {
      float acc = 0.0f;
      if (a < a_size) {
        for (std::int64_t t = 0; t < in; ++t) acc += x[r * in + t] * w[a * in + t];
        if (!bias.empty()) acc += bias[a];
      }
      y[r * a_pad + a] = acc;
    }
  }
}

// S[r][c] = sum_a v[a] tanh(qa[r][a] + ka[c][a]) (the additive score).
inline void AdditiveScoresTile(const float* HWY_RESTRICT qa, std::int64_t rows,
                               const float* HWY_RESTRICT ka, std::int64_t cols,
                               const float* HWY_RESTRICT v, std::int64_t a_pad,
                               float* HWY_RESTRICT s, std::int64_t lds) {
  const hn::ScalableTag<float> d;
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(d));
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < cols; ++c) {
      auto acc = hn::Zero(d);
      for (std::int64_t a = 0; a < a_pad; a += lanes) {
        const auto x = hn::Add(hn::Load(d, qa + r * a_pad + a), hn::Load(d, ka + c * a_pad + a));
        acc = hn::MulAdd(hn::Load(d, v + a), hn::Tanh(d, x), acc);
      }
      s[r * lds + c] = hn::GetLane(hn::SumOfLanes(d, acc));
    }
  }
}

// Value of a mask element [b, h, i, j] broadcast from the mask's rank.
inline std::int64_t MaskOffset(ConstTensorView mask, std::int64_t b, std::int64_t h,
                               std::int64_t i) {
  const std::int64_t index[3] = {b, h, i};
  std::int64_t off = 0;
  for (int d = 0; d < mask.rank() - 1; ++d) {
    const std::int64_t x = index[3 - (mask.rank() - 1) + d];
    off += (mask.size(d) == 1 ? 0 : x) * mask.stride(d);
  }
  return off;
}

// Adds the biases (softcap, ALiBi, relative bias, float mask) and score_mod
// to the tile, then (when `partial`) drops keys outside each row's range and
// those the bool mask or mask_mod reject; pad columns become -inf.
inline void ModifyAndMask(const FlashPlan& plan, const Unit& u, const UnitGeometry& g,
                          std::int64_t j0, std::int64_t cols, std::int64_t cols_pad,
                          bool range_partial, bool mask_partial, float* HWY_RESTRICT s,
                          std::int64_t lds) {
  const AttentionOptions& o = *plan.options;
  const detail::AttentionProblem& p = *plan.problem;
  const hn::ScalableTag<float> d;
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(d));
  const hn::RebindToSigned<decltype(d)> di;
  const auto iota = hn::ConvertTo(d, hn::Iota(di, 0));
  const float cap = static_cast<float>(o.softcap);
  const bool float_mask = o.mask.defined() && o.mask.dtype() != DType::boolean;
  const bool bool_mask = o.mask.defined() && o.mask.dtype() == DType::boolean;
  const bool per_batch_slopes =
      !o.alibi_slopes.empty() && static_cast<std::int64_t>(o.alibi_slopes.size()) != p.hq;

  for (std::int64_t gi = 0; gi < g.group; ++gi) {
    const std::int64_t h = u.hkv * g.group + gi;
    for (std::int64_t t = 0; t < g.positions; ++t) {
      float* row = s + (gi * g.positions + t) * lds;
      const std::int64_t i = u.i0 + t;
      const std::int64_t pos = i + g.offset;
      if (cap > 0.0f) {
        const auto inv = hn::Set(d, 1.0f / cap);
        for (std::int64_t c = 0; c < cols_pad; c += lanes) {
          const auto x = hn::Load(d, row + c);
          hn::Store(hn::Mul(hn::Set(d, cap), hn::Tanh(d, hn::Mul(x, inv))), d, row + c);
        }
      }
      if (!o.alibi_slopes.empty()) {
        const float slope =
            o.alibi_slopes[static_cast<std::size_t>(per_batch_slopes ? u.s * p.hq + h : h)];
        for (std::int64_t c = 0; c < cols_pad; c += lanes) {
          const auto delta = hn::Add(iota, hn::Set(d, static_cast<float>(j0 + c - pos)));
          hn::Store(hn::MulAdd(hn::Abs(delta), hn::Set(d, -slope), hn::Load(d, row + c)), d,
                    row + c);
        }
      }
      if (!plan.relative_bias.empty()) {
        const float* bias = plan.relative_bias.data() + h * (2 * plan.relative_radius + 1) +
                            plan.relative_radius + j0 - pos;
        for (std::int64_t c = 0; c < cols; ++c) row[c] += bias[c];
      }
      if (float_mask) {
        const ConstTensorView m = o.mask;
        const std::int64_t base = MaskOffset(m, g.seq.batch, h, g.seq.q_begin + i);
        const std::int64_t js = m.rank() == 0 || m.size(-1) == 1 ? 0 : m.stride(-1);
        for (std::int64_t c = 0; c < cols; ++c) {
          row[c] += static_cast<float>(
              detail::load(m.data(), m.dtype(), base + (g.seq.k_begin + j0 + c) * js));
        }
      }
    }
    if (plan.mods->score_mod != nullptr) {
      plan.mods->score_mod(plan.mods->context,
                           {s + gi * g.positions * lds, lds, u.s, h, u.i0, g.positions, j0, cols});
    }
    for (std::int64_t t = 0; t < g.positions; ++t) {
      float* row = s + (gi * g.positions + t) * lds;
      const std::int64_t i = u.i0 + t;
      if (range_partial) {
        const KeyRange range = RangeFor(o, i + g.offset, g.seq.nk);
        const auto lo = hn::Set(d, static_cast<float>(range.lo - j0));
        const auto hi = hn::Set(d, static_cast<float>(range.hi - j0));
        for (std::int64_t c = 0; c < cols_pad; c += lanes) {
          const auto col = hn::Add(iota, hn::Set(d, static_cast<float>(c)));
          const auto keep = hn::And(hn::Ge(col, lo), hn::Lt(col, hi));
          hn::Store(hn::IfThenElse(keep, hn::Load(d, row + c), hn::Set(d, kNegInf)), d, row + c);
        }
      }
      if (bool_mask && mask_partial) {
        const ConstTensorView m = o.mask;
        const std::int64_t base = MaskOffset(m, g.seq.batch, h, g.seq.q_begin + i);
        const std::int64_t js = m.rank() == 0 || m.size(-1) == 1 ? 0 : m.stride(-1);
        const auto* bits = static_cast<const std::uint8_t*>(m.data());
        for (std::int64_t c = 0; c < cols; ++c) {
          if (bits[base + (g.seq.k_begin + j0 + c) * js] == 0) row[c] = kNegInf;
        }
      }
      for (std::int64_t c = cols; c < cols_pad; ++c) row[c] = kNegInf;
    }
    if (plan.mods->mask_mod != nullptr && mask_partial) {
      plan.mods->mask_mod(plan.mods->context,
                          {s + gi * g.positions * lds, lds, u.s, h, u.i0, g.positions, j0, cols});
    }
  }
}

// Packs the key block [j0, j0 + cols) and computes its raw scores into sc.s.
inline void BlockScores(const FlashPlan& plan, const Unit& u, const UnitGeometry& g,
                        const TileShape& shape, std::int64_t j0, std::int64_t cols,
                        std::int64_t cols_pad, Scratch& sc) {
  const ConstTensorView k = plan.k;
  const std::int64_t dk = k.size(3);
  const std::int64_t rows = g.rows();
  const std::uint8_t* k0 = At(k, g.seq.batch, g.seq.k_begin + j0, u.hkv);
  if (plan.options->score == Score::additive) {
    // Keys projected through W_k (+ bias) into [cols][a_pad].
    for (std::int64_t c = 0; c < cols; ++c) {
      LoadStridedRowF32(k0 + c * k.stride(1) * ElementBytes(k.dtype()), k.dtype(), dk, k.stride(3),
                        sc.row.get());
      Project(sc.row.get(), 1, dk, plan.additive_w_k, plan.additive_bias,
              plan.problem->attention_size, shape.a_pad, sc.k.get() + c * shape.a_pad);
    }
    AdditiveScoresTile(sc.qa.get(), rows, sc.k.get(), cols, plan.additive_v.data(), shape.a_pad,
                       sc.s.get(), shape.keys_pad);
    return;
  }
  PackKeys(k0, k.dtype(), k.stride(1), k.stride(3), cols, cols_pad, dk, sc.row.get(), sc.k.get());
  ScoresTile(sc.q.get(), rows, dk, sc.k.get(), cols_pad / PanelWidth(), sc.s.get(), shape.keys_pad);
}

inline TileShape ShapeOf(const FlashPlan& plan) {
  const detail::AttentionProblem& p = *plan.problem;
  const std::int64_t nr = PanelWidth();
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(hn::ScalableTag<float>()));
  TileShape t;
  t.rows = p.group() * plan.positions_per_unit;
  t.keys_pad = RoundUp(std::max<std::int64_t>(plan.config.keys, 1), nr);
  t.dk = std::max(p.dq, p.dk);
  t.dv_pad = RoundUp(std::max<std::int64_t>(p.dv, 1), nr);
  t.a_pad = RoundUp(std::max<std::int64_t>(p.attention_size, 1), lanes);
  return t;
}

// The classification of the explicit masks for block `jb` of unit `u`.
inline BlockClass MaskClass(const FlashPlan& plan, const Unit& u, std::int64_t jb) {
  if (plan.block_class.empty()) return BlockClass::full;
  return plan.block_class[static_cast<std::size_t>(u.first_block + jb)];
}

inline UnitGeometry GeometryOf(const FlashPlan& plan, const Unit& u) {
  UnitGeometry g;
  g.seq = plan.problem->sequence(u.s, *plan.options);
  g.group = plan.problem->group();
  g.positions = u.positions;
  g.offset = plan.options->align == Align::bottom_right ? g.seq.nk - g.seq.nq : 0;
  return g;
}

// Packs the unit's queries (and for additive scores their projections).
inline void PrepareQueries(const FlashPlan& plan, const Unit& u, const UnitGeometry& g,
                           const TileShape& shape, Scratch& sc) {
  const bool additive = plan.options->score == Score::additive;
  PackQueries(plan, u, g, additive ? 1.0f : static_cast<float>(plan.problem->scale), sc.q.get());
  if (additive) {
    Project(sc.q.get(), g.rows(), plan.problem->dq, plan.additive_w_q, {},
            plan.problem->attention_size, shape.a_pad, sc.qa.get());
  }
}

inline void ForwardUnit(const FlashPlan& plan, const Unit& u, const TileShape& shape, Scratch& sc) {
  const AttentionOptions& o = *plan.options;
  const UnitGeometry g = GeometryOf(plan, u);
  const std::int64_t rows = g.rows();
  const std::int64_t nr = PanelWidth();
  const hn::ScalableTag<float> d;
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(d));
  const std::int64_t bk = plan.config.keys;
  const std::int64_t dv = plan.problem->dv;
  const std::int64_t dv_panels = shape.dv_pad / nr;

  PrepareQueries(plan, u, g, shape, sc);
  float* m = sc.m.get();
  float* l = sc.l.get();
  float* out_acc = sc.o.get();
  std::fill_n(m, rows, kNegInf);
  std::fill_n(l, rows, 0.0f);
  std::fill_n(out_acc, rows * shape.dv_pad, 0.0f);

  // Monotone in the position: the first row has the lowest range, the last
  // the highest.
  const KeyRange first = RangeFor(o, u.i0 + g.offset, g.seq.nk);
  const KeyRange last = RangeFor(o, u.i0 + u.positions - 1 + g.offset, g.seq.nk);
  for (std::int64_t jb = first.lo / bk; jb * bk < last.hi; ++jb) {
    const std::int64_t j0 = jb * bk;
    const std::int64_t cols = std::min(bk, g.seq.nk_rows - j0);
    const BlockClass mask_class = MaskClass(plan, u, jb);
    if (mask_class == BlockClass::empty) continue;
    const bool range_partial = !(last.lo <= j0 && first.hi >= j0 + cols);
    const std::int64_t cols_pad = RoundUp(cols, nr);

    BlockScores(plan, u, g, shape, j0, cols, cols_pad, sc);
    ModifyAndMask(plan, u, g, j0, cols, cols_pad, range_partial, mask_class == BlockClass::partial,
                  sc.s.get(), shape.keys_pad);

    // Online softmax, row by row.
    float* s = sc.s.get();
    for (std::int64_t r = 0; r < rows; ++r) {
      float* row = s + r * shape.keys_pad;
      auto vmax = hn::Set(d, kNegInf);
      for (std::int64_t c = 0; c < cols_pad; c += lanes) vmax = hn::Max(vmax, hn::Load(d, row + c));
      float block_max = hn::GetLane(hn::MaxOfLanes(d, vmax));
      if (block_max == kNegInf) {
        // Nothing admitted here, unless only NaN scores (which poison the row).
        bool nan = false;
        for (std::int64_t c = 0; c < cols; ++c) nan = nan || std::isnan(row[c]);
        if (!nan) {
          std::fill_n(row, cols_pad, 0.0f);
          continue;
        }
        block_max = std::numeric_limits<float>::quiet_NaN();
      }
      // A NaN maximum sticks, so everything after it in the row is NaN.
      const float m_new = std::isnan(m[r]) || std::isnan(block_max)
                              ? std::numeric_limits<float>::quiet_NaN()
                              : std::max(m[r], block_max);
      const auto vm = hn::Set(d, m_new);
      auto vsum = hn::Zero(d);
      for (std::int64_t c = 0; c < cols_pad; c += lanes) {
        const auto pexp = FastExp(d, hn::Sub(hn::Load(d, row + c), vm));
        hn::Store(pexp, d, row + c);
        vsum = hn::Add(vsum, pexp);
      }
      const float alpha = m[r] == kNegInf ? 0.0f : std::exp(m[r] - m_new);
      l[r] = alpha * l[r] + hn::GetLane(hn::SumOfLanes(d, vsum));
      m[r] = m_new;
      if (alpha != 1.0f) {
        float* orow = out_acc + r * shape.dv_pad;
        for (std::int64_t c = 0; c < shape.dv_pad; c += lanes) {
          hn::Store(hn::Mul(hn::Load(d, orow + c), hn::Set(d, alpha)), d, orow + c);
        }
      }
    }
    const ConstTensorView v = plan.v;
    PackValues(At(v, g.seq.batch, g.seq.k_begin + j0, u.hkv), v.dtype(), v.stride(1), v.stride(3),
               cols, cols_pad, dv, shape.dv_pad, sc.row.get(), sc.v.get());
    AccumulateValues(s, rows, shape.keys_pad, cols, sc.v.get(), cols_pad, dv_panels, out_acc,
                     shape.dv_pad);
  }

  // O / l into out (rounded once), m + log l into lse.
  const TensorView out = plan.out;
  const TensorView lse = plan.lse;
  for (std::int64_t gi = 0; gi < g.group; ++gi) {
    const std::int64_t h = u.hkv * g.group + gi;
    for (std::int64_t t = 0; t < g.positions; ++t) {
      const std::int64_t r = gi * g.positions + t;
      const std::int64_t qrow = g.seq.q_begin + u.i0 + t;
      float* orow = out_acc + r * shape.dv_pad;
      const float inv = l[r] == 0.0f ? 0.0f : 1.0f / l[r];
      for (std::int64_t c = 0; c < shape.dv_pad; c += lanes) {
        hn::Store(hn::Mul(hn::Load(d, orow + c), hn::Set(d, inv)), d, orow + c);
      }
      auto* dst = static_cast<std::uint8_t*>(out.data()) +
                  (g.seq.batch * out.stride(0) + qrow * out.stride(1) + h * out.stride(2)) *
                      ElementBytes(out.dtype());
      if (out.stride(3) == 1) {
        StoreRowFromF32(orow, dv, dst, out.dtype());
      } else {
        for (std::int64_t c = 0; c < dv; ++c) {
          StoreRowFromF32(orow + c, 1, dst + c * out.stride(3) * ElementBytes(out.dtype()),
                          out.dtype());
        }
      }
      static_cast<float*>(
          lse.data())[g.seq.batch * lse.stride(0) + h * lse.stride(1) + qrow * lse.stride(2)] =
          l[r] == 0.0f ? kNegInf : m[r] + std::log(l[r]);
    }
  }
}

// Probabilities of one unit: P = exp(S - lse) per admitted key, 0 elsewhere.
inline void ProbabilitiesUnit(const FlashPlan& plan, const Unit& u, const TileShape& shape,
                              Scratch& sc) {
  const AttentionOptions& o = *plan.options;
  const UnitGeometry g = GeometryOf(plan, u);
  const std::int64_t nr = PanelWidth();
  const hn::ScalableTag<float> d;
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(d));
  const std::int64_t bk = plan.config.keys;
  const TensorView probs = plan.probs;
  const TensorView lse = plan.lse;
  auto* pdata = static_cast<float*>(probs.data());

  PrepareQueries(plan, u, g, shape, sc);
  // Zero every probability of the unit's rows, then fill the open blocks.
  for (std::int64_t gi = 0; gi < g.group; ++gi) {
    for (std::int64_t t = 0; t < g.positions; ++t) {
      float* prow = pdata + g.seq.batch * probs.stride(0) +
                    (u.hkv * g.group + gi) * probs.stride(1) +
                    (g.seq.q_begin + u.i0 + t) * probs.stride(2);
      for (std::int64_t j = 0; j < probs.size(3); ++j) prow[j * probs.stride(3)] = 0.0f;
    }
  }
  const KeyRange first = RangeFor(o, u.i0 + g.offset, g.seq.nk);
  const KeyRange last = RangeFor(o, u.i0 + u.positions - 1 + g.offset, g.seq.nk);
  for (std::int64_t jb = first.lo / bk; jb * bk < last.hi; ++jb) {
    const std::int64_t j0 = jb * bk;
    const std::int64_t cols = std::min(bk, g.seq.nk_rows - j0);
    const BlockClass mask_class = MaskClass(plan, u, jb);
    if (mask_class == BlockClass::empty) continue;
    const bool range_partial = !(last.lo <= j0 && first.hi >= j0 + cols);
    const std::int64_t cols_pad = RoundUp(cols, nr);
    BlockScores(plan, u, g, shape, j0, cols, cols_pad, sc);
    ModifyAndMask(plan, u, g, j0, cols, cols_pad, range_partial, mask_class == BlockClass::partial,
                  sc.s.get(), shape.keys_pad);
    for (std::int64_t gi = 0; gi < g.group; ++gi) {
      const std::int64_t h = u.hkv * g.group + gi;
      for (std::int64_t t = 0; t < g.positions; ++t) {
        const std::int64_t qrow = g.seq.q_begin + u.i0 + t;
        float* row = sc.s.get() + (gi * g.positions + t) * shape.keys_pad;
        const float row_lse = static_cast<const float*>(
            lse.data())[g.seq.batch * lse.stride(0) + h * lse.stride(1) + qrow * lse.stride(2)];
        if (row_lse == kNegInf) continue;  // fully masked row: stays 0
        for (std::int64_t c = 0; c < cols_pad; c += lanes) {
          hn::Store(FastExp(d, hn::Sub(hn::Load(d, row + c), hn::Set(d, row_lse))), d, row + c);
        }
        float* prow = pdata + g.seq.batch * probs.stride(0) + h * probs.stride(1) +
                      qrow * probs.stride(2) + (g.seq.k_begin + j0) * probs.stride(3);
        for (std::int64_t c = 0; c < cols; ++c) prow[c * probs.stride(3)] = row[c];
      }
    }
  }
}

// Runs `unit_fn` over all units on OpenMP threads with per-thread scratch.
template <class UnitFn>
void ForEachUnit(const FlashPlan& plan, UnitFn unit_fn) {
  const TileShape shape = ShapeOf(plan);
  const auto n = static_cast<std::int64_t>(plan.units.size());
#pragma omp parallel
  {
    Scratch scratch(shape);
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t i = 0; i < n; ++i) {
      unit_fn(plan, plan.units[static_cast<std::size_t>(i)], shape, scratch);
    }
  }
}

inline void FlashForwardImpl(const FlashPlan& plan) { ForEachUnit(plan, ForwardUnit); }
inline void FlashProbabilitiesImpl(const FlashPlan& plan) { ForEachUnit(plan, ProbabilitiesUnit); }

}  // namespace HWY_NAMESPACE
}  // namespace qkv::cpu
HWY_AFTER_NAMESPACE();

#endif  // QKV_CPU_FLASH_INL_H_
