// Strided views, the owning tensor, and dtype-converting copies.
#include "qkv/tensor.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <utility>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "core/checks.hpp"
#include "core/elements.hpp"

namespace qkv {

Shape contiguous_strides(std::span<const std::int64_t> sizes) {
  Shape strides{};
  std::int64_t stride = 1;
  for (std::size_t d = sizes.size(); d-- > 0;) {
    if (d < strides.size()) strides[d] = stride;
    // The outermost size scales no stride (an empty [2, 2^62, 0] has
    // strides [2^62, 1, 1]).
    if (d > 0 && __builtin_mul_overflow(stride, sizes[d] > 0 ? sizes[d] : 1, &stride)) {
      throw Error("tensor sizes " + shape_string(sizes) + ": element count overflows int64");
    }
  }
  return strides;
}

std::string shape_string(std::span<const std::int64_t> sizes) {
  std::string text = "[";
  for (std::size_t d = 0; d < sizes.size(); ++d) {
    if (d) text += ", ";
    text += std::to_string(sizes[d]);
  }
  return text + "]";
}

template <bool Const>
BasicTensorView<Const>::BasicTensorView(Pointer data, DType dtype,
                                        std::span<const std::int64_t> sizes,
                                        std::span<const std::int64_t> strides)
    : data_(data), dtype_(dtype), rank_(static_cast<int>(sizes.size())), defined_(true) {
  if (dtype_size(dtype) == 0) {
    throw Error("tensor dtype: expected f32, f64, f16, bf16 or bool, got value " +
                std::to_string(static_cast<int>(dtype)));
  }
  if (sizes.size() > kMaxRank) {
    throw Error("tensor rank: expected at most " + std::to_string(kMaxRank) + ", got " +
                std::to_string(sizes.size()) + " (sizes " + shape_string(sizes) + ")");
  }
  if (strides.size() != sizes.size()) {
    throw Error("tensor strides: expected one per dimension (" + std::to_string(sizes.size()) +
                "), got " + std::to_string(strides.size()));
  }
  for (std::size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] < 0) {
      throw Error("tensor sizes: expected non-negative sizes, got " + shape_string(sizes));
    }
    if (strides[d] < 0) {
      throw Error("tensor strides: expected non-negative strides, got " + shape_string(strides));
    }
    sizes_[d] = sizes[d];
    strides_[d] = strides[d];
  }
}

template <bool Const>
std::int64_t BasicTensorView<Const>::numel() const {
  for (int d = 0; d < rank_; ++d) {
    if (sizes_[d] == 0) return 0;
  }
  std::int64_t n = 1;
  for (int d = 0; d < rank_; ++d) {
    if (__builtin_mul_overflow(n, sizes_[d], &n)) return std::numeric_limits<std::int64_t>::max();
  }
  return n;
}

template <bool Const>
bool BasicTensorView<Const>::is_contiguous() const {
  std::int64_t expected = 1;
  for (int d = rank_; d-- > 0;) {
    if (sizes_[d] != 1 && strides_[d] != expected) return false;
    expected *= sizes_[d];
  }
  return true;
}

template <bool Const>
BasicTensorView<Const> BasicTensorView<Const>::transpose(int a, int b) const {
  const int aa = axis(a);
  const int bb = axis(b);
  if (aa < 0 || aa >= rank_ || bb < 0 || bb >= rank_) {
    throw Error("transpose: dimensions " + std::to_string(a) + " and " + std::to_string(b) +
                " must lie in [-" + std::to_string(rank_) + ", " + std::to_string(rank_) +
                ") for a rank-" + std::to_string(rank_) + " view");
  }
  BasicTensorView out = *this;
  std::swap(out.sizes_[aa], out.sizes_[bb]);
  std::swap(out.strides_[aa], out.strides_[bb]);
  return out;
}

template <bool Const>
BasicTensorView<Const> BasicTensorView<Const>::slice(int d, std::int64_t start,
                                                     std::int64_t length) const {
  const int dd = axis(d);
  if (dd < 0 || dd >= rank_) {
    throw Error("slice: dimension " + std::to_string(d) + " out of range for a rank-" +
                std::to_string(rank_) + " view");
  }
  if (start < 0 || length < 0 || start > sizes_[dd] || length > sizes_[dd] - start) {
    throw Error("slice: [" + std::to_string(start) + ", " + std::to_string(start) + " + " +
                std::to_string(length) + ") out of range for dimension " + std::to_string(d) +
                " of size " + std::to_string(sizes_[dd]));
  }
  BasicTensorView out = *this;
  if (length > 0) {
    using Byte = std::conditional_t<Const, const std::byte, std::byte>;
    out.data_ = static_cast<Byte*>(data_) +
                start * strides_[dd] * static_cast<std::int64_t>(dtype_size(dtype_));
  }
  out.sizes_[dd] = length;
  return out;
}

template <bool Const>
std::int64_t BasicTensorView<Const>::offset_of(std::initializer_list<std::int64_t> index) const {
  if (!defined_) throw Error("element access: the view is undefined");
  if (static_cast<int>(index.size()) != rank_) {
    throw Error("element access: expected " + std::to_string(rank_) + " indices, got " +
                std::to_string(index.size()));
  }
  std::int64_t offset = 0;
  int d = 0;
  for (std::int64_t i : index) {
    if (i < 0 || i >= sizes_[d]) {
      throw Error("element access: index " + std::to_string(i) + " out of range for dimension " +
                  std::to_string(d) + " of size " + std::to_string(sizes_[d]));
    }
    offset += i * strides_[d++];
  }
  return offset;
}

template <bool Const>
double BasicTensorView<Const>::get(std::initializer_list<std::int64_t> index) const {
  return detail::load(data_, dtype_, offset_of(index));
}

void store_element(void* data, DType dtype, std::int64_t offset, double value) {
  detail::store(data, dtype, offset, value);
}

template class BasicTensorView<true>;
template class BasicTensorView<false>;

void Tensor::Free::operator()(void* p) const { std::free(p); }

namespace {

// Zeroes a fresh allocation. Large ones are zeroed by all threads, in fixed
// 1 MiB pieces: there the cost is the kernel faulting the pages in (several
// milliseconds per 10 MB here), which proceeds in parallel.
void zero_fill(void* p, std::int64_t bytes) {
  constexpr std::int64_t kPiece = std::int64_t{1} << 20;
  if (bytes < 4 * kPiece) {
    std::memset(p, 0, static_cast<std::size_t>(bytes));
    return;
  }
  const std::int64_t pieces = (bytes + kPiece - 1) / kPiece;
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < pieces; ++i) {
    const std::int64_t begin = i * kPiece;
    std::memset(static_cast<char*>(p) + begin, 0,
                static_cast<std::size_t>(std::min(kPiece, bytes - begin)));
  }
}

// Allocations from this size on are backed by 2 MiB pages where the system
// offers them (Linux transparent huge pages in "madvise" mode): a kernel
// streaming a 100 MB KV cache through 4 KiB pages spends a fifth of its time
// on TLB misses.
constexpr std::size_t kHugePage = std::size_t{2} << 20;
constexpr std::size_t kHugeFrom = 4 * kHugePage;

// `bytes` (a multiple of 64) aligned to 64 bytes, large ones to a huge page.
void* allocate(std::size_t bytes) {
  if (bytes < kHugeFrom) return std::aligned_alloc(64, bytes);
  const std::size_t whole = (bytes + kHugePage - 1) / kHugePage * kHugePage;
  void* p = std::aligned_alloc(kHugePage, whole);
#ifdef MADV_HUGEPAGE
  // Advice only: where it is refused the pages stay 4 KiB.
  if (p != nullptr) madvise(p, whole, MADV_HUGEPAGE);
#endif
  return p;
}

}  // namespace

Tensor::Tensor(DType dtype, std::span<const std::int64_t> sizes) {
  // Validate through the view constructor before allocating.
  TensorView shape(nullptr, dtype, sizes);
  std::int64_t bytes = 0;
  if (__builtin_mul_overflow(shape.numel(), static_cast<std::int64_t>(dtype_size(dtype)), &bytes)) {
    throw Error("Tensor: sizes " + shape_string(sizes) + " of " + std::string(dtype_name(dtype)) +
                " need more than 2^63 bytes");
  }
  const std::size_t rounded = (static_cast<std::size_t>(bytes) + 63) / 64 * 64;
  void* p = allocate(rounded == 0 ? 64 : rounded);
  if (p == nullptr) {
    throw Error("Tensor: cannot allocate " + std::to_string(rounded) + " bytes for sizes " +
                shape_string(sizes) + " of " + std::string(dtype_name(dtype)));
  }
  zero_fill(p, static_cast<std::int64_t>(rounded == 0 ? 64 : rounded));
  storage_.reset(p);
  view_ = TensorView(p, dtype, sizes);
}

Tensor::Tensor(const Tensor& other) {
  if (!other.defined()) return;
  Tensor copy(other.dtype(), other.view_.size_span());
  std::memcpy(copy.view_.data(), other.view_.data(),
              static_cast<std::size_t>(other.numel()) * dtype_size(other.dtype()));
  *this = std::move(copy);
}

Tensor::Tensor(Tensor&& other) noexcept
    : storage_(std::move(other.storage_)), view_(std::exchange(other.view_, TensorView())) {}

Tensor& Tensor::operator=(Tensor&& other) noexcept {
  storage_ = std::move(other.storage_);
  view_ = std::exchange(other.view_, TensorView());
  return *this;
}

Tensor& Tensor::operator=(const Tensor& other) {
  if (this != &other) *this = Tensor(other);
  return *this;
}

void Tensor::check_type(DType requested) const {
  if (!defined()) throw Error("Tensor::data: the tensor is undefined");
  if (requested != dtype()) {
    throw Error("Tensor::data: requested element type " + std::string(dtype_name(requested)) +
                " but the tensor holds " + std::string(dtype_name(dtype())));
  }
}

void copy(ConstTensorView src, TensorView dst) {
  detail::Reasons r;
  const bool src_ok = detail::check_view("copy: src", src, {}, r);
  const bool dst_ok = detail::check_view("copy: dst", dst, {}, r);
  if (src_ok && dst_ok && (src.rank() != dst.rank() || src.sizes() != dst.sizes())) {
    r.push_back("copy: dst sizes " + shape_string(dst.size_span()) + " must equal src sizes " +
                shape_string(src.size_span()));
  }
  detail::throw_if(r);
  // Element by element, an overlapping destination would overwrite source
  // elements before they are read.
  detail::Aliasing aliasing;
  aliasing.input("src", src);
  aliasing.output("copy: dst", dst, r);
  detail::throw_if(r);
  if (src.dtype() == dst.dtype() && src.rank() > 0 && src.stride(-1) == 1 && dst.stride(-1) == 1) {
    // Rows of the last dimension are contiguous in both: one memcpy each.
    if (src.numel() == 0) return;
    const int rank = src.rank();
    const std::size_t bytes = dtype_size(src.dtype());
    const std::size_t row = static_cast<std::size_t>(src.size(-1)) * bytes;
    Shape outer = src.sizes();
    outer[rank - 1] = 1;
    detail::for_each_index(outer, rank, [&](const Shape& idx) {
      std::memcpy(
          static_cast<char*>(dst.data()) + detail::offset(idx, dst.strides(), rank) * bytes,
          static_cast<const char*>(src.data()) + detail::offset(idx, src.strides(), rank) * bytes,
          row);
    });
    return;
  }
  detail::for_each_index(src.sizes(), src.rank(), [&](const Shape& idx) {
    detail::store(
        dst.data(), dst.dtype(), detail::offset(idx, dst.strides(), dst.rank()),
        detail::load(src.data(), src.dtype(), detail::offset(idx, src.strides(), src.rank())));
  });
}

Tensor to_dtype(ConstTensorView src, DType dtype) {
  if (!src.defined()) throw Error("to_dtype: src must be a defined view");
  Tensor out(dtype, src.size_span());
  copy(src, out);
  return out;
}

}  // namespace qkv
