// Element-wise helpers shared by the core and the reference backend: typed
// loads and stores by element offset, index iteration, and memory-extent
// checks. Slow by design (a switch per element); never used by fast kernels.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <utility>

#include "qkv/tensor.hpp"

namespace qkv::detail {

// Value of element `offset` (in elements) of `data` as double.
inline double load(const void* data, DType dtype, std::int64_t offset) {
  switch (dtype) {
    case DType::f32:
      return static_cast<const float*>(data)[offset];
    case DType::f64:
      return static_cast<const double*>(data)[offset];
    case DType::f16:
      return to_float(static_cast<const f16*>(data)[offset]);
    case DType::bf16:
      return to_float(static_cast<const bf16*>(data)[offset]);
    case DType::boolean:
      return static_cast<const std::uint8_t*>(data)[offset] != 0 ? 1.0 : 0.0;
  }
  return 0.0;
}

// Stores `value` rounded once (RNE) to `dtype`.
inline void store(void* data, DType dtype, std::int64_t offset, double value) {
  switch (dtype) {
    case DType::f32:
      static_cast<float*>(data)[offset] = static_cast<float>(value);
      return;
    case DType::f64:
      static_cast<double*>(data)[offset] = value;
      return;
    case DType::f16:
      static_cast<f16*>(data)[offset] = to_f16(value);
      return;
    case DType::bf16:
      static_cast<bf16*>(data)[offset] = to_bf16(value);
      return;
    case DType::boolean:
      static_cast<std::uint8_t*>(data)[offset] = value != 0.0;
      return;
  }
}

inline std::int64_t offset(const Shape& index, const Shape& strides, int rank) {
  std::int64_t o = 0;
  for (int d = 0; d < rank; ++d) o += index[d] * strides[d];
  return o;
}

// Calls f(index) for every index of a tensor with these sizes, row-major.
template <class F>
void for_each_index(const Shape& sizes, int rank, F&& f) {
  for (int d = 0; d < rank; ++d) {
    if (sizes[d] == 0) return;
  }
  Shape idx{};
  while (true) {
    f(std::as_const(idx));
    int d = rank - 1;
    for (; d >= 0; --d) {
      if (++idx[d] < sizes[d]) break;
      idx[d] = 0;
    }
    if (d < 0) return;
  }
}

// Sets every element of t to `value` (rounded once to its dtype).
inline void fill(TensorView t, double value) {
  for_each_index(t.sizes(), t.rank(), [&](const Shape& idx) {
    store(t.data(), t.dtype(), offset(idx, t.strides(), t.rank()), value);
  });
}

// Whether no element of t is NaN, nor an infinity other than -inf when
// `negative_infinity` allows it (a logsumexp of a row without keys).
inline bool all_finite(ConstTensorView t, bool negative_infinity = false) {
  bool finite = true;
  for_each_index(t.sizes(), t.rank(), [&](const Shape& idx) {
    const double x = load(t.data(), t.dtype(), offset(idx, t.strides(), t.rank()));
    finite = finite && (std::isfinite(x) || (negative_infinity && x < 0 && std::isinf(x)));
  });
  return finite;
}

// Byte range [begin, end) spanned by a view's elements; empty for no elements.
struct ByteRange {
  std::uintptr_t begin = 0;
  std::uintptr_t end = 0;
  bool empty() const { return begin == end; }
  bool overlaps(const ByteRange& o) const {
    return !empty() && !o.empty() && begin < o.end && o.begin < end;
  }
};
ByteRange byte_range(ConstTensorView view);

// Empty when no two indices of `view` address the same element; otherwise the
// reason ("has overlapping elements: ...").
std::string self_overlap_reason(ConstTensorView view);

}  // namespace qkv::detail

namespace qkv::detail {

// False when the element count, the largest element offset or its byte
// offset does not fit in int64 (a view no real allocation can back).
bool extent_fits(ConstTensorView view);

}  // namespace qkv::detail

namespace qkv::detail {

// Element offset of mask[b, h, i, 0] for a mask of rank <= 4 broadcast
// (right-aligned, size-1 dimensions repeat) to [B, Hq, Nq, Nk].
inline std::int64_t mask_row_offset(ConstTensorView mask, std::int64_t b, std::int64_t h,
                                    std::int64_t i) {
  const std::int64_t index[3] = {b, h, i};
  std::int64_t off = 0;
  for (int dim = 0; dim < mask.rank() - 1; ++dim) {
    const std::int64_t x = index[3 - (mask.rank() - 1) + dim];
    off += (mask.size(dim) == 1 ? 0 : x) * mask.stride(dim);
  }
  return off;
}

// Element stride between consecutive keys of a broadcast mask row.
inline std::int64_t mask_key_stride(ConstTensorView mask) {
  return mask.rank() == 0 || mask.size(-1) == 1 ? 0 : mask.stride(-1);
}

}  // namespace qkv::detail
