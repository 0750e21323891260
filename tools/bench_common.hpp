// Pieces shared by the benchmark suites: seeded inputs, timing as the median
// of repeated runs, and peak resident memory growth.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <ostream>
#include <random>
#include <string>
#include <string_view>

#include "bench.hpp"
#include "peak_probe.hpp"
#include "qkv/tensor.hpp"

namespace qkv::tools {

// A contiguous tensor of uniform values in [-1, 1), rounded to `dtype`.
Tensor random_tensor(DType dtype, std::initializer_list<std::int64_t> sizes, std::mt19937& rng);

// The value of a "VmRSS:"-style line of a /proc file in bytes; -1 if there
// is none (no /proc).
std::int64_t proc_bytes(const char* path, std::string_view field);

struct Timing {
  double seconds = 0.0;          // median of the timed runs
  double best_seconds = 0.0;     // the fastest timed run (as the probes report theirs)
  std::int64_t extra_bytes = 0;  // peak resident memory growth
};

// The first line a suite prints: the probe as a JSON object with --json,
// else the probe and the kernels' target in words, then a table header
// (`columns`, already formatted).
std::string probe_line(const PeakProbe& peak, const BenchOptions& options,
                       const std::string& columns);

// The progress line of measurement `run` of `total`: rewritten in place on a
// terminal, one line each in a log.
void report_progress(std::ostream& progress, const BenchOptions& options, std::size_t run,
                     std::size_t total, const std::string& name);

// The probe value each case is read against. On a shared machine the probes
// move by up to 2x within minutes, so a probe from the start of a long run
// says little about a case timed later: after a case, once kReprobeSeconds
// have passed since the last probe, `probe` runs again and the case is read
// against the larger (the stricter reading) of the probes just before and
// just after its timed runs; the probe after one case is the one before the
// next. Runs of short cases (the smoke tests) probe only now and then.
class ProbeBracket {
 public:
  static constexpr double kReprobeSeconds = 2.0;
  ProbeBracket(std::function<double()> probe, double first);
  // The value for the case just timed.
  double next();
  double last() const { return last_; }

 private:
  std::function<double()> probe_;
  double last_;
  std::chrono::steady_clock::time_point last_time_;
};

// One warm-up run, then `repeats` timed runs. The memory window opens before
// the warm-up so that scratch allocated once and kept is counted too.
Timing measure(const std::function<void()>& run, int repeats);

}  // namespace qkv::tools
