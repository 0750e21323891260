// Typed rows of elements for the code that converts between storage dtypes
// outside the fused kernels (the KV cache's appends, RoPE): a row function
// is chosen once per call, so the element loops carry no dtype switch.
// Values pass through double and are rounded once (RNE) to the destination.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "qkv/dtype.hpp"

namespace qkv::detail {

template <class T>
double widen(T x) {
  if constexpr (std::is_same_v<T, f16> || std::is_same_v<T, bf16>) {
    return to_float(x);
  } else {
    return static_cast<double>(x);
  }
}

// Rounds once (RNE) to T.
template <class T>
T narrow(double x) {
  if constexpr (std::is_same_v<T, f16>) {
    return to_f16(x);
  } else if constexpr (std::is_same_v<T, bf16>) {
    return to_bf16(x);
  } else {
    return static_cast<T>(x);
  }
}

// Row kernels over n elements, chosen once per call so that the element loops
// carry no dtype switch: copy (src strided, dst contiguous), load into double
// and store from double (dst strided).
using CopyRow = void (*)(const void* src, std::int64_t stride, void* dst, std::int64_t n);
using LoadRow = void (*)(const void* src, std::int64_t stride, double* out, std::int64_t n);
using StoreRow = void (*)(const double* in, void* dst, std::int64_t stride, std::int64_t n);

template <class S, class D>
void copy_row(const void* src, std::int64_t stride, void* dst, std::int64_t n) {
  const auto* s = static_cast<const S*>(src);
  auto* d = static_cast<D*>(dst);
  for (std::int64_t i = 0; i < n; ++i) {
    if constexpr (std::is_same_v<S, D>) {
      d[i] = s[i * stride];  // already in the storage format: nothing to round
    } else {
      d[i] = narrow<D>(widen(s[i * stride]));
    }
  }
}

template <class T>
void load_row(const void* src, std::int64_t stride, double* out, std::int64_t n) {
  const auto* s = static_cast<const T*>(src);
  for (std::int64_t i = 0; i < n; ++i) out[i] = widen(s[i * stride]);
}

template <class T>
void store_row(const double* in, void* dst, std::int64_t stride, std::int64_t n) {
  auto* d = static_cast<T*>(dst);
  for (std::int64_t i = 0; i < n; ++i) d[i * stride] = narrow<T>(in[i]);
}

template <class T>
struct Type {
  using type = T;
};

// Calls f(Type<T>{}) for the element type T of a floating dtype (validation
// has ruled out bool before any of these run).
template <class F>
decltype(auto) visit_floating(DType dtype, F&& f) {
  switch (dtype) {
    case DType::f64:
      return f(Type<double>{});
    case DType::f16:
      return f(Type<f16>{});
    case DType::bf16:
      return f(Type<bf16>{});
    default:
      return f(Type<float>{});
  }
}

inline CopyRow copy_row_for(DType src, DType dst) {
  return visit_floating(src, [&](auto s) {
    return visit_floating(dst, [&](auto d) -> CopyRow {
      return &copy_row<typename decltype(s)::type, typename decltype(d)::type>;
    });
  });
}

inline LoadRow load_row_for(DType dtype) {
  return visit_floating(dtype,
                        [](auto t) -> LoadRow { return &load_row<typename decltype(t)::type>; });
}

inline StoreRow store_row_for(DType dtype) {
  return visit_floating(dtype,
                        [](auto t) -> StoreRow { return &store_row<typename decltype(t)::type>; });
}

inline const std::byte* at(const void* data, DType dtype, std::int64_t offset) {
  return static_cast<const std::byte*>(data) +
         offset * static_cast<std::int64_t>(dtype_size(dtype));
}
inline std::byte* at(void* data, DType dtype, std::int64_t offset) {
  return static_cast<std::byte*>(data) + offset * static_cast<std::int64_t>(dtype_size(dtype));
}

}  // namespace qkv::detail
