// The int8 tile product on each engine (int8_product.hpp): the emulation,
// and the instructions in functions of their own target attribute, compiled
// on every x86-64 build and called only where core/isa.hpp allows them.
#include "cpu/engines/int8_product.hpp"

#include <algorithm>
#include <cstring>

#include "core/isa.hpp"
#include "cpu/engines/amx_tiles.hpp"
#include "cpu/engines/engine_table.hpp"
#include "cpu/engines/strips.hpp"

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

void product_vnni(const Int8Product& p) {
  for_each_strip(p.m, p.n, [&]<int R, int kVecs>(std::int64_t i0, std::int64_t j0) {
    vnni_micro<R, kVecs>(p, i0, j0);
  });
}

void product_amx_int8(const Int8Product& p) {
  amx_product(AmxOp::int8, {reinterpret_cast<const std::uint8_t*>(p.a), p.lda,
                            reinterpret_cast<const std::uint8_t*>(p.b), p.ldb * 4, p.c, p.ldc, p.m,
                            p.n, p.k, p.accumulate});
}

#undef QKV_VNNI
#endif

}  // namespace

namespace {

#if !QKV_INT8_X86
// Never available (engine_available), so never run.
void product_vnni(const Int8Product&) {}
void product_amx_int8(const Int8Product&) {}
#endif

// The engines in Int8Engine's order.
constexpr EngineRow<Int8Product> kEngines[] = {
    {"avx512_vnni", detail::Family::avx512_vnni, product_vnni},
    {"amx_int8", detail::Family::amx_int8, product_amx_int8},
    {"emulated int8", std::nullopt, emulate},
};
static_assert(std::size(kEngines) == static_cast<std::size_t>(Int8Engine::emulate) + 1);

}  // namespace

const char* engine_name(Int8Engine e) { return row_of(kEngines, e).name; }
bool engine_available(Int8Engine e) { return runs_now(row_of(kEngines, e), QKV_INT8_X86); }
void int8_product(Int8Engine e, const Int8Product& p) { row_of(kEngines, e).run(p); }

}  // namespace qkv::cpu::engines
