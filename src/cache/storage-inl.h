// Storage traits of the KV cache, one specialization per stored element type
// (f32, bf16, f16), in the manner of gemma.cpp's CompressTraits: each says
// how a stored row is written from the appended keys and values (of any
// floating dtype) and how the decode kernel (cpu/decode-inl.h) loads it into
// f32 lanes, for the Q.K dot products and the P.V accumulation alike. The
// kernel is one template over the traits; WithStorage maps a cache's dtype
// to its traits.
//
// The interface a specialization provides:
//   Stored              element type of a stored row, as the kernel addresses
//                       it (a row of n elements is n Stored apart)
//   kDType              the KvCacheConfig::dtype it stores
//   kStreamAhead        the kernel's prefetching: true streams the next block's
//                       token rows during this block's passes (LineStream);
//                       false fetches keys two tokens ahead and values inside
//                       the value tiles
//   Write<S>(src, stride, dst, n)
//                       n elements of type S (f32, f64, f16, bf16; src
//                       `stride` elements apart) rounded once (RNE) into the
//                       stored row dst; S = double with stride 1 writes a key
//                       rotated in double by RoPE
//   Load(d, row, i)     elements [i, i + Lanes(d)) of a stored row as an f32
//                       vector, exactly
//   LoadOne(row, i)     element i of a stored row as f32, exactly
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

#include "core/rows.hpp"
#include "hwy/highway.h"
#include "qkv/dtype.hpp"

HWY_BEFORE_NAMESPACE();
namespace qkv::cache {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

template <class Stored>
struct StorageTraits;

// f32: rows read as they are.
template <>
struct StorageTraits<float> {
  using Stored = float;
  static constexpr DType kDType = DType::f32;
  static constexpr bool kStreamAhead = false;

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

// bf16: the 16 bits are the upper half of the f32, so widening is a shift.
template <>
struct StorageTraits<hwy::bfloat16_t> {
  using Stored = hwy::bfloat16_t;
  static constexpr DType kDType = DType::bf16;
  static constexpr bool kStreamAhead = true;

  template <class S>
  static void Write(const void* src, std::int64_t stride, void* dst, std::int64_t n) {
    detail::copy_row<S, bf16>(src, stride, dst, n);
  }
  template <class D>
  static HWY_INLINE hn::Vec<D> Load(D d, const Stored* HWY_RESTRICT row, std::int64_t i) {
    const hn::Rebind<std::uint16_t, D> du16;
    const hn::RebindToUnsigned<D> du32;
    const auto bits =
        hn::PromoteTo(du32, hn::LoadU(du16, reinterpret_cast<const std::uint16_t*>(row + i)));
    return hn::BitCast(d, hn::ShiftLeft<16>(bits));
  }
  static HWY_INLINE float LoadOne(const Stored* row, std::int64_t i) {
    std::uint16_t bits;
    std::memcpy(&bits, row + i, sizeof bits);
    return to_float(bf16{bits});
  }
};

// f16: widened by the target's conversion (F16C on x86).
template <>
struct StorageTraits<hwy::float16_t> {
  using Stored = hwy::float16_t;
  static constexpr DType kDType = DType::f16;
  static constexpr bool kStreamAhead = true;

  template <class S>
  static void Write(const void* src, std::int64_t stride, void* dst, std::int64_t n) {
    detail::copy_row<S, f16>(src, stride, dst, n);
  }
  template <class D>
  static HWY_INLINE hn::Vec<D> Load(D d, const Stored* HWY_RESTRICT row, std::int64_t i) {
    const hn::Rebind<hwy::float16_t, D> df16;
    return hn::PromoteTo(d, hn::LoadU(df16, row + i));
  }
  static HWY_INLINE float LoadOne(const Stored* row, std::int64_t i) {
    std::uint16_t bits;
    std::memcpy(&bits, row + i, sizeof bits);
    return to_float(f16{bits});
  }
};

// Calls f(StorageTraits<...>{}) for the traits of storage `dtype` (the
// cache's config has been validated: one of the specializations above).
template <class F>
decltype(auto) WithStorage(DType dtype, F&& f) {
  switch (dtype) {
    case DType::bf16:
      return f(StorageTraits<hwy::bfloat16_t>{});
    case DType::f16:
      return f(StorageTraits<hwy::float16_t>{});
    default:
      return f(StorageTraits<float>{});
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace qkv::cache
HWY_AFTER_NAMESPACE();

#endif  // QKV_CACHE_STORAGE_INL_H_
