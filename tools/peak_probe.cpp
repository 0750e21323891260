// FMA peak probe: compiled once per Highway target by re-including this file
// (as src/cpu/flash.cpp is), so it runs the vector width the kernels run.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "peak_probe.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
// (foreach_target.h must come first: it re-includes this file per target.)
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::tools {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Independent accumulators: an FMA has 4-5 cycles of latency and current
// cores issue 2 per cycle, so at least 10 chains keep both ports busy; 12 plus
// the two constants still fit in the 16 AVX2 registers.
constexpr int kChains = 12;

// Runs `iterations` steps of kChains FMA chains and returns the flops done.
// x <- 0.999 x + 0.001 converges to 1, so the values stay normal (subnormals
// would be slow); the sum goes to `sink` so that no chain is dead code.
std::int64_t FmaChains(std::int64_t iterations, float* sink) {
  const hn::ScalableTag<float> d;
  using V = hn::Vec<decltype(d)>;
  const V m = hn::Set(d, 0.999f);
  const V c = hn::Set(d, 0.001f);
  V acc[kChains];
  for (int k = 0; k < kChains; ++k) acc[k] = hn::Set(d, static_cast<float>(k));
  for (std::int64_t i = 0; i < iterations; ++i) {
    for (int k = 0; k < kChains; ++k) acc[k] = hn::MulAdd(acc[k], m, c);
  }
  V sum = acc[0];
  for (int k = 1; k < kChains; ++k) sum = hn::Add(sum, acc[k]);
  *sink = hn::GetLane(hn::SumOfLanes(d, sum));
  return iterations * kChains * 2 * static_cast<std::int64_t>(hn::Lanes(d));
}

const char* Target() { return hwy::TargetName(HWY_TARGET); }

}  // namespace HWY_NAMESPACE
}  // namespace qkv::tools
HWY_AFTER_NAMESPACE();

#if HWY_ONCE

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <vector>

#include "peak_probe.hpp"

namespace qkv::tools {

HWY_EXPORT(FmaChains);
HWY_EXPORT(Target);

namespace {

struct ProbeRun {
  double seconds = 0.0;
  double flops = 0.0;  // all threads together
};

// One run of `iterations` steps on every thread at once, timed from the
// start of the parallel region to its closing barrier.
ProbeRun run_once(int threads, std::int64_t iterations) {
  const auto fma_chains = HWY_DYNAMIC_DISPATCH(FmaChains);
  std::vector<std::int64_t> flops(static_cast<std::size_t>(threads), 0);
  std::vector<float> sinks(static_cast<std::size_t>(threads));
  const auto start = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads)
  {
    const auto t = static_cast<std::size_t>(omp_get_thread_num());
    flops[t] = fma_chains(iterations, &sinks[t]);
  }
  const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
  double total = 0.0;
  for (const std::int64_t f : flops) total += static_cast<double>(f);
  return {elapsed.count(), total};
}

}  // namespace

PeakProbe probe_fma_peak(int threads) {
  // Long enough that starting the threads is noise; the doubling runs also
  // wake the threads and let the clock settle before the measured runs.
  constexpr double kMinSeconds = 0.05;
  constexpr int kRuns = 5;
  PeakProbe result;
  result.threads = threads;
  result.target = HWY_DYNAMIC_DISPATCH(Target)();
  std::int64_t iterations = 1 << 16;
  while (run_once(threads, iterations).seconds < kMinSeconds) iterations *= 2;
  for (int r = 0; r < kRuns; ++r) {
    const ProbeRun run = run_once(threads, iterations);
    result.gflops = std::max(result.gflops, run.flops / run.seconds / 1e9);
  }
  return result;
}

}  // namespace qkv::tools

#endif  // HWY_ONCE
