// Arrays from Python (NumPy, PyTorch, anything with DLPack or the buffer
// protocol, through nanobind's ndarray) as qkv views, without copies.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <optional>
#include <string>

#include "qkv/tensor.hpp"

namespace qkv::python {

namespace nb = nanobind;

// An input (read-only arrays accepted) and an output array, any dtype,
// shape and strides; checked when turned into a view.
using In = nb::ndarray<nb::ro>;
using Out = nb::ndarray<>;
// Integer metadata (lengths, offsets, block tables): 1-D int64, contiguous.
// The Python layer converts sequences and int32 tensors to this.
using Ints = nb::ndarray<nb::ro, const std::int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
// Per-head float metadata (ALiBi slopes): 1-D float32, contiguous.
using Floats = nb::ndarray<nb::ro, const float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

// An array handed to Python (NumPy, PyTorch and others read it through the
// array API / DLPack).
using Array = nb::ndarray<nb::array_api>;

// An array over `view`'s memory, kept alive by `owner` (no copy).
Array array_of(TensorView view, nb::handle owner);

// An array that owns `t` (moved, not copied). With `bf16_as_bits`, bfloat16
// elements go over as their uint16 bits (NumPy has no bfloat16; the Python
// layer views them as ml_dtypes.bfloat16).
Array owning_array(Tensor t, bool bf16_as_bits = false);

// The qkv dtype of an array: float32, float64, float16, bfloat16 (PyTorch's,
// or ml_dtypes' passed by the Python layer as its uint16 bits) and bool.
// Throws qkv::Error naming `name` for anything else.
DType dtype_of(const nb::dlpack::dtype& t, const std::string& name);

// A view of `a` (rank 0 to 4, CPU memory, non-negative strides); throws
// qkv::Error naming `name` otherwise.
ConstTensorView view_of(const In& a, const std::string& name);
TensorView view_of(const Out& a, const std::string& name);

// The same for optional arguments: undefined when absent.
ConstTensorView view_of(const std::optional<In>& a, const std::string& name);
TensorView view_of(const std::optional<Out>& a, const std::string& name);

// The elements of 1-D metadata as a span (empty when absent).
std::span<const std::int64_t> span_of(const std::optional<Ints>& a);
std::span<const float> span_of(const std::optional<Floats>& a);

}  // namespace qkv::python
