// `qkv bench`: attention speed (forward and backward) in GFLOP/s and as a
// fraction of the FMA peak measured in the same run, against materialized
// (sgemm + softmax) baselines; decoding against a KV cache in bytes read per
// second and as a fraction of the memory bandwidth measured in the same run.
#pragma once

#include <ostream>
#include <string>

namespace qkv::tools {

struct BenchOptions {
  // "forward", "backward", "decode", "all" (those three in turn), "scaling", "modules" or
  // "ring" (under mpiexec; builds with MPI)
  std::string suite = "forward";
  std::string filter;          // run the cases whose name std::regex_search matches
  bool json = false;           // one JSON object per line instead of a table
  bool list = false;           // print the selected case names, run nothing
  bool live_progress = false;  // rewrite one progress line in place (a terminal)
  bool check = false;          // compare the baseline's outputs with qkv's
  int threads = 1;             // OpenMP threads for every implementation and the probe
  int repeats = 5;             // timed runs per case, after one warm-up run
  int shrink = 1;              // divide every sequence (and cache) length by this
};

// Runs the selected cases, writing results to `out` and one progress line per
// measurement (and, with `check`, one line per compared case) to `progress`.
// Returns the exit status: 0; 1 if the filter selects no case; 3 if a check
// finds the baseline's outputs (out, or dq, dk and dv) further from qkv's than
// a loose bound. A decode case whose cache does not fit in the available
// memory is skipped with a line on `progress`. Throws qkv::Error for an
// unknown suite, a bad filter or shrink, or an error of the kernels.
int run_bench(std::ostream& out, std::ostream& progress, const BenchOptions& options);

// Suite "scaling" (run_bench calls it): time against N = 1024 .. 65536 (H = 8,
// D = 64, f32) for dense causal attention, a causal window of 512 keys, a
// dilated causal window (256 keys, every second one), a BigBird block-sparse
// layout and causal linear attention, then each curve's log-log slope fitted
// over N >= 4096. --json: one object per point (suite, name, variant, N,
// seconds, gflops, fraction_of_peak, ...) and one per curve (variant, slope).
int run_scaling_bench(std::ostream& out, std::ostream& progress, const BenchOptions& options);

// Suite "modules" (run_bench calls it): qkv::nn layers at model shapes: a
// BERT-base self-attention block (B = 8, N = 512, E = 768, 12 heads) forward
// and backward, one decode step of a grouped-query decoder block (E = 2048,
// 32 query and 8 KV heads, RoPE) against a KV cache of L = 4096 tokens, and
// squeeze-and-excitation and CBAM on a [1, 64, 56, 56] feature map. --json:
// one object per case (suite, name, impl, dtype, B, N, E, heads, kv_heads,
// H, W, threads, seconds, gflops, fraction_of_peak, extra_bytes).
int run_modules_bench(std::ostream& out, std::ostream& progress, const BenchOptions& options);

// Suite "ring" (run_bench calls it; only in builds with MPI), under mpiexec:
// causal attention at N = 16384 and 65536 (H = 8, D = 64, f32) by ring
// attention in both layouts and by all-to-all attention, against one
// process with the threads of all ranks, timed in the same run; per rank
// the compute, waiting and total time, the bytes sent and the transfers
// that were complete when the compute beside them ended; and a ping-pong
// bandwidth probe between ranks 0 and 1. --json: one object per case with
// a per_rank array, after one with the probe.
int run_ring_bench(std::ostream& out, std::ostream& progress, const BenchOptions& options);

}  // namespace qkv::tools
