// Decode as a small GEMM on a bf16 engine (cpu/engines/): where a KV head
// has many query rows (several new tokens per sequence, or many query
// heads per KV head as in MLA) and the cache is bf16, under
// MatmulPrecision::medium, each block's products are two tile products per
// KV head instead of dot products per row:
//   S^T[keys][rows] = K[keys][Dk] . Q^T      (A: the keys, B: the rows)
//   O[rows][Dv]    += P[rows][keys] . V      (A: the weights, B: the values)
// the query rows of one KV head (its query heads x the new tokens) being
// the columns of the first product and the rows of the second, as in the
// fused forward (flash_engine-inl.h). The scaled queries and the weights are
// rounded to bf16 (as by the AVX512-BF16 tiles of bf16_dot-inl.h); the
// running max, sum and rescaling stay in f32 (decode-inl.h).
//
// Layouts (bf16_product.hpp's A rows and B pairs):
//   Q  B of the scores, per KV head: [dk2 / 2][hpad][2], hpad the head's
//      rows rounded up to 16, zero past them and past Dk;
//   K  A of the scores: a block's rows of one head, [block][dk2];
//   V  B of P V: a block's values of one head in pairs of tokens,
//      [block / 2][vpad][2], zero past Dv;
//   P  A of P V: [hpad][block] (an odd last token paired with 0).
// The head functions take decode-inl.h's ItemShape as `Shape` and a
// callable `next` that prefetches a few lines of the next block.
#if defined(QKV_CPU_DECODE_ENGINE_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_CPU_DECODE_ENGINE_INL_H_
#undef QKV_CPU_DECODE_ENGINE_INL_H_
#else
#define QKV_CPU_DECODE_ENGINE_INL_H_
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "cache/view.hpp"
#include "core/hwy_namespace.hpp"
#include "cpu/decode.hpp"
#include "cpu/engines/bf16_product.hpp"
#include "cpu/engines/select.hpp"
#include "cpu/tile_gemm-inl.h"
#include "cpu/vec_math-inl.h"
#include "hwy/aligned_allocator.h"
#include "hwy/highway.h"

QKV_HWY_NAMESPACE_BEGIN(cpu);

// Query rows per KV head from which a call takes the engine: below, the
// per-row tiles of decode-inl.h (one new token against GQA 4) read the
// cache with less packing. Not yet measured on a CPU with an engine.
constexpr std::int64_t kEngineRows = 8;

// The engine a decode call's products run on, or none: medium precision,
// a bf16 cache (keys, and values unless they are the keys), a KV head's
// rows at least kEngineRows, on a target whose vectors hold whole 16-column
// units (AVX2 and wider).
inline std::optional<engines::Bf16Engine> DecodeEngine(const DecodePlan& plan) {
  const cache::KvView& c = *plan.cache;
  const bool bf16 = c.key_storage == KvStorage::bf16 && c.tail_dim == 0 &&
                    (c.values_in_keys || c.value_storage == KvStorage::bf16);
  if (plan.params.matmul_precision == MatmulPrecision::highest || !bf16 ||
      plan.rows / plan.hkv < kEngineRows || PanelWidth() % 16 != 0) {
    return std::nullopt;
  }
  return engines::bf16_engine();
}

// The per-sequence query operands: B of the scores for every KV head,
// [Hkv][dk2 / 2][hpad][2] bf16, from the scaled f32 rows q [rows][dk_pad].
struct DecodeEngineQueries {
  std::int64_t dk2 = 0, hpad = 0;
  hwy::AlignedFreeUniquePtr<std::uint16_t[]> pairs;

  DecodeEngineQueries(const float* HWY_RESTRICT q, std::int64_t hkv, std::int64_t head_rows,
                      std::int64_t dk, std::int64_t dk_pad)
      : dk2(RoundUp(dk, 2)),
        hpad(RoundUp(head_rows, 16)),
        pairs(hwy::AllocateAligned<std::uint16_t>(static_cast<std::size_t>(hkv * dk2 * hpad))) {
    std::fill_n(pairs.get(), hkv * dk2 * hpad, std::uint16_t{0});
    std::vector<std::uint16_t> row(static_cast<std::size_t>(dk));
    for (std::int64_t hk = 0; hk < hkv; ++hk) {
      std::uint16_t* head = pairs.get() + hk * dk2 * hpad;
      for (std::int64_t i = 0; i < head_rows; ++i) {
        StoreRowFromF32(q + (hk * head_rows + i) * dk_pad, dk, row.data(), DType::bf16);
        for (std::int64_t x = 0; x < dk; ++x) {
          head[(x / 2) * 2 * hpad + 2 * i + x % 2] = row[static_cast<std::size_t>(x)];
        }
      }
    }
  }
  const std::uint16_t* head(std::int64_t hk) const { return pairs.get() + hk * dk2 * hpad; }
};

// One thread's block operands (the header's K, V and P) for blocks of up
// to `block` tokens (even), the scores of one head st [block][hpad], and
// one row's weights in f32, column [block].
struct DecodeEngineScratch {
  std::int64_t block, dk2, vpad, hpad;
  hwy::AlignedFreeUniquePtr<std::uint16_t[]> k, v, p;
  hwy::AlignedFreeUniquePtr<float[]> st, column;

  DecodeEngineScratch(std::int64_t block_, std::int64_t dk, std::int64_t dv, std::int64_t hpad_)
      : block(block_),
        dk2(RoundUp(dk, 2)),
        vpad(RoundUp(dv, 16)),
        hpad(hpad_),
        k(Zeros<std::uint16_t>(block * dk2)),
        v(Zeros<std::uint16_t>(block * vpad)),
        p(Zeros<std::uint16_t>(hpad * block)),
        st(Zeros<float>(block * hpad)),
        column(Zeros<float>(block)) {}
  template <class T>
  static hwy::AlignedFreeUniquePtr<T[]> Zeros(std::int64_t n) {
    auto b = hwy::AllocateAligned<T>(static_cast<std::size_t>(n));
    std::fill_n(b.get(), n, T{0});
    return b;
  }
};

// s[c][head hk's rows] = the scores of its rows against a block's `cols`
// keys (bf16 rows, key_head bytes per head), on the engine.
template <class Shape, class Next>
void HeadScoresEngine(engines::Bf16Engine engine, const Shape& sh, std::int64_t hk,
                      const std::uint16_t* q_pairs, const hwy::bfloat16_t* const* keys,
                      std::int64_t cols, Next&& next, DecodeEngineScratch& e,
                      float* HWY_RESTRICT s) {
  for (std::int64_t c = 0; c < cols; ++c) {
    next();
    std::memcpy(e.k.get() + c * e.dk2,
                reinterpret_cast<const std::byte*>(keys[c]) + hk * sh.key_head,
                static_cast<std::size_t>(sh.dk) * sizeof(std::uint16_t));
  }
  engines::bf16_product(engine, {.a = e.k.get(),
                                 .lda = e.dk2,
                                 .b = q_pairs,
                                 .ldb = e.hpad,
                                 .c = e.st.get(),
                                 .ldc = e.hpad,
                                 .m = cols,
                                 .n = e.hpad,
                                 .k = e.dk2});
  const std::int64_t first = hk * sh.head_rows;
  for (std::int64_t c = 0; c < cols; ++c) {
    std::copy_n(e.st.get() + c * e.hpad, sh.head_rows, s + c * sh.rows_pad + first);
  }
}

// O[head hk's rows] += P V over a block's `cols` tokens (bf16 value rows,
// the head's dv values from hk * dv), the weights s rounded to bf16, on the
// engine.
template <class Shape, class Next>
void HeadValuesEngine(engines::Bf16Engine engine, const Shape& sh, std::int64_t hk,
                      const float* HWY_RESTRICT s, const hwy::bfloat16_t* const* values,
                      std::int64_t cols, Next&& next, DecodeEngineScratch& e,
                      float* HWY_RESTRICT o_acc) {
  const std::int64_t depth = RoundUp(cols, 2);
  for (std::int64_t c = 0; c < depth; ++c) {
    if (c < cols) next();
    const auto* row =
        reinterpret_cast<const std::uint16_t*>(values[std::min(c, cols - 1)]) + hk * sh.dv;
    std::uint16_t* pair = e.v.get() + (c / 2) * 2 * e.vpad + c % 2;
    for (std::int64_t x = 0; x < sh.dv; ++x) pair[2 * x] = c < cols ? row[x] : 0;
  }
  const std::int64_t first = hk * sh.head_rows;
  float* column = e.column.get();
  column[depth - 1] = 0.0f;  // an odd last token's partner
  for (std::int64_t i = 0; i < sh.head_rows; ++i) {
    for (std::int64_t c = 0; c < cols; ++c) column[c] = s[c * sh.rows_pad + first + i];
    StoreRowFromF32(column, depth, e.p.get() + i * e.block, DType::bf16);
  }
  engines::bf16_product(engine, {.a = e.p.get(),
                                 .lda = e.block,
                                 .b = e.v.get(),
                                 .ldb = e.vpad,
                                 .c = o_acc + first * sh.dv_pad,
                                 .ldc = sh.dv_pad,
                                 .m = sh.head_rows,
                                 .n = e.vpad,
                                 .k = depth,
                                 .accumulate = true});
}

QKV_HWY_NAMESPACE_END(cpu);

#endif  // QKV_CPU_DECODE_ENGINE_INL_H_
