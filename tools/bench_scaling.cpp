// `qkv bench --suite scaling`: time against sequence length for dense causal
// attention and the variants that cost O(N): a sliding window, a dilated
// window, a BigBird block-sparse layout and causal linear attention. Each
// curve's log-log slope, fitted over N >= 4096, says how its time grows.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <regex>
#include <string>
#include <vector>

#include "bench.hpp"
#include "bench_common.hpp"
#include "bench_naive.hpp"
#include "peak_probe.hpp"
#include "qkv/internal/kernels.hpp"
#include "qkv/linear.hpp"
#include "qkv/qkv.hpp"

namespace qkv::tools {
namespace {

constexpr std::uint32_t kSeed = 20240502;
constexpr std::int64_t kHeads = 8, kDim = 64;
// The slope is fitted over N >= this (before --shrink): shorter sequences
// are dominated by per-call and per-row costs.
constexpr std::int64_t kFitFrom = 4096;

enum class Variant : std::uint8_t { dense_causal, window, dilated, block_sparse, linear_causal };

struct Curve {
  Variant variant;
  const char* name;
};
constexpr Curve kCurves[] = {{Variant::dense_causal, "dense_causal"},
                             {Variant::window, "window512"},
                             {Variant::dilated, "dilated256x2"},
                             {Variant::block_sparse, "bigbird64"},
                             {Variant::linear_causal, "linear_causal"}};

// The attention options of a softmax variant at sequence length n.
AttentionOptions options_of(Variant variant, std::int64_t n) {
  AttentionOptions o;
  o.backend = Backend::fast;
  switch (variant) {
    case Variant::dense_causal:
      o.causal = true;
      break;
    case Variant::window:  // the query and the 511 keys before it
      o.causal = true;
      o.window_left = 511;
      o.window_right = 0;
      break;
    case Variant::dilated:  // 256 keys, every 2nd of the 511 before the query
      o.causal = true;
      o.sparse = SparsePattern::dilated_window(255, 0, 2);
      break;
    case Variant::block_sparse:  // BigBird: 3 window, 1 global and 2 random blocks of 64
      o.sparse = SparsePattern::block_sparse(bigbird_layout({.heads = kHeads,
                                                             .nq = n,
                                                             .nk = n,
                                                             .block_size = 64,
                                                             .window_blocks = 1,
                                                             .global_blocks = 1,
                                                             .random_blocks = 2,
                                                             .seed = 7}));
      break;
    case Variant::linear_causal:
      break;
  }
  return o;
}

// (query, key) pairs every mask admits, summed over the heads: the range of
// causal and window, intersected with the pattern, counted a 64 x 64 tile at
// a time (tiles the pattern covers wholly or not at all are not enumerated).
double admitted_pairs(std::int64_t n, const AttentionOptions& o) {
  if (!o.sparse.defined()) return static_cast<double>(kHeads * unmasked_pairs(n, n, o));
  constexpr std::int64_t kTile = 64;
  double pairs = 0.0;
#pragma omp parallel for reduction(+ : pairs) schedule(dynamic, 1)
  for (std::int64_t i0 = 0; i0 < n; i0 += kTile) {
    const std::int64_t rows = std::min(kTile, n - i0);
    std::vector<KeyRange> range(static_cast<std::size_t>(rows));
    std::int64_t lo = n, hi = 0;
    for (std::int64_t r = 0; r < rows; ++r) {
      range[r] = keys_of_row(i0 + r, n, n, o);
      lo = std::min(lo, range[r].begin);
      hi = std::max(hi, range[r].end);
    }
    std::vector<std::uint8_t> keep;
    for (std::int64_t h = 0; h < kHeads; ++h) {
      for (std::int64_t j0 = lo / kTile * kTile; j0 < hi; j0 += kTile) {
        const std::int64_t cols = std::min(kTile, n - j0);
        keep.resize(static_cast<std::size_t>(rows * cols));
        if (!internal::admitted_pairs(o.sparse, h, i0, rows, i0, j0, cols, keep.data())) continue;
        for (std::int64_t r = 0; r < rows; ++r) {
          const std::int64_t b = std::max(range[r].begin, j0) - j0;
          const std::int64_t e = std::min(range[r].end, j0 + cols) - j0;
          for (std::int64_t x = b; x < e; ++x) pairs += keep[x * rows + r];
        }
      }
    }
  }
  return pairs;
}

// Least-squares slope of log(seconds) against log(N).
double log_log_slope(const std::vector<std::pair<double, double>>& points) {
  double sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (const auto& [n, t] : points) {
    const double x = std::log(n), y = std::log(t);
    sx += x;
    sy += y;
    sxx += x * x;
    sxy += x * y;
  }
  const auto m = static_cast<double>(points.size());
  return (m * sxy - sx * sy) / (m * sxx - sx * sx);
}

struct Point {
  const Curve* curve;
  std::int64_t n;
  std::string name;
};

}  // namespace

int run_scaling_bench(std::ostream& out, std::ostream& progress, const BenchOptions& options) {
  if (options.shrink < 1) {
    throw Error("bench: --shrink must be at least 1, got " + std::to_string(options.shrink));
  }
  const std::regex filter(options.filter);
  std::vector<Point> points;
  for (const Curve& curve : kCurves) {
    for (std::int64_t full_n = 1024; full_n <= 65536; full_n *= 2) {
      const std::int64_t n = std::max<std::int64_t>(1, full_n / options.shrink);
      std::string name = "scaling/" + std::string(curve.name) + "/N" + std::to_string(n);
      if (std::regex_search(name, filter)) points.push_back({&curve, n, std::move(name)});
    }
  }
  if (points.empty()) {
    progress << "qkv bench: no case matches --filter '" << options.filter << "'\n";
    return 1;
  }
  if (options.list) {
    for (const Point& p : points) out << p.name << "\n";
    return 0;
  }
  omp_set_num_threads(options.threads);
  const PeakProbe peak = probe_fma_peak(options.threads);
  char line[512];
  std::snprintf(line, sizeof line, "%-28s  %12s  %9s  %9s  %14s", "name", "ms", "GFLOP/s",
                "% of peak", "pairs or flops");
  out << probe_line(peak, options, line) << std::endl;

  // seconds by (curve, N) for the fits
  ProbeBracket peak_bracket([&] { return probe_fma_peak(options.threads).gflops; }, peak.gflops);
  std::vector<std::vector<std::pair<double, double>>> fits(std::size(kCurves));
  std::size_t run = 0;
  for (const Point& p : points) {
    ++run;
    report_progress(progress, options, run, points.size(), p.name);
    std::mt19937 rng(kSeed);
    const Tensor q = random_tensor(DType::f32, {1, p.n, kHeads, kDim}, rng);
    const Tensor k = random_tensor(DType::f32, {1, p.n, kHeads, kDim}, rng);
    const Tensor v = random_tensor(DType::f32, {1, p.n, kHeads, kDim}, rng);
    Tensor o(DType::f32, {1, p.n, kHeads, kDim});
    std::function<void()> call;
    double work = 0.0;  // admitted pairs, or for linear attention its flops
    double flops = 0.0;
    if (p.curve->variant == Variant::linear_causal) {
      LinearAttentionOptions lo;
      lo.causal = true;
      call = [&q, &k, &v, &o, lo] { linear_attention_into(q, k, v, o, lo); };
      // The recurrent form's work per token and head: o = phi(q) S and
      // S += phi(k) v^T, 2 D Dv flops each (the normalizer adds 4 D).
      flops = static_cast<double>(p.n * kHeads) * (4.0 * kDim * kDim + 4.0 * kDim);
      work = flops;
    } else {
      const AttentionOptions ao = options_of(p.curve->variant, p.n);
      call = [&q, &k, &v, &o, ao] { attention_into(q, k, v, {.out = o}, ao); };
      work = admitted_pairs(p.n, ao);
      flops = 4.0 * kDim * work;
    }
    const Timing t = measure(call, options.repeats);
    const double gflops = flops / t.seconds / 1e9;
    const double peak_gflops = peak_bracket.next();
    if (options.live_progress) progress << "\r\033[K" << std::flush;
    if (options.json) {
      std::snprintf(line, sizeof line,
                    "{\"suite\":\"scaling\",\"name\":\"%s\",\"variant\":\"%s\",\"N\":%lld,"
                    "\"H\":%lld,\"D\":%lld,\"dtype\":\"f32\",\"threads\":%d,\"seconds\":%.6g,"
                    "\"gflops\":%.6g,\"peak_gflops\":%.6g,\"fraction_of_peak\":%.4g,"
                    "\"work\":%.6g,\"extra_bytes\":%lld}",
                    p.name.c_str(), p.curve->name, static_cast<long long>(p.n),
                    static_cast<long long>(kHeads), static_cast<long long>(kDim), options.threads,
                    t.seconds, gflops, peak_gflops, gflops / peak_gflops, work,
                    static_cast<long long>(t.extra_bytes));
    } else {
      std::snprintf(line, sizeof line, "%-28s  %12.3f  %9.1f  %9.1f  %14.4g", p.name.c_str(),
                    t.seconds * 1e3, gflops, 100.0 * gflops / peak_gflops, work);
    }
    out << line << std::endl;
    if (p.n * options.shrink >= kFitFrom) {
      fits[static_cast<std::size_t>(p.curve - kCurves)].push_back(
          {static_cast<double>(p.n), t.seconds});
    }
  }

  if (!options.json)
    out << "\n"
        << "log-log slope of time against N, fitted over N >= " << kFitFrom / options.shrink
        << ":\n";
  for (std::size_t c = 0; c < std::size(kCurves); ++c) {
    if (fits[c].size() < 2) continue;
    const double slope = log_log_slope(fits[c]);
    if (options.json) {
      std::snprintf(line, sizeof line,
                    "{\"suite\":\"scaling\",\"variant\":\"%s\",\"slope\":%.4g,\"points\":%zu,"
                    "\"fit_from_N\":%lld}",
                    kCurves[c].name, slope, fits[c].size(),
                    static_cast<long long>(kFitFrom / options.shrink));
    } else {
      std::snprintf(line, sizeof line, "  %-16s %6.3f  (%zu points)", kCurves[c].name, slope,
                    fits[c].size());
    }
    out << line << std::endl;
  }
  return 0;
}

}  // namespace qkv::tools
