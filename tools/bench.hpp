// `qkv bench`: attention speed in GFLOP/s and as a fraction of the FMA peak
// measured in the same run, against a materialized (sgemm + softmax) baseline.
#pragma once

#include <ostream>
#include <string>

namespace qkv::tools {

struct BenchOptions {
  std::string suite = "forward";  // the only suite so far
  std::string filter;             // run the cases whose name std::regex_search matches
  bool json = false;              // one JSON object per line instead of a table
  bool list = false;              // print the selected case names, run nothing
  bool live_progress = false;     // rewrite one progress line in place (a terminal)
  int threads = 1;                // OpenMP threads for every implementation and the probe
  int repeats = 5;                // timed runs per case, after one warm-up run
};

// Runs the selected cases, writing results to `out` and one progress line per
// measurement to `progress`. Returns the exit status: 0, or 1 if the filter
// selects no case. Throws qkv::Error for an unknown suite or a bad filter.
int run_bench(std::ostream& out, std::ostream& progress, const BenchOptions& options);

}  // namespace qkv::tools
