// Position encodings as the library's other parts use them: RoPE's rotation
// of one position (the KV cache rotates keys on the way in with it) and of
// whole [B, n, H, D] tensors. The public functions are in qkv/positional.hpp.
#pragma once

#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "qkv/positional.hpp"

namespace qkv::detail {

inline std::int64_t resolved_rotary_dim(const RopeConfig& rope, std::int64_t head_dim) {
  return rope.rotary_dim == 0 ? head_dim : rope.rotary_dim;
}

// The rotation of one position, applied to head vectors held in double.
class Rotation {
 public:
  Rotation(const RopeConfig& rope, std::int64_t head_dim)
      : half_(resolved_rotary_dim(rope, head_dim) / 2),
        interleaved_(rope.interleaved),
        inv_freq_(static_cast<std::size_t>(half_)),
        cos_(inv_freq_.size()),
        sin_(inv_freq_.size()) {
    const auto rotary_dim = static_cast<double>(2 * half_);
    for (std::int64_t i = 0; i < half_; ++i) {
      inv_freq_[i] = std::pow(rope.base, -static_cast<double>(2 * i) / rotary_dim);
    }
  }

  std::int64_t rotary_dim() const { return 2 * half_; }

  void set_position(std::int64_t position) {
    for (std::int64_t i = 0; i < half_; ++i) {
      const double angle = static_cast<double>(position) * inv_freq_[i];
      cos_[i] = std::cos(angle);
      sin_[i] = std::sin(angle);
    }
  }

  // Rotates the first rotary_dim() elements of x by the current position.
  void rotate(double* x) const { turn(x, 1.0); }
  // The transposed rotation, which is its inverse: turns back by the angle.
  void rotate_back(double* x) const { turn(x, -1.0); }

 private:
  std::int64_t half_;
  bool interleaved_;
  std::vector<double> inv_freq_;   // [rotary_dim / 2]: base^(-2i / rotary_dim)
  std::vector<double> cos_, sin_;  // [rotary_dim / 2] at the current position

  // Each pair (a, b) turns by the angle times `direction` (+1 or -1).
  void turn(double* x, double direction) const {
    for (std::int64_t i = 0; i < half_; ++i) {
      const std::int64_t ia = interleaved_ ? 2 * i : i;
      const std::int64_t ib = interleaved_ ? 2 * i + 1 : i + half_;
      const double a = x[ia];
      const double b = x[ib];
      const double s = direction * sin_[i];
      x[ia] = a * cos_[i] - b * s;
      x[ib] = a * s + b * cos_[i];
    }
  }
};

// Turns every head vector of a validated x [B, n, H, D] by its position's
// rotation (`back`: by the transposed rotation).
void rotate_heads(TensorView x, std::span<const std::int64_t> start_positions,
                  const RopeConfig& rope, bool back);

}  // namespace qkv::detail
