// The per-target body of the linear attention forward (see linear.hpp) and
// the building blocks it shares with the backward (linear_backward-inl.h).
// Per (sequence, KV head) the keys and queries are cut into chunks of C
// positions; with A = phi(Q_n), K = phi(K_n), V = V_n for chunk n and the
// state (S, z) summed over the keys before it:
//
//   causal       O_n = A S + tril(A K^T) V,  den_i = <a_i, z + sum_{j<=i} k_j> + eps,
//                then S += K^T V, z += sum_j k_j
//   non-causal   S, z summed over every key first, then O_n = A S, den_i = <a_i, z> + eps
//
// Every product is a register-tiled micro-kernel call (tile_gemm-inl.h) on
// f32 buffers padded with zeros to the panel width.
#if defined(QKV_CPU_LINEAR_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_CPU_LINEAR_INL_H_
#undef QKV_CPU_LINEAR_INL_H_
#else
#define QKV_CPU_LINEAR_INL_H_
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <optional>
#include <vector>

#include "core/hwy_namespace.hpp"
#include "cpu/linear.hpp"
#include "cpu/tile_gemm-inl.h"
#include "cpu/vec_math-inl.h"
#include "hwy/cache_control.h"
#include "hwy/highway.h"

QKV_HWY_NAMESPACE_BEGIN(cpu);

// Positions per split of the non-causal sums over all keys (or queries):
// their number follows the sequence length only, so the order in which the
// partial sums are added never depends on the thread count.
constexpr std::int64_t kSplitPositions = 4096;
constexpr std::int64_t kMaxSplits = 64;

inline std::int64_t DivCeil(std::int64_t x, std::int64_t m) { return (x + m - 1) / m; }

// Sizes of a call's buffers; padded sizes are multiples of NR = ValueWidth().
struct LinearShape {
  std::int64_t d = 0, m = 0, dv = 0;  // head dim, features M, value dim
  std::int64_t m_pad = 0, dv_pad = 0;
  std::int64_t chunk = 0, c_pad = 0;  // positions per chunk, padded
  std::int64_t width = 0;             // value columns of a causal forward unit
  std::int64_t unit_heads = 1;        // (sequence, KV head) pairs of a causal forward unit
};

inline LinearShape LinearShapeOf(const LinearPlan& plan) {
  const detail::LinearProblem& p = *plan.problem;
  const std::int64_t nr = ValueWidth();
  LinearShape s;
  s.d = p.d;
  s.m = p.features;
  s.dv = p.dv;
  s.m_pad = RoundUp(s.m, nr);
  s.dv_pad = RoundUp(s.dv, nr);
  // A chunk longer than the sequence computes what one of the sequence's
  // length does; the cap keeps a decoding step's scratch small.
  s.chunk = std::min(plan.options->chunk, std::max<std::int64_t>({p.nq, p.nk, 1}));
  s.c_pad = RoundUp(s.chunk, nr);
  const std::int64_t blocks =
      std::clamp<std::int64_t>(plan.column_blocks, 1, std::max<std::int64_t>(s.dv_pad / nr, 1));
  s.width = RoundUp(DivCeil(s.dv_pad, blocks), nr);
  s.unit_heads = std::max<std::int64_t>(plan.unit_heads, 1);
  return s;
}

// One thread's buffers, allocated once per call (C = chunk):
//   x, xk       raw query / key rows [C][D]
//   a           query features [C][m_pad]
//   keys        key features [C][m_pad];  keys_t  transposed [m_pad][c_pad]
//   prefix      running key sums [C][m_pad]: z + sum of the chunk's keys <= t
//   values      value rows [C][dv_pad];   values_t  transposed [dv_pad][c_pad]
//   grad        g = dout / den [C][dv_pad]
//   square, square2   [C][c_pad] intra-chunk products
//   rows        output rows [C][max(m_pad, dv_pad)];  rows2  [C][dv_pad]
//   state       S [unit_heads][m_pad][width], S^T [dv_pad][m_pad] or R [m_pad][dv_pad]
//   keys_grad   dK^T [m_pad][c_pad]
//   z           [unit_heads][m_pad];  r  [m_pad];  den, c  [C];  row  one row
//   xd, fd, gd  a custom map's rows in double
struct LinearScratch {
  explicit LinearScratch(const LinearShape& s)
      : x(AllocFloats(s.chunk * s.d)),
        xk(AllocFloats(s.chunk * s.d)),
        a(AllocFloats(s.chunk * s.m_pad)),
        keys(AllocFloats(s.chunk * s.m_pad)),
        keys_t(AllocFloats(s.m_pad * s.c_pad)),
        prefix(AllocFloats(s.chunk * s.m_pad)),
        values(AllocFloats(s.chunk * s.dv_pad)),
        values_t(AllocFloats(s.dv_pad * s.c_pad)),
        grad(AllocFloats(s.chunk * s.dv_pad)),
        square(AllocFloats(s.chunk * s.c_pad)),
        square2(AllocFloats(s.chunk * s.c_pad)),
        rows(AllocFloats(s.chunk * std::max(s.m_pad, s.dv_pad))),
        rows2(AllocFloats(s.chunk * s.dv_pad)),
        state(AllocFloats(s.unit_heads * s.m_pad * s.dv_pad)),
        keys_grad(AllocFloats(s.m_pad * s.c_pad)),
        z(AllocFloats(s.unit_heads * s.m_pad)),
        r(AllocFloats(s.m_pad)),
        den(AllocFloats(s.chunk)),
        c(AllocFloats(s.chunk)),
        row(AllocFloats(std::max({s.d, s.m_pad, s.dv_pad}))),
        xd(static_cast<std::size_t>(s.d)),
        fd(static_cast<std::size_t>(s.m)),
        gd(static_cast<std::size_t>(s.d)) {}

  Floats x, xk, a, keys, keys_t, prefix, values, values_t, grad, square, square2, rows, rows2,
      state, keys_grad, z, r, den, c, row;
  std::vector<double> xd, fd, gd;
};

// Runs body(unit, scratch) for units [0, n) on OpenMP threads, each thread
// with its own scratch. An exception (from a custom feature map) stops the
// remaining units and is rethrown on the calling thread.
template <class Body>
void ForEachUnit(const LinearShape& s, std::int64_t n, Body body) {
  std::exception_ptr error;
  std::atomic<bool> failed{false};
  const auto record = [&] {
#pragma omp critical(qkv_linear_error)
    if (!error) error = std::current_exception();
    failed = true;
  };
#pragma omp parallel
  {
    std::optional<LinearScratch> scratch;
    try {
      scratch.emplace(s);
    } catch (...) {
      record();
    }
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t u = 0; u < n; ++u) {
      if (failed.load(std::memory_order_relaxed)) continue;
      try {
        body(u, *scratch);
      } catch (...) {
        record();
      }
    }
  }
  if (error) std::rethrow_exception(error);
}

// Calls f(tag, i) over [0, n): full vectors, then single lanes.
template <class F>
HWY_INLINE void ForLanes(std::int64_t n, F&& f) {
  const hn::ScalableTag<float> d;
  const auto lanes = static_cast<std::int64_t>(hn::Lanes(d));
  std::int64_t i = 0;
  for (; i + lanes <= n; i += lanes) f(d, i);
  const hn::CappedTag<float, 1> d1;
  for (; i < n; ++i) f(d1, i);
}

// <x, y> over n floats (n a multiple of the vector length).
inline float Dot(const float* HWY_RESTRICT x, const float* HWY_RESTRICT y, std::int64_t n) {
  const hn::ScalableTag<float> d;
  const auto lanes = static_cast<std::int64_t>(hn::Lanes(d));
  auto acc = hn::Zero(d);
  for (std::int64_t i = 0; i < n; i += lanes) {
    acc = hn::MulAdd(hn::LoadU(d, x + i), hn::LoadU(d, y + i), acc);
  }
  return hn::GetLane(hn::SumOfLanes(d, acc));
}

// y += alpha x over n floats.
inline void AddScaled(float alpha, const float* HWY_RESTRICT x, std::int64_t n,
                      float* HWY_RESTRICT y) {
  ForLanes(n, [&](auto d, std::int64_t i) {
    hn::StoreU(hn::MulAdd(hn::Set(d, alpha), hn::LoadU(d, x + i), hn::LoadU(d, y + i)), d, y + i);
  });
}

// x *= 1 / divisor over n floats: one rounding more than a division, far
// below the error of the f32 sums, at a fraction of its cost.
inline void Divide(float* HWY_RESTRICT x, std::int64_t n, float divisor) {
  const float inverse = 1.0f / divisor;
  ForLanes(n, [&](auto d, std::int64_t i) {
    hn::StoreU(hn::Mul(hn::LoadU(d, x + i), hn::Set(d, inverse)), d, x + i);
  });
}

// The built-in maps, lane-wise.
template <class D, class V = hn::Vec<D>>
HWY_INLINE V Phi(D d, V x, FeatureMap map) {
  if (map == FeatureMap::relu) return hn::Max(x, hn::Zero(d));
  return hn::IfThenElse(hn::Gt(x, hn::Zero(d)), hn::Add(x, hn::Set(d, 1.0f)), FastExp(d, x));
}

// phi(x) of one row x [D] into f [m_pad], zero beyond M.
inline void Features(const LinearAttentionOptions& o, const LinearShape& s,
                     const float* HWY_RESTRICT x, float* HWY_RESTRICT f, LinearScratch& w) {
  if (o.feature_map == FeatureMap::custom) {
    std::copy_n(x, s.d, w.xd.begin());
    o.custom.map(w.xd, w.fd);
    std::copy_n(w.fd.begin(), s.m, f);
  } else {
    ForLanes(s.d, [&](auto d, std::int64_t i) {
      hn::StoreU(Phi(d, hn::LoadU(d, x + i), o.feature_map), d, f + i);
    });
  }
  std::fill(f + s.m, f + s.m_pad, 0.0f);
}

// Columns [c0, c0 + n) of row (b, i, h) of a rank-4 view, as f32.
inline void LoadRow(ConstTensorView t, std::int64_t b, std::int64_t i, std::int64_t h,
                    std::int64_t c0, std::int64_t n, float* HWY_RESTRICT dst) {
  LoadStridedRowF32(At(t, b, i, h) + c0 * t.stride(3) * ElementBytes(t.dtype()), t.dtype(), n,
                    t.stride(3), dst);
}

// Rows to fetch while others load: rows p0 + r of head h of sequence b
// (none when p0 < 0). In [B, N, H, D] layouts consecutive rows of a head are
// H * D elements apart, a page every few rows, where hardware prefetchers
// stop; the chunk loops fetch the rows of the chunk they visit next while
// they load the current one's.
struct RowsAhead {
  std::int64_t b = 0, h = 0, p0 = -1;
};

// Starts fetching row r of `ahead` in a rank-4 view (unit-stride rows inside
// the sequence only).
inline void PrefetchRow(ConstTensorView t, const RowsAhead& ahead, std::int64_t r) {
  const std::int64_t i = ahead.p0 + r;
  if (ahead.p0 < 0 || i >= t.size(1) || t.stride(3) != 1 || t.data() == nullptr) return;
  const std::uint8_t* row = At(t, ahead.b, i, ahead.h);
  for (std::int64_t byte = 0; byte < t.size(3) * ElementBytes(t.dtype()); byte += 64) {
    hwy::Prefetch(row + byte);
  }
}

// Rows [p0, p0 + n) of head h: columns [c0, c0 + cols) into dst [n][ld],
// zero-padded to ld; prefetches the same rows of `ahead`.
inline void LoadRows(ConstTensorView t, std::int64_t b, std::int64_t h, std::int64_t p0,
                     std::int64_t n, std::int64_t c0, std::int64_t cols, std::int64_t ld,
                     const RowsAhead& ahead, float* HWY_RESTRICT dst) {
  for (std::int64_t r = 0; r < n; ++r) {
    PrefetchRow(t, ahead, r);
    LoadRow(t, b, p0 + r, h, c0, cols, dst + r * ld);
    std::fill(dst + r * ld + cols, dst + (r + 1) * ld, 0.0f);
  }
}

// Features of rows [p0, p0 + n) of head h of q or k into f [n][m_pad]; the
// raw rows are kept in x [n][D] when x is not null. Prefetches the same rows
// of `ahead`.
inline void FeatureRows(const LinearPlan& plan, const LinearShape& s, ConstTensorView t,
                        std::int64_t b, std::int64_t h, std::int64_t p0, std::int64_t n,
                        const RowsAhead& ahead, float* HWY_RESTRICT f, float* HWY_RESTRICT x,
                        LinearScratch& w) {
  // f32 rows at unit stride are read in place unless kept.
  const bool in_place = x == nullptr && t.dtype() == DType::f32 && t.stride(3) == 1;
  for (std::int64_t r = 0; r < n; ++r) {
    PrefetchRow(t, ahead, r);
    const float* raw = reinterpret_cast<const float*>(At(t, b, p0 + r, h));
    if (!in_place) {
      float* copy = x != nullptr ? x + r * s.d : w.row.get();
      LoadRow(t, b, p0 + r, h, 0, s.d, copy);
      raw = copy;
    }
    Features(*plan.options, s, raw, f + r * s.m_pad, w);
  }
}

// dst [cols][ld_dst] = src^T for src [n][ld_src], its first cols columns:
// 4 x 4 blocks in 128-bit vectors (two rounds of interleaves), the edges
// element by element.
inline void Transpose(const float* HWY_RESTRICT src, std::int64_t n, std::int64_t cols,
                      std::int64_t ld_src, float* HWY_RESTRICT dst, std::int64_t ld_dst) {
  std::int64_t r0 = 0;
#if HWY_TARGET != HWY_SCALAR
  const hn::FixedTag<float, 4> d;
  const hn::Repartition<std::uint64_t, decltype(d)> d64;
  for (; r0 + 4 <= n; r0 += 4) {
    std::int64_t c0 = 0;
    for (; c0 + 4 <= cols; c0 += 4) {
      const float* in = src + r0 * ld_src + c0;
      const auto a = hn::LoadU(d, in), b = hn::LoadU(d, in + ld_src);
      const auto c = hn::LoadU(d, in + 2 * ld_src), e = hn::LoadU(d, in + 3 * ld_src);
      const auto ab_lo = hn::BitCast(d64, hn::InterleaveLower(d, a, b));  // a0 b0 a1 b1
      const auto ce_lo = hn::BitCast(d64, hn::InterleaveLower(d, c, e));  // c0 e0 c1 e1
      const auto ab_hi = hn::BitCast(d64, hn::InterleaveUpper(d, a, b));  // a2 b2 a3 b3
      const auto ce_hi = hn::BitCast(d64, hn::InterleaveUpper(d, c, e));  // c2 e2 c3 e3
      float* out = dst + c0 * ld_dst + r0;
      hn::StoreU(hn::BitCast(d, hn::InterleaveLower(d64, ab_lo, ce_lo)), d, out);
      hn::StoreU(hn::BitCast(d, hn::InterleaveUpper(d64, ab_lo, ce_lo)), d, out + ld_dst);
      hn::StoreU(hn::BitCast(d, hn::InterleaveLower(d64, ab_hi, ce_hi)), d, out + 2 * ld_dst);
      hn::StoreU(hn::BitCast(d, hn::InterleaveUpper(d64, ab_hi, ce_hi)), d, out + 3 * ld_dst);
    }
    for (std::int64_t r = r0; r < r0 + 4; ++r) {
      for (std::int64_t c = c0; c < cols; ++c) dst[c * ld_dst + r] = src[r * ld_src + c];
    }
  }
#endif
  for (std::int64_t r = r0; r < n; ++r) {
    for (std::int64_t c = 0; c < cols; ++c) dst[c * ld_dst + r] = src[r * ld_src + c];
  }
}

// prefix[t] = z + keys[0] + ... + keys[t] for t < n, rows of m_pad floats.
inline void RunningSums(const float* HWY_RESTRICT keys, std::int64_t n, std::int64_t m_pad,
                        const float* HWY_RESTRICT z, float* HWY_RESTRICT prefix) {
  const float* previous = z;
  for (std::int64_t t = 0; t < n; ++t) {
    float* out = prefix + t * m_pad;
    ForLanes(m_pad, [&](auto d, std::int64_t i) {
      hn::StoreU(hn::Add(hn::LoadU(d, previous + i), hn::LoadU(d, keys + t * m_pad + i)), d,
                 out + i);
    });
    previous = out;
  }
}

// sq[i][j] for i < n: plus add[i] where j <= i (when add is not null), 0
// where i < j < cols.
inline void LowerTriangle(float* HWY_RESTRICT sq, std::int64_t ld, std::int64_t n,
                          std::int64_t cols, const float* HWY_RESTRICT add) {
  for (std::int64_t i = 0; i < n; ++i) {
    float* row = sq + i * ld;
    if (add != nullptr) {
      for (std::int64_t j = 0; j <= i; ++j) row[j] += add[i];
    }
    std::fill(row + std::min(i + 1, cols), row + cols, 0.0f);
  }
}

// C[rows][cols] (+)= A B, where A's element (r, k) is a[r * a_row + k *
// a_k], B has rows of ldb floats and C of ldc; cols is a multiple of NR. For
// each strip of R rows from r0 and panel of NR columns from c0, only k in
// span(r0, R, c0) contributes: outside it the caller's triangular operands
// make every term zero. Without kAccumulate an empty span stores zeros.
// Panels outer: a panel of B stays in L1 while the strips of A stream past.
template <bool kAccumulate, class SpanFn>
void Product(const float* HWY_RESTRICT a, std::int64_t a_row, std::int64_t a_k, std::int64_t rows,
             const float* HWY_RESTRICT b, std::int64_t ldb, std::int64_t cols,
             float* HWY_RESTRICT c, std::int64_t ldc, SpanFn span) {
  const std::int64_t nr = ValueWidth();
  for (std::int64_t c0 = 0; c0 < cols; c0 += nr) {
    for (std::int64_t r0 = 0; r0 < rows; r0 += kValueStrip) {
      WithStrip<kValueStrip>(rows - r0, [&](auto strip) {
        const KeySpan k = span(r0, std::int64_t{strip()}, c0);
        Micro<strip(), kValueVecs, kAccumulate>(
            a + r0 * a_row + k.begin * a_k, a_row, a_k, std::max<std::int64_t>(k.end - k.begin, 0),
            b + k.begin * ldb + c0, ldb, c + r0 * ldc + c0, ldc);
      });
    }
  }
}

// Contraction spans for Product.
inline auto All(std::int64_t depth) {
  return [depth](std::int64_t, std::int64_t, std::int64_t) { return KeySpan{0, depth}; };
}
// A lower triangular: row r sums k <= r.
inline auto UpToRow(std::int64_t depth) {
  return [depth](std::int64_t r0, std::int64_t strip, std::int64_t) {
    return KeySpan{0, std::min(depth, r0 + strip)};
  };
}
// C lower triangular: panels right of a strip's last row are left zero.
inline auto LowerPanels(std::int64_t depth) {
  return [depth](std::int64_t r0, std::int64_t strip, std::int64_t c0) {
    return KeySpan{0, c0 < r0 + strip ? depth : 0};
  };
}

// The chunks [first, last) of split i of `splits` over `chunks`.
inline KeySpan SplitChunks(std::int64_t i, std::int64_t splits, std::int64_t chunks) {
  return {chunks * i / splits, chunks * (i + 1) / splits};
}
inline std::int64_t SplitCount(std::int64_t positions) {
  return std::clamp<std::int64_t>(DivCeil(positions, kSplitPositions), 1, kMaxSplits);
}

// ---------------------------------------------------------------- forward --

// One chunk, positions [p0, p0 + n), of the causal forward of KV head hk of
// sequence b, value columns [c0, c0 + cols): the outputs of the group's
// query heads from the state (S [M][width], z [m_pad]) before the chunk,
// then the state advanced past the chunk's keys. `next` is the KV head and
// chunk the unit visits next, whose rows are prefetched.
inline void CausalForwardChunk(const LinearPlan& plan, const LinearShape& s, std::int64_t b,
                               std::int64_t hk, std::int64_t c0, std::int64_t cols, std::int64_t p0,
                               std::int64_t n, const RowsAhead& next, float* HWY_RESTRICT state,
                               float* HWY_RESTRICT z, LinearScratch& w) {
  const detail::LinearProblem& p = *plan.problem;
  const LinearAttentionOptions& o = *plan.options;
  const std::int64_t width = s.width;
  const std::int64_t n_pad = RoundUp(n, ValueWidth());
  const TensorView out = plan.out.slice(3, c0, cols);
  const float eps = static_cast<float>(o.eps);
  FeatureRows(plan, s, plan.k, b, hk, p0, n, next, w.keys.get(), nullptr, w);
  Transpose(w.keys.get(), n, s.m, s.m_pad, w.keys_t.get(), s.c_pad);
  LoadRows(plan.v, b, hk, p0, n, c0, cols, width, next, w.values.get());
  for (std::int64_t h = hk * p.group(); h < (hk + 1) * p.group(); ++h) {
    const RowsAhead next_queries{next.b, next.h * p.group() + h - hk * p.group(), next.p0};
    FeatureRows(plan, s, plan.q, b, h, p0, n, next_queries, w.a.get(), nullptr, w);
    float* o_rows = w.rows.get();  // [n][width]
    Product<false>(w.a.get(), s.m_pad, 1, n, state, width, width, o_rows, width, All(s.m));
    Product<false>(w.a.get(), s.m_pad, 1, n, w.keys_t.get(), s.c_pad, n_pad, w.square.get(),
                   s.c_pad, LowerPanels(s.m));
    LowerTriangle(w.square.get(), s.c_pad, n, n_pad, nullptr);
    Product<true>(w.square.get(), s.c_pad, 1, n, w.values.get(), width, width, o_rows, width,
                  UpToRow(n));
    for (std::int64_t t = 0; t < n; ++t) {
      float* row = o_rows + t * width;
      if (o.normalize) {
        // The normalizer from the numerator's own products: <a_t, z> over the
        // keys before the chunk plus the row's weights <a_t, k_j>, j <= t,
        // inside it, so that rounding common to both cancels in the ratio,
        // as in the quadratic form. <a_t, z + sum_j k_j> (the running sums)
        // rounds apart from the numerator and exceeded twice the naive error
        // in about 5% of random causal problems.
        const float* weights = w.square.get() + t * s.c_pad;
        float within = 0.0f;
        for (std::int64_t j = 0; j <= t; ++j) within += weights[j];
        Divide(row, cols, Dot(w.a.get() + t * s.m_pad, z, s.m_pad) + within + eps);
      }
      StoreViewRow(row, cols, out, b, p0 + t, h);
    }
  }
  Product<true>(w.keys_t.get(), s.c_pad, 1, s.m, w.values.get(), width, width, state, width,
                All(n));
  // z now moves past the chunk's keys (the rows above read it before).
  for (std::int64_t t = 0; t < n; ++t) AddScaled(1.0f, w.keys.get() + t * s.m_pad, s.m_pad, z);
}

// The causal forward of one unit: the (sequence, KV head) pairs [g0, g0 +
// count) of the B * Hkv, value columns [c0, c0 + width), each carrying its
// state in scratch through the chunks in order. All heads of the unit take
// each chunk in turn: in [B, N, H, D] layouts a head's rows are H * D
// elements apart, so this touches each memory page of a chunk once, not
// once per head.
inline void CausalForwardUnit(const LinearPlan& plan, const LinearShape& s, std::int64_t g0,
                              std::int64_t count, std::int64_t c0, LinearScratch& w) {
  const detail::LinearProblem& p = *plan.problem;
  const std::int64_t width = s.width;
  const std::int64_t cols = std::min(width, s.dv - c0);  // real value columns
  auto state_of = [&](std::int64_t i) { return w.state.get() + i * s.m_pad * width; };
  auto z_of = [&](std::int64_t i) { return w.z.get() + i * s.m_pad; };
  for (std::int64_t i = 0; i < count; ++i) {
    const std::int64_t head = g0 + i;
    for (std::int64_t m = 0; m < s.m; ++m) {
      float* row = state_of(i) + m * width;
      std::fill(row, row + width, 0.0f);
      if (plan.s_in != nullptr) std::copy_n(plan.s_in + (head * s.m + m) * s.dv + c0, cols, row);
    }
    std::fill(z_of(i), z_of(i) + s.m_pad, 0.0f);
    if (!plan.z_in.empty()) std::copy_n(plan.z_in.data() + head * s.m, s.m, z_of(i));
  }
  for (std::int64_t p0 = 0; p0 < p.nq; p0 += s.chunk) {
    for (std::int64_t i = 0; i < count; ++i) {
      const std::int64_t next = i + 1 < count ? g0 + i + 1 : g0;
      const RowsAhead ahead{next / p.hkv, next % p.hkv, i + 1 < count ? p0 : p0 + s.chunk};
      CausalForwardChunk(plan, s, (g0 + i) / p.hkv, (g0 + i) % p.hkv, c0, cols, p0,
                         std::min(s.chunk, p.nq - p0), ahead, state_of(i), z_of(i), w);
    }
  }
  for (std::int64_t i = 0; i < count; ++i) {
    const std::int64_t head = g0 + i;
    if (plan.s_out != nullptr) {
      for (std::int64_t m = 0; m < s.m; ++m) {
        std::copy_n(state_of(i) + m * width, cols, plan.s_out + (head * s.m + m) * s.dv + c0);
      }
    }
    if (plan.z_out != nullptr && c0 == 0) std::copy_n(z_of(i), s.m, plan.z_out + head * s.m);
  }
}

// Sums over every key of each (sequence, KV head): S [B * Hkv][M][dv_pad]
// and z [B * Hkv][m_pad], split into fixed ranges of chunks whose partial
// sums are added in order.
struct KeySums {
  Floats s, z;
};

inline KeySums SumKeys(const LinearPlan& plan, const LinearShape& s) {
  const detail::LinearProblem& p = *plan.problem;
  const std::int64_t heads = p.batch * p.hkv;
  const std::int64_t chunks = DivCeil(p.nk, s.chunk);
  const std::int64_t splits = SplitCount(p.nk);
  const std::int64_t s_size = s.m * s.dv_pad;
  Floats partial_s = AllocFloats(heads * splits * s_size);
  Floats partial_z = AllocFloats(heads * splits * s.m_pad);
  ForEachUnit(s, heads * splits, [&](std::int64_t u, LinearScratch& w) {
    const std::int64_t b = u / splits / p.hkv, hk = u / splits % p.hkv;
    float* sum = partial_s.get() + u * s_size;
    float* z = partial_z.get() + u * s.m_pad;
    const KeySpan range = SplitChunks(u % splits, splits, chunks);
    for (std::int64_t chunk = range.begin; chunk < range.end; ++chunk) {
      const std::int64_t p0 = chunk * s.chunk, n = std::min(s.chunk, p.nk - p0);
      const RowsAhead next{b, hk, p0 + s.chunk};
      FeatureRows(plan, s, plan.k, b, hk, p0, n, next, w.keys.get(), nullptr, w);
      Transpose(w.keys.get(), n, s.m, s.m_pad, w.keys_t.get(), s.c_pad);
      for (std::int64_t t = 0; t < n; ++t) AddScaled(1.0f, w.keys.get() + t * s.m_pad, s.m_pad, z);
      LoadRows(plan.v, b, hk, p0, n, 0, s.dv, s.dv_pad, next, w.values.get());
      Product<true>(w.keys_t.get(), s.c_pad, 1, s.m, w.values.get(), s.dv_pad, s.dv_pad, sum,
                    s.dv_pad, All(n));
    }
  });
  KeySums total{AllocFloats(heads * s_size), AllocFloats(heads * s.m_pad)};
  for (std::int64_t h = 0; h < heads; ++h) {
    for (std::int64_t i = 0; i < splits; ++i) {
      AddScaled(1.0f, partial_s.get() + (h * splits + i) * s_size, s_size,
                total.s.get() + h * s_size);
      AddScaled(1.0f, partial_z.get() + (h * splits + i) * s.m_pad, s.m_pad,
                total.z.get() + h * s.m_pad);
    }
  }
  return total;
}

// The non-causal forward: sums over all keys, then every chunk of queries
// independently, O = A S / (A z + eps).
inline void NonCausalForward(const LinearPlan& plan, const LinearShape& s) {
  const detail::LinearProblem& p = *plan.problem;
  const LinearAttentionOptions& o = *plan.options;
  const KeySums sums = SumKeys(plan, s);
  const std::int64_t chunks = DivCeil(p.nq, s.chunk);
  const float eps = static_cast<float>(o.eps);
  ForEachUnit(s, p.batch * p.hkv * chunks, [&](std::int64_t u, LinearScratch& w) {
    const std::int64_t head = u / chunks, b = head / p.hkv, hk = head % p.hkv;
    const std::int64_t p0 = u % chunks * s.chunk, n = std::min(s.chunk, p.nq - p0);
    const float* state = sums.s.get() + head * s.m * s.dv_pad;
    const float* z = sums.z.get() + head * s.m_pad;
    for (std::int64_t h = hk * p.group(); h < (hk + 1) * p.group(); ++h) {
      FeatureRows(plan, s, plan.q, b, h, p0, n, {}, w.a.get(), nullptr, w);
      Product<false>(w.a.get(), s.m_pad, 1, n, state, s.dv_pad, s.dv_pad, w.rows.get(), s.dv_pad,
                     All(s.m));
      for (std::int64_t t = 0; t < n; ++t) {
        float* row = w.rows.get() + t * s.dv_pad;
        if (o.normalize) Divide(row, s.dv, Dot(w.a.get() + t * s.m_pad, z, s.m_pad) + eps);
        StoreViewRow(row, s.dv, plan.out, b, p0 + t, h);
      }
    }
  });
}

inline void LinearForwardImpl(const LinearPlan& plan) {
  const detail::LinearProblem& p = *plan.problem;
  const LinearShape s = LinearShapeOf(plan);
  if (!plan.options->causal) return NonCausalForward(plan, s);
  const std::int64_t blocks = std::max<std::int64_t>(DivCeil(s.dv_pad, s.width), 1);
  const std::int64_t heads = p.batch * p.hkv;
  const std::int64_t head_blocks = DivCeil(heads, s.unit_heads);
  ForEachUnit(s, head_blocks * blocks, [&](std::int64_t u, LinearScratch& w) {
    const std::int64_t g0 = u / blocks * s.unit_heads;
    CausalForwardUnit(plan, s, g0, std::min(s.unit_heads, heads - g0), u % blocks * s.width, w);
  });
}

QKV_HWY_NAMESPACE_END(cpu);

#endif  // QKV_CPU_LINEAR_INL_H_
