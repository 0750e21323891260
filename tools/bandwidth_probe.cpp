// Memory-read bandwidth probe: compiled once per Highway target by
// re-including this file (as peak_probe.cpp is), so it loads the vector width
// the kernels load.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "bandwidth_probe.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
// (foreach_target.h must come first: it re-includes this file per target.)
#include "hwy/cache_control.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::tools {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Sums `count` floats of `data` (aligned; count a multiple of 4 vectors) and
// returns the sum, so that no load is dead code. Four independent
// accumulators keep the adds' latency from limiting the loads.
float SumStream(const float* HWY_RESTRICT data, std::size_t count) {
  const hn::ScalableTag<float> d;
  const std::size_t n = hn::Lanes(d);
  auto a0 = hn::Zero(d), a1 = hn::Zero(d), a2 = hn::Zero(d), a3 = hn::Zero(d);
  for (std::size_t i = 0; i < count; i += 4 * n) {
    a0 = hn::Add(a0, hn::Load(d, data + i));
    a1 = hn::Add(a1, hn::Load(d, data + i + n));
    a2 = hn::Add(a2, hn::Load(d, data + i + 2 * n));
    a3 = hn::Add(a3, hn::Load(d, data + i + 3 * n));
  }
  return hn::GetLane(hn::SumOfLanes(d, hn::Add(hn::Add(a0, a1), hn::Add(a2, a3))));
}

// Streams `count` f16 values of `data` (aligned; count a multiple of 4
// vectors) with a decode step's arithmetic on an f16 cache and nothing else:
// each vector widened to f32 and multiplied into four accumulating rows (the
// four query rows per KV head of GQA 32/8), the line 4 KiB ahead fetched
// into L1 (the fastest of the prefetch settings measured on the Sapphire
// Rapids-class VM, 2026-12-05). What it reads per second bounds what a
// kernel doing that arithmetic can read; the plain sum bounds the rest.
float WidenStream(const hwy::float16_t* HWY_RESTRICT data, std::size_t count) {
  const hn::ScalableTag<float> d;
  const hn::Rebind<hwy::float16_t, decltype(d)> d16;
  const std::size_t n = hn::Lanes(d);
  constexpr int kRows = 4, kVecs = 4;
  constexpr std::size_t kAhead = 4096 / sizeof(hwy::float16_t);
  hn::Vec<decltype(d)> q[kRows], acc[kRows][kVecs];
  for (int u = 0; u < kRows; ++u) {
    q[u] = hn::Set(d, 0.25f * static_cast<float>(u + 1));
    for (int k = 0; k < kVecs; ++k) acc[u][k] = hn::Zero(d);
  }
  for (std::size_t i = 0; i < count; i += kVecs * n) {
    // One prefetch per 64-byte line of the step, within the slice.
    if (i + kAhead < count) {
      for (std::size_t line = 0; line < kVecs * n; line += 64 / sizeof(hwy::float16_t)) {
        hwy::Prefetch(data + i + kAhead + line);
      }
    }
    for (int k = 0; k < kVecs; ++k) {
      const auto v = hn::PromoteTo(d, hn::Load(d16, data + i + k * n));
      for (int u = 0; u < kRows; ++u) acc[u][k] = hn::MulAdd(v, q[u], acc[u][k]);
    }
  }
  auto sum = hn::Zero(d);
  for (int u = 0; u < kRows; ++u) {
    for (int k = 0; k < kVecs; ++k) sum = hn::Add(sum, acc[u][k]);
  }
  return hn::GetLane(hn::SumOfLanes(d, sum));
}

const char* StreamTarget() { return hwy::TargetName(HWY_TARGET); }

}  // namespace HWY_NAMESPACE
}  // namespace qkv::tools
HWY_AFTER_NAMESPACE();

#if HWY_ONCE

#include <omp.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <new>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "bandwidth_probe.hpp"
#include "qkv/error.hpp"
#include "qkv/tensor.hpp"

namespace qkv::tools {

HWY_EXPORT(SumStream);
HWY_EXPORT(WidenStream);
HWY_EXPORT(StreamTarget);

namespace {

std::string first_line(const std::filesystem::path& path) {
  std::ifstream file(path);
  std::string line;
  std::getline(file, line);
  return line;
}

// A sysfs cache size ("32768K") in bytes; 0 if unreadable.
std::int64_t parse_size(const std::string& text) {
  std::int64_t value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc()) return 0;
  const std::string_view suffix(end, text.data() + text.size());
  if (suffix == "K") return value << 10;
  if (suffix == "M") return value << 20;
  if (suffix == "G") return value << 30;
  return value;
}

// The L3 caches of all CPUs together: servers have one L3 per socket or core
// complex, each listed by every CPU that shares it (the same
// shared_cpu_list). 0 where sysfs does not describe them.
std::int64_t total_l3_bytes() {
  namespace fs = std::filesystem;
  const fs::path cpus = "/sys/devices/system/cpu";
  std::set<std::string> seen;
  std::int64_t total = 0;
  for (int cpu = 0; fs::exists(cpus / ("cpu" + std::to_string(cpu))); ++cpu) {
    const fs::path caches = cpus / ("cpu" + std::to_string(cpu)) / "cache";
    for (int index = 0; fs::exists(caches / ("index" + std::to_string(index))); ++index) {
      const fs::path cache = caches / ("index" + std::to_string(index));
      if (first_line(cache / "level") != "3") continue;
      if (seen.insert(first_line(cache / "shared_cpu_list")).second) {
        total += parse_size(first_line(cache / "size"));
      }
    }
  }
  return total;
}

// One run: every thread streams its slice at once (SumStream, or
// WidenStream over the same bytes as f16), timed from the start of the
// parallel region to its closing barrier. Returns the seconds. (Should the
// runtime give fewer threads than asked, the team still reads every slice.)
double run_once(const float* data, std::size_t slice, int threads, bool widen) {
  const auto sum_stream = HWY_DYNAMIC_DISPATCH(SumStream);
  const auto widen_stream = HWY_DYNAMIC_DISPATCH(WidenStream);
  std::vector<float> sinks(static_cast<std::size_t>(threads));
  const auto start = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads)
  for (int s = omp_get_thread_num(); s < threads; s += omp_get_num_threads()) {
    const auto t = static_cast<std::size_t>(s);
    sinks[t] =
        widen ? widen_stream(reinterpret_cast<const hwy::float16_t*>(data + t * slice), 2 * slice)
              : sum_stream(data + t * slice, slice);
  }
  const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
  return elapsed.count();
}

}  // namespace

BandwidthProbe probe_read_bandwidth(int threads, bool with_widening) {
  constexpr std::int64_t kMinBytes = std::int64_t{512} << 20;
  constexpr int kRuns = 5;
  // Slices of whole 4 KiB pages: aligned, and a multiple of 4 vectors of
  // any target.
  constexpr std::size_t kPageFloats = 4096 / sizeof(float);
  const auto slice_pages = static_cast<std::size_t>(
      (std::max(kMinBytes, 8 * total_l3_bytes()) / 4096 + threads - 1) / threads);
  const std::size_t slice = slice_pages * kPageFloats;
  const std::size_t floats = slice * static_cast<std::size_t>(threads);
  // A Tensor, so that the buffer has the pages the kernels' tensors and KV
  // caches get (huge pages where the system offers them).
  Tensor buffer;
  try {
    buffer = Tensor(DType::f32, {static_cast<std::int64_t>(floats)});
  } catch (const std::bad_alloc&) {
    throw Error("bench: cannot allocate the bandwidth probe's " +
                std::to_string(floats * sizeof(float) >> 20) + " MiB buffer");
  }
  // Each thread writes its own slice, so that no page fault falls into a
  // timed run.
  float* data = buffer.data<float>();
#pragma omp parallel num_threads(threads)
  for (int s = omp_get_thread_num(); s < threads; s += omp_get_num_threads()) {
    const auto t = static_cast<std::size_t>(s);
    std::fill(data + t * slice, data + (t + 1) * slice, 1.0f);
  }
  BandwidthProbe result;
  result.buffer_bytes = static_cast<std::int64_t>(floats * sizeof(float));
  result.threads = threads;
  result.target = HWY_DYNAMIC_DISPATCH(StreamTarget)();
  const auto bytes = static_cast<double>(result.buffer_bytes);
  for (int r = 0; r < kRuns; ++r) {
    result.bytes_per_second =
        std::max(result.bytes_per_second, bytes / run_once(data, slice, threads, false));
    if (with_widening) {
      result.widen_bytes_per_second =
          std::max(result.widen_bytes_per_second, bytes / run_once(data, slice, threads, true));
    }
  }
  return result;
}

}  // namespace qkv::tools

#endif  // HWY_ONCE
