// `qkv bench`, suite "forward": the fused kernel (qkv::attention_into with
// Backend::fast) and the materialized baseline (bench_naive.hpp) on the same
// inputs and thread count, timed as the median of repeated runs, with the FMA
// peak probed in the same process (peak_probe.hpp) so ratios hold even when
// absolute speeds drift between runs.
#include "bench.hpp"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <functional>
#include <random>
#include <regex>
#include <string>
#include <string_view>
#include <vector>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "bench_naive.hpp"
#include "cpu/flash.hpp"
#include "peak_probe.hpp"
#include "qkv/qkv.hpp"

namespace qkv::tools {
namespace {

// Every case draws its inputs from a generator with this seed, so a case's
// inputs do not depend on which other cases the filter selects.
constexpr std::uint32_t kSeed = 20240501;

struct Case {
  std::string name;
  DType dtype = DType::f32;
  std::int64_t b = 1, hq = 16, hkv = 16, nq = 0, nk = 0, d = 0;
  bool causal = false;
  std::int64_t window_left = -1, window_right = -1;  // -1 = unbounded
  bool naive = true;  // false where the baseline's Nq x Nk scores do not fit in memory
};

// The forward suite. Names are stable: results are compared across runs by name.
std::vector<Case> forward_cases() {
  std::vector<Case> cases;
  for (const DType dtype : {DType::f32, DType::bf16, DType::f16}) {
    const std::string prefix = "fwd/" + std::string(dtype_name(dtype)) + "/B1/H16/";
    for (const std::int64_t n : {512, 2048, 8192}) {
      for (const std::int64_t d : {64, 128}) {
        const std::string shape = prefix + "N" + std::to_string(n) + "/D" + std::to_string(d);
        Case c{.name = shape + "/full", .dtype = dtype, .nq = n, .nk = n, .d = d};
        cases.push_back(c);
        c.name = shape + "/causal";
        c.causal = true;
        cases.push_back(c);
        // A local causal window of 257 keys: the query's own and 256 before it.
        c.name = shape + "/window256";
        c.window_left = 256;
        c.window_right = 0;
        cases.push_back(c);
      }
    }
    cases.push_back(
        {.name = prefix + "Nq77/Nk4096/D64/cross", .dtype = dtype, .nq = 77, .nk = 4096, .d = 64});
  }
  // 64K tokens in one head: the fused kernel's O(N) memory where the baseline
  // would need 16 GiB of scores.
  cases.push_back({.name = "fwd/f32/B1/H1/N65536/D64/full",
                   .hq = 1,
                   .hkv = 1,
                   .nq = 65536,
                   .nk = 65536,
                   .d = 64,
                   .naive = false});
  return cases;
}

AttentionOptions options_of(const Case& c) {
  AttentionOptions options;
  options.causal = c.causal;
  options.window_left = c.window_left;
  options.window_right = c.window_right;
  options.backend = Backend::fast;
  return options;
}

template <class T, class Round>
void fill_uniform(Tensor& t, std::mt19937& rng, Round round) {
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  T* data = t.data<T>();
  for (std::int64_t i = 0; i < t.numel(); ++i) data[i] = round(uniform(rng));
}

// A contiguous tensor of uniform values in [-1, 1), rounded to `dtype`.
Tensor random_tensor(DType dtype, std::initializer_list<std::int64_t> sizes, std::mt19937& rng) {
  Tensor t(dtype, sizes);
  switch (dtype) {
    case DType::bf16:
      fill_uniform<bf16>(t, rng, [](float x) { return to_bf16(x); });
      break;
    case DType::f16:
      fill_uniform<f16>(t, rng, [](float x) { return to_f16(x); });
      break;
    default:
      fill_uniform<float>(t, rng, [](float x) { return x; });
  }
  return t;
}

// The value of a "VmRSS:"-style line of /proc/self/status in bytes; -1 if
// there is none (no /proc).
std::int64_t status_bytes(std::string_view field) {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.starts_with(field)) return std::stoll(line.substr(field.size())) * 1024;  // in kB
  }
  return -1;
}

// Peak resident memory growth from construction to bytes(): writing "5" to
// clear_refs resets the peak (VmHWM) to the current RSS, so the growth is what
// the code in between allocated and touched, including memory freed again.
class PeakGrowth {
 public:
  PeakGrowth() {
#if defined(__GLIBC__)
    // Free memory that malloc keeps from earlier cases would be reused
    // without growing the RSS and hide this case's scratch.
    malloc_trim(0);
#endif
    std::ofstream clear_refs("/proc/self/clear_refs");
    clear_refs << "5" << std::flush;
    // Without the reset VmHWM would be the process's all-time peak.
    if (clear_refs) start_ = status_bytes("VmRSS:");
  }
  // 0 where /proc is unavailable.
  std::int64_t bytes() const {
    const std::int64_t peak = start_ < 0 ? -1 : status_bytes("VmHWM:");
    return peak < 0 ? 0 : std::max<std::int64_t>(0, peak - start_);
  }

 private:
  std::int64_t start_ = -1;
};

struct Timing {
  double seconds = 0.0;          // median of the timed runs
  std::int64_t extra_bytes = 0;  // peak resident memory growth
};

// One warm-up run, then `repeats` timed runs. The memory window opens before
// the warm-up so that scratch allocated once and kept is counted too.
Timing measure(const std::function<void()>& run, int repeats) {
  const PeakGrowth growth;
  run();
  std::vector<double> seconds;
  for (int r = 0; r < repeats; ++r) {
    const auto start = std::chrono::steady_clock::now();
    run();
    const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
    seconds.push_back(elapsed.count());
  }
  std::sort(seconds.begin(), seconds.end());
  const std::size_t mid = seconds.size() / 2;
  const double median =
      seconds.size() % 2 == 1 ? seconds[mid] : (seconds[mid - 1] + seconds[mid]) / 2.0;
  return {median, growth.bytes()};
}

struct Row {
  const Case* c = nullptr;
  std::string_view impl;
  Timing timing;
  double gflops = 0.0;
};

std::string json_line(const Row& r, const PeakProbe& peak, int threads, const char* target) {
  const Case& c = *r.c;
  char text[1024];
  std::snprintf(
      text, sizeof text,
      "{\"suite\":\"forward\",\"name\":\"%s\",\"impl\":\"%.*s\",\"dtype\":\"%.*s\","
      "\"B\":%lld,\"Hq\":%lld,\"Hkv\":%lld,\"Nq\":%lld,\"Nk\":%lld,\"D\":%lld,"
      "\"causal\":%s,\"window\":[%lld,%lld],\"threads\":%d,\"seconds\":%.6g,"
      "\"gflops\":%.6g,\"peak_gflops\":%.6g,\"fraction_of_peak\":%.4g,"
      "\"extra_bytes\":%lld,\"target\":\"%s\"}",
      c.name.c_str(), static_cast<int>(r.impl.size()), r.impl.data(),
      static_cast<int>(dtype_name(c.dtype).size()), dtype_name(c.dtype).data(),
      static_cast<long long>(c.b), static_cast<long long>(c.hq), static_cast<long long>(c.hkv),
      static_cast<long long>(c.nq), static_cast<long long>(c.nk), static_cast<long long>(c.d),
      c.causal ? "true" : "false", static_cast<long long>(c.window_left),
      static_cast<long long>(c.window_right), threads, r.timing.seconds, r.gflops, peak.gflops,
      r.gflops / peak.gflops, static_cast<long long>(r.timing.extra_bytes), target);
  return text;
}

std::string table_line(const Row& r, const PeakProbe& peak, int name_width) {
  char text[512];
  std::snprintf(text, sizeof text, "%-*s  %-5.*s  %10.3f  %9.1f  %9.1f  %9.1f", name_width,
                r.c->name.c_str(), static_cast<int>(r.impl.size()), r.impl.data(),
                r.timing.seconds * 1e3, r.gflops, 100.0 * r.gflops / peak.gflops,
                static_cast<double>(r.timing.extra_bytes) / 1e6);
  return text;
}

std::string table_header(int name_width) {
  char text[512];
  std::snprintf(text, sizeof text, "%-*s  %-5s  %10s  %9s  %9s  %9s", name_width, "name", "impl",
                "ms", "GFLOP/s", "% of peak", "extra MB");
  return text;
}

}  // namespace

int run_bench(std::ostream& out, std::ostream& progress, const BenchOptions& options) {
  if (options.suite != "forward") {
    throw Error("bench: --suite must be forward, got '" + options.suite + "'");
  }
  std::regex filter;
  try {
    filter.assign(options.filter);
  } catch (const std::regex_error& e) {
    throw Error("bench: --filter '" + options.filter +
                "' is not a regular expression: " + e.what());
  }
  std::vector<Case> cases;
  for (Case& c : forward_cases()) {
    if (std::regex_search(c.name, filter)) cases.push_back(std::move(c));
  }
  if (cases.empty()) {
    progress << "qkv bench: no case matches --filter '" << options.filter << "'\n";
    return 1;
  }
  if (options.list) {
    for (const Case& c : cases) out << c.name << "\n";
    return 0;
  }

  // The kernels' parallel regions use the default team size.
  omp_set_num_threads(options.threads);
#if defined(__GLIBC__)
  // glibc raises its mmap threshold (up to 32 MiB) after freeing a mapped
  // block and then keeps later blocks of that size in its heaps, where
  // malloc_trim cannot return them all (the top of a thread's heap stays):
  // a fixed threshold maps and unmaps every block of 1 MiB and more, so each
  // case's large scratch shows in its own peak. Faulting such a block in
  // costs far less than the attention work that needs it.
  mallopt(M_MMAP_THRESHOLD, 1 << 20);
#endif
  const PeakProbe peak = probe_fma_peak(options.threads);
  const char* target = cpu::flash_target();
  int name_width = 0;
  int runs = 0;
  for (const Case& c : cases) {
    name_width = std::max(name_width, static_cast<int>(c.name.size()));
    runs += c.naive ? 2 : 1;
  }
  if (options.json) {
    char text[256];
    std::snprintf(text, sizeof text,
                  "{\"suite\":\"probe\",\"peak_gflops\":%.6g,\"threads\":%d,\"target\":\"%s\"}",
                  peak.gflops, peak.threads, peak.target);
    out << text << std::endl;
  } else {
    char text[256];
    std::snprintf(text, sizeof text,
                  "FMA peak %.1f GFLOP/s (%s probe, %d threads); kernels: %s; median of %d runs\n",
                  peak.gflops, peak.target, peak.threads, target, options.repeats);
    out << text << table_header(name_width) << std::endl;
  }

  int run = 0;
  for (const Case& c : cases) {
    std::mt19937 rng(kSeed);
    const Tensor q = random_tensor(c.dtype, {c.b, c.nq, c.hq, c.d}, rng);
    const Tensor k = random_tensor(c.dtype, {c.b, c.nk, c.hkv, c.d}, rng);
    const Tensor v = random_tensor(c.dtype, {c.b, c.nk, c.hkv, c.d}, rng);
    Tensor o(c.dtype, {c.b, c.nq, c.hq, c.d});
    const AttentionOptions attention_options = options_of(c);
    // The naive baseline is credited with the same useful flops.
    const double flops = 4.0 * static_cast<double>(c.b * c.hq * c.d) *
                         static_cast<double>(unmasked_pairs(c.nq, c.nk, attention_options));

    std::vector<std::pair<std::string_view, std::function<void()>>> impls = {
        {"qkv", [&] { attention_into(q, k, v, {.out = o}, attention_options); }}};
    if (c.naive) {
      impls.emplace_back("naive",
                         [&] { naive_attention(q, k, v, o, attention_options, options.threads); });
    }
    for (const auto& [impl, fn] : impls) {
      ++run;
      progress << (options.live_progress ? "\r" : "") << "[" << run << "/" << runs << "] " << c.name
               << " " << impl << " ..." << (options.live_progress ? "\033[K" : "\n") << std::flush;
      const Timing timing = measure(fn, options.repeats);
      const Row row{&c, impl, timing, flops / timing.seconds / 1e9};
      if (options.live_progress) progress << "\r\033[K" << std::flush;
      out << (options.json ? json_line(row, peak, options.threads, target)
                           : table_line(row, peak, name_width))
          << std::endl;
    }
  }
  return 0;
}

}  // namespace qkv::tools
