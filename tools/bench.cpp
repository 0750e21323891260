// `qkv bench`: the fused kernels (qkv::attention_into with Backend::fast for
// suite "forward", qkv::attention_backward_into for suite "backward",
// qkv::decode_attention_into against a KvCache for suite "decode") and the
// materialized baselines (bench_naive.hpp) on the same inputs and thread
// count, timed as the median of repeated runs, with the FMA peak and the
// memory-read bandwidth probed in the same process (peak_probe.hpp,
// bandwidth_probe.hpp) so ratios hold even when absolute speeds drift between
// runs.
#include "bench.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <new>
#include <optional>
#include <random>
#include <regex>
#include <string>
#include <string_view>
#include <vector>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "bandwidth_probe.hpp"
#include "bench_common.hpp"
#include "bench_naive.hpp"
#include "peak_probe.hpp"
#include "qkv/decode.hpp"
#include "qkv/internal/kernels.hpp"
#include "qkv/kv_cache.hpp"
#include "qkv/qkv.hpp"

namespace qkv::tools {
namespace {

// Every case draws its inputs from a generator with this seed, so a case's
// inputs do not depend on which other cases the filter selects.
constexpr std::uint32_t kSeed = 20240501;

enum class Pass : std::uint8_t { forward, backward, decode };

std::string_view suite_name(Pass pass) {
  switch (pass) {
    case Pass::backward:
      return "backward";
    case Pass::decode:
      return "decode";
    default:
      return "forward";
  }
}

// AttentionOptions::matmul_precision as Python spells it.
const char* precision_name(MatmulPrecision precision) {
  switch (precision) {
    case MatmulPrecision::medium:
      return "medium";
    case MatmulPrecision::int8:
      return "int8";
    default:
      return "highest";
  }
}

struct Case {
  std::string name;
  Pass pass = Pass::forward;
  DType dtype = DType::f32;
  std::int64_t b = 1, hq = 16, hkv = 16, nq = 0, nk = 0, d = 0;
  bool causal = false;
  std::int64_t window_left = -1, window_right = -1;  // -1 = unbounded
  bool naive = true;  // false where the baseline's Nq x Nk scores do not fit in memory
  // Decode: the KvCache's storage; Nq is the new queries per sequence and Nk
  // the cache length L (queries, in `dtype`, see all L keys).
  KvStorage cache_storage = KvStorage::f32;
  // Decode: tokens per page of a paged cache (the pool's pages taken in the
  // order the fill appends them); 0: contiguous.
  std::int64_t page_size = 0;
  // Decode: a latent cache (MLA, KvCacheConfig::values_in_keys; Hkv 1): each
  // row of D values is the key, its first dv the value. 0: values of D apart.
  std::int64_t latent_dv = 0;
  // Decode, latent: the row's last values kept in bf16 past its blocks
  // (KvCacheConfig::tail_dim, the RoPE part); 0: the whole row in the storage.
  std::int64_t latent_tail = 0;
  // AttentionOptions::matmul_precision (medium: bf16 products for bf16 rows
  // on AVX512-BF16; the name then says "medium").
  MatmulPrecision precision = MatmulPrecision::highest;
};

// A sequence length divided by --shrink (at least 1).
std::int64_t shrunk(std::int64_t n, int shrink) { return std::max<std::int64_t>(1, n / shrink); }

std::string shape_name(std::string_view pass, DType dtype, std::int64_t b, std::int64_t h,
                       std::int64_t n, std::int64_t d) {
  return std::string(pass) + "/" + std::string(dtype_name(dtype)) + "/B" + std::to_string(b) +
         "/H" + std::to_string(h) + "/N" + std::to_string(n) + "/D" + std::to_string(d);
}

// The forward suite. Names are stable: results are compared across runs by
// name. Names show the sequence lengths after --shrink.
std::vector<Case> forward_cases(int shrink) {
  std::vector<Case> cases;
  for (const DType dtype : {DType::f32, DType::bf16, DType::f16}) {
    const std::string prefix = "fwd/" + std::string(dtype_name(dtype)) + "/B1/H16/";
    for (const std::int64_t full_n : {512, 2048, 8192}) {
      const std::int64_t n = shrunk(full_n, shrink);
      for (const std::int64_t d : {64, 128}) {
        const std::string shape = shape_name("fwd", dtype, 1, 16, n, d);
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
    const std::int64_t nq = shrunk(77, shrink), nk = shrunk(4096, shrink);
    cases.push_back(
        {.name = prefix + "Nq" + std::to_string(nq) + "/Nk" + std::to_string(nk) + "/D64/cross",
         .dtype = dtype,
         .nq = nq,
         .nk = nk,
         .d = 64});
  }
  // 64K tokens in one head: the fused kernel's O(N) memory where the baseline
  // would need 16 GiB of scores.
  const std::int64_t n = shrunk(65536, shrink);
  cases.push_back({.name = shape_name("fwd", DType::f32, 1, 1, n, 64) + "/full",
                   .hq = 1,
                   .hkv = 1,
                   .nq = n,
                   .nk = n,
                   .d = 64,
                   .naive = false});
  return cases;
}

// The backward suite: the gradients of full and causal attention.
std::vector<Case> backward_cases(int shrink) {
  std::vector<Case> cases;
  const std::int64_t n = shrunk(2048, shrink);
  for (const DType dtype : {DType::f32, DType::bf16}) {
    for (const std::int64_t d : {64, 128}) {
      const std::string shape = shape_name("bwd", dtype, 1, 16, n, d);
      Case c{.name = shape + "/full",
             .pass = Pass::backward,
             .dtype = dtype,
             .nq = n,
             .nk = n,
             .d = d};
      cases.push_back(c);
      c.name = shape + "/causal";
      c.causal = true;
      cases.push_back(c);
    }
  }
  // 32K tokens in one head: the fused backward's O(N) memory where the
  // baseline would need 8 GiB of probabilities and their gradients.
  const std::int64_t long_n = shrunk(32768, shrink);
  cases.push_back({.name = shape_name("bwd", DType::f32, 1, 1, long_n, 64) + "/full",
                   .pass = Pass::backward,
                   .hq = 1,
                   .hkv = 1,
                   .nq = long_n,
                   .nk = long_n,
                   .d = 64,
                   .naive = false});
  return cases;
}

// The decode suite: one new query per sequence against a cache of L tokens,
// with the heads of Llama 3 8B (32 query heads sharing 8 KV heads of 128), the
// cache in f32, bf16, f16 (half the bytes to read) and ggml's q8_0 and q4_0
// blocks (8.5 and 4.5 bits per value), queries in f32; the 16-bit and f32
// caches also at B = 4 and paged (16 tokens per page, vLLM's default), and
// with four new tokens per sequence (n4). Every case reads each cached byte
// once per step, so with one new token memory bandwidth bounds it.
std::vector<Case> decode_cases(int shrink) {
  struct Shape {
    std::int64_t b, l, page_size;
  };
  std::vector<Case> cases;
  const auto add = [&](KvStorage storage, Shape shape,
                       MatmulPrecision precision = MatmulPrecision::highest, std::int64_t n = 1) {
    const std::int64_t l = shrunk(shape.l, shrink);
    const std::string paged =
        shape.page_size > 0 ? "paged" + std::to_string(shape.page_size) + "/" : "";
    const std::string medium = precision == MatmulPrecision::medium ? "medium/" : "";
    cases.push_back({.name = "dec/" + std::string(storage_name(storage)) + "/" + medium + paged +
                             "B" + std::to_string(shape.b) + "/Hq32/Hkv8/L" + std::to_string(l) +
                             "/D128/n" + std::to_string(n),
                     .pass = Pass::decode,
                     .b = shape.b,
                     .hq = 32,
                     .hkv = 8,
                     .nq = n,
                     .nk = l,
                     .d = 128,
                     .causal = true,
                     .naive = false,
                     .cache_storage = storage,
                     .page_size = shape.page_size,
                     .precision = precision});
  };
  for (const KvStorage storage :
       {KvStorage::f32, KvStorage::bf16, KvStorage::f16, KvStorage::q8_0, KvStorage::q4_0}) {
    for (const Shape shape :
         {Shape{1, 4096, 0}, Shape{1, 32768, 0}, Shape{1, 131072, 0}, Shape{16, 4096, 0}}) {
      add(storage, shape);
    }
  }
  for (const KvStorage storage : {KvStorage::f32, KvStorage::bf16, KvStorage::f16}) {
    for (const Shape shape : {Shape{4, 32768, 0}, Shape{1, 32768, 16}, Shape{4, 32768, 16}}) {
      add(storage, shape);
    }
  }
  // Four new tokens per sequence (speculative decoding, causal among
  // themselves): the query rows of a KV head grow from 4 to 16.
  for (const KvStorage storage : {KvStorage::f32, KvStorage::bf16, KvStorage::f16}) {
    add(storage, Shape{1, 32768, 0}, MatmulPrecision::highest, 4);
  }
  // And on a bf16 engine where the CPU has one (the small GEMM of
  // cpu/decode_engine-inl.h).
  add(KvStorage::bf16, Shape{1, 32768, 0}, MatmulPrecision::medium, 4);
  // The bf16 cache on bf16 dot products (MatmulPrecision::medium).
  for (const Shape shape : {Shape{1, 4096, 0}, Shape{1, 32768, 0}, Shape{1, 131072, 0},
                            Shape{4, 32768, 0}, Shape{1, 32768, 16}, Shape{4, 32768, 16}}) {
    add(KvStorage::bf16, shape, MatmulPrecision::medium);
  }
  // DeepSeek's MLA, absorbed: 128 query heads against one latent row of 576
  // (512 + 64 RoPE) per token, the first 512 the value; bf16, q8_0, and q8_0
  // with the RoPE part in bf16.
  struct Latent {
    KvStorage storage;
    std::int64_t tail;
    MatmulPrecision precision = MatmulPrecision::highest;
  };
  for (const Latent latent :
       {Latent{KvStorage::bf16, 0}, Latent{KvStorage::bf16, 0, MatmulPrecision::medium},
        Latent{KvStorage::q8_0, 0}, Latent{KvStorage::q8_0, 64}}) {
    const std::int64_t l = shrunk(32768, shrink);
    cases.push_back({.name = "dec/mla/" + std::string(storage_name(latent.storage)) +
                             (latent.tail > 0 ? "+bf16rope" : "") +
                             (latent.precision == MatmulPrecision::medium ? "/medium" : "") +
                             "/B1/Hq128/L" + std::to_string(l) + "/D576/Dv512/n1",
                     .pass = Pass::decode,
                     .b = 1,
                     .hq = 128,
                     .hkv = 1,
                     .nq = 1,
                     .nk = l,
                     .d = 576,
                     .causal = true,
                     .naive = false,
                     .cache_storage = latent.storage,
                     .latent_dv = 512,
                     .latent_tail = latent.tail,
                     .precision = latent.precision});
  }
  return cases;
}

AttentionOptions options_of(const Case& c) {
  AttentionOptions options;
  options.causal = c.causal;
  options.matmul_precision = c.precision;
  options.window_left = c.window_left;
  options.window_right = c.window_right;
  options.backend = Backend::fast;
  return options;
}

struct Row {
  const Case* c = nullptr;
  std::string_view impl;
  Timing timing;
  double gflops = 0.0;
  double bytes_per_second = 0.0;        // decode: cached K and V bytes read per second
  double best_bytes_per_second = 0.0;   // decode: the same in the fastest run
  double peak_gflops = 0.0;             // the FMA peak the row is read against (ProbeBracket)
  double probe_bytes_per_second = 0.0;  // decode: the read bandwidth likewise
  // The instruction family of the products: qkv's kernels say which they
  // took ("f32", "avx512_bf16", "amx_bf16"); the baseline's are f32 sgemm.
  const char* isa = "f32";
};

// The probes at the start of a run; `bandwidth` is probed only when a decode
// case runs.
struct Probes {
  PeakProbe peak;
  std::optional<BandwidthProbe> bandwidth;
};

std::string json_line(const Row& r, int threads, const char* target) {
  const Case& c = *r.c;
  const std::string_view suite = suite_name(c.pass);
  char text[1024];
  std::snprintf(
      text, sizeof text,
      "{\"suite\":\"%.*s\",\"name\":\"%s\",\"impl\":\"%.*s\",\"dtype\":\"%.*s\","
      "\"B\":%lld,\"Hq\":%lld,\"Hkv\":%lld,\"Nq\":%lld,\"Nk\":%lld,\"D\":%lld,"
      "\"causal\":%s,\"window\":[%lld,%lld],\"threads\":%d,\"seconds\":%.6g,"
      "\"gflops\":%.6g,\"peak_gflops\":%.6g,\"fraction_of_peak\":%.4g,"
      "\"extra_bytes\":%lld,\"target\":\"%s\",\"isa\":\"%s\",\"matmul_precision\":\"%s\"",
      static_cast<int>(suite.size()), suite.data(), c.name.c_str(), static_cast<int>(r.impl.size()),
      r.impl.data(), static_cast<int>(dtype_name(c.dtype).size()), dtype_name(c.dtype).data(),
      static_cast<long long>(c.b), static_cast<long long>(c.hq), static_cast<long long>(c.hkv),
      static_cast<long long>(c.nq), static_cast<long long>(c.nk), static_cast<long long>(c.d),
      c.causal ? "true" : "false", static_cast<long long>(c.window_left),
      static_cast<long long>(c.window_right), threads, r.timing.seconds, r.gflops, r.peak_gflops,
      r.gflops / r.peak_gflops, static_cast<long long>(r.timing.extra_bytes), target, r.isa,
      precision_name(c.precision));
  std::string line = text;
  if (c.pass == Pass::decode) {
    const double bandwidth = r.probe_bytes_per_second;
    std::snprintf(text, sizeof text,
                  ",\"cache_dtype\":\"%.*s\",\"L\":%lld,\"bytes_per_second\":%.6g,"
                  "\"probe_bytes_per_second\":%.6g,\"fraction_of_bandwidth\":%.4g,"
                  "\"tokens_per_second\":%.6g,\"best_seconds\":%.6g,"
                  "\"best_fraction_of_bandwidth\":%.4g",
                  static_cast<int>(std::strlen(storage_name(c.cache_storage))),
                  storage_name(c.cache_storage), static_cast<long long>(c.nk), r.bytes_per_second,
                  bandwidth, r.bytes_per_second / bandwidth,
                  static_cast<double>(c.b * c.nq) / r.timing.seconds, r.timing.best_seconds,
                  r.best_bytes_per_second / bandwidth);
    line += text;
  }
  return line + "}";
}

std::string table_line(const Row& r, int name_width) {
  char text[512];
  if (r.c->pass == Pass::decode) {
    std::snprintf(text, sizeof text,
                  "%-*s  %-5.*s  %10.3f  %9.2f  %9.1f  %9.1f  %10.1f  %9.1f  %9.1f", name_width,
                  r.c->name.c_str(), static_cast<int>(r.impl.size()), r.impl.data(),
                  r.timing.seconds * 1e3, r.bytes_per_second / 1e9,
                  100.0 * r.bytes_per_second / r.probe_bytes_per_second,
                  100.0 * r.best_bytes_per_second / r.probe_bytes_per_second,
                  static_cast<double>(r.c->b * r.c->nq) / r.timing.seconds, r.gflops,
                  static_cast<double>(r.timing.extra_bytes) / 1e6);
    return text;
  }
  std::snprintf(text, sizeof text, "%-*s  %-5.*s  %10.3f  %9.1f  %9.1f  %9.1f", name_width,
                r.c->name.c_str(), static_cast<int>(r.impl.size()), r.impl.data(),
                r.timing.seconds * 1e3, r.gflops, 100.0 * r.gflops / r.peak_gflops,
                static_cast<double>(r.timing.extra_bytes) / 1e6);
  return text;
}

// Decode rows have their own columns: bytes read rather than flops bound them.
std::string table_header(int name_width, bool decode) {
  char text[512];
  if (decode) {
    std::snprintf(text, sizeof text, "%-*s  %-5s  %10s  %9s  %9s  %9s  %10s  %9s  %9s", name_width,
                  "name", "impl", "ms", "GB/s", "% of bw", "best %", "tokens/s", "GFLOP/s",
                  "extra MB");
  } else {
    std::snprintf(text, sizeof text, "%-*s  %-5s  %10s  %9s  %9s  %9s", name_width, "name", "impl",
                  "ms", "GFLOP/s", "% of peak", "extra MB");
  }
  return text;
}

std::vector<Case> suite_cases(const BenchOptions& options) {
  if (options.shrink < 1) {
    throw Error("bench: --shrink must be at least 1, got " + std::to_string(options.shrink));
  }
  if (options.suite == "forward") return forward_cases(options.shrink);
  if (options.suite == "backward") return backward_cases(options.shrink);
  if (options.suite == "decode") return decode_cases(options.shrink);
  if (options.suite == "all") {
    std::vector<Case> cases = forward_cases(options.shrink);
    for (Case& c : backward_cases(options.shrink)) cases.push_back(std::move(c));
    for (Case& c : decode_cases(options.shrink)) cases.push_back(std::move(c));
    return cases;
  }
  throw Error(
      "bench: --suite must be forward, backward, decode, all, scaling, modules or ring, got '" +
      options.suite + "'");
}

// Token rows (B * tokens) per KvCache::append when filling a decode case's
// cache: bounds the f32 temporaries (16 MiB each for K and V at Hkv = 8,
// D = 128) whatever L is.
constexpr std::int64_t kFillRows = 4096;

// Bytes a decode case's cache holds: B * L * Hkv * (Dk + Dv) stored values
// (a latent cache: B * L rows of D).
std::int64_t cache_bytes(const Case& c) {
  if (c.latent_dv > 0) {
    return c.b * c.nk *
           (stored_bytes(c.cache_storage, c.d - c.latent_tail) +
            stored_bytes(KvStorage::bf16, c.latent_tail));
  }
  return c.b * c.nk * c.hkv * 2 * stored_bytes(c.cache_storage, c.d);
}

// Makes `cache` a cache (contiguous, or paged by the case) holding L tokens per sequence: uniform
// [-1, 1) keys and values drawn in f32 and rounded once to the storage dtype
// by append(). Returns why not where the cache does not fit in memory (the
// case is then skipped, not failed, so that a smaller machine still measures
// the shorter caches); empty on success.
std::string fill_cache(const Case& c, std::mt19937& rng, std::optional<KvCache>& cache) {
  const std::int64_t chunk = std::max<std::int64_t>(1, kFillRows / c.b);
  const std::int64_t needed =
      cache_bytes(c) + 2 * c.b * chunk * c.hkv * c.d * static_cast<std::int64_t>(sizeof(float));
  const std::int64_t available = proc_bytes("/proc/meminfo", "MemAvailable:");
  if (available >= 0 && needed > available) {
    return "needs " + std::to_string(needed >> 20) + " MiB, " + std::to_string(available >> 20) +
           " MiB available";
  }
  try {
    const bool latent = c.latent_dv > 0;
    cache.emplace(KvCacheConfig{.batch = c.b,
                                .kv_heads = c.hkv,
                                .head_dim = c.d,
                                .value_dim = c.latent_dv,
                                .capacity = c.nk,
                                .page_size = c.page_size,
                                .key_storage = c.cache_storage,
                                .value_storage = c.cache_storage,
                                .values_in_keys = latent,
                                .tail_dim = c.latent_tail});
    for (std::int64_t t = 0; t < c.nk; t += chunk) {
      const std::int64_t n = std::min(chunk, c.nk - t);
      const Tensor k = random_tensor(DType::f32, {c.b, n, c.hkv, c.d}, rng);
      const Tensor v = latent ? Tensor() : random_tensor(DType::f32, {c.b, n, c.hkv, c.d}, rng);
      cache->append(k, latent ? ConstTensorView{} : v.view());
    }
  } catch (const std::bad_alloc&) {
    cache.reset();
    return "cannot allocate its " + std::to_string(cache_bytes(c) >> 20) + " MiB cache";
  }
  return {};
}

// One implementation of a case and how to run it.
struct Impl {
  std::string_view name;
  std::function<void()> run;
};

// max |naive - qkv| / max |qkv| over the elements of one output.
double relative_difference(ConstTensorView qkv, ConstTensorView naive) {
  const Tensor a = to_dtype(qkv, DType::f64), b = to_dtype(naive, DType::f64);
  const double* x = a.data<double>();
  const double* y = b.data<double>();
  double max_diff = 0.0, max_abs = 0.0;
  for (std::int64_t i = 0; i < a.numel(); ++i) {
    // std::max would drop a NaN difference; the comparison below keeps it.
    const double diff = std::abs(x[i] - y[i]);
    if (!(diff <= max_diff)) max_diff = diff;
    max_abs = std::max(max_abs, std::abs(x[i]));
  }
  return max_diff / std::max(max_abs, 1e-30);
}

// The --check bound on relative_difference: loose enough for a different
// summation order and, in bf16 and f16, for the two implementations rounding
// an output element to neighbouring values (one ulp: 2^-7 and 2^-10 of it),
// yet a wrong scale, mask or operand fails it.
double check_bound(DType dtype) { return dtype == DType::f32 ? 1e-3 : 3e-2; }

// --filter as a regular expression; throws qkv::Error if it is not one.
std::regex compile_filter(const BenchOptions& options) {
  try {
    return std::regex(options.filter);
  } catch (const std::regex_error& e) {
    throw Error("bench: --filter '" + options.filter +
                "' is not a regular expression: " + e.what());
  }
}

// The suite's cases that match the filter (none: an empty list).
std::vector<Case> select_cases(const BenchOptions& options, const std::regex& filter) {
  std::vector<Case> cases;
  for (Case& c : suite_cases(options)) {
    if (std::regex_search(c.name, filter)) cases.push_back(std::move(c));
  }
  return cases;
}

// The first line: the probes of the start of the run (JSON or text).
void print_probes(std::ostream& out, const BenchOptions& options, const Probes& probes,
                  const char* target) {
  const PeakProbe& peak = probes.peak;
  char header[512];
  if (options.json) {
    int length = std::snprintf(header, sizeof header,
                               "{\"suite\":\"probe\",\"peak_gflops\":%.6g,\"threads\":%d,"
                               "\"target\":\"%s\"",
                               peak.gflops, peak.threads, peak.target);
    if (probes.bandwidth) {
      length += std::snprintf(header + length, sizeof header - static_cast<std::size_t>(length),
                              ",\"probe_bytes_per_second\":%.6g,\"probe_buffer_bytes\":%lld,"
                              "\"probe_widen_bytes_per_second\":%.6g",
                              probes.bandwidth->bytes_per_second,
                              static_cast<long long>(probes.bandwidth->buffer_bytes),
                              probes.bandwidth->widen_bytes_per_second);
    }
    out << header << "}" << std::endl;
    return;
  }
  int length = std::snprintf(header, sizeof header,
                             "At the start: FMA peak %.1f GFLOP/s (%s probe, %d threads); ",
                             peak.gflops, peak.target, peak.threads);
  if (probes.bandwidth) {
    length +=
        std::snprintf(header + length, sizeof header - static_cast<std::size_t>(length),
                      "read bandwidth %.1f GB/s (%s probe, %lld MiB, %d threads), "
                      "%.1f GB/s widening f16 with 4 FMAs per value; ",
                      probes.bandwidth->bytes_per_second / 1e9, probes.bandwidth->target,
                      static_cast<long long>(probes.bandwidth->buffer_bytes >> 20),
                      probes.bandwidth->threads, probes.bandwidth->widen_bytes_per_second / 1e9);
  }
  std::snprintf(header + length, sizeof header - static_cast<std::size_t>(length),
                "kernels: %s; median of %d runs, each case against the probes around it%s", target,
                options.repeats,
                probes.bandwidth ? " (best %: the fastest run, as the probe takes its best)" : "");
  out << header << std::endl;
}

// One case ready to time: its tensors, its implementations and the outputs
// --check compares. Every tensor is allocated (and touched: Tensor
// zero-fills) before measure() opens its memory window, so extra_bytes
// counts scratch only. The implementations refer to the members: a
// PreparedCase stays where prepare_case built it.
struct PreparedCase {
  AttentionOptions attention_options;
  double flops = 0.0;  // useful flops, credited to every implementation
  // Backward: the forward's lse, dout and the gradients; decode: the cache.
  Tensor q, o, k, v, lse, dout, dq, dk, dv;
  std::optional<KvCache> cache;
  std::vector<Impl> impls;
  std::vector<std::pair<std::string_view, TensorView>> outputs;  // compared under --check
};

// Builds case c into p; returns why the case is skipped (empty: it runs).
std::string prepare_case(const Case& c, const BenchOptions& options, PreparedCase& p) {
  std::mt19937 rng(kSeed);
  p.q = random_tensor(c.dtype, {c.b, c.nq, c.hq, c.d}, rng);
  p.o = Tensor(c.dtype, {c.b, c.nq, c.hq, c.latent_dv > 0 ? c.latent_dv : c.d});
  p.attention_options = options_of(c);
  // 4 flops per unmasked pair, head and head dimension forward and decode,
  // 2.5 times that backward. The naive baselines are credited with the same
  // useful flops.
  // A latent case: 2 D + 2 Dv flops per pair and head.
  const std::int64_t dims = c.latent_dv > 0 ? (c.d + c.latent_dv) / 2 : c.d;
  p.flops = (c.pass == Pass::backward ? 10.0 : 4.0) * static_cast<double>(c.b * c.hq * dims) *
            static_cast<double>(unmasked_pairs(c.nq, c.nk, p.attention_options));
  if (c.pass == Pass::decode) {
    if (std::string skip = fill_cache(c, rng, p.cache); !skip.empty()) return skip;
    p.impls.push_back({"qkv", [&p, precision = c.precision, causal = c.causal] {
                         AttentionOptions o;
                         o.matmul_precision = precision;
                         o.causal = causal;
                         decode_attention_into(p.q, *p.cache, p.o, {}, o);
                       }});
    return {};
  }
  p.k = random_tensor(c.dtype, {c.b, c.nk, c.hkv, c.d}, rng);
  p.v = random_tensor(c.dtype, {c.b, c.nk, c.hkv, c.d}, rng);
  const int threads = options.threads;
  if (c.pass == Pass::forward) {
    p.impls.push_back(
        {"qkv", [&p] { attention_into(p.q, p.k, p.v, {.out = p.o}, p.attention_options); }});
    if (c.naive) {
      p.impls.push_back({"naive", [&p, threads] {
                           materialized_attention(p.q, p.k, p.v, p.o, p.attention_options, threads);
                         }});
    }
    p.outputs = {{"out", p.o}};
    return {};
  }
  p.lse = Tensor(DType::f32, {c.b, c.hq, c.nq});
  attention_into(p.q, p.k, p.v, {.out = p.o, .lse = p.lse}, p.attention_options);
  p.dout = random_tensor(c.dtype, {c.b, c.nq, c.hq, c.d}, rng);
  p.dq = Tensor(c.dtype, {c.b, c.nq, c.hq, c.d});
  p.dk = Tensor(c.dtype, {c.b, c.nk, c.hkv, c.d});
  p.dv = Tensor(c.dtype, {c.b, c.nk, c.hkv, c.d});
  p.impls.push_back({"qkv", [&p] {
                       attention_backward_into(p.q, p.k, p.v, p.o, p.dout, p.lse,
                                               {.dq = p.dq, .dk = p.dk, .dv = p.dv},
                                               p.attention_options);
                     }});
  if (c.naive) {
    p.impls.push_back({"naive", [&p, threads] {
                         materialized_attention_backward(p.q, p.k, p.v, p.o, p.dout, p.lse, p.dq,
                                                         p.dk, p.dv, p.attention_options, threads);
                       }});
  }
  p.outputs = {{"dq", p.dq}, {"dk", p.dk}, {"dv", p.dv}};
  return {};
}

// --check: the baseline's outputs (just written) against qkv's copies;
// prints one line and returns whether every output is within the bound.
bool check_outputs(std::ostream& progress, const Case& c, const PreparedCase& p,
                   const std::vector<Tensor>& qkv_outputs) {
  const double bound = check_bound(c.dtype);
  std::string report = "check " + c.name + ": max |naive - qkv| / max |qkv|:";
  bool passed = true;
  for (std::size_t i = 0; i < p.outputs.size(); ++i) {
    const double difference = relative_difference(qkv_outputs[i], p.outputs[i].second);
    passed = passed && difference <= bound;
    char text[64];
    std::snprintf(text, sizeof text, " %.*s %.2e", static_cast<int>(p.outputs[i].first.size()),
                  p.outputs[i].first.data(), difference);
    report += text;
  }
  char text[64];
  std::snprintf(text, sizeof text, " (bound %.0e): %s", bound, passed ? "ok" : "FAILED");
  progress << report << text << std::endl;
  return passed;
}

}  // namespace

int run_bench(std::ostream& out, std::ostream& progress, const BenchOptions& options) {
  const std::regex filter = compile_filter(options);
  if (options.suite == "scaling") return run_scaling_bench(out, progress, options);
  if (options.suite == "modules") return run_modules_bench(out, progress, options);
  if (options.suite == "ring") {
#ifdef QKV_WITH_MPI
    return run_ring_bench(out, progress, options);
#else
    throw Error("bench: --suite ring needs qkv built with MPI (QKV_WITH_MPI, libopenmpi-dev)");
#endif
  }
  const std::vector<Case> cases = select_cases(options, filter);
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
  Probes probes{.peak = probe_fma_peak(options.threads), .bandwidth = {}};
  const char* target = internal::kernel_target();
  int name_width = 0;
  int runs = 0;
  for (const Case& c : cases) {
    name_width = std::max(name_width, static_cast<int>(c.name.size()));
    runs += c.naive ? 2 : 1;
    if (c.pass == Pass::decode && !probes.bandwidth) {
      probes.bandwidth = probe_read_bandwidth(options.threads, /*with_widening=*/true);
    }
  }
  print_probes(out, options, probes, target);

  ProbeBracket peak_bracket([&] { return probe_fma_peak(options.threads).gflops; },
                            probes.peak.gflops);
  std::optional<ProbeBracket> bandwidth_bracket;
  if (probes.bandwidth) {
    bandwidth_bracket.emplace(
        [&] { return probe_read_bandwidth(options.threads).bytes_per_second; },
        probes.bandwidth->bytes_per_second);
  }
  int run = 0;
  bool checks_passed = true;
  std::optional<bool> decode_table;  // which table header was printed last
  for (const Case& c : cases) {
    PreparedCase p;
    if (const std::string skip = prepare_case(c, options, p); !skip.empty()) {
      ++run;
      progress << "[" << run << "/" << runs << "] " << c.name << " skipped: " << skip << std::endl;
      continue;
    }
    // qkv's outputs, copied after its runs when --check compares them with
    // the baseline's (outside the baseline's memory window).
    std::vector<Tensor> qkv_outputs;
    for (const Impl& impl : p.impls) {
      ++run;
      progress << (options.live_progress ? "\r" : "") << "[" << run << "/" << runs << "] " << c.name
               << " " << impl.name << " ..." << (options.live_progress ? "\033[K" : "\n")
               << std::flush;
      const Timing timing = measure(impl.run, options.repeats);
      Row row{&c, impl.name, timing, p.flops / timing.seconds / 1e9};
      if (impl.name == "qkv") row.isa = internal::last_products_isa();
      if (c.pass == Pass::decode) {
        // Decoding reads memory: probe the bandwidth again; the peak stands.
        row.bytes_per_second = static_cast<double>(cache_bytes(c)) / timing.seconds;
        row.best_bytes_per_second = static_cast<double>(cache_bytes(c)) / timing.best_seconds;
        row.probe_bytes_per_second = bandwidth_bracket->next();
        row.peak_gflops = peak_bracket.last();
      } else {
        row.peak_gflops = peak_bracket.next();
      }
      if (options.live_progress) progress << "\r\033[K" << std::flush;
      if (options.json) {
        out << json_line(row, options.threads, target) << std::endl;
      } else {
        const bool decode = c.pass == Pass::decode;
        if (decode_table != decode) {
          if (decode_table.has_value()) out << "\n";
          out << table_header(name_width, decode) << "\n";
          decode_table = decode;
        }
        out << table_line(row, name_width) << std::endl;
      }
      if (!options.check || !c.naive) continue;
      if (impl.name == "qkv") {
        for (const auto& [name, view] : p.outputs) qkv_outputs.push_back(to_dtype(view, c.dtype));
        continue;
      }
      // The baseline has run last: compare it with qkv.
      checks_passed = check_outputs(progress, c, p, qkv_outputs) && checks_passed;
    }
  }
  return checks_passed ? 0 : 3;
}

}  // namespace qkv::tools
