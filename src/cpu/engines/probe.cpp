// Register probes (probe.hpp): each runs kChains independent accumulators
// of one instruction, enough to cover its latency on the ports that issue
// it, doubling the iterations until a run lasts the requested time, and
// keeps the best of three runs.
#include "cpu/engines/probe.hpp"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>

#include "cpu/engines/amx_tiles.hpp"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define QKV_PROBES_X86 1
#include <immintrin.h>
#else
#define QKV_PROBES_X86 0
#endif

namespace qkv::cpu::engines {
namespace {

#if QKV_PROBES_X86
constexpr int kChains = 12;

__attribute__((target("avx512f"))) double fma_chains(std::int64_t iterations, float* sink) {
  const __m512 m = _mm512_set1_ps(0.999f), c = _mm512_set1_ps(0.001f);
  __m512 acc[kChains];
  for (auto& y : acc) y = _mm512_set1_ps(1.0f);
  for (std::int64_t i = 0; i < iterations; ++i) {
    for (auto& y : acc) y = _mm512_fmadd_ps(y, m, c);
  }
  float lanes[16];
  _mm512_storeu_ps(lanes, acc[0]);
  *sink = lanes[0];
  return static_cast<double>(iterations) * kChains * 32.0;
}

// Pairs of 2^-12 and 0: each step adds 2^-24 per lane, values stay normal.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) double dpbf16_chains(
    std::int64_t iterations, float* sink) {
  const __m512i x = _mm512_set1_epi32(0x00003980);
  __m512 acc[kChains];
  for (auto& y : acc) y = _mm512_set1_ps(1.0f);
  for (std::int64_t i = 0; i < iterations; ++i) {
    for (auto& y : acc) y = _mm512_dpbf16_ps(y, (__m512bh)x, (__m512bh)x);
  }
  float lanes[16];
  _mm512_storeu_ps(lanes, acc[0]);
  *sink = lanes[0];
  return static_cast<double>(iterations) * kChains * 64.0;
}

__attribute__((target("avx512f,avx512vnni"))) double dpbusd_chains(std::int64_t iterations,
                                                                   float* sink) {
  const __m512i x = _mm512_set1_epi8(1);
  __m512i acc[kChains];
  for (auto& y : acc) y = _mm512_setzero_si512();
  for (std::int64_t i = 0; i < iterations; ++i) {
    for (auto& y : acc) y = _mm512_dpbusd_epi32(y, x, x);
  }
  int lanes[16];
  _mm512_storeu_si512(lanes, acc[0]);
  *sink = static_cast<float>(lanes[0]);
  return static_cast<double>(iterations) * kChains * 128.0;
}

// Four accumulator tiles (tmm0-3) against two A and two B tiles (tmm4-7):
// each product is 16 x 16 x 32 bf16 multiply-adds (or 16 x 16 x 64 int8).
__attribute__((target("amx-tile,amx-bf16,amx-int8"))) double amx_chains(std::int64_t iterations,
                                                                        bool int8, float* sink) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
  alignas(64) static const std::uint8_t zeros[16 * 64] = {};
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, zeros, 64);
  _tile_loadd(5, zeros, 64);
  _tile_loadd(6, zeros, 64);
  _tile_loadd(7, zeros, 64);
  for (std::int64_t i = 0; i < iterations; ++i) {
    if (int8) {
      _tile_dpbssd(0, 4, 6);
      _tile_dpbssd(1, 4, 7);
      _tile_dpbssd(2, 5, 6);
      _tile_dpbssd(3, 5, 7);
    } else {
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float out[16 * 16];
  _tile_stored(0, out, 64);
  _tile_release();
  *sink = out[0];
  return static_cast<double>(iterations) * 4 * 16 * 16 * (int8 ? 64 : 32) * 2.0;
}
#endif

// Best rate of `chains` over three runs of at least `seconds` / 4 each.
template <class Chains>
double best_rate(double seconds, Chains chains) {
  float sink = 0.0f;
  std::int64_t iterations = 1 << 10;
  const auto timed = [&] {
    const auto start = std::chrono::steady_clock::now();
    const double ops = chains(iterations, &sink);
    const std::chrono::duration<double> t = std::chrono::steady_clock::now() - start;
    return std::pair<double, double>{ops, t.count()};
  };
  while (timed().second < seconds / 4 && iterations < (std::int64_t{1} << 40)) iterations *= 2;
  double best = 0.0;
  for (int r = 0; r < 3; ++r) {
    const auto [ops, t] = timed();
    best = std::max(best, ops / std::max(t, 1e-9) / 1e9);
  }
  volatile float keep = sink;
  (void)keep;
  return best;
}

}  // namespace

double probe_avx512_fma_gflops(double seconds) {
#if QKV_PROBES_X86
  return best_rate(seconds, fma_chains);
#else
  (void)seconds;
  return 0.0;
#endif
}

double probe_family_gops(detail::Family f, double seconds) {
#if QKV_PROBES_X86
  switch (f) {
    case detail::Family::avx512_bf16:
      return best_rate(seconds, dpbf16_chains);
    case detail::Family::avx512_vnni:
      return best_rate(seconds, dpbusd_chains);
    case detail::Family::amx_bf16:
      return best_rate(seconds, [](std::int64_t n, float* s) { return amx_chains(n, false, s); });
    case detail::Family::amx_int8:
      return best_rate(seconds, [](std::int64_t n, float* s) { return amx_chains(n, true, s); });
  }
#endif
  (void)f;
  (void)seconds;
  return 0.0;
}

}  // namespace qkv::cpu::engines
