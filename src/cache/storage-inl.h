// Storage traits of the KV cache, one specialization per stored format
// (f32, bf16, f16, and ggml's blocks q8_0 and q4_0; cache/formats.hpp), in
// the manner of gemma.cpp's CompressTraits: each says how a stored row is
// written from the appended keys and values (of any floating dtype) and how
// the decode kernel (cpu/decode-inl.h) loads it into f32 lanes, for the Q.K
// dot products and the P.V accumulation alike. The kernel is one template
// over the traits of the keys and of the values; WithStorage maps a
// KvStorage to its traits.
//
// The interface a specialization provides:
//   Stored              unit of a stored row as the kernel addresses it: an
//                       element, or a block of kBlock elements
//   kBlock              elements per Stored (rows of a head start at a
//                       Stored: the cache's D is a multiple of kBlock)
//   Write<S>(src, stride, dst, n)
//                       n elements of type S (f32, f64, f16, bf16; src
//                       `stride` elements apart, n a multiple of kBlock)
//                       into the stored row dst: rounded once (RNE) to the
//                       element type, or to f32 and then quantized; S =
//                       double with stride 1 writes a key rotated in double
//                       by RoPE
//   Load(d, row, i)     elements [i, i + Lanes(d)) of a stored row as an f32
//                       vector, exactly; i is a multiple of Lanes(d)
//   LoadOne(row, i)     element i of a stored row as f32, exactly
// and, for blocks (kBlock > 1), Load = LoadUnscaled * Scale:
//   Scale(d, row, i)    the scale of the block holding element i, broadcast
//   LoadUnscaled(d, row, i)
//                       elements [i, i + Lanes(d)) before their scale (the
//                       kernel widens a scale once per block and token for
//                       all of the block's vectors)
//
// Per Highway target (the -inl.h toggle); the cache's appends include it for
// the static target only, since writes are scalar.
#if defined(QKV_CACHE_STORAGE_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_CACHE_STORAGE_INL_H_
#undef QKV_CACHE_STORAGE_INL_H_
#else
#define QKV_CACHE_STORAGE_INL_H_
#endif

#include <cstdint>
#include <cstring>

#include "cache/formats.hpp"
#include "core/hwy_namespace.hpp"
#include "core/rows.hpp"
#include "hwy/highway.h"
#include "qkv/dtype.hpp"
#include "qkv/kv_storage.hpp"

QKV_HWY_NAMESPACE_BEGIN(cache);

template <class Stored>
struct StorageTraits;

// f32: rows read as they are.
template <>
struct StorageTraits<float> {
  using Stored = float;
  static constexpr std::int64_t kBlock = 1;

  template <class S>
  static void Write(const void* src, std::int64_t stride, void* dst, std::int64_t n) {
    detail::copy_row<S, float>(src, stride, dst, n);
  }
  template <class D>
  static HWY_INLINE hn::Vec<D> Load(D d, const Stored* HWY_RESTRICT row, std::int64_t i) {
    return hn::LoadU(d, row + i);
  }
  static HWY_INLINE float LoadOne(const Stored* row, std::int64_t i) { return row[i]; }
};

// A 16-bit float format `Half` (qkv::bf16, qkv::f16) stored as Highway's
// type `Stored`: writing rounds to it, one element is read by its bits;
// each specialization below widens vectors its own way.
template <class StoredHalf, class Half>
struct HalfStorage {
  using Stored = StoredHalf;
  static constexpr std::int64_t kBlock = 1;

  template <class S>
  static void Write(const void* src, std::int64_t stride, void* dst, std::int64_t n) {
    detail::copy_row<S, Half>(src, stride, dst, n);
  }
  static HWY_INLINE float LoadOne(const Stored* row, std::int64_t i) {
    std::uint16_t bits;
    std::memcpy(&bits, row + i, sizeof bits);
    return to_float(Half{bits});
  }
};

// bf16: the 16 bits are the upper half of the f32, so widening is a shift.
template <>
struct StorageTraits<hwy::bfloat16_t> : HalfStorage<hwy::bfloat16_t, bf16> {
  template <class D>
  static HWY_INLINE hn::Vec<D> Load(D d, const Stored* HWY_RESTRICT row, std::int64_t i) {
    const hn::Rebind<std::uint16_t, D> du16;
    const hn::RebindToUnsigned<D> du32;
    const auto bits =
        hn::PromoteTo(du32, hn::LoadU(du16, reinterpret_cast<const std::uint16_t*>(row + i)));
    return hn::BitCast(d, hn::ShiftLeft<16>(bits));
  }
};

// f16: widened by the target's conversion (F16C on x86).
template <>
struct StorageTraits<hwy::float16_t> : HalfStorage<hwy::float16_t, f16> {
  template <class D>
  static HWY_INLINE hn::Vec<D> Load(D d, const Stored* HWY_RESTRICT row, std::int64_t i) {
    const hn::Rebind<hwy::float16_t, D> df16;
    return hn::PromoteTo(d, hn::LoadU(df16, row + i));
  }
};

// The f16 scale of a block, broadcast and widened by the target's
// conversion (F16C on x86): a scalar conversion here took most of the time.
template <class D>
HWY_INLINE hn::Vec<D> BlockScale(D d, std::uint16_t bits) {
  const hn::Rebind<hwy::float16_t, D> df16;
  const hn::RebindToUnsigned<decltype(df16)> du16;
  return hn::PromoteTo(d, hn::BitCast(df16, hn::Set(du16, bits)));
}

// What the quantized blocks share (Traits: the specialization, which adds
// LoadUnscaled and LoadOne): a row is written 32 values at a time, rounded
// to f32 and quantized as ggml does (cache/formats.hpp); a block's scale is
// its f16 `d`; Load is LoadUnscaled times the scale.
template <class Traits, class Block, void (*kQuantize)(const float*, std::int64_t, Block*)>
struct BlockStorage {
  using Stored = Block;
  static constexpr std::int64_t kBlock = kQuantBlock;

  template <class S>
  static void Write(const void* src, std::int64_t stride, void* dst, std::int64_t n) {
    float block[kQuantBlock];
    const auto* s = static_cast<const S*>(src);
    auto* out = static_cast<Block*>(dst);
    for (std::int64_t b = 0; b < n / kQuantBlock; ++b) {
      detail::copy_row<S, float>(s + b * kQuantBlock * stride, stride, block, kQuantBlock);
      kQuantize(block, kQuantBlock, out + b);
    }
  }
  template <class D>
  static HWY_INLINE hn::Vec<D> Scale(D d, const Block* HWY_RESTRICT row, std::int64_t i) {
    return BlockScale(d, row[i / kBlock].d);
  }
  template <class D>
  static HWY_INLINE hn::Vec<D> Load(D d, const Block* HWY_RESTRICT row, std::int64_t i) {
    return hn::Mul(Traits::LoadUnscaled(d, row, i), Scale(d, row, i));
  }
};

// q8_0: d * q, the int8 values widened and converted.
template <>
struct StorageTraits<BlockQ8_0>
    : BlockStorage<StorageTraits<BlockQ8_0>, BlockQ8_0, &quantize_q8_0> {
  template <class D>
  static HWY_INLINE hn::Vec<D> LoadUnscaled(D d, const Stored* HWY_RESTRICT row, std::int64_t i) {
    const hn::Rebind<std::int8_t, D> d8;
    const hn::RebindToSigned<D> d32;
    return hn::ConvertTo(d, hn::PromoteTo(d32, hn::LoadU(d8, row[i / kBlock].qs + i % kBlock)));
  }
  static HWY_INLINE float LoadOne(const Stored* row, std::int64_t i) {
    const Stored& block = row[i / kBlock];
    return to_float(f16{block.d}) * static_cast<float>(block.qs[i % kBlock]);
  }
};

// q4_0: d * (q - 8); byte j of a block holds elements j (low nibble) and
// j + 16 (high), so a vector of up to 16 lanes at i (a multiple of its
// lanes) reads the low or the high nibbles of consecutive bytes.
template <>
struct StorageTraits<BlockQ4_0>
    : BlockStorage<StorageTraits<BlockQ4_0>, BlockQ4_0, &quantize_q4_0> {
  static constexpr std::int64_t kHalf = kBlock / 2;

  template <class D>
  static HWY_INLINE hn::Vec<D> LoadUnscaled(D d, const Stored* HWY_RESTRICT row, std::int64_t i) {
    static_assert(hn::MaxLanes(D()) <= kHalf, "a vector within one half of a block");
    const hn::Rebind<std::uint8_t, D> d8;
    const hn::RebindToSigned<D> d32;
    const std::int64_t j = i % kBlock;
    const auto bytes = hn::BitCast(
        d32,
        hn::PromoteTo(hn::RebindToUnsigned<D>(), hn::LoadU(d8, row[i / kBlock].qs + j % kHalf)));
    const auto q = j < kHalf ? hn::And(bytes, hn::Set(d32, 15)) : hn::ShiftRight<4>(bytes);
    return hn::ConvertTo(d, hn::Sub(q, hn::Set(d32, 8)));
  }
  static HWY_INLINE float LoadOne(const Stored* row, std::int64_t i) {
    const Stored& block = row[i / kBlock];
    const std::int64_t j = i % kBlock;
    const int q = j < kHalf ? block.qs[j] & 15 : block.qs[j - kHalf] >> 4;
    return to_float(f16{block.d}) * static_cast<float>(q - 8);
  }
};

// Calls f(StorageTraits<...>{}) for the traits of `storage` (resolved, not
// automatic: one of the specializations above).
template <class F>
decltype(auto) WithStorage(KvStorage storage, F&& f) {
  switch (storage) {
    case KvStorage::bf16:
      return f(StorageTraits<hwy::bfloat16_t>{});
    case KvStorage::f16:
      return f(StorageTraits<hwy::float16_t>{});
    case KvStorage::q8_0:
      return f(StorageTraits<BlockQ8_0>{});
    case KvStorage::q4_0:
      return f(StorageTraits<BlockQ4_0>{});
    default:
      return f(StorageTraits<float>{});
  }
}

QKV_HWY_NAMESPACE_END(cache);

#endif  // QKV_CACHE_STORAGE_INL_H_
