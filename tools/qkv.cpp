// The qkv command line tool.
#include <omp.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <iostream>
#include <limits>

#include "bench.hpp"
#include "demo.hpp"
#include "qkv/error.hpp"

int main(int argc, char** argv) {
  // CLI11 does not wrap help text: lines are broken by hand to fit 80 columns.
  CLI::App app{
      "qkv: attention mechanisms for CPUs\n"
      "(scaled-dot, additive, multi-head, masks, position biases).",
      "qkv"};
  app.require_subcommand(1);

  CLI::App* demo = app.add_subcommand("demo", "Run built-in examples and check their results");
  demo->footer(
      "Self-attention over a short sentence with sinusoidal positions,\n"
      "cross-attention, causal attention and a padded batch, on built-in data.\n"
      "Prints each example's checks and a heatmap of its attention weights;\n"
      "exits 1 if a check fails.");
  bool color = false;
  demo->add_flag("--color", color, "Shade the heatmap with ANSI colours");

  CLI::App* bench =
      app.add_subcommand("bench", "Time attention against the FMA peak and bandwidth");
  bench->footer(
      "Times the fused kernels (impl qkv) and materialized sgemm + softmax\n"
      "baselines (impl naive) on each case: one warm-up run, then the median of\n"
      "--repeats runs. Suite backward times the gradients alone (the forward's\n"
      "out and lse are computed beforehand). GFLOP/s count 4 flops per unmasked\n"
      "(query, key) pair and head dimension forward, 10 backward; the FMA peak\n"
      "is probed in the same run with the same threads. Extra MB is the peak\n"
      "resident memory growth during a case, beyond its inputs and outputs.\n"
      "Suite decode times one new query per sequence against a filled KV cache\n"
      "(no baseline): GB/s of cached keys and values read, against a read\n"
      "bandwidth probe (all threads streaming a buffer far larger than the\n"
      "L3 cache) of the same run, and tokens/s.\n"
      "Suite scaling times N = 1024 .. 65536 (H = 8, D = 64, f32) for dense\n"
      "causal attention, a causal window of 512, a dilated window, a BigBird\n"
      "layout and causal linear attention, and prints each curve's log-log\n"
      "slope over N >= 4096 (not part of suite all: dense causal at N = 65536\n"
      "alone takes about a minute).\n"
      "Suite modules times qkv::nn layers at model shapes: a BERT-base\n"
      "self-attention block forward and backward, a grouped-query decoder\n"
      "step against a 4096-token cache, and SE and CBAM on 64 x 56 x 56.\n"
      "Progress goes to stderr; results to stdout. Exits 1 if no case matches,\n"
      "3 if --check fails.");
  qkv::tools::BenchOptions bench_options;
  const CLI::Range positive(1, std::numeric_limits<int>::max());
  bench_options.threads = omp_get_max_threads();
  bench->add_option("--suite", bench_options.suite, "Benchmark suite")
      ->check(CLI::IsMember({"forward", "backward", "decode", "all", "scaling", "modules"}))
      ->capture_default_str();
  bench->add_option("--filter", bench_options.filter,
                    "Run only the cases whose name matches this\n"
                    "regular expression (std::regex_search)");
  bench->add_flag("--json", bench_options.json,
                  "Print one JSON object per line (the first: the\n"
                  "probes) instead of a table");
  bench->add_option("--threads", bench_options.threads, "OpenMP threads (default: all cores)")
      ->check(positive)
      ->capture_default_str();
  bench->add_option("--repeats", bench_options.repeats, "Timed runs per case")
      ->check(positive)
      ->capture_default_str();
  bench->add_flag("--list", bench_options.list, "Print the names of the selected cases and exit");
  bench->add_flag("--check", bench_options.check,
                  "Also compare the baseline's outputs with qkv's\n"
                  "(max |naive - qkv| / max |qkv|, on stderr)");
  bench
      ->add_option("--shrink", bench_options.shrink,
                   "Divide sequence and cache lengths by this, for\n"
                   "quick runs (case names show the sizes run)")
      ->check(positive)
      ->capture_default_str();

  CLI11_PARSE(app, argc, argv);
  try {
    if (demo->parsed()) return qkv::tools::run_demo(std::cout, {color}) ? 0 : 1;
    if (bench->parsed()) {
      // On a terminal one progress line is rewritten in place; in a log, each
      // measurement gets its own line.
      bench_options.live_progress = isatty(STDERR_FILENO) == 1;
      return qkv::tools::run_bench(std::cout, std::cerr, bench_options);
    }
  } catch (const qkv::Error& e) {
    std::cerr << e.what() << "\n";
    return 2;
  }
  return 0;
}
