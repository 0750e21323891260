// qkv/dtype.hpp — element types and exact conversions between them.
//
// qkv stores half-precision values as raw 16-bit patterns (`f16`, `bf16`) so
// the headers need no compiler extension. Every conversion *to* a narrower
// format rounds to nearest, ties to even (RNE), with overflow to infinity and
// gradual underflow, as IEEE 754 specifies; conversions to wider formats are
// exact.
#pragma once

#include <cstdint>
#include <string_view>

namespace qkv {

// Element type of a tensor. `boolean` is one byte per element (0 or 1) and is
// only accepted where a mask is expected.
enum class DType : std::uint8_t { f32, f64, f16, bf16, boolean };

// Bytes per element: 4, 8, 2, 2, 1.
std::size_t dtype_size(DType dtype);
// "f32", "f64", "f16", "bf16", "bool".
std::string_view dtype_name(DType dtype);
// True for the four floating-point types.
bool is_floating(DType dtype);

// IEEE 754 binary16, stored as its bit pattern.
struct f16 {
  std::uint16_t bits = 0;
};
// bfloat16 (the upper half of a binary32), stored as its bit pattern.
struct bf16 {
  std::uint16_t bits = 0;
};

// Exact widening conversions.
float to_float(f16 x);
float to_float(bf16 x);
// Rounding (RNE) narrowing conversions. NaN stays NaN (quiet).
f16 to_f16(float x);
f16 to_f16(double x);
bf16 to_bf16(float x);
bf16 to_bf16(double x);
// Rounds a double to the nearest float (RNE); provided for symmetry.
inline float to_f32(double x) { return static_cast<float>(x); }

// The DType of a C++ element type, for typed views and tensors.
template <class T>
struct dtype_of;
template <>
struct dtype_of<float> {
  static constexpr DType value = DType::f32;
};
template <>
struct dtype_of<double> {
  static constexpr DType value = DType::f64;
};
template <>
struct dtype_of<f16> {
  static constexpr DType value = DType::f16;
};
template <>
struct dtype_of<bf16> {
  static constexpr DType value = DType::bf16;
};
template <>
struct dtype_of<bool> {
  static constexpr DType value = DType::boolean;
};
template <class T>
inline constexpr DType dtype_of_v = dtype_of<T>::value;

}  // namespace qkv
