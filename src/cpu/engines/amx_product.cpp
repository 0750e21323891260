// The AMX tile product of amx_tiles.hpp, in a function of its own target
// attribute (Highway 1.0.3 has no AMX).
#include <algorithm>
#include <cstring>

#include "cpu/engines/amx_tiles.hpp"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

namespace qkv::cpu::engines {

__attribute__((target("amx-tile,amx-bf16,amx-int8"))) void amx_product(AmxOp op,
                                                                       const AmxOperands& p) {
  TileConfig cfg;
  for (int t = 0; t < 5; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
  alignas(64) std::uint8_t c_stage[2][16][64];
  alignas(64) std::uint8_t a_stage[16][64];
  alignas(64) std::uint8_t b_stage[2][16][64];
  const std::int64_t c_stride = p.ldc * 4;  // bytes
  for (std::int64_t i0 = 0; i0 < p.m; i0 += 16) {
    const std::int64_t rows = std::min<std::int64_t>(16, p.m - i0);
    for (std::int64_t j0 = 0; j0 < p.n; j0 += 32) {
      const int tiles = j0 + 32 <= p.n ? 2 : 1;
      auto* c = static_cast<std::uint8_t*>(p.c) + i0 * c_stride + j0 * 4;
      if (!p.accumulate) {
        _tile_zero(0);
        _tile_zero(1);
      } else if (rows == 16) {
        _tile_loadd(0, c, c_stride);
        if (tiles == 2) _tile_loadd(1, c + 64, c_stride);
      } else {
        std::memset(c_stage, 0, sizeof c_stage);
        for (std::int64_t r = 0; r < rows; ++r) {
          for (int t = 0; t < tiles; ++t) std::memcpy(c_stage[t][r], c + r * c_stride + 64 * t, 64);
        }
        _tile_loadd(0, c_stage[0], 64);
        _tile_loadd(1, c_stage[1], 64);
      }
      for (std::int64_t x0 = 0; x0 < p.depth; x0 += 64) {
        const std::int64_t bytes = std::min<std::int64_t>(64, p.depth - x0);
        const std::uint8_t* a = p.a + i0 * p.a_stride + x0;
        const std::uint8_t* b = p.b + (x0 / 4) * p.b_stride + 4 * j0;
        if (rows == 16 && bytes == 64) {
          _tile_loadd(2, a, p.a_stride);
        } else {
          std::memset(a_stage, 0, sizeof a_stage);
          for (std::int64_t r = 0; r < rows; ++r) {
            std::memcpy(a_stage[r], a + r * p.a_stride, static_cast<std::size_t>(bytes));
          }
          _tile_loadd(2, a_stage, 64);
        }
        if (bytes == 64) {
          _tile_loadd(3, b, p.b_stride);
          if (tiles == 2) _tile_loadd(4, b + 64, p.b_stride);
        } else {
          std::memset(b_stage, 0, sizeof b_stage);
          for (std::int64_t q = 0; q < bytes / 4; ++q) {
            for (int t = 0; t < tiles; ++t)
              std::memcpy(b_stage[t][q], b + q * p.b_stride + 64 * t, 64);
          }
          _tile_loadd(3, b_stage[0], 64);
          _tile_loadd(4, b_stage[1], 64);
        }
        if (op == AmxOp::bf16) {
          _tile_dpbf16ps(0, 2, 3);
          if (tiles == 2) _tile_dpbf16ps(1, 2, 4);
        } else {
          _tile_dpbssd(0, 2, 3);
          if (tiles == 2) _tile_dpbssd(1, 2, 4);
        }
      }
      if (rows == 16) {
        _tile_stored(0, c, c_stride);
        if (tiles == 2) _tile_stored(1, c + 64, c_stride);
      } else {
        _tile_stored(0, c_stage[0], 64);
        _tile_stored(1, c_stage[1], 64);
        for (std::int64_t r = 0; r < rows; ++r) {
          for (int t = 0; t < tiles; ++t) std::memcpy(c + r * c_stride + 64 * t, c_stage[t][r], 64);
        }
      }
    }
  }
  _tile_release();
}

}  // namespace qkv::cpu::engines
#endif
