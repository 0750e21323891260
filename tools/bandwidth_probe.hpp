// The memory-read bandwidth of this machine, measured in the benchmark's own
// run so that decoding speeds (which read the whole KV cache once per step)
// can be read as a fraction of it.
#pragma once

#include <cstdint>

namespace qkv::tools {

struct BandwidthProbe {
  double bytes_per_second = 0.0;  // bytes read per second, all threads together
  // Bytes per second streamed with an f16 decode step's arithmetic (each
  // value widened, four FMAs, prefetched ahead); 0 unless asked for.
  double widen_bytes_per_second = 0.0;
  std::int64_t buffer_bytes = 0;  // size of the buffer streamed
  int threads = 0;                // OpenMP threads that ran the probe
  const char* target = nullptr;   // Highway target of the probe ("AVX2")
};

// Every one of `threads` OpenMP threads sums its own slice of a buffer far
// larger than the last-level cache (8x the L3 caches together, at least
// 512 MiB) with vector loads, all at once; returns the best of several runs.
// with_widening: each run also streams the buffer as f16 values with a decode
// step's arithmetic (widen_bytes_per_second). The buffer is freed before
// returning. Throws qkv::Error if it cannot be allocated.
BandwidthProbe probe_read_bandwidth(int threads, bool with_widening = false);

}  // namespace qkv::tools
