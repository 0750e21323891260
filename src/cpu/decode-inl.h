// The per-target body of decode attention (see decode.hpp). A work item
// streams its keys once: for each block of keys it computes the scores of
// every query row (all heads x the new tokens), updates the rows' running max
// and sum, and accumulates p V, widening 16-bit cache entries to f32 in
// registers. A work item takes all KV heads of a range of tokens, so it reads
// the cache sequentially, token row after token row: one KV head alone would
// read D of every Hkv * D elements, a new page per key, and leave the
// hardware prefetchers and the TLB behind.
#if defined(QKV_CPU_DECODE_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_CPU_DECODE_INL_H_
#undef QKV_CPU_DECODE_INL_H_
#else
#define QKV_CPU_DECODE_INL_H_
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu/decode.hpp"
#include "cpu/vec_math-inl.h"
#include "hwy/aligned_allocator.h"
#include "hwy/cache_control.h"
#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::cpu {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

constexpr float kDecodeNegInf = -std::numeric_limits<float>::infinity();
// Keys per block: their scores for up to 64 rows stay in L1.
constexpr std::int64_t kDecodeBlock = 32;

// A vector of f32 from `n` lanes of storage type T at p (T = float,
// hwy::bfloat16_t or hwy::float16_t), widened exactly.
template <class T, class D>
HWY_INLINE hn::Vec<D> LoadWide(D d, const T* HWY_RESTRICT p) {
  if constexpr (std::is_same_v<T, float>) {
    return hn::LoadU(d, p);
  } else if constexpr (std::is_same_v<T, hwy::bfloat16_t>) {
    const hn::Rebind<std::uint16_t, D> du16;
    const hn::RebindToUnsigned<D> du32;
    const auto bits =
        hn::PromoteTo(du32, hn::LoadU(du16, reinterpret_cast<const std::uint16_t*>(p)));
    return hn::BitCast(d, hn::ShiftLeft<16>(bits));
  } else {
    const hn::Rebind<hwy::float16_t, D> df16;
    return hn::PromoteTo(d, hn::LoadU(df16, p));
  }
}

// One element of storage type T as f32 (exact).
template <class T>
HWY_INLINE float Wide(T x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    std::uint16_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    if constexpr (std::is_same_v<T, hwy::bfloat16_t>) return to_float(bf16{bits});
    return to_float(f16{bits});
  }
}

template <class D>
HWY_INLINE float Sum(D d, hn::Vec<D> v) {
  return hn::GetLane(hn::SumOfLanes(d, v));
}

// Per-thread buffers: q rows [rows][dk_pad] (scaled f32), scores [rows][block].
struct DecodeScratch {
  DecodeScratch(std::int64_t rows, std::int64_t dk_pad)
      : q(hwy::AllocateAligned<float>(static_cast<std::size_t>(rows * dk_pad))),
        s(hwy::AllocateAligned<float>(static_cast<std::size_t>(rows * kDecodeBlock))) {
    std::fill_n(q.get(), rows * dk_pad, 0.0f);
  }
  hwy::AlignedFreeUniquePtr<float[]> q, s;
};

// The key range [lo, hi) of row (query token t) of sequence b: causal
// bottom-right, and the left window.
struct RowRange {
  std::int64_t lo, hi;
};
inline RowRange DecodeRange(const DecodePlan& plan, std::int64_t length, std::int64_t t) {
  const std::int64_t pos = length - plan.n + t;
  std::int64_t lo = 0;
  if (plan.options->window_left >= 0)
    lo = std::max<std::int64_t>(0, pos - plan.options->window_left);
  return {lo, pos + 1};
}

template <class T>
void DecodeItemRun(DecodePlan& plan, const DecodeItem& item, DecodeScratch& sc) {
  const hn::ScalableTag<float> d;
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(d));
  const AttentionOptions& o = *plan.options;
  const KvCache& cache = *plan.cache;
  const std::int64_t hkv_count = plan.hkv;
  const std::int64_t rows = plan.rows;              // row r = h * n + t, all query heads
  const std::int64_t head_rows = rows / hkv_count;  // the rows of one KV head
  const std::int64_t dk = plan.dk, dv = plan.dv, dv_pad = plan.dv_pad;
  const std::int64_t dk_pad = (dk + lanes - 1) / lanes * lanes;
  const std::int64_t length = cache.length(item.b);
  const std::int64_t ps = cache.page_size();
  float* o_acc = plan.partial_o.data() + item.slot * rows * dv_pad;
  float* m = plan.partial_m.data() + item.slot * rows;
  float* l = plan.partial_l.data() + item.slot * rows;
  std::fill_n(o_acc, rows * dv_pad, 0.0f);
  std::fill_n(m, rows, kDecodeNegInf);
  std::fill_n(l, rows, 0.0f);

  // Scaled queries as f32 rows; the padding past dk stays zero.
  float* q = sc.q.get();
  for (std::int64_t h = 0; h < plan.hq; ++h) {
    for (std::int64_t t = 0; t < plan.n; ++t) {
      float* row = q + (h * plan.n + t) * dk_pad;
      for (std::int64_t c = 0; c < dk; ++c) {
        row[c] = static_cast<float>(plan.q.get({item.b, t, h, c})) * plan.scale;
      }
    }
  }
  std::vector<float> slopes(static_cast<std::size_t>(plan.hq), 0.0f);
  if (!o.alibi_slopes.empty()) {
    const bool per_batch = static_cast<std::int64_t>(o.alibi_slopes.size()) != plan.hq;
    for (std::int64_t h = 0; h < plan.hq; ++h) {
      slopes[static_cast<std::size_t>(h)] =
          o.alibi_slopes[static_cast<std::size_t>(per_batch ? item.b * plan.hq + h : h)];
    }
  }
  // Token j's keys (all KV heads, [Hkv][Dk]) and values ([Hkv][Dv]): a
  // token's row of the cache, contiguous, so the item streams its range.
  auto key_token = [&](std::int64_t j) {
    return static_cast<const T*>(cache.key_page(item.b, j / ps)) + (j % ps) * hkv_count * dk;
  };
  auto value_token = [&](std::int64_t j) {
    return static_cast<const T*>(cache.value_page(item.b, j / ps)) + (j % ps) * hkv_count * dv;
  };

  float* s = sc.s.get();
  for (std::int64_t j0 = item.begin; j0 < item.end; j0 += kDecodeBlock) {
    const std::int64_t cols = std::min(kDecodeBlock, item.end - j0);
    // Scores: each key row is read once and dotted with the query rows of
    // its KV head, four rows per loaded key vector.
    for (std::int64_t c = 0; c < cols; ++c) {
      const T* token = key_token(j0 + c);
      // The token's values, read below by KV head: fetched now so that the
      // value pass finds the block (<= 32 x Hkv x Dv) in L2.
      const auto* values = reinterpret_cast<const std::uint8_t*>(value_token(j0 + c));
      for (std::int64_t x = 0; x < hkv_count * dv * static_cast<std::int64_t>(sizeof(T)); x += 64) {
        hwy::Prefetch(values + x);
      }
      for (std::int64_t hk = 0; hk < hkv_count; ++hk) {
        const T* krow = token + hk * dk;
        std::int64_t r = hk * head_rows;
        const std::int64_t r_end = r + head_rows;
        for (; r + 4 <= r_end; r += 4) {
          auto a0 = hn::Zero(d), a1 = hn::Zero(d), a2 = hn::Zero(d), a3 = hn::Zero(d);
          std::int64_t x = 0;
          for (; x + lanes <= dk; x += lanes) {
            const auto kv = LoadWide<T>(d, krow + x);
            a0 = hn::MulAdd(kv, hn::Load(d, q + r * dk_pad + x), a0);
            a1 = hn::MulAdd(kv, hn::Load(d, q + (r + 1) * dk_pad + x), a1);
            a2 = hn::MulAdd(kv, hn::Load(d, q + (r + 2) * dk_pad + x), a2);
            a3 = hn::MulAdd(kv, hn::Load(d, q + (r + 3) * dk_pad + x), a3);
          }
          float tail[4] = {0.0f, 0.0f, 0.0f, 0.0f};
          for (; x < dk; ++x) {
            const float kx = Wide(krow[x]);
            for (int u = 0; u < 4; ++u) tail[u] += kx * q[(r + u) * dk_pad + x];
          }
          s[r * kDecodeBlock + c] = Sum(d, a0) + tail[0];
          s[(r + 1) * kDecodeBlock + c] = Sum(d, a1) + tail[1];
          s[(r + 2) * kDecodeBlock + c] = Sum(d, a2) + tail[2];
          s[(r + 3) * kDecodeBlock + c] = Sum(d, a3) + tail[3];
        }
        for (; r < r_end; ++r) {
          auto a = hn::Zero(d);
          std::int64_t x = 0;
          for (; x + lanes <= dk; x += lanes) {
            a = hn::MulAdd(LoadWide<T>(d, krow + x), hn::Load(d, q + r * dk_pad + x), a);
          }
          float tail = 0.0f;
          for (; x < dk; ++x) tail += Wide(krow[x]) * q[r * dk_pad + x];
          s[r * kDecodeBlock + c] = Sum(d, a) + tail;
        }
      }
    }
    // Biases, masks and the online softmax, row by row.
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t h = r / plan.n, t = r % plan.n;
      const RowRange range = DecodeRange(plan, length, t);
      const std::int64_t pos = length - plan.n + t;
      float* sr = s + r * kDecodeBlock;
      float block_max = kDecodeNegInf;
      for (std::int64_t c = 0; c < cols; ++c) {
        const std::int64_t j = j0 + c;
        float x = sr[c];
        if (o.softcap > 0.0) {
          const auto cap = static_cast<float>(o.softcap);
          x = cap * std::tanh(x / cap);
        }
        if (!o.alibi_slopes.empty()) {
          x -= slopes[static_cast<std::size_t>(h)] * static_cast<float>(std::llabs(pos - j));
        }
        if (j < range.lo || j >= range.hi) x = kDecodeNegInf;
        sr[c] = x;
        block_max = std::max(block_max, x);
      }
      const float m_new = std::max(m[r], block_max);
      if (m_new == kDecodeNegInf) {  // nothing admitted yet: weights 0
        std::fill_n(sr, cols, 0.0f);
        continue;
      }
      const float alpha = m[r] == kDecodeNegInf ? 0.0f : std::exp(m[r] - m_new);
      float sum = 0.0f;
      std::int64_t c = 0;
      const auto shift = hn::Set(d, m_new);
      for (; c + lanes <= cols; c += lanes) {
        const auto p = FastExp(d, hn::Sub(hn::LoadU(d, sr + c), shift));
        hn::StoreU(p, d, sr + c);
        sum += Sum(d, p);
      }
      for (; c < cols; ++c) {
        const hn::CappedTag<float, 1> d1;
        const auto p = FastExp(d1, hn::Sub(hn::LoadU(d1, sr + c), hn::Set(d1, m_new)));
        hn::StoreU(p, d1, sr + c);
        sum += hn::GetLane(p);
      }
      l[r] = alpha * l[r] + sum;
      m[r] = m_new;
      if (alpha != 1.0f) {
        float* orow = o_acc + r * dv_pad;
        for (std::int64_t x = 0; x < dv_pad; x += lanes) {
          hn::StoreU(hn::Mul(hn::LoadU(d, orow + x), hn::Set(d, alpha)), d, orow + x);
        }
      }
    }
    // O += P V: per KV head and column chunk, four rows' accumulators stay in
    // registers across the block's tokens, each widened value vector
    // serving the four.
    const T* tokens[kDecodeBlock];
    for (std::int64_t c = 0; c < cols; ++c) tokens[c] = value_token(j0 + c);
    for (std::int64_t hk = 0; hk < hkv_count; ++hk) {
      for (std::int64_t x = 0; x < dv_pad; x += lanes) {
        const bool full = x + lanes <= dv;
        for (std::int64_t r0 = hk * head_rows; r0 < (hk + 1) * head_rows; r0 += 4) {
          const std::int64_t tile = std::min<std::int64_t>(4, (hk + 1) * head_rows - r0);
          auto rows_tile = [&](auto kTile) {
            constexpr int kRows = decltype(kTile)::value;
            hn::Vec<decltype(d)> acc[kRows];
            for (int u = 0; u < kRows; ++u) acc[u] = hn::LoadU(d, o_acc + (r0 + u) * dv_pad + x);
            const float* p_rows = s + r0 * kDecodeBlock;
            // Masked keys have p = 0 (as in the forward kernel's P V).
            auto add = [&](std::int64_t c, hn::Vec<decltype(d)> vv) HWY_ATTR {
              for (int u = 0; u < kRows; ++u) {
                acc[u] = hn::MulAdd(hn::Set(d, p_rows[u * kDecodeBlock + c]), vv, acc[u]);
              }
            };
            if (full) {
              for (std::int64_t c = 0; c < cols; ++c)
                add(c, LoadWide<T>(d, tokens[c] + hk * dv + x));
            } else {
              for (std::int64_t c = 0; c < cols; ++c) {
                HWY_ALIGN float tmp[hn::MaxLanes(d)] = {};
                for (std::int64_t e = x; e < dv; ++e) tmp[e - x] = Wide(tokens[c][hk * dv + e]);
                add(c, hn::Load(d, tmp));
              }
            }
            for (int u = 0; u < kRows; ++u) hn::StoreU(acc[u], d, o_acc + (r0 + u) * dv_pad + x);
          };
          switch (tile) {
            case 4:
              rows_tile(std::integral_constant<int, 4>());
              break;
            case 3:
              rows_tile(std::integral_constant<int, 3>());
              break;
            case 2:
              rows_tile(std::integral_constant<int, 2>());
              break;
            default:
              rows_tile(std::integral_constant<int, 1>());
          }
        }
      }
    }
  }
}

inline void DecodeImpl(DecodePlan& plan) {
  const hn::ScalableTag<float> d;
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(d));
  const std::int64_t dk_pad = (plan.dk + lanes - 1) / lanes * lanes;
  const auto n = static_cast<std::int64_t>(plan.items.size());
  const DType storage = plan.cache->config().dtype;
  // Threads only when the step is worth waking them: a short cache decodes
  // in microseconds, less than a parallel region's start and barrier.
  std::int64_t work = 0;
  for (const DecodeItem& item : plan.items) {
    work += (item.end - item.begin) * plan.rows * (plan.dk + plan.dv);
  }
  constexpr std::int64_t kParallelWork = std::int64_t{1} << 22;
#pragma omp parallel if (work >= kParallelWork)
  {
    DecodeScratch sc(plan.rows, dk_pad);
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t i = 0; i < n; ++i) {
      const DecodeItem& item = plan.items[static_cast<std::size_t>(i)];
      if (storage == DType::f32) {
        DecodeItemRun<float>(plan, item, sc);
      } else if (storage == DType::bf16) {
        DecodeItemRun<hwy::bfloat16_t>(plan, item, sc);
      } else {
        DecodeItemRun<hwy::float16_t>(plan, item, sc);
      }
    }
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace qkv::cpu
HWY_AFTER_NAMESPACE();

#endif  // QKV_CPU_DECODE_INL_H_
