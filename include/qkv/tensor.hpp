// qkv/tensor.hpp — strided tensor views and an owning tensor.
//
// A view is a pointer, a dtype, a rank (0 to 4), and int64 sizes and strides
// counted in *elements* (not bytes). Views never own memory; `Tensor` does.
//
//   float buf[2 * 5 * 3 * 8];
//   qkv::TensorView x(buf, {2, 5, 3, 8});      // contiguous [B, N, H, D]
//   qkv::ConstTensorView y = x.transpose(1, 2); // [B, H, N, D] view, no copy
//
// Strides must be non-negative. A stride of 0 broadcasts (allowed for inputs,
// rejected for outputs, whose elements must not overlap).
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <type_traits>

#include "qkv/dtype.hpp"
#include "qkv/error.hpp"

namespace qkv {

inline constexpr int kMaxRank = 4;
using Shape = std::array<std::int64_t, kMaxRank>;

// Stores `value`, rounded to `dtype` (RNE), at element `offset` of `data`.
void store_element(void* data, DType dtype, std::int64_t offset, double value);

// Row-major strides of a contiguous tensor with the given sizes.
Shape contiguous_strides(std::span<const std::int64_t> sizes);
// "[2, 5, 3, 8]".
std::string shape_string(std::span<const std::int64_t> sizes);

// A non-owning strided view. `BasicTensorView<true>` (ConstTensorView) reads,
// `BasicTensorView<false>` (TensorView) also writes; a TensorView converts to a
// ConstTensorView implicitly. A default-constructed view is *undefined*
// (`defined() == false`) and stands for "not given" in option structs.
template <bool Const>
class BasicTensorView {
 public:
  using Pointer = std::conditional_t<Const, const void*, void*>;

  BasicTensorView() = default;

  // Contiguous (row-major) view over `data` with the given sizes.
  BasicTensorView(Pointer data, DType dtype, std::span<const std::int64_t> sizes)
      : BasicTensorView(data, dtype, sizes,
                        std::span<const std::int64_t>(contiguous_strides(sizes))
                            .first(std::min<std::size_t>(sizes.size(), kMaxRank))) {}
  BasicTensorView(Pointer data, DType dtype, std::initializer_list<std::int64_t> sizes)
      : BasicTensorView(data, dtype, std::span<const std::int64_t>(sizes.begin(), sizes.size())) {}

  // Strided view; `strides` has one entry per size. Throws qkv::Error when the
  // rank exceeds 4, ranks differ, or a size or stride is negative.
  BasicTensorView(Pointer data, DType dtype, std::span<const std::int64_t> sizes,
                  std::span<const std::int64_t> strides);
  BasicTensorView(Pointer data, DType dtype, std::initializer_list<std::int64_t> sizes,
                  std::initializer_list<std::int64_t> strides)
      : BasicTensorView(data, dtype, std::span<const std::int64_t>(sizes.begin(), sizes.size()),
                        std::span<const std::int64_t>(strides.begin(), strides.size())) {}

  // Typed conveniences: the dtype follows from the element type.
  template <class T>
  requires(!std::is_void_v<T> && (Const || !std::is_const_v<T>))
      BasicTensorView(T* data, std::initializer_list<std::int64_t> sizes)
      : BasicTensorView(static_cast<Pointer>(data), dtype_of_v<std::remove_const_t<T>>, sizes) {}
  template <class T>
  requires(!std::is_void_v<T> && (Const || !std::is_const_v<T>))
      BasicTensorView(T* data, std::initializer_list<std::int64_t> sizes,
                      std::initializer_list<std::int64_t> strides)
      : BasicTensorView(static_cast<Pointer>(data), dtype_of_v<std::remove_const_t<T>>, sizes,
                        strides) {}

  // A mutable view converts to a read-only one.
  template <bool OtherConst>
  requires(Const && !OtherConst)
      BasicTensorView(const BasicTensorView<OtherConst>& other)  // NOLINT: implicit by design
      : data_(other.data()),
        dtype_(other.dtype()),
        rank_(other.rank()),
        defined_(other.defined()),
        sizes_(other.sizes()),
        strides_(other.strides()) {}

  bool defined() const { return defined_; }
  Pointer data() const { return data_; }
  DType dtype() const { return dtype_; }
  int rank() const { return rank_; }
  // Size and stride of dimension `d`; negative `d` counts from the end.
  std::int64_t size(int d) const { return sizes_[axis(d)]; }
  std::int64_t stride(int d) const { return strides_[axis(d)]; }
  const Shape& sizes() const { return sizes_; }
  const Shape& strides() const { return strides_; }
  std::span<const std::int64_t> size_span() const { return {sizes_.data(), std::size_t(rank_)}; }
  std::span<const std::int64_t> stride_span() const {
    return {strides_.data(), std::size_t(rank_)};
  }
  // Number of elements (1 for rank 0; INT64_MAX when the count overflows
  // int64, which no allocation can back).
  std::int64_t numel() const;
  // True when the elements are laid out row-major without gaps.
  bool is_contiguous() const;

  // The same data with dimensions `a` and `b` exchanged (no copy).
  BasicTensorView transpose(int a, int b) const;
  // Dimension `d` restricted to [start, start + length) (no copy).
  BasicTensorView slice(int d, std::int64_t start, std::int64_t length) const;

  // Reads element `index` (one index per dimension) as double. Bounds-checked;
  // meant for tests and small tools, not for inner loops.
  double get(std::initializer_list<std::int64_t> index) const;
  // Writes `value` (rounded to the dtype, RNE). Bounds-checked. (A member
  // template, so the read-only view never instantiates it.)
  template <bool C = Const>
  requires(!C) void set(std::initializer_list<std::int64_t> index, double value) const {
    store_element(data_, dtype_, offset_of(index), value);
  }

 private:
  int axis(int d) const { return d < 0 ? d + rank_ : d; }
  std::int64_t offset_of(std::initializer_list<std::int64_t> index) const;

  Pointer data_ = nullptr;
  DType dtype_ = DType::f32;
  int rank_ = 0;
  bool defined_ = false;
  Shape sizes_{};
  Shape strides_{};
};

using TensorView = BasicTensorView<false>;
using ConstTensorView = BasicTensorView<true>;

// An owning, contiguous, 64-byte-aligned tensor, zero-initialized on
// construction. Copies are deep. Tensors of 8 MiB or more start on a 2 MiB
// boundary and, on Linux, ask for transparent huge pages
// (madvise(MADV_HUGEPAGE); effective where THP is "always" or "madvise"):
// kernels that stream large K/V tensors or caches then miss the TLB far
// less often.
class Tensor {
 public:
  Tensor() = default;
  Tensor(DType dtype, std::span<const std::int64_t> sizes);
  Tensor(DType dtype, std::initializer_list<std::int64_t> sizes)
      : Tensor(dtype, std::span<const std::int64_t>(sizes.begin(), sizes.size())) {}
  Tensor(const Tensor& other);
  Tensor& operator=(const Tensor& other);
  // A moved-from tensor is undefined (not a view of memory it gave away).
  Tensor(Tensor&& other) noexcept;
  Tensor& operator=(Tensor&& other) noexcept;
  ~Tensor() = default;

  bool defined() const { return view_.defined(); }
  DType dtype() const { return view_.dtype(); }
  int rank() const { return view_.rank(); }
  std::int64_t size(int d) const { return view_.size(d); }
  std::int64_t numel() const { return view_.numel(); }
  const Shape& sizes() const { return view_.sizes(); }

  TensorView view() { return view_; }
  ConstTensorView view() const { return view_; }
  operator TensorView() { return view_; }             // NOLINT: implicit by design
  operator ConstTensorView() const { return view_; }  // NOLINT: implicit by design

  // Typed pointer to the first element; throws qkv::Error if T does not match.
  template <class T>
  T* data() {
    check_type(dtype_of_v<T>);
    return static_cast<T*>(view_.data());
  }
  template <class T>
  const T* data() const {
    check_type(dtype_of_v<T>);
    return static_cast<const T*>(view_.data());
  }

  double get(std::initializer_list<std::int64_t> index) const { return view_.get(index); }
  void set(std::initializer_list<std::int64_t> index, double value) { view_.set(index, value); }

 private:
  struct Free {
    void operator()(void* p) const;
  };
  void check_type(DType requested) const;

  std::unique_ptr<void, Free> storage_;
  TensorView view_;
};

// Copies `src` into `dst` (same sizes, any strides), converting the dtype with
// RNE rounding. Throws qkv::Error, writing nothing, if a view is undefined or
// not backed by memory, the sizes differ, `dst` overlaps itself, or the two
// share memory (an element-wise copy would read elements it has overwritten).
void copy(ConstTensorView src, TensorView dst);
// A contiguous copy of `src` in `dtype`.
Tensor to_dtype(ConstTensorView src, DType dtype);

}  // namespace qkv
