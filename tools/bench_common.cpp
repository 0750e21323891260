#include "bench_common.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "qkv/dtype.hpp"
#include "qkv/internal/kernels.hpp"

namespace qkv::tools {
namespace {

template <class T, class Round>
void fill_uniform(Tensor& t, std::mt19937& rng, Round round) {
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  T* data = t.data<T>();
  for (std::int64_t i = 0; i < t.numel(); ++i) data[i] = round(uniform(rng));
}

std::int64_t status_bytes(std::string_view field) { return proc_bytes("/proc/self/status", field); }

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

}  // namespace

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

std::int64_t proc_bytes(const char* path, std::string_view field) {
  std::ifstream file(path);
  for (std::string line; std::getline(file, line);) {
    if (line.starts_with(field)) return std::stoll(line.substr(field.size())) * 1024;  // in kB
  }
  return -1;
}

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
  return {median, seconds.front(), growth.bytes()};
}

std::string probe_line(const PeakProbe& peak, const BenchOptions& options,
                       const std::string& columns) {
  char line[256];
  if (options.json) {
    std::snprintf(line, sizeof line,
                  "{\"suite\":\"probe\",\"peak_gflops\":%.6g,\"threads\":%d,\"target\":\"%s\"}",
                  peak.gflops, peak.threads, peak.target);
    return line;
  }
  std::snprintf(line, sizeof line,
                "At the start: FMA peak %.1f GFLOP/s (%s probe, %d threads); kernels: %s; median "
                "of %d runs, each case against the probes around it\n",
                peak.gflops, peak.target, peak.threads, internal::kernel_target(), options.repeats);
  return line + columns;
}

ProbeBracket::ProbeBracket(std::function<double()> probe, double first)
    : probe_(std::move(probe)), last_(first), last_time_(std::chrono::steady_clock::now()) {}

double ProbeBracket::next() {
  const std::chrono::duration<double> since = std::chrono::steady_clock::now() - last_time_;
  if (since.count() < kReprobeSeconds) return last_;
  const double after = probe_();
  const double larger = std::max(last_, after);
  last_ = after;
  last_time_ = std::chrono::steady_clock::now();
  return larger;
}

void report_progress(std::ostream& progress, const BenchOptions& options, std::size_t run,
                     std::size_t total, const std::string& name) {
  progress << (options.live_progress ? "\r" : "") << "[" << run << "/" << total << "] " << name
           << " ..." << (options.live_progress ? "\033[K" : "\n") << std::flush;
}

}  // namespace qkv::tools
