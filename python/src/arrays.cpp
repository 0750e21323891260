#include "arrays.hpp"

#include <array>
#include <utility>

#include "qkv/error.hpp"

namespace qkv::python {

namespace {

std::string describe(const nb::dlpack::dtype& t) {
  const char* kind = "unknown";
  switch (static_cast<nb::dlpack::dtype_code>(t.code)) {
    case nb::dlpack::dtype_code::Int:
      kind = "int";
      break;
    case nb::dlpack::dtype_code::UInt:
      kind = "uint";
      break;
    case nb::dlpack::dtype_code::Float:
      kind = "float";
      break;
    case nb::dlpack::dtype_code::Bfloat:
      kind = "bfloat";
      break;
    case nb::dlpack::dtype_code::Complex:
      kind = "complex";
      break;
    case nb::dlpack::dtype_code::Bool:
      kind = "bool";
      break;
  }
  std::string s = kind + std::to_string(t.bits);
  if (t.lanes != 1) s += "x" + std::to_string(t.lanes);
  return s;
}

template <class View, class Array>
View make_view(const Array& a, const std::string& name) {
  if (a.device_type() != nb::device::cpu::value) {
    throw Error(name + ": expected an array in CPU memory, got device type " +
                std::to_string(a.device_type()));
  }
  const DType dtype = dtype_of(a.dtype(), name);
  if (a.ndim() > static_cast<std::size_t>(kMaxRank)) {
    throw Error(name + ": expected at most " + std::to_string(kMaxRank) + " dimensions, got " +
                std::to_string(a.ndim()));
  }
  std::array<std::int64_t, kMaxRank> sizes{};
  std::array<std::int64_t, kMaxRank> strides{};
  const auto rank = a.ndim();
  for (std::size_t d = 0; d < rank; ++d) {
    sizes[d] = static_cast<std::int64_t>(a.shape(d));
    strides[d] = a.stride(d);
    if (strides[d] < 0 && sizes[d] > 1) {
      throw Error(name + ": expected non-negative strides, got stride " +
                  std::to_string(strides[d]) + " in dimension " + std::to_string(d) +
                  " (a reversed view; pass a copy)");
    }
    if (sizes[d] <= 1) strides[d] = std::max<std::int64_t>(strides[d], 0);
  }
  return View(a.data(), dtype, std::span<const std::int64_t>(sizes.data(), rank),
              std::span<const std::int64_t>(strides.data(), rank));
}

nb::dlpack::dtype dlpack_dtype(DType d) {
  using Code = nb::dlpack::dtype_code;
  switch (d) {
    case DType::f32:
      return {static_cast<std::uint8_t>(Code::Float), 32, 1};
    case DType::f64:
      return {static_cast<std::uint8_t>(Code::Float), 64, 1};
    case DType::f16:
      return {static_cast<std::uint8_t>(Code::Float), 16, 1};
    case DType::bf16:
      return {static_cast<std::uint8_t>(Code::Bfloat), 16, 1};
    case DType::boolean:
      return {static_cast<std::uint8_t>(Code::Bool), 8, 1};
  }
  throw Error("dtype: no DLPack code for " + std::string(dtype_name(d)));
}

Array array_of(TensorView view, nb::handle owner, nb::dlpack::dtype dtype) {
  std::array<std::size_t, kMaxRank> shape{};
  for (int d = 0; d < view.rank(); ++d) shape[d] = static_cast<std::size_t>(view.size(d));
  return Array(view.data(), static_cast<std::size_t>(view.rank()), shape.data(), owner,
               view.strides().data(), dtype);
}

}  // namespace

Array array_of(TensorView view, nb::handle owner) {
  return array_of(view, owner, dlpack_dtype(view.dtype()));
}

Array owning_array(Tensor t, bool bf16_as_bits) {
  auto* held = new Tensor(std::move(t));
  nb::capsule owner(held, [](void* p) noexcept { delete static_cast<Tensor*>(p); });
  nb::dlpack::dtype dtype = dlpack_dtype(held->dtype());
  if (bf16_as_bits && held->dtype() == DType::bf16) {
    dtype = {static_cast<std::uint8_t>(nb::dlpack::dtype_code::UInt), 16, 1};
  }
  return array_of(held->view(), owner, dtype);
}

DType dtype_of(const nb::dlpack::dtype& t, const std::string& name) {
  using Code = nb::dlpack::dtype_code;
  const auto code = static_cast<Code>(t.code);
  if (t.lanes == 1) {
    if (code == Code::Float && t.bits == 32) return DType::f32;
    if (code == Code::Float && t.bits == 64) return DType::f64;
    if (code == Code::Float && t.bits == 16) return DType::f16;
    if (code == Code::Bfloat && t.bits == 16) return DType::bf16;
    if (code == Code::UInt && t.bits == 16) return DType::bf16;  // ml_dtypes.bfloat16's bits
    if (code == Code::Bool && t.bits == 8) return DType::boolean;
  }
  throw Error(name + ": expected float32, float64, float16, bfloat16 or bool elements, got " +
              describe(t));
}

ConstTensorView view_of(const In& a, const std::string& name) {
  return make_view<ConstTensorView>(a, name);
}

TensorView view_of(const Out& a, const std::string& name) { return make_view<TensorView>(a, name); }

ConstTensorView view_of(const std::optional<In>& a, const std::string& name) {
  return a ? view_of(*a, name) : ConstTensorView{};
}

TensorView view_of(const std::optional<Out>& a, const std::string& name) {
  return a ? view_of(*a, name) : TensorView{};
}

std::span<const std::int64_t> span_of(const std::optional<Ints>& a) {
  if (!a) return {};
  return {a->data(), a->shape(0)};
}

std::span<const float> span_of(const std::optional<Floats>& a) {
  if (!a) return {};
  return {a->data(), a->shape(0)};
}

}  // namespace qkv::python
