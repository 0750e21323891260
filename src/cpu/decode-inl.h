// The per-target body of decode attention (see decode.hpp). A work item
// streams its keys once: for each block of keys it computes the scores of
// every query row (all heads x the new tokens), updates the rows' running max
// and sum, and accumulates p V, widening the stored entries to f32 in
// registers. The cache comes as a plain view (cache/view.hpp) and its rows
// are read through the storage traits (cache/storage-inl.h): the kernel is
// one template over the keys' and the values' traits, whatever they store.
// A work item takes all KV heads of a range of tokens, so it reads the cache
// sequentially, token row after token row: one KV head alone would read D of
// every Hkv * D elements, a new page per key, and leave the hardware
// prefetchers and the TLB behind.
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
#include <optional>
#include <type_traits>
#include <vector>

#include "cache/storage-inl.h"
#include "core/hadamard.hpp"
#include "core/hwy_namespace.hpp"
#include "core/isa.hpp"
#include "core/softmax_epilogue.hpp"
#include "core/sparse.hpp"
#include "cpu/bf16_dot-inl.h"
#include "cpu/decode.hpp"
#include "cpu/decode_engine-inl.h"
#include "cpu/row_sums-inl.h"
#include "cpu/score_mods-inl.h"
#include "cpu/vec_math-inl.h"
#include "hwy/aligned_allocator.h"
#include "hwy/cache_control.h"
#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"

QKV_HWY_NAMESPACE_BEGIN(cpu);

// Keys per block: their scores for up to 64 rows stay in L1.
constexpr std::int64_t kDecodeBlock = 32;
// Tokens per step of the value pass. Its tiles read one line per token at
// a time, Hkv * Dv elements apart: eight interleaved token rows still look
// sequential enough to the hardware prefetchers (all 32 of a block, or 16,
// measured slower, up to 1.7x), and the accumulators' load and store per
// step stay cheap against 8 tokens of FMAs (4 and 2 measured slower).
constexpr std::int64_t kValueGroup = 8;

// Scores of kRows consecutive query rows (q, dk_pad apart) against kTokens
// keys of dk values: out[t * out_stride + u] = q_u . keys[t] (kAccumulate:
// +=). Each key vector is widened once for the kRows rows; the kRows x
// kTokens sums are reduced together.
// Not inlined, with the query vectors pinned in registers: inside the item
// loop GCC folded a load of each query vector into every FMA that used it
// (10 loads per 8 FMAs; now 6). With the cache in L3 (L = 1024, one thread)
// an f16 call went from 0.378 to 0.356 ms.
template <int kRows, int kTokens, class Traits, bool kAccumulate = false, class D>
HWY_NOINLINE void ScoreTile(D d, const float* HWY_RESTRICT q, std::int64_t dk_pad,
                            const typename Traits::Stored* const* keys, std::int64_t dk,
                            float* HWY_RESTRICT out, std::int64_t out_stride) {
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(d));
  hn::Vec<D> acc[kTokens][kRows];
  for (int t = 0; t < kTokens; ++t) {
    for (int u = 0; u < kRows; ++u) acc[t][u] = hn::Zero(d);
  }
  std::int64_t x = 0;
  if constexpr (Traits::kBlock > 1) {
    // Blocks (dk is a multiple of kBlock, itself of the lanes): each token's
    // block is addressed and its scale widened once for the block's
    // vectors, whose offsets in it are then constants (the loads' address
    // arithmetic took as many instructions as the FMAs).
    using T = typename Traits::Stored;
    constexpr std::int64_t kLanes = static_cast<std::int64_t>(hn::MaxLanes(D()));
    constexpr std::int64_t kPerBlock = Traits::kBlock / kLanes;
    for (; x < dk; x += Traits::kBlock) {
      const T* block[kTokens];
      hn::Vec<D> scale[kTokens];
      for (int t = 0; t < kTokens; ++t) {
        block[t] = keys[t] + x / Traits::kBlock;
        scale[t] = Traits::Scale(d, block[t], 0);
      }
      for (std::int64_t v = 0; v < kPerBlock; ++v) {
        hn::Vec<D> qv[kRows];
        for (int u = 0; u < kRows; ++u) {
          qv[u] = hn::Load(d, q + u * dk_pad + x + v * kLanes);
          KeepInRegister(qv[u]);
        }
        for (int t = 0; t < kTokens; ++t) {
          const auto kv = hn::Mul(Traits::LoadUnscaled(d, block[t], v * kLanes), scale[t]);
          for (int u = 0; u < kRows; ++u) acc[t][u] = hn::MulAdd(kv, qv[u], acc[t][u]);
        }
      }
    }
  }
  for (; x + lanes <= dk; x += lanes) {
    hn::Vec<D> qv[kRows];
    for (int u = 0; u < kRows; ++u) {
      qv[u] = hn::Load(d, q + u * dk_pad + x);
      KeepInRegister(qv[u]);
    }
    for (int t = 0; t < kTokens; ++t) {
      const auto kv = Traits::Load(d, keys[t], x);
      for (int u = 0; u < kRows; ++u) acc[t][u] = hn::MulAdd(kv, qv[u], acc[t][u]);
    }
  }
  // Past dk the key row holds the next head: the last partial vector is
  // summed in scalars, onto out's scores where accumulating.
  HWY_ALIGN float scalar[kTokens][4] = {};
  if constexpr (kAccumulate) {
    for (int t = 0; t < kTokens; ++t) {
      for (int u = 0; u < kRows; ++u) scalar[t][u] = out[t * out_stride + u];
    }
  }
  for (; x < dk; ++x) {
    for (int t = 0; t < kTokens; ++t) {
      const float kx = Traits::LoadOne(keys[t], x);
      for (int u = 0; u < kRows; ++u) scalar[t][u] += kx * q[u * dk_pad + x];
    }
  }
  StoreScoreSums<kRows, kTokens>(d, acc, scalar, out, out_stride);
}

// O[u][k * lanes ...] += sum_c p[c * p_stride + u] * values[c][k * lanes ...]
// for kRows rows and kVecs vectors of columns: the accumulators stay in
// registers across the block's tokens, each widened value vector serves
// every row and each broadcast weight every column vector.
template <int kRows, int kVecs, class Traits, class D>
HWY_INLINE void ValueTile(D d, const float* HWY_RESTRICT p, std::int64_t p_stride,
                          const typename Traits::Stored* const* values, std::int64_t offset,
                          std::int64_t cols, float* HWY_RESTRICT o, std::int64_t o_stride) {
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(d));
  hn::Vec<D> acc[kRows][kVecs];
  for (int u = 0; u < kRows; ++u) {
    for (int k = 0; k < kVecs; ++k) acc[u][k] = hn::LoadU(d, o + u * o_stride + k * lanes);
  }
  for (std::int64_t c = 0; c < cols; ++c) {
    hn::Vec<D> vv[kVecs];
    if constexpr (Traits::kBlock > 1) {
      // The tile's kVecs vectors lie in one block (offset is a multiple of
      // kVecs * lanes, which divides kBlock): one scale for them all.
      const auto* block = values[c] + offset / Traits::kBlock;
      const std::int64_t in_block = offset % Traits::kBlock;
      const auto scale = Traits::Scale(d, block, 0);
      for (int k = 0; k < kVecs; ++k) {
        vv[k] = hn::Mul(Traits::LoadUnscaled(d, block, in_block + k * lanes), scale);
      }
    } else {
      for (int k = 0; k < kVecs; ++k) vv[k] = Traits::Load(d, values[c], offset + k * lanes);
    }
    for (int u = 0; u < kRows; ++u) {
      const auto pu = hn::Set(d, p[c * p_stride + u]);
      for (int k = 0; k < kVecs; ++k) acc[u][k] = hn::MulAdd(pu, vv[k], acc[u][k]);
    }
  }
  for (int u = 0; u < kRows; ++u) {
    for (int k = 0; k < kVecs; ++k) hn::StoreU(acc[u][k], d, o + u * o_stride + k * lanes);
  }
}

// Prefetches the line at p into L2 (x86: prefetcht1).
HWY_INLINE void PrefetchToL2(const void* p) {
#if HWY_COMPILER_GCC_ACTUAL || HWY_COMPILER_CLANG
  __builtin_prefetch(p, /*rw=*/0, /*locality=*/2);
#else
  hwy::Prefetch(p);
#endif
}

// Prefetches the lines of up to kDecodeBlock token rows (row_bytes each), a
// few lines per call: called once per tile of a pass, it spreads the next
// block's fetches over this block's arithmetic, so that misses stay in flight
// throughout instead of arriving in bursts that fill the miss buffers. The
// lines go to L2, not L1: a block's keys and values (64 KiB of f16 at Hkv = 8,
// D = 128) do not fit L1 beside the block being read, and fetched into L1
// they were evicted before use (AVX-512 Zen 4: the f16 cache at L = 131072
// went from 61% to 78% of the read bandwidth, f32 from 63% to 90-96%).
struct LineStream {
  const std::uint8_t* rows[kDecodeBlock];
  std::int64_t count = 0;      // rows
  std::int64_t row_bytes = 0;  // bytes per row
  std::int64_t per_call = 0;   // lines per call of Next
  std::int64_t c = 0, x = 0;   // the next line: row c, byte x

  // Lines spread over `calls` calls.
  template <class T>
  void Start(const T* const* row_ptrs, std::int64_t n, std::int64_t bytes, std::int64_t calls) {
    count = n;
    row_bytes = bytes;
    for (std::int64_t r = 0; r < n; ++r)
      rows[r] = reinterpret_cast<const std::uint8_t*>(row_ptrs[r]);
    const std::int64_t lines = n * ((bytes + 63) / 64);
    per_call = calls > 0 ? (lines + calls - 1) / calls : lines;
    c = x = 0;
  }
  HWY_INLINE void Next() {
    for (std::int64_t i = 0; i < per_call && c < count; ++i) {
      PrefetchToL2(rows[c] + x);
      x += 64;
      if (x >= row_bytes) {
        x = 0;
        ++c;
      }
    }
  }
};

// Calls f(std::integral_constant<int, k>) for k = n in 1..4.
template <class F>
HWY_INLINE void WithRows(std::int64_t n, F&& f) {
  switch (n) {
    case 4:
      f(std::integral_constant<int, 4>());
      break;
    case 3:
      f(std::integral_constant<int, 3>());
      break;
    case 2:
      f(std::integral_constant<int, 2>());
      break;
    default:
      f(std::integral_constant<int, 1>());
  }
}

// Per-thread buffers, rows padded to whole vectors: block scores and weights
// s [kDecodeBlock][rows_pad] (a token's row holds every query row, so the
// softmax runs down the rows), running max m, sum l and rescale factor
// alpha [rows_pad].
struct DecodeScratch {
  explicit DecodeScratch(std::int64_t rows_pad)
      : s(Allocate<float>(kDecodeBlock * rows_pad)),
        m(Allocate<float>(rows_pad)),
        l(Allocate<float>(rows_pad)),
        alpha(Allocate<float>(rows_pad)),
        p2(Allocate<std::uint32_t>(kDecodeBlock / 2 * rows_pad)) {}
  template <class T>
  static hwy::AlignedFreeUniquePtr<T[]> Allocate(std::int64_t n) {
    auto p = hwy::AllocateAligned<T>(static_cast<std::size_t>(n));
    std::fill_n(p.get(), n, T{0});
    return p;
  }
  hwy::AlignedFreeUniquePtr<float[]> s, m, l, alpha;
  // bf16 value tiles: the weights by pairs of tokens [kDecodeBlock / 2][rows_pad]
  hwy::AlignedFreeUniquePtr<std::uint32_t[]> p2;
};

// Where the products run on bf16 dot products (cpu/bf16_dot-inl.h):
// MatmulPrecision::medium on a CPU with AVX512-BF16, for bf16 rows; or, with
// many rows per KV head, as a small GEMM on a bf16 engine
// (cpu/decode_engine-inl.h).
struct DotPlan {
  const std::uint16_t* q16 = nullptr;  // the sequences' query rows in bf16 for the scores; or none
  bool values = false;                 // P V on bf16 products
  std::optional<engines::Bf16Engine> engine;     // both products on this engine; or none
  const DecodeEngineQueries* queries = nullptr;  // engine: the sequence's query operands
  DecodeEngineScratch* scratch = nullptr;        // engine: this thread's block operands
};

// The shape of one work item's tiles: rows r = h * n + t over all query
// heads, head_rows = rows / Hkv per KV head; scores s[c][r] with row stride
// rows_pad; queries [rows][dk_pad]; the output accumulator [rows][dv_pad];
// key_head bytes per head's key row, of which a latent row's last `tail`
// values lie from byte tail_at in tail_storage (cache::KvView::tail_dim).
struct ItemShape {
  std::int64_t lanes, hkv, rows, head_rows, rows_pad, dk, dk_pad, dv, dv_pad;
  std::int64_t key_head, tail, tail_at;
  KvStorage tail_storage;
};

// Adds to the scores of kRows rows against kTokens key rows (rows[t]: a
// head's row as bytes) their tails' products; q is the rows' tail part.
template <int kRows, int kTokens, class D>
HWY_INLINE void TailScores(D d, const ItemShape& sh, const float* HWY_RESTRICT q,
                           const std::byte* const* rows, float* HWY_RESTRICT out) {
  const auto run = [&](auto traits) {
    using Traits = decltype(traits);
    const typename Traits::Stored* tails[kTokens];
    for (int t = 0; t < kTokens; ++t) {
      tails[t] = reinterpret_cast<const typename Traits::Stored*>(rows[t] + sh.tail_at);
    }
    ScoreTile<kRows, kTokens, Traits, true>(d, q, sh.dk_pad, tails, sh.tail, out, sh.rows_pad);
  };
  if (sh.tail_storage == KvStorage::f16) {
    run(cache::HWY_NAMESPACE::StorageTraits<hwy::float16_t>{});
  } else {
    run(cache::HWY_NAMESPACE::StorageTraits<hwy::bfloat16_t>{});
  }
}

// Scores of a block's `cols` tokens, s[c][r] = <q_r, k_c>: two keys at a
// time against four rows of their KV head, prefetching the next block's
// keys through next_keys; with q16 (the rows in bf16: bf16 keys under
// MatmulPrecision::medium, see DotPlan) on bf16 dot products. A key row
// with a tail (blocks only) is scored over its blocks, then its tail added
// (TailScores); the tail starts at a multiple of 32 values, so the queries'
// vectors there stay aligned.
template <class Traits>
void BlockScores(const ItemShape& sh, const float* HWY_RESTRICT q, const std::uint16_t* q16,
                 const typename Traits::Stored* const* keys, std::int64_t cols,
                 LineStream& next_keys, float* HWY_RESTRICT s) {
  using T = typename Traits::Stored;
  const hn::ScalableTag<float> d;
  const std::int64_t lead = sh.dk - sh.tail;  // values in Traits' storage
  for (std::int64_t c = 0; c < cols; c += 2) {
    const std::int64_t pair = std::min<std::int64_t>(2, cols - c);
    for (std::int64_t hk = 0; hk < sh.hkv; ++hk) {
      const std::byte* rows[2] = {
          reinterpret_cast<const std::byte*>(keys[c]) + hk * sh.key_head,
          reinterpret_cast<const std::byte*>(keys[c + pair - 1]) + hk * sh.key_head};
      const T* krows[2] = {reinterpret_cast<const T*>(rows[0]),
                           reinterpret_cast<const T*>(rows[1])};
      for (std::int64_t r = hk * sh.head_rows; r < (hk + 1) * sh.head_rows; r += 4) {
        WithRows(std::min<std::int64_t>(4, (hk + 1) * sh.head_rows - r), [&](auto kRows) {
          constexpr int kR = decltype(kRows)::value;
          float* out = s + c * sh.rows_pad + r;
          const float* qr = q + r * sh.dk_pad;
          next_keys.Next();
          if constexpr (kBf16Dot && std::is_same_v<T, hwy::bfloat16_t>) {
            if (q16 != nullptr) {
              const auto* const* k16 = reinterpret_cast<const std::uint16_t* const*>(krows);
              const std::uint16_t* q16r = q16 + r * sh.dk_pad;
              if (pair == 2) {
                ScoreTileBf16<kR, 2>(q16r, sh.dk_pad, k16, lead, out, sh.rows_pad);
              } else {
                ScoreTileBf16<kR, 1>(q16r, sh.dk_pad, k16, lead, out, sh.rows_pad);
              }
              return;
            }
          }
          if (pair == 2) {
            ScoreTile<kR, 2, Traits>(d, qr, sh.dk_pad, krows, lead, out, sh.rows_pad);
          } else {
            ScoreTile<kR, 1, Traits>(d, qr, sh.dk_pad, krows, lead, out, sh.rows_pad);
          }
          if constexpr (Traits::kBlock > 1) {
            if (sh.tail > 0) {
              if (pair == 2) {
                TailScores<kR, 2>(d, sh, qr + lead, rows, out);
              } else {
                TailScores<kR, 1>(d, sh, qr + lead, rows, out);
              }
            }
          }
        });
      }
    }
  }
}

// The biases decode takes (the seam's ModifyScore), the key ranges of
// causal and the window, and the sparse pattern (of positions: query row t
// of the call at position pos), on a block of tokens [j0, j0 + cols) of a
// sequence holding `length` tokens; slopes per query head.
inline void BlockModifyAndMask(const DecodePlan& plan, const ItemShape& sh, std::int64_t length,
                               std::int64_t j0, std::int64_t cols, bool alibi,
                               const std::vector<float>& slopes, float* HWY_RESTRICT s) {
  const KernelParams& o = plan.params;
  std::uint8_t keep[kDecodeBlock];
  for (std::int64_t r = 0; r < sh.rows; ++r) {
    const std::int64_t h = r / plan.n, t = r % plan.n;
    const detail::KeyRange range = decode_key_range(plan, length, t);
    const std::int64_t pos = decode_position(plan, length, t);
    for (std::int64_t c = 0; c < cols; ++c) {
      const std::int64_t j = j0 + c;
      float& x = s[c * sh.rows_pad + r];
      x = ModifyScore(x, o.softcap, alibi, slopes[static_cast<std::size_t>(h)], pos, j);
      if (j < range.lo || j >= range.hi) x = kNegInf;
    }
    if (o.sparse.defined()) {
      const detail::PatternTile tile{h, t, 1, pos, j0, cols};
      if (detail::coverage(o.sparse, tile) != detail::Coverage::all) {
        detail::fill_admitted(o.sparse, tile, keep);
        for (std::int64_t c = 0; c < cols; ++c) {
          if (keep[c] == 0) s[c * sh.rows_pad + r] = kNegInf;
        }
      }
    }
  }
}

// Calls tile(g0, gcols, hk, r) for each group of kValueGroup of a block's
// `cols` tokens (from g0, gcols of them), each KV head hk and each tile of
// up to four of its query rows (from r): the value passes' order, which
// reads one line per token at a time, Hkv * Dv elements apart.
template <class F>
HWY_INLINE void ForEachValueTile(const ItemShape& sh, std::int64_t cols, F&& tile) {
  for (std::int64_t g0 = 0; g0 < cols; g0 += kValueGroup) {
    const std::int64_t gcols = std::min(kValueGroup, cols - g0);
    for (std::int64_t hk = 0; hk < sh.hkv; ++hk) {
      for (std::int64_t r = hk * sh.head_rows; r < (hk + 1) * sh.head_rows; r += 4) {
        tile(g0, gcols, hk, r);
      }
    }
  }
}

// O += P V for a block's `cols` tokens, per KV head, kValueGroup tokens at
// a time: tiles of four rows x two vectors of columns, the columns past the
// last whole vector in scalars, prefetching the next block's values
// through next_values.
template <class Traits>
void BlockValues(const ItemShape& sh, const float* HWY_RESTRICT s,
                 const typename Traits::Stored* const* values, std::int64_t cols,
                 LineStream& next_values, float* HWY_RESTRICT o_acc) {
  const hn::ScalableTag<float> d;
  const std::int64_t lanes = sh.lanes, dv = sh.dv, dv_pad = sh.dv_pad, rows_pad = sh.rows_pad;
  const std::int64_t full = dv / lanes * lanes;
  ForEachValueTile(
      sh, cols, [&](std::int64_t g0, std::int64_t gcols, std::int64_t hk, std::int64_t r) {
        const float* sg = s + g0 * rows_pad;
        const auto* vg = values + g0;
        WithRows(std::min<std::int64_t>(4, (hk + 1) * sh.head_rows - r), [&](auto kRows) {
          constexpr int kR = decltype(kRows)::value;
          std::int64_t x = 0;
          for (; x + 2 * lanes <= full; x += 2 * lanes) {
            next_values.Next();
            ValueTile<kR, 2, Traits>(d, sg + r, rows_pad, vg, hk * dv + x, gcols,
                                     o_acc + r * dv_pad + x, dv_pad);
          }
          if (x < full) {
            next_values.Next();
            ValueTile<kR, 1, Traits>(d, sg + r, rows_pad, vg, hk * dv + x, gcols,
                                     o_acc + r * dv_pad + x, dv_pad);
          }
        });
        // Columns past the last whole vector, in scalars.
        const std::int64_t row_end = std::min((hk + 1) * sh.head_rows, r + 4);
        for (std::int64_t e = full; e < dv; ++e) {
          for (std::int64_t rr = r; rr < row_end; ++rr) {
            float sum = o_acc[rr * dv_pad + e];
            for (std::int64_t c = 0; c < gcols; ++c) {
              sum += sg[c * rows_pad + rr] * Traits::LoadOne(vg[c], hk * dv + e);
            }
            o_acc[rr * dv_pad + e] = sum;
          }
        }
      });
}

// BlockValues on bf16 products (cpu/bf16_dot-inl.h) for bf16 value rows:
// dv a multiple of 32, the weights packed by pairs in p2, o_acc's chunks of
// 32 columns permuted.
inline void BlockValuesBf16(const ItemShape& sh, const std::uint32_t* HWY_RESTRICT p2,
                            const hwy::bfloat16_t* const* values, std::int64_t cols,
                            LineStream& next_values, float* HWY_RESTRICT o_acc) {
  const auto* const* v16 = reinterpret_cast<const std::uint16_t* const*>(values);
  ForEachValueTile(
      sh, cols, [&](std::int64_t g0, std::int64_t gcols, std::int64_t hk, std::int64_t r) {
        const std::uint32_t* pg = p2 + g0 / 2 * sh.rows_pad + r;
        float* o = o_acc + r * sh.dv_pad;
        WithRows(std::min<std::int64_t>(4, (hk + 1) * sh.head_rows - r), [&](auto kRows) {
          constexpr int kR = decltype(kRows)::value;
          std::int64_t x = 0;
          for (; x + 2 * kBf16Chunk <= sh.dv; x += 2 * kBf16Chunk) {
            next_values.Next();
            next_values.Next();
            ValueTileBf16<kR, 2>(pg, sh.rows_pad, v16 + g0, hk * sh.dv + x, gcols, o + x,
                                 sh.dv_pad);
          }
          if (x < sh.dv) {
            next_values.Next();
            ValueTileBf16<kR, 1>(pg, sh.rows_pad, v16 + g0, hk * sh.dv + x, gcols, o + x,
                                 sh.dv_pad);
          }
        });
      });
}

// One work item of a cache whose keys are stored as KTraits says and its
// values as VTraits. q holds the sequence's scaled query rows [rows][dk_pad].
template <class KTraits, class VTraits>
void DecodeItemRun(DecodePlan& plan, const DecodeItem& item, const float* HWY_RESTRICT q,
                   const DotPlan& dot, DecodeScratch& sc) {
  const hn::ScalableTag<float> d;
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(d));
  using KT = typename KTraits::Stored;
  using VT = typename VTraits::Stored;
  const KernelParams& o = plan.params;
  const cache::KvView& cache = *plan.cache;
  // Bytes of a token's keys [Hkv, Dk] and values [Hkv, Dv] (a latent
  // cache's values: the key rows, in the same storage).
  const std::int64_t key_bytes = cache.key_token_bytes;
  const std::int64_t value_bytes = cache.value_token_bytes;
  const ItemShape sh{.lanes = lanes,
                     .hkv = plan.hkv,
                     .rows = plan.rows,
                     .head_rows = plan.rows / plan.hkv,
                     .rows_pad = RoundUp(plan.rows, lanes),
                     .dk = plan.dk,
                     .dk_pad = RoundUp(plan.dk, lanes),
                     .dv = plan.dv,
                     .dv_pad = plan.dv_pad,
                     .key_head = key_bytes / plan.hkv,
                     .tail = cache.tail_dim,
                     .tail_at = stored_bytes(cache.key_storage, plan.dk - cache.tail_dim),
                     .tail_storage = cache.tail_storage};
  const std::int64_t length = cache.length(item.b);
  const std::int64_t ps = cache.page_size;
  float* o_acc = plan.partial_o.data() + item.slot * sh.rows * sh.dv_pad;
  float* m = sc.m.get();
  float* l = sc.l.get();
  float* alpha = sc.alpha.get();
  std::fill_n(o_acc, sh.rows * sh.dv_pad, 0.0f);
  std::fill_n(m, sh.rows_pad, kNegInf);
  std::fill_n(l, sh.rows_pad, 0.0f);

  std::vector<float> slopes(static_cast<std::size_t>(plan.hq), 0.0f);
  if (!o.alibi_slopes.empty()) {
    for (std::int64_t h = 0; h < plan.hq; ++h) {
      slopes[static_cast<std::size_t>(h)] = o.slope(item.b, h, plan.hq);
    }
  }
  // Blocks inside every row's range need no mask: keys from the largest
  // window start up to the first row's position.
  std::int64_t open_lo = 0;
  for (std::int64_t t = 0; t < plan.n; ++t) {
    open_lo = std::max(open_lo, decode_key_range(plan, length, t).lo);
  }
  const std::int64_t open_hi = decode_key_range(plan, length, 0).hi;
  const bool alibi = !o.alibi_slopes.empty();
  const bool transform = o.softcap > 0.0 || alibi || o.sparse.defined();

  // Token j's keys (all KV heads, [Hkv][Dk]) and values ([Hkv][Dv]) are a
  // token's row of the cache, contiguous, so the item streams its range.
  // The page of a block's first token is looked up once; the rows after it
  // follow within the page.
  auto token_rows = [&](std::int64_t j0, std::int64_t cols, const KT** keys, const VT** values) {
    std::int64_t page = j0 / ps, row = j0 % ps;
    for (std::int64_t c = 0; c < cols; ++page, row = 0) {
      const std::byte* k = cache.key_page(item.b, page);
      const std::byte* v = cache.value_page(item.b, page);
      for (; row < ps && c < cols; ++row, ++c) {
        keys[c] = reinterpret_cast<const KT*>(k + row * key_bytes);
        values[c] = reinterpret_cast<const VT*>(v + row * value_bytes);
      }
    }
  };

  float* s = sc.s.get();
  const KT* keys[kDecodeBlock];
  const VT* values[kDecodeBlock];
  // The next block's keys are fetched during this block's score pass and
  // its values during the value pass, a few lines per tile (LineStream),
  // instead of in bursts: on AVX2 (2026-12-04), for the f16 cache, eight of
  // nine paired comparisons at L = 32768 and 131072 gained, +4 points of the
  // read bandwidth on average; into L2 since (see LineStream), every storage
  // streams so, f32 included.
  const std::int64_t tiles_per_head = (sh.head_rows + 3) / 4;
  LineStream next_keys, next_values;
  for (std::int64_t j0 = item.begin; j0 < item.end; j0 += kDecodeBlock) {
    const std::int64_t cols = std::min(kDecodeBlock, item.end - j0);
    token_rows(j0, cols, keys, values);
    const KT* ahead_keys[kDecodeBlock];
    const VT* ahead_values[kDecodeBlock];
    const std::int64_t ahead = std::min(kDecodeBlock, item.end - j0 - cols);
    if (ahead > 0) token_rows(j0 + cols, ahead, ahead_keys, ahead_values);
    const std::int64_t score_tiles = (cols + 1) / 2 * sh.hkv * tiles_per_head;
    const std::int64_t value_tiles = (cols + kValueGroup - 1) / kValueGroup * sh.hkv *
                                     tiles_per_head * ((sh.dv + 2 * lanes - 1) / (2 * lanes));
    const bool per_token = dot.engine.has_value();  // the engine's packing calls per token and head
    next_keys.Start(ahead_keys, std::max<std::int64_t>(ahead, 0), key_bytes,
                    per_token ? cols * sh.hkv : score_tiles);
    next_values.Start(ahead_values, std::max<std::int64_t>(ahead, 0), value_bytes,
                      per_token ? cols * sh.hkv : value_tiles);
    constexpr bool kBf16Rows =
        std::is_same_v<KT, hwy::bfloat16_t> && std::is_same_v<VT, hwy::bfloat16_t>;
    const bool engine = kBf16Rows && dot.engine.has_value();
    if constexpr (kBf16Rows) {
      if (engine) {
        for (std::int64_t hk = 0; hk < sh.hkv; ++hk) {
          HeadScoresEngine(
              *dot.engine, sh, hk, dot.queries->head(hk), keys, cols, [&] { next_keys.Next(); },
              *dot.scratch, s);
        }
      }
    }
    if (!engine) BlockScores<KTraits>(sh, q, dot.q16, keys, cols, next_keys, s);
    // Biases and masks, only where a block needs them.
    if (transform || j0 < open_lo || j0 + cols > open_hi) {
      BlockModifyAndMask(plan, sh, length, j0, cols, alibi, slopes, s);
    }
    // Online softmax, a vector of rows at a time (padding rows included).
    OnlineSoftmaxBlock(s, sh.rows_pad, cols, sh.rows_pad, m, l, alpha);
    RescaleRows(o_acc, sh.rows, sh.dv_pad, sh.dv_pad, alpha);
    if constexpr (kBf16Rows) {
      if (engine) {
        for (std::int64_t hk = 0; hk < sh.hkv; ++hk) {
          HeadValuesEngine(
              *dot.engine, sh, hk, s, values, cols, [&] { next_values.Next(); }, *dot.scratch,
              o_acc);
        }
        continue;
      }
    }
    if constexpr (kBf16Dot && std::is_same_v<VT, hwy::bfloat16_t>) {
      if (dot.values) {
        PackWeightPairs(s, sh.rows_pad, cols, sh.rows_pad, sc.p2.get());
        BlockValuesBf16(sh, sc.p2.get(), values, cols, next_values, o_acc);
        continue;
      }
    }
    BlockValues<VTraits>(sh, s, values, cols, next_values, o_acc);
  }
  if (dot.values) {
    for (std::int64_t r = 0; r < sh.rows; ++r) UnpermuteChunks(o_acc + r * sh.dv_pad, sh.dv);
  }
  std::copy_n(m, sh.rows, plan.partial_m.data() + item.slot * sh.rows);
  std::copy_n(l, sh.rows, plan.partial_l.data() + item.slot * sh.rows);
}

// Merges the splits of each sequence in key order and finishes the rows
// (core/softmax_epilogue.hpp).
inline void DecodeMerge(DecodePlan& plan) {
  const Floats row = AllocFloats(plan.dv);
  const std::span<const float> sinks = plan.params.sinks;
  for (std::size_t first = 0; first < plan.items.size();
       first += static_cast<std::size_t>(plan.splits)) {
    const std::int64_t b = plan.items[first].b;
    for (std::int64_t r = 0; r < plan.rows; ++r) {
      const std::int64_t h = r / plan.n, t = r % plan.n;
      const float lse = detail::merge_softmax_parts<float>(
          plan.splits, plan.dv,
          [&](std::int64_t s) {
            const std::size_t slot = (first + static_cast<std::size_t>(s)) * plan.rows + r;
            return detail::SoftmaxPart<float>{plan.partial_m[slot], plan.partial_l[slot],
                                              plan.partial_o.data() + slot * plan.dv_pad};
          },
          row.get(), detail::sink_of<float>(sinks.data(), sinks.size(), h));
      if (plan.cache->rotated) detail::hadamard(row.get(), plan.dv);  // back from the rotation
      StoreViewRow(row.get(), plan.dv, plan.out, b, t, h);
      if (plan.lse.defined()) plan.lse.set({b, h, t}, lse);
    }
  }
}

// Calls f(KTraits{}, VTraits{}) for the storage of the keys and of the
// values (each of the five, in any pair).
template <class F>
void WithCacheTraits(KvStorage keys, KvStorage values, F&& f) {
  using cache::HWY_NAMESPACE::WithStorage;
  WithStorage(keys, [&](auto k) { WithStorage(values, [&](auto v) { f(k, v); }); });
}

inline void DecodeImpl(DecodePlan& plan) {
  const hn::ScalableTag<float> d;
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(d));
  const std::int64_t dk_pad = RoundUp(plan.dk, lanes);
  const std::int64_t rows_pad = RoundUp(plan.rows, lanes);
  const auto n = static_cast<std::int64_t>(plan.items.size());
  const KvStorage key_storage = plan.cache->key_storage;
  const KvStorage value_storage = plan.cache->value_storage;
  // Every sequence's scaled query rows [B][rows][dk_pad], converted once
  // for all its splits; the padding past dk stays zero.
  const Floats q = AllocFloats(plan.batch * plan.rows * dk_pad);
  for (std::int64_t b = 0; b < plan.batch; ++b) {
    for (std::int64_t r = 0; r < plan.rows; ++r) {
      const std::int64_t h = r / plan.n, t = r % plan.n;
      float* row = q.get() + (b * plan.rows + r) * dk_pad;
      LoadStridedRowF32(At(plan.q, b, t, h), plan.q.dtype(), plan.dk, plan.q.stride(3), row);
      if (plan.cache->rotated) detail::hadamard(row, plan.dk);  // as the cached keys
      for (std::int64_t c = 0; c < plan.dk; ++c) row[c] *= plan.scale;
    }
  }
  // bf16 products where allowed and the rows are bf16 (a latent cache's
  // values are its key rows), in chunks of 32 (cpu/bf16_dot-inl.h).
  DotPlan dot;
  // Many rows per KV head: the small GEMM on an engine, which then takes
  // both products.
  dot.engine = DecodeEngine(plan);
  const std::int64_t head_rows = plan.rows / plan.hkv;
  std::vector<DecodeEngineQueries> queries;
  if (dot.engine) {
    for (std::int64_t b = 0; b < plan.batch; ++b) {
      queries.emplace_back(q.get() + b * plan.rows * dk_pad, plan.hkv, head_rows, plan.dk, dk_pad);
    }
  }
  std::vector<std::uint16_t> q16;
  if (kBf16Dot && !dot.engine && plan.params.matmul_precision != MatmulPrecision::highest &&
      detail::has_bf16_dot()) {
    const KvStorage values_storage = plan.cache->values_in_keys ? key_storage : value_storage;
    if (key_storage == KvStorage::bf16 && plan.dk % kBf16Chunk == 0) {
      q16.resize(static_cast<std::size_t>(plan.batch * plan.rows * dk_pad));
      StoreRowFromF32(q.get(), static_cast<std::int64_t>(q16.size()), q16.data(), DType::bf16);
      dot.q16 = q16.data();
    }
    dot.values = values_storage == KvStorage::bf16 && plan.dv % kBf16Chunk == 0;
  }
  detail::note_products_isa(dot.engine                         ? engines::engine_name(*dot.engine)
                            : dot.q16 != nullptr || dot.values ? "avx512_bf16"
                                                               : "f32");
  // Threads only when the step is worth waking them: a short cache decodes
  // in microseconds, less than a parallel region's start and barrier.
  std::int64_t work = 0;
  for (const DecodeItem& item : plan.items) {
    work += (item.end - item.begin) * plan.rows * (plan.dk + plan.dv);
  }
  constexpr std::int64_t kParallelWork = std::int64_t{1} << 22;
#pragma omp parallel if (work >= kParallelWork)
  {
    DecodeScratch sc(rows_pad);
    std::optional<DecodeEngineScratch> es;
    if (dot.engine) es.emplace(kDecodeBlock, plan.dk, plan.dv, RoundUp(head_rows, 16));
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t i = 0; i < n; ++i) {
      const DecodeItem& item = plan.items[static_cast<std::size_t>(i)];
      const float* q_item = q.get() + item.b * plan.rows * dk_pad;
      DotPlan dot_item = dot;
      if (dot.q16 != nullptr) dot_item.q16 = dot.q16 + item.b * plan.rows * dk_pad;
      if (dot.engine) {
        dot_item.queries = &queries[static_cast<std::size_t>(item.b)];
        dot_item.scratch = &*es;
      }
      WithCacheTraits(key_storage, value_storage, [&](auto k, auto v) {
        DecodeItemRun<decltype(k), decltype(v)>(plan, item, q_item, dot_item, sc);
      });
    }
  }
  DecodeMerge(plan);
}

QKV_HWY_NAMESPACE_END(cpu);

#endif  // QKV_CPU_DECODE_INL_H_
