// Decode with MatmulPrecision::medium: bf16 caches on AVX512-BF16 dot
// products (cpu/bf16_dot-inl.h), and with many rows per KV head as a small
// GEMM on the bf16 engines (cpu/decode_engine-inl.h, through their exact
// emulations on any CPU), against the same cache decoded at highest
// precision, within the error model of rounding the queries and the weights
// to bf16 (docs/numerics.md); shapes around the 32-value chunks, the pairs
// of tokens, the four-row tiles and the engines' 16 columns; the paths
// without the instructions (QKV_ISA=avx512, dims not a multiple of 32, other
// storages) bit for bit the highest-precision decode.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>

#include "core/isa.hpp"
#include "cpu/engines/select.hpp"
#include "test_util.hpp"

namespace {

using qkv::AttentionOptions;
using qkv::DType;
using qkv::KvCache;
using qkv::KvStorage;
using qkv::Tensor;
using qkv::test::max_abs;
using qkv::test::max_abs_diff;
using qkv::test::random_tensor;

struct Shape {
  std::int64_t batch, hq, hkv, dk, dv, length, n, page_size;
};

std::string label(const Shape& s) {
  char text[160];
  std::snprintf(text, sizeof text, "B%lld Hq%lld Hkv%lld Dk%lld Dv%lld L%lld n%lld page%lld",
                static_cast<long long>(s.batch), static_cast<long long>(s.hq),
                static_cast<long long>(s.hkv), static_cast<long long>(s.dk),
                static_cast<long long>(s.dv), static_cast<long long>(s.length),
                static_cast<long long>(s.n), static_cast<long long>(s.page_size));
  return text;
}

struct Filled {
  KvCache cache;
  Tensor q, k, v;  // k and v as appended
  std::vector<std::int64_t> counts;
};

// A cache of `storage` holding random keys and values (the second sequence
// shorter by 7 tokens), and n new query rows per sequence.
Filled fill(const Shape& s, KvStorage storage, std::uint32_t seed) {
  KvCache cache({.batch = s.batch,
                 .kv_heads = s.hkv,
                 .head_dim = s.dk,
                 .value_dim = s.dv,
                 .capacity = s.length,
                 .page_size = s.page_size,
                 .key_storage = storage,
                 .value_storage = storage});
  Tensor k = random_tensor(DType::f32, {s.batch, s.length, s.hkv, s.dk}, seed, -1.5, 1.5);
  Tensor v = random_tensor(DType::f32, {s.batch, s.length, s.hkv, s.dv}, seed + 1);
  std::vector<std::int64_t> counts(static_cast<std::size_t>(s.batch), s.length);
  if (s.batch > 1) counts[1] = s.length - 7;
  cache.append(k, v, counts);
  return {std::move(cache),
          random_tensor(DType::f32, {s.batch, s.n, s.hq, s.dk}, seed + 2, -1.5, 1.5), std::move(k),
          std::move(v), std::move(counts)};
}

double round_bf16(double x) { return qkv::to_float(qkv::to_bf16(static_cast<float>(x))); }

// The same math in double, rounding as medium does: the scaled queries and
// the weights (relative to the row's largest score) to bf16, the keys and
// values as a bf16 cache holds them. Out [B, n, Hq, Dv].
Tensor emulate(const Shape& s, const Filled& f) {
  Tensor out(DType::f64, {s.batch, s.n, s.hq, s.dv});
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.dk));
  const std::int64_t group = s.hq / s.hkv;
  for (std::int64_t b = 0; b < s.batch; ++b) {
    const std::int64_t length = f.counts[static_cast<std::size_t>(b)];
    for (std::int64_t t = 0; t < s.n; ++t) {
      const std::int64_t keys = length - (s.n - 1 - t);  // causal, bottom-right
      for (std::int64_t h = 0; h < s.hq; ++h) {
        std::vector<double> score(static_cast<std::size_t>(keys));
        double m = -INFINITY;
        for (std::int64_t j = 0; j < keys; ++j) {
          double dot = 0.0;
          for (std::int64_t c = 0; c < s.dk; ++c) {
            dot += round_bf16(scale * f.q.get({b, t, h, c})) *
                   round_bf16(f.k.get({b, j, h / group, c}));
          }
          score[static_cast<std::size_t>(j)] = dot;
          m = std::max(m, dot);
        }
        double l = 0.0;
        std::vector<double> o(static_cast<std::size_t>(s.dv), 0.0);
        for (std::int64_t j = 0; j < keys; ++j) {
          const double p = std::exp(score[static_cast<std::size_t>(j)] - m);
          l += p;
          for (std::int64_t c = 0; c < s.dv; ++c) {
            o[static_cast<std::size_t>(c)] +=
                round_bf16(p) * round_bf16(f.v.get({b, j, h / group, c}));
          }
        }
        for (std::int64_t c = 0; c < s.dv; ++c)
          out.set({b, t, h, c}, o[static_cast<std::size_t>(c)] / l);
      }
    }
  }
  return out;
}

// The largest row sum of |q| times the scale: scores move by at most
// u * qk_l1 * max|k| when q is rounded to bf16 (u its unit roundoff).
double scaled_q_l1(const Tensor& q, double scale) {
  double most = 0.0;
  const std::int64_t rows = q.numel() / q.size(3);
  for (std::int64_t r = 0; r < rows; ++r) {
    double sum = 0.0;
    for (std::int64_t c = 0; c < q.size(3); ++c)
      sum += std::fabs(q.data<float>()[r * q.size(3) + c]);
    most = std::max(most, sum);
  }
  return most * scale;
}

// Decodes with medium and with highest precision; checks the error model
// and returns the difference of the outputs.
double expect_within_model(const Shape& s, std::uint32_t seed) {
  SCOPED_TRACE(label(s));
  const Filled f = fill(s, KvStorage::bf16, seed);
  AttentionOptions highest;
  highest.return_lse = true;
  AttentionOptions medium = highest;
  medium.matmul_precision = qkv::MatmulPrecision::medium;
  const qkv::AttentionResult exact = qkv::decode_attention(f.q, f.cache, highest);
  const qkv::AttentionResult got = qkv::decode_attention(f.q, f.cache, medium);
  // Rounding q to bf16 moves each score by at most delta; each weight then
  // by a factor within e^(+-2 delta) after normalisation, and rounding the
  // weights to bf16 moves the output by at most u max|v| (l keeps the f32
  // weights). The f32 sums of both (order and pairing) add a few 2^-24
  // relative: the 1.1.
  const double u = std::ldexp(1.0, -8);
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.dk));
  // The keys are stored in bf16: |k| at most max|k| (1 + u).
  const double delta = u * scaled_q_l1(f.q, scale) * 1.5 * (1 + u);
  const double vmax = 1.0;
  const double bound = (u + std::expm1(2 * delta)) * vmax * 1.1;
  const double diff = max_abs_diff(got.out, exact.out);
  // FlashAttention's policy beside the bound: within 2x of the same math's
  // error (emulate) and a few f32 roundings.
  const double same_math = max_abs_diff(emulate(s, f), exact.out);
  std::printf("[ bf16 dot ] %s: out %.3g, same math %.3g (bound %.3g)\n", label(s).c_str(), diff,
              same_math, bound);
  EXPECT_LE(diff, bound) << "out";
  EXPECT_LE(diff, 2 * same_math + 64 * std::ldexp(1.0, -24)) << "out against the same math";
  EXPECT_LE(max_abs_diff(got.lse, exact.lse), delta * 1.1) << "lse";
  return diff;
}

TEST(Bf16Dot, DecodeWithinTheRoundingOfQueriesAndWeights) {
  if (!qkv::detail::has_bf16_dot()) {
    GTEST_SKIP() << "this CPU has no AVX512-BF16 (or QKV_ISA caps it): the "
                    "highest-precision path runs, tested below";
  }
  // Dims a multiple of 32 (one and two chunks per value tile, 32 alone),
  // GQA groups of 1 to 6 rows per KV head (partial four-row tiles), several
  // new tokens, odd lengths (a token without its pair), pages, batches.
  const Shape shapes[] = {
      {1, 32, 8, 128, 128, 515, 1, 0}, {2, 8, 2, 64, 64, 301, 1, 16}, {1, 6, 1, 32, 96, 77, 2, 0},
      {2, 4, 4, 96, 32, 130, 3, 32},   {1, 3, 1, 64, 160, 33, 1, 0},  {1, 2, 1, 32, 32, 1, 1, 0},
  };
  std::uint32_t seed = 100;
  for (const Shape& s : shapes) {
    const double diff = expect_within_model(s, seed += 10);
    // The bf16 products ran: rounding the queries changes something (one
    // key alone has the weight 1, exactly, and its value is the output).
    if (s.length > 1) {
      EXPECT_GT(diff, 0.0) << label(s);
    }
  }
}

// The small GEMM on each engine's emulation: a KV head's rows (query heads
// x new tokens) from 8 to 32, around the engines' 16 columns; odd block
// tails (a token without its pair), pages, a second shorter sequence, dims
// that are not multiples of 16 or 32.
TEST(Bf16Dot, DecodeOnTheEnginesWithinTheSameModel) {
  namespace engines = qkv::cpu::engines;
  const Shape shapes[] = {
      {1, 32, 8, 128, 128, 515, 4, 0}, {2, 8, 2, 64, 64, 301, 2, 16}, {1, 6, 1, 32, 96, 77, 2, 0},
      {1, 3, 1, 40, 24, 99, 3, 0},     {2, 16, 2, 64, 48, 33, 1, 0},  {1, 8, 1, 2, 2, 17, 4, 8},
  };
  for (const engines::Bf16Engine engine :
       {engines::Bf16Engine::emulate_amx_bf16, engines::Bf16Engine::emulate_avx512_bf16}) {
    SCOPED_TRACE(engines::engine_name(engine));
    engines::set_bf16_engine_for_test(engine);
    std::uint32_t seed = 300;
    for (const Shape& s : shapes) {
      EXPECT_GT(expect_within_model(s, seed += 10), 0.0) << label(s);
      EXPECT_STREQ(qkv::detail::last_products_isa(), engines::engine_name(engine)) << label(s);
    }
    engines::reset_bf16_engine_for_test();
  }
  // Four rows per KV head (one new token, GQA 4) stay on the per-row tiles.
  engines::set_bf16_engine_for_test(engines::Bf16Engine::emulate_amx_bf16);
  const Shape few{1, 8, 2, 64, 64, 40, 1, 0};
  const Filled f = fill(few, KvStorage::bf16, 9);
  AttentionOptions medium;
  medium.matmul_precision = qkv::MatmulPrecision::medium;
  (void)qkv::decode_attention(f.q, f.cache, medium);
  EXPECT_STRNE(qkv::detail::last_products_isa(), "emulated amx_bf16");
  engines::reset_bf16_engine_for_test();
}

TEST(Bf16Dot, LatentCache) {
  // MLA's shape at 16 heads: keys of 576, values the first 512 of the row;
  // on AVX512-BF16's per-row tiles where the CPU has them, and as the small
  // GEMM (16 rows) on the AMX engine's emulation.
  const std::int64_t hq = 16, dk = 576, dv = 512, l = 200;
  KvCache cache({.batch = 1,
                 .kv_heads = 1,
                 .head_dim = dk,
                 .value_dim = dv,
                 .capacity = l,
                 .page_size = 64,
                 .key_storage = KvStorage::bf16,
                 .values_in_keys = true});
  cache.append(random_tensor(DType::f32, {1, l, 1, dk}, 5), {});
  const Tensor q = random_tensor(DType::f32, {1, 1, hq, dk}, 6, -0.5, 0.5);
  AttentionOptions highest;
  highest.scale = 1.0 / std::sqrt(192.0);
  AttentionOptions medium = highest;
  medium.matmul_precision = qkv::MatmulPrecision::medium;
  const double u = std::ldexp(1.0, -8);
  const double delta = u * scaled_q_l1(q, *highest.scale) * (1 + u);
  const double bound = (u + std::expm1(2 * delta)) * 1.1;
  const auto check = [&] {
    const double diff = max_abs_diff(qkv::decode_attention(q, cache, medium).out,
                                     qkv::decode_attention(q, cache, highest).out);
    EXPECT_LE(diff, bound);
    EXPECT_GT(diff, 0.0);
  };
  namespace engines = qkv::cpu::engines;
  engines::set_bf16_engine_for_test(std::nullopt);
  if (qkv::detail::has_bf16_dot()) check();
  engines::set_bf16_engine_for_test(engines::Bf16Engine::emulate_amx_bf16);
  check();
  engines::reset_bf16_engine_for_test();
}

// Without the instructions, or where the kernel has no bf16 products for
// the call, medium decodes bit for bit as highest.
TEST(Bf16Dot, OtherPathsAreTheHighestPrecisionDecode) {
  const auto same = [](const Shape& s, KvStorage storage) {
    SCOPED_TRACE(label(s) + " " + qkv::storage_name(storage));
    const Filled f = fill(s, storage, 7);
    AttentionOptions medium;
    medium.matmul_precision = qkv::MatmulPrecision::medium;
    const Tensor a = qkv::decode_attention(f.q, f.cache, medium).out;
    const Tensor b = qkv::decode_attention(f.q, f.cache).out;
    EXPECT_EQ(std::memcmp(a.data<float>(), b.data<float>(), sizeof(float) * a.numel()), 0);
  };
  const Shape shape{2, 8, 2, 64, 64, 150, 1, 0};
  for (const KvStorage storage : {KvStorage::f32, KvStorage::f16, KvStorage::q8_0}) {
    same(shape, storage);
  }
  same({1, 4, 2, 40, 24, 99, 1, 0}, KvStorage::bf16);  // not multiples of 32
  qkv::detail::set_isa_limit_for_test(qkv::detail::Isa::f32);
  EXPECT_FALSE(qkv::detail::has_bf16_dot());
  same(shape, KvStorage::bf16);
  qkv::detail::set_isa_limit_for_test(std::nullopt);
}

}  // namespace
