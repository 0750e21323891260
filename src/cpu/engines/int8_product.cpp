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
      return amx_product(AmxOp::int8, {reinterpret_cast<const std::uint8_t*>(p.a), p.lda,
                                       reinterpret_cast<const std::uint8_t*>(p.b), p.ldb * 4, p.c,
                                       p.ldc, p.m, p.n, p.k, p.accumulate});
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
