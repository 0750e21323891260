#include "qkv/positional.hpp"

#include <cmath>
#include <limits>
#include <string>

#include "core/checks.hpp"
#include "core/elements.hpp"
#include "core/positional.hpp"
#include "core/rows.hpp"

namespace qkv {
namespace detail {

void rotate_heads(TensorView x, std::span<const std::int64_t> start_positions,
                  const RopeConfig& rope, bool back) {
  Rotation rotation(rope, x.size(3));
  const std::int64_t rotary_dim = rotation.rotary_dim();
  const LoadRow load = load_row_for(x.dtype());
  const StoreRow store = store_row_for(x.dtype());
  std::vector<double> row(static_cast<std::size_t>(rotary_dim));
  for (std::int64_t b = 0; b < x.size(0); ++b) {
    for (std::int64_t t = 0; t < x.size(1); ++t) {
      rotation.set_position(start_positions[b] + t);
      for (std::int64_t h = 0; h < x.size(2); ++h) {
        void* head = at(x.data(), x.dtype(), b * x.stride(0) + t * x.stride(1) + h * x.stride(2));
        load(head, x.stride(3), row.data(), rotary_dim);
        if (back) {
          rotation.rotate_back(row.data());
        } else {
          rotation.rotate(row.data());
        }
        store(row.data(), head, x.stride(3), rotary_dim);
      }
    }
  }
}

}  // namespace detail

namespace {

using detail::Reasons;
using detail::throw_if;
using std::to_string;

// Checks a call of apply_rope (or its backward, whose tensor is `name`),
// listing every problem. x is rotated in place, so it is checked as an
// output: no two of its indices may address the same element.
void check_rope_call(const char* name, TensorView x, std::span<const std::int64_t> start_positions,
                     const RopeConfig& rope) {
  Reasons r;
  detail::Aliasing in_place;
  if (!detail::check_output(name, x, {.rank = 4, .layout = "[B, n, H, D]", .floating = true},
                            in_place, r)) {
    detail::check_rope(rope, -1, "D", r);
    throw_if(r);
  }
  detail::check_rope(rope, x.size(3), "D", r);
  const std::int64_t batch = x.size(0);
  const std::int64_t n = x.size(1);
  if (static_cast<std::int64_t>(start_positions.size()) != batch) {
    r.push_back("start_positions: expected one position per sequence (B = " + to_string(batch) +
                "), got " + to_string(start_positions.size()));
  } else {
    for (std::size_t b = 0; b < start_positions.size(); ++b) {
      const std::int64_t p = start_positions[b];
      if (p < 0) {
        r.push_back("start_positions[" + to_string(b) + "]: expected a position >= 0, got " +
                    to_string(p));
      } else if (n > 0 && p > std::numeric_limits<std::int64_t>::max() - (n - 1)) {
        r.push_back("start_positions[" + to_string(b) + "]: " + to_string(p) + " + " +
                    to_string(n - 1) + " (its last row) overflows int64");
      }
    }
  }
  throw_if(r);
}

}  // namespace

void apply_rope(TensorView x, std::span<const std::int64_t> start_positions,
                const RopeConfig& rope) {
  check_rope_call("x", x, start_positions, rope);
  detail::rotate_heads(x, start_positions, rope, false);
}

void apply_rope_backward(TensorView grad, std::span<const std::int64_t> start_positions,
                         const RopeConfig& rope) {
  check_rope_call("grad", grad, start_positions, rope);
  detail::rotate_heads(grad, start_positions, rope, true);
}

Tensor sinusoidal_positions(std::int64_t n, std::int64_t d, double base, DType dtype) {
  std::vector<std::string> reasons;
  if (n < 0) reasons.push_back("sinusoidal_positions: n must be >= 0, got " + std::to_string(n));
  if (d < 1) reasons.push_back("sinusoidal_positions: d must be >= 1, got " + std::to_string(d));
  if (!(base > 1.0) || !std::isfinite(base)) {
    reasons.push_back("sinusoidal_positions: base must be finite and > 1, got " +
                      std::to_string(base));
  }
  if (!is_floating(dtype)) {
    reasons.push_back("sinusoidal_positions: dtype must be f32, f64, f16 or bf16, got " +
                      std::string(dtype_name(dtype)));
  }
  if (!reasons.empty()) throw Error(reasons);
  Tensor pe(dtype, {n, d});
  for (std::int64_t pos = 0; pos < n; ++pos) {
    for (std::int64_t c = 0; c < d; ++c) {
      const double frequency =
          std::pow(base, -static_cast<double>(c - c % 2) / static_cast<double>(d));
      const double angle = static_cast<double>(pos) * frequency;
      pe.set({pos, c}, c % 2 == 0 ? std::sin(angle) : std::cos(angle));
    }
  }
  return pe;
}

std::int64_t t5_relative_bucket(std::int64_t relative_position, std::int64_t num_buckets,
                                std::int64_t max_distance, bool bidirectional) {
  std::int64_t buckets = num_buckets;
  std::int64_t bucket = 0;
  std::int64_t distance = 0;
  if (bidirectional) {
    buckets /= 2;
    if (relative_position > 0) bucket += buckets;  // keys after the query
    distance = relative_position < 0 ? -relative_position : relative_position;
  } else {
    distance = relative_position < 0 ? -relative_position : 0;  // keys after share bucket 0
  }
  const std::int64_t max_exact = buckets / 2;
  if (max_exact < 1 || max_distance <= max_exact) {
    throw Error("t5_relative_bucket: need num_buckets >= " + std::to_string(bidirectional ? 4 : 2) +
                " and max_distance > " + std::to_string(max_exact) + ", got num_buckets = " +
                std::to_string(num_buckets) + ", max_distance = " + std::to_string(max_distance));
  }
  if (distance < max_exact) return bucket + distance;
  // Logarithmic buckets between max_exact and max_distance, computed in float
  // in the same order, and truncated, as T5's reference implementation does.
  const float ratio = static_cast<float>(distance) / static_cast<float>(max_exact);
  const auto log_range = static_cast<float>(
      std::log(static_cast<double>(max_distance) / static_cast<double>(max_exact)));
  const float steps = std::log(ratio) / log_range * static_cast<float>(buckets - max_exact);
  const auto large = max_exact + static_cast<std::int64_t>(steps);
  return bucket + std::min(large, buckets - 1);
}

std::vector<float> alibi_slopes(std::int64_t num_heads) {
  if (num_heads < 1) {
    throw Error("alibi_slopes: num_heads must be >= 1, got " + std::to_string(num_heads));
  }
  // Slopes of a power-of-two head count n: 2^(-8 (i + 1) / n).
  const auto power_of_two = [](std::int64_t n) {
    std::vector<double> s(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i) s[i] = std::exp2(-8.0 * double(i + 1) / double(n));
    return s;
  };
  std::int64_t lower = 1;
  while (lower * 2 <= num_heads) lower *= 2;
  std::vector<double> slopes = power_of_two(lower);
  const std::vector<double> upper = power_of_two(2 * lower);
  for (std::int64_t i = 0; static_cast<std::int64_t>(slopes.size()) < num_heads; i += 2) {
    slopes.push_back(upper[i]);
  }
  return std::vector<float>(slopes.begin(), slopes.end());
}

Tensor sinusoidal_positions_2d(std::int64_t height, std::int64_t width, std::int64_t dim,
                               double base, DType dtype) {
  std::vector<std::string> reasons;
  const std::string op = "sinusoidal_positions_2d: ";
  if (height < 0) reasons.push_back(op + "height must be >= 0, got " + std::to_string(height));
  if (width < 0) reasons.push_back(op + "width must be >= 0, got " + std::to_string(width));
  if (dim < 4 || dim % 4 != 0) {
    reasons.push_back(op +
                      "dim must be a positive multiple of 4 (a sine and a cosine per axis), got " +
                      std::to_string(dim));
  }
  if (!(base > 1.0) || !std::isfinite(base)) {
    reasons.push_back(op + "base must be finite and > 1, got " + std::to_string(base));
  }
  if (!is_floating(dtype)) {
    reasons.push_back(op + "dtype must be f32, f64, f16 or bf16, got " +
                      std::string(dtype_name(dtype)));
  }
  std::int64_t patches = 0;
  if (height >= 0 && width >= 0 && __builtin_mul_overflow(height, width, &patches)) {
    reasons.push_back(op + "height * width overflows int64");
  }
  if (!reasons.empty()) throw Error(reasons);

  // The same operations as MAE's numpy code, in double: omega = t / q, then
  // 1 / base^omega, then position * omega.
  const std::int64_t q = dim / 4;
  std::vector<double> omega(static_cast<std::size_t>(q));
  for (std::int64_t t = 0; t < q; ++t) {
    omega[t] = 1.0 / std::pow(base, static_cast<double>(t) / static_cast<double>(q));
  }
  Tensor pe(DType::f64, {patches, dim});
  double* out = pe.data<double>();
  for (std::int64_t y = 0; y < height; ++y) {
    for (std::int64_t x = 0; x < width; ++x) {
      double* row = out + (y * width + x) * dim;
      for (std::int64_t t = 0; t < q; ++t) {
        const double ax = static_cast<double>(x) * omega[t];
        const double ay = static_cast<double>(y) * omega[t];
        row[t] = std::sin(ax);
        row[q + t] = std::cos(ax);
        row[2 * q + t] = std::sin(ay);
        row[3 * q + t] = std::cos(ay);
      }
    }
  }
  return dtype == DType::f64 ? pe : to_dtype(pe, dtype);
}

}  // namespace qkv
