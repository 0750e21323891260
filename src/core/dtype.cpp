// Element types and their conversions. Narrowing goes through one generic
// round-to-nearest-even on doubles, so f16 and bf16 share one tested path.
#include "qkv/dtype.hpp"

#include <bit>
#include <cmath>
#include <limits>

namespace qkv {

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return 4;
    case DType::f64:
      return 8;
    case DType::f16:
      return 2;
    case DType::bf16:
      return 2;
    case DType::boolean:
      return 1;
  }
  return 0;
}

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return "f32";
    case DType::f64:
      return "f64";
    case DType::f16:
      return "f16";
    case DType::bf16:
      return "bf16";
    case DType::boolean:
      return "bool";
  }
  return "?";
}

bool is_floating(DType dtype) { return dtype != DType::boolean; }

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
  const int sign = x.bits >> 15;
  const int exponent = (x.bits >> 10) & 0x1f;
  const int mantissa = x.bits & 0x3ff;
  float magnitude;
  if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -24);
  } else if (exponent == 31) {
    magnitude = mantissa == 0 ? std::numeric_limits<float>::infinity()
                              : std::numeric_limits<float>::quiet_NaN();
  } else {
    magnitude = std::ldexp(static_cast<float>(1024 + mantissa), exponent - 25);
  }
  return sign ? -magnitude : magnitude;
}

float to_float(bf16 x) { return std::bit_cast<float>(static_cast<std::uint32_t>(x.bits) << 16); }

f16 to_f16(double x) {
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

f16 to_f16(float x) { return to_f16(static_cast<double>(x)); }

bf16 to_bf16(double x) {
  if (std::isnan(x)) return {static_cast<std::uint16_t>(std::signbit(x) ? 0xffc0 : 0x7fc0)};
  // The rounded value is a bf16, hence exactly a float whose low 16 bits are 0.
  const auto f = static_cast<float>(round_to_format(x, 8, -126, 127));
  return {static_cast<std::uint16_t>(std::bit_cast<std::uint32_t>(f) >> 16)};
}

bf16 to_bf16(float x) { return to_bf16(static_cast<double>(x)); }

}  // namespace qkv
