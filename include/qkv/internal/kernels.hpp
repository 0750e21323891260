// qkv/internal/kernels.hpp — what benchmarks and tools need from inside the
// kernels, for the `qkv` tool's baselines and reports. Not part of the
// stable API: names and signatures may change with the kernels.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "qkv/dtype.hpp"
#include "qkv/sparse.hpp"

namespace qkv::internal {

// The Highway target the fused kernels dispatch to on this CPU ("AVX3",
// "AVX2", "SSE4", ...).
const char* kernel_target();

// One instruction family of products beyond the f32 FMA (`qkv info`).
struct IsaFamily {
  std::string name;         // "avx512_vnni", "avx512_bf16", "amx_int8", "amx_bf16"
  bool listed = false;      // cpuid lists it
  bool usable = false;      // listed, and the OS enabled its registers for this process
  bool allowed = false;     // usable and allowed by QKV_ISA
  std::string reason;       // why a listed family is not usable ("" otherwise)
  double probe_gops = 0.0;  // its register probe on one thread (0: not run)
};

// What this CPU and process can run, and what the kernels chose.
struct CpuReport {
  std::string vendor, model;        // cpuid's vendor and model name
  std::string target;               // the Highway target of the kernels
  std::vector<IsaFamily> families;  // each family (with probes when asked)
  double fma_gflops = 0.0;          // the 512-bit f32 FMA's probe (0: not run)
  std::string bf16_engine;          // the bf16 products' engine, or "f32"
  std::string bf16_engine_reason;   // why
};

// The report; with `probe`, each allowed family's register probe and the
// 512-bit FMA's run for about `seconds` each on this thread. Throws
// qkv::Error for a QKV_ISA it does not know.
CpuReport cpu_report(bool probe, double seconds = 0.05);

// The family the last fused call's products ran on ("f32", "avx512_bf16",
// "amx_bf16"), for the benchmarks' "isa" field.
const char* last_products_isa();

// dst[i] = exp(src[i]) for i < n with the kernels' vectorized exp (src and
// dst may be the same row).
void exp_row(const float* src, std::int64_t n, float* dst);

// Stores n floats into dst as `dtype` (f32, bf16 or f16), rounded as the
// kernels round their outputs.
void store_row(const float* src, std::int64_t n, void* dst, DType dtype);

// The (query, key) pairs that `pattern` admits for head h in the tile of
// query rows [i0, i0 + rows) at positions [p0, p0 + rows) and keys
// [j0, j0 + cols): keep[c * rows + r] = 1 when row r may attend to key
// j0 + c, else 0. Returns false, leaving keep alone, when the pattern admits
// no pair of the tile (found without visiting the pairs).
bool admitted_pairs(const SparsePattern& pattern, std::int64_t h, std::int64_t i0,
                    std::int64_t rows, std::int64_t p0, std::int64_t j0, std::int64_t cols,
                    std::uint8_t* keep);

}  // namespace qkv::internal
