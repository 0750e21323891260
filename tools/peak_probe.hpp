// The FP32 FMA peak of this machine, measured in the benchmark's own run so
// that kernel speeds can be read as a fraction of it.
#pragma once

namespace qkv::tools {

struct PeakProbe {
  double gflops = 0.0;           // f32 flops per second / 1e9, all threads together
  int threads = 0;               // OpenMP threads that ran the probe
  const char* target = nullptr;  // Highway target of the probe ("AVX2")
};

// Runs independent chains of f32 multiply-adds on `threads` OpenMP threads at
// once (2 flops per lane per FMA) and returns the best of several runs. The
// probe is compiled for the same Highway targets as the attention kernels.
PeakProbe probe_fma_peak(int threads);

}  // namespace qkv::tools
