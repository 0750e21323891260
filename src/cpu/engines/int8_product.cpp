// The int8 tile product on each engine (int8_product.hpp): the emulation,
// and the instructions in functions of their own target attribute, compiled
// on every x86-64 build and called only where core/isa.hpp allows them.
#include "cpu/engines/int8_product.hpp"

#include <algorithm>
#include <cstring>

#include "core/isa.hpp"
#include "cpu/engines/amx_tiles.hpp"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define QKV_INT8_X86 1
#include <immintrin.h>
#else
#define QKV_INT8_X86 0
#endif

namespace qkv::cpu::engines {
namespace {

void emulate(const Int8Product& p) {
  for (std::int64_t i = 0; i < p.m; ++i) {
    for (std::int64_t j = 0; j < p.n; ++j) {
      std::int32_t acc = p.accumulate ? p.c[i * p.ldc + j] : 0;
      for (std::int64_t x = 0; x < p.k; ++x) {
        acc += static_cast<std::int32_t>(p.a[i * p.lda + x]) *
               static_cast<std::int32_t>(p.b[(x / 4) * 4 * p.ldb + 4 * j + x % 4]);
      }
      p.c[i * p.ldc + j] = acc;
    }
  }
}

#if QKV_INT8_X86
#define QKV_VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))

// C rows [i0, i0 + R), vectors [j0, j0 + 16 kVecs): B's bytes flipped to
// unsigned (b + 128) against A's quads broadcast, then 128 sum_x A[i][x]
// taken off each row.
template <int R, int kVecs>
QKV_VNNI void vnni_micro(const Int8Product& p, std::int64_t i0, std::int64_t j0) {
  __m512i acc[R][kVecs];
  std::int32_t row_sum[R] = {};
  for (int r = 0; r < R; ++r) {
    for (std::int64_t x = 0; x < p.k; ++x) row_sum[r] += p.a[(i0 + r) * p.lda + x];
    for (int v = 0; v < kVecs; ++v) {
      acc[r][v] = p.accumulate ? _mm512_loadu_si512(p.c + (i0 + r) * p.ldc + j0 + 16 * v)
                               : _mm512_setzero_si512();
    }
  }
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (std::int64_t x = 0; x < p.k; x += 4) {
    const std::int8_t* b = p.b + (x / 4) * 4 * p.ldb + 4 * j0;
    __m512i bv[kVecs];
    for (int v = 0; v < kVecs; ++v) bv[v] = _mm512_xor_si512(_mm512_loadu_si512(b + 64 * v), flip);
    for (int r = 0; r < R; ++r) {
      std::int32_t quad;
      std::memcpy(&quad, p.a + (i0 + r) * p.lda + x, sizeof quad);
      const __m512i av = _mm512_set1_epi32(quad);
      for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm512_dpbusd_epi32(acc[r][v], bv[v], av);
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m512i fix = _mm512_set1_epi32(128 * row_sum[r]);
    for (int v = 0; v < kVecs; ++v) {
      _mm512_storeu_si512(p.c + (i0 + r) * p.ldc + j0 + 16 * v, _mm512_sub_epi32(acc[r][v], fix));
    }
  }
}

template <int kVecs>
QKV_VNNI void vnni_strip(const Int8Product& p, std::int64_t i0, std::int64_t j0) {
  switch (std::min<std::int64_t>(p.m - i0, 8)) {
    case 1:
      return vnni_micro<1, kVecs>(p, i0, j0);
    case 2:
      return vnni_micro<2, kVecs>(p, i0, j0);
    case 3:
      return vnni_micro<3, kVecs>(p, i0, j0);
    case 4:
      return vnni_micro<4, kVecs>(p, i0, j0);
    case 5:
      return vnni_micro<5, kVecs>(p, i0, j0);
    case 6:
      return vnni_micro<6, kVecs>(p, i0, j0);
    case 7:
      return vnni_micro<7, kVecs>(p, i0, j0);
    default:
      return vnni_micro<8, kVecs>(p, i0, j0);
  }
}

QKV_VNNI void product_vnni(const Int8Product& p) {
  for (std::int64_t j0 = 0; j0 < p.n; j0 += 32) {
    for (std::int64_t i0 = 0; i0 < p.m; i0 += 8) {
      if (j0 + 32 <= p.n) {
        vnni_strip<2>(p, i0, j0);
      } else {
        vnni_strip<1>(p, i0, j0);
      }
    }
  }
}

// As product_amx_bf16 (bf16_product.cpp), with int8 quads: an A tile is 16
// rows x 64 bytes, a B tile 16 quad rows x 16 columns.
__attribute__((target("amx-tile,amx-int8"))) void product_amx_int8(const Int8Product& p) {
  TileConfig cfg;
  for (int t = 0; t < 5; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
  alignas(64) std::int32_t c_stage[2][16][16];
  alignas(64) std::int8_t a_stage[16][64];
  alignas(64) std::int8_t b_stage[2][16][64];
  const std::int64_t b_quad_row = 4 * p.ldb;
  for (std::int64_t i0 = 0; i0 < p.m; i0 += 16) {
    const std::int64_t rows = std::min<std::int64_t>(16, p.m - i0);
    for (std::int64_t j0 = 0; j0 < p.n; j0 += 32) {
      const int tiles = j0 + 32 <= p.n ? 2 : 1;
      std::int32_t* c = p.c + i0 * p.ldc + j0;
      if (!p.accumulate) {
        _tile_zero(0);
        _tile_zero(1);
      } else if (rows == 16) {
        _tile_loadd(0, c, p.ldc * 4);
        if (tiles == 2) _tile_loadd(1, c + 16, p.ldc * 4);
      } else {
        std::memset(c_stage, 0, sizeof c_stage);
        for (std::int64_t r = 0; r < rows; ++r) {
          for (int t = 0; t < tiles; ++t) std::memcpy(c_stage[t][r], c + r * p.ldc + 16 * t, 64);
        }
        _tile_loadd(0, c_stage[0], 64);
        _tile_loadd(1, c_stage[1], 64);
      }
      for (std::int64_t x0 = 0; x0 < p.k; x0 += 64) {
        const std::int64_t depth = std::min<std::int64_t>(64, p.k - x0);
        const std::int8_t* a = p.a + i0 * p.lda + x0;
        const std::int8_t* b = p.b + (x0 / 4) * b_quad_row + 4 * j0;
        if (rows == 16 && depth == 64) {
          _tile_loadd(2, a, p.lda);
        } else {
          std::memset(a_stage, 0, sizeof a_stage);
          for (std::int64_t r = 0; r < rows; ++r) {
            std::memcpy(a_stage[r], a + r * p.lda, static_cast<std::size_t>(depth));
          }
          _tile_loadd(2, a_stage, 64);
        }
        if (depth == 64) {
          _tile_loadd(3, b, b_quad_row);
          if (tiles == 2) _tile_loadd(4, b + 64, b_quad_row);
        } else {
          std::memset(b_stage, 0, sizeof b_stage);
          for (std::int64_t q = 0; q < depth / 4; ++q) {
            for (int t = 0; t < tiles; ++t) {
              std::memcpy(b_stage[t][q], b + q * b_quad_row + 64 * t, 64);
            }
          }
          _tile_loadd(3, b_stage[0], 64);
          _tile_loadd(4, b_stage[1], 64);
        }
        _tile_dpbssd(0, 2, 3);
        if (tiles == 2) _tile_dpbssd(1, 2, 4);
      }
      if (rows == 16) {
        _tile_stored(0, c, p.ldc * 4);
        if (tiles == 2) _tile_stored(1, c + 16, p.ldc * 4);
      } else {
        _tile_stored(0, c_stage[0], 64);
        _tile_stored(1, c_stage[1], 64);
        for (std::int64_t r = 0; r < rows; ++r) {
          for (int t = 0; t < tiles; ++t) std::memcpy(c + r * p.ldc + 16 * t, c_stage[t][r], 64);
        }
      }
    }
  }
  _tile_release();
}
#undef QKV_VNNI
#endif

}  // namespace

const char* engine_name(Int8Engine e) {
  switch (e) {
    case Int8Engine::avx512_vnni:
      return "avx512_vnni";
    case Int8Engine::amx_int8:
      return "amx_int8";
    case Int8Engine::emulate:
      return "emulated int8";
  }
  return "?";
}

bool engine_available(Int8Engine e) {
  switch (e) {
    case Int8Engine::avx512_vnni:
      return QKV_INT8_X86 && detail::family_allowed(detail::Family::avx512_vnni);
    case Int8Engine::amx_int8:
      return QKV_INT8_X86 && detail::family_allowed(detail::Family::amx_int8);
    case Int8Engine::emulate:
      return true;
  }
  return false;
}

void int8_product(Int8Engine e, const Int8Product& p) {
  switch (e) {
#if QKV_INT8_X86
    case Int8Engine::avx512_vnni:
      return product_vnni(p);
    case Int8Engine::amx_int8:
      return product_amx_int8(p);
#else
    case Int8Engine::avx512_vnni:
    case Int8Engine::amx_int8:
      return emulate(p);
#endif
    case Int8Engine::emulate:
      return emulate(p);
  }
}

}  // namespace qkv::cpu::engines
