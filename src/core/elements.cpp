#include "core/elements.hpp"

#include <array>
#include <utility>

namespace qkv::detail {

ByteRange byte_range(ConstTensorView view) {
  if (!view.defined() || view.numel() == 0) return {};
  std::int64_t last = 0;
  for (int d = 0; d < view.rank(); ++d) last += (view.size(d) - 1) * view.stride(d);
  const auto begin = reinterpret_cast<std::uintptr_t>(view.data());
  const auto bytes = static_cast<std::uintptr_t>(dtype_size(view.dtype()));
  return {begin, begin + (static_cast<std::uintptr_t>(last) + 1) * bytes};
}

std::string self_overlap_reason(ConstTensorView view) {
  // Sort the non-trivial dimensions by stride; the layout is overlap-free when
  // each stride exceeds the span of all smaller-strided dimensions together.
  std::array<int, kMaxRank> dims{};
  int n = 0;
  for (int d = 0; d < view.rank(); ++d) {
    if (view.size(d) > 1) dims[n++] = d;
  }
  for (int t = 1; t < n; ++t) {  // insertion sort of at most 4 dimensions by stride
    for (int u = t; u > 0 && view.stride(dims[u]) < view.stride(dims[u - 1]); --u) {
      std::swap(dims[u], dims[u - 1]);
    }
  }
  std::int64_t span = 1;  // elements covered by the dimensions seen so far
  std::int64_t span_next = 0;
  for (int t = 0; t < n; ++t) {
    const int d = dims[t];
    if (view.stride(d) < span) {
      return "has overlapping elements: dimension " + std::to_string(d) + " (size " +
             std::to_string(view.size(d)) + ") has stride " + std::to_string(view.stride(d)) +
             ", expected at least " + std::to_string(span) + " (sizes " +
             shape_string(view.size_span()) + ", strides " + shape_string(view.stride_span()) + ")";
    }
    // A span past int64 is an extent past int64, which the memory check
    // rejects on its own: no verdict on overlap is needed.
    if (__builtin_mul_overflow(view.stride(d), view.size(d) - 1, &span_next) ||
        __builtin_add_overflow(span_next, span, &span)) {
      return {};
    }
  }
  return {};
}

}  // namespace qkv::detail

namespace qkv::detail {

bool extent_fits(ConstTensorView view) {
  std::int64_t last = 0;
  std::int64_t count = 1;
  for (int d = 0; d < view.rank(); ++d) {
    if (view.size(d) == 0) return true;
    if (__builtin_mul_overflow(count, view.size(d), &count)) return false;
    std::int64_t term = 0;
    if (__builtin_mul_overflow(view.size(d) - 1, view.stride(d), &term) ||
        __builtin_add_overflow(last, term, &last)) {
      return false;
    }
  }
  // The end of the last element, last + 1 elements in, in bytes (last may
  // be 2^63 - 1 itself).
  std::int64_t bytes = 0;
  return !__builtin_add_overflow(last, 1, &last) &&
         !__builtin_mul_overflow(last, static_cast<std::int64_t>(dtype_size(view.dtype())), &bytes);
}

}  // namespace qkv::detail
