// qkv/positional.hpp — position encodings (sinusoidal, RoPE) and position-bias
// helpers (T5 buckets, ALiBi slopes).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "qkv/tensor.hpp"

namespace qkv {

// Sinusoidal absolute positions ("Attention Is All You Need"), [n, d]:
//   pe[pos, 2t]     = sin(pos / base^(2t / d))
//   pe[pos, 2t + 1] = cos(pos / base^(2t / d))
// Computed in double and rounded once to `dtype` (f32, f64, f16 or bf16).
// Throws qkv::Error if n < 0, d < 1, base <= 1 or dtype is not floating.
Tensor sinusoidal_positions(std::int64_t n, std::int64_t d, double base = 10000.0,
                            DType dtype = DType::f32);

// The bucket of a relative position (key position minus query position) in
// T5's relative attention bias. bidirectional: half the buckets for keys
// before the query, half for keys after; causal (false): keys after the query
// all fall in bucket 0. Within each half, the first half of the buckets are
// exact distances, the rest grow logarithmically up to `max_distance`.
// Throws qkv::Error unless num_buckets >= 2 (>= 4 if bidirectional) and
// max_distance > the number of exact buckets.
std::int64_t t5_relative_bucket(std::int64_t relative_position, std::int64_t num_buckets,
                                std::int64_t max_distance, bool bidirectional);

// ALiBi slopes for `num_heads` heads (Press et al. 2022): the geometric
// sequence 2^(-8/n), 2^(-16/n), ... for n = num_heads a power of two; for
// other counts, the slopes of the nearest lower power of two followed by every
// other slope of the next power of two, as the paper's reference code does.
std::vector<float> alibi_slopes(std::int64_t num_heads);

// 2-D sine-cosine positions of a height x width grid of patches, [height *
// width, dim], exactly MAE's get_2d_sincos_pos_embed (also used by I-JEPA and
// DiT), with patches in row-major order: patch p = y * width + x. With
// q = dim / 4 and frequencies w_t = 1 / base^(t / q), t < q:
//   pe[p, t]         = sin(x w_t)     pe[p, q + t]     = cos(x w_t)    x = column
//   pe[p, 2q + t]    = sin(y w_t)     pe[p, 3q + t]    = cos(y w_t)    y = row
// Each half is MAE's 1-D embedding at dimension dim / 2: every sine, then every
// cosine (not interleaved as in sinusoidal_positions). The FIRST half encodes
// the COLUMN: MAE builds its grid with np.meshgrid(grid_w, grid_h), so the
// grid[0] it passes to the half it calls emb_h holds the x coordinates. MAE
// prepends a zero row for the class token; that row is left to the caller.
// Computed in double and rounded once to `dtype` (f32, f64, f16 or bf16).
// Throws qkv::Error if height or width < 0, dim is not a positive multiple of
// 4, base <= 1 or dtype is not floating.
Tensor sinusoidal_positions_2d(std::int64_t height, std::int64_t width, std::int64_t dim,
                               double base = 10000.0, DType dtype = DType::f32);

// Rotary position embedding (RoPE, Su et al. 2021) of a head vector x at
// position p: pairs (x_a, x_b) rotate by angle p * base^(-2i / rotary_dim)
// for pair i; half-split pairs (i, i + rotary_dim / 2) (GPT-NeoX, Llama) or
// interleaved pairs (2i, 2i + 1) (GPT-J, the original paper). Elements past
// rotary_dim are left alone.
struct RopeConfig {
  double base = 10000.0;        // frequency base (> 1)
  bool interleaved = false;     // pairs (2i, 2i + 1) instead of (i, i + rotary_dim / 2)
  std::int64_t rotary_dim = 0;  // leading elements rotated (even); 0 = the whole head
};

// Rotates x [B, n, H, D] in place: row t of sequence b sits at position
// start_positions[b] + t (start_positions has B entries). Computed in double,
// rounded once to x's dtype (f32, f64, f16, bf16). Throws qkv::Error on bad
// shapes or configuration.
void apply_rope(TensorView x, std::span<const std::int64_t> start_positions,
                const RopeConfig& rope);

// The gradient of apply_rope, in place: given grad = dLoss/dy [B, n, H, D] for
// y = apply_rope(x), overwrites it with dLoss/dx, the transposed rotation of
// each head vector, which is the rotation by minus the angle (so it also
// undoes apply_rope). Same arguments, computation and checks as apply_rope.
void apply_rope_backward(TensorView grad, std::span<const std::int64_t> start_positions,
                         const RopeConfig& rope);

}  // namespace qkv
