// Element types and their conversions. Narrowing goes through one generic
// round-to-nearest-even on doubles, so f16 and bf16 share one tested path.
#include "qkv/dtype.hpp"

#include <bit>
#include <cmath>
#include <iterator>
#include <limits>

namespace qkv {

namespace {

// Per dtype, in DType's order: bytes per element and name.
struct DTypeRow {
  std::size_t size;
  std::string_view name;
};
constexpr DTypeRow kDTypes[] = {{4, "f32"}, {8, "f64"}, {2, "f16"}, {2, "bf16"}, {1, "bool"}};
static_assert(std::size(kDTypes) == static_cast<std::size_t>(DType::boolean) + 1);

// The row of a dtype; none for a value that is no DType.
const DTypeRow* row_of(DType dtype) {
  const auto i = static_cast<std::size_t>(dtype);
  return i < std::size(kDTypes) ? &kDTypes[i] : nullptr;
}

}  // namespace

std::size_t dtype_size(DType dtype) { return row_of(dtype) ? row_of(dtype)->size : 0; }

std::string_view dtype_name(DType dtype) { return row_of(dtype) ? row_of(dtype)->name : "?"; }

bool is_floating(DType dtype) {
  return dtype == DType::f32 || dtype == DType::f64 || dtype == DType::f16 || dtype == DType::bf16;
}

namespace {

// Rounds finite x to a binary format with `precision` significand bits
// (implicit bit included), minimum normal exponent `emin` and maximum exponent
// `emax`: RNE, gradual underflow, overflow to +-inf. The result is exactly
// representable in that format (and so in float for the formats used here).
double round_to_format(double x, int precision, int emin, int emax) {
  if (!std::isfinite(x) || x == 0.0) return x;
  int e = 0;
  std::frexp(x, &e);                           // |x| = m * 2^e, m in [0.5, 1)
  const int exponent = std::max(e - 1, emin);  // exponent of the leading bit
  const int quantum_exp = exponent - (precision - 1);
  // Scaling by a power of two is exact; nearbyint rounds half to even in the
  // default rounding mode.
  const double r = std::ldexp(std::nearbyint(std::ldexp(x, -quantum_exp)), quantum_exp);
  const double max_finite = std::ldexp(2.0 - std::ldexp(1.0, 1 - precision), emax);
  if (std::fabs(r) > max_finite) return std::copysign(std::numeric_limits<double>::infinity(), x);
  return r;
}

}  // namespace

float to_float(f16 x) {
  const std::uint32_t sign = static_cast<std::uint32_t>(x.bits & 0x8000) << 16;
  const std::uint32_t exponent = (x.bits >> 10) & 0x1f;
  const std::uint32_t mantissa = x.bits & 0x3ff;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
    return sign != 0 ? -magnitude : magnitude;
  }
  if (exponent == 31) {
    return std::bit_cast<float>(sign | (mantissa == 0 ? 0x7f800000u : 0x7fc00000u));
  }
  // Rebias the exponent (15 -> 127) and widen the mantissa (10 -> 23 bits).
  return std::bit_cast<float>(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

float to_float(bf16 x) { return std::bit_cast<float>(static_cast<std::uint32_t>(x.bits) << 16); }

f16 to_f16(double x) {
  // A double that is exactly a float (any value widened from f32 or a 16-bit
  // type) rounds the same through the float overload, on its bits.
  if (const auto f = static_cast<float>(x); static_cast<double>(f) == x) return to_f16(f);
  const std::uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  if (std::isnan(x)) return {static_cast<std::uint16_t>(sign | 0x7e00)};
  const double r = std::fabs(round_to_format(x, 11, -14, 15));
  if (std::isinf(r)) return {static_cast<std::uint16_t>(sign | 0x7c00)};
  if (r < std::ldexp(1.0, -14)) {  // subnormal or zero: r = mantissa * 2^-24
    return {static_cast<std::uint16_t>(sign | static_cast<std::uint16_t>(std::ldexp(r, 24)))};
  }
  int e = 0;
  const double m = std::frexp(r, &e);  // r = m * 2^e, m in [0.5, 1)
  const auto exponent = static_cast<std::uint16_t>(e - 1 + 15);
  const auto mantissa = static_cast<std::uint16_t>(std::ldexp(m, 11) - 1024);
  return {static_cast<std::uint16_t>(sign | (exponent << 10) | mantissa)};
}

// The same rounding as the double overload, on the float's bits: a float's
// 24-bit significand is cut to 11 bits (fewer for f16 subnormals), rounding
// to nearest even once.
f16 to_f16(float x) {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(x);
  const auto sign = static_cast<std::uint16_t>((bits >> 16) & 0x8000);
  const std::uint32_t magnitude = bits & 0x7fffffff;
  if (magnitude > 0x7f800000) return {static_cast<std::uint16_t>(sign | 0x7e00)};   // NaN
  if (magnitude >= 0x47800000) return {static_cast<std::uint16_t>(sign | 0x7c00)};  // >= 2^16
  if (magnitude < 0x38800000) {
    // Below 2^-14 the f16 is q * 2^-24 with q = significand * 2^(e - 150 + 24),
    // a right shift by 126 - e >= 14 bits, rounded to nearest even. A q of
    // 1024 is the smallest normal, whose pattern is also 1024. Float
    // subnormals (e = 0) are far below half of 2^-24: they give 0.
    const std::uint32_t e = magnitude >> 23;
    const std::uint32_t shift = 126 - e;
    if (shift >= 25) return {sign};
    const std::uint32_t significand = (magnitude & 0x7fffff) | 0x800000;
    std::uint32_t q = significand >> shift;
    const std::uint32_t rest = significand & ((std::uint32_t{1} << shift) - 1);
    const std::uint32_t half = std::uint32_t{1} << (shift - 1);
    if (rest > half || (rest == half && (q & 1) != 0)) ++q;
    return {static_cast<std::uint16_t>(sign | q)};
  }
  // Rebias the exponent (127 -> 15) and keep the top 10 mantissa bits; the
  // 13 cut bits round to nearest even. A carry moves into the exponent, and
  // past 65504 into the infinity pattern 0x7c00.
  const std::uint32_t rebased = magnitude - (std::uint32_t{112} << 23);
  std::uint32_t h = rebased >> 13;
  const std::uint32_t cut = rebased & 0x1fff;
  h += static_cast<std::uint32_t>((cut > 0x1000) | ((cut == 0x1000) & ((h & 1) != 0)));
  return {static_cast<std::uint16_t>(sign | h)};
}

bf16 to_bf16(double x) {
  if (const auto f = static_cast<float>(x); static_cast<double>(f) == x) return to_bf16(f);
  if (std::isnan(x)) return {static_cast<std::uint16_t>(std::signbit(x) ? 0xffc0 : 0x7fc0)};
  // The rounded value is a bf16, hence exactly a float whose low 16 bits are 0.
  const auto f = static_cast<float>(round_to_format(x, 8, -126, 127));
  return {static_cast<std::uint16_t>(std::bit_cast<std::uint32_t>(f) >> 16)};
}

bf16 to_bf16(float x) {
  if (std::isnan(x)) return {static_cast<std::uint16_t>(std::signbit(x) ? 0xffc0 : 0x7fc0)};
  // Round the low 16 bits to nearest even; a carry moves into the exponent
  // (and past the largest bf16 into infinity).
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(x);
  return {static_cast<std::uint16_t>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16)};
}

}  // namespace qkv
