// Quantized KV caches (ggml's q8_0 and q4_0 blocks): the stored bytes are
// the quantizer's, the quantizer keeps the error of docs/numerics.md, the
// decode kernel reads a quantized cache exactly as it reads an f32 cache
// holding the dequantized values (bitwise, on every Highway target), and the
// decode output moves from the f32 cache's by no more than the quantization
// error bounds; bad configs and unquantizable values throw, changing
// nothing.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "bad_input.hpp"
#include "cache/formats.hpp"
#include "cpu/flash.hpp"
#include "hwy/targets.h"
#include "test_util.hpp"

namespace {

using qkv::DType;
using qkv::KvCache;
using qkv::KvCacheConfig;
using qkv::KvStorage;
using qkv::Tensor;
using qkv::cache::BlockQ4_0;
using qkv::cache::BlockQ8_0;
using qkv::cache::kQuantBlock;
using qkv::test::error_of;
using qkv::test::expect_contains;
using qkv::test::max_abs;
using qkv::test::max_abs_diff;
using qkv::test::random_tensor;

float half(std::uint16_t bits) { return qkv::to_float(qkv::f16{bits}); }

// The dequantized values of x, one row of n values in `storage`.
std::vector<float> round_trip(KvStorage storage, const float* x, std::int64_t n) {
  std::vector<std::byte> bytes(static_cast<std::size_t>(qkv::stored_bytes(storage, n)));
  if (storage == KvStorage::q8_0) {
    qkv::cache::quantize_q8_0(x, n, reinterpret_cast<BlockQ8_0*>(bytes.data()));
  } else {
    qkv::cache::quantize_q4_0(x, n, reinterpret_cast<BlockQ4_0*>(bytes.data()));
  }
  std::vector<float> out(static_cast<std::size_t>(n));
  qkv::cache::dequantize_row(storage, bytes.data(), n, out.data());
  return out;
}

TEST(QuantizedFormats, Q8_0ByHand) {
  // max |x| = 2.54: d = 0.02, q = round(x / 0.02).
  float x[kQuantBlock] = {};
  x[0] = 2.54f;
  x[1] = -1.0f;
  x[2] = 0.03f;   // 1.5 rounds away from zero: 2
  x[3] = -0.01f;  // -0.5: -1
  BlockQ8_0 block;
  qkv::cache::quantize_q8_0(x, kQuantBlock, &block);
  EXPECT_EQ(block.d, qkv::to_f16(2.54f / 127.0f).bits);
  EXPECT_EQ(block.qs[0], 127);
  EXPECT_EQ(block.qs[1], -50);
  EXPECT_EQ(block.qs[2], 2);
  EXPECT_EQ(block.qs[3], -1);
  for (int i = 4; i < kQuantBlock; ++i) EXPECT_EQ(block.qs[i], 0);
}

TEST(QuantizedFormats, Q4_0ByHand) {
  // The value of largest magnitude is -4: d = -4 / -8 = 0.5, q = min(15,
  // floor(x / 0.5 + 8.5)); byte j holds values j (low) and j + 16 (high).
  float x[kQuantBlock] = {};
  x[0] = -4.0f;   // q 0
  x[1] = 3.9f;    // 7.8 + 8.5 = 16.3: 16, clipped to 15 (3.5)
  x[16] = 1.2f;   // 2.4 + 8.5 = 10.9: 10
  x[17] = -0.3f;  // -0.6 + 8.5 = 7.9: 7
  BlockQ4_0 block;
  qkv::cache::quantize_q4_0(x, kQuantBlock, &block);
  EXPECT_EQ(half(block.d), 0.5f);
  EXPECT_EQ(block.qs[0], 0 | (10 << 4));
  EXPECT_EQ(block.qs[1], 15 | (7 << 4));
  for (int j = 2; j < kQuantBlock / 2; ++j) EXPECT_EQ(block.qs[j], 8 | (8 << 4));
  float y[kQuantBlock];
  qkv::cache::dequantize_row(KvStorage::q4_0, &block, kQuantBlock, y);
  EXPECT_EQ(y[0], -4.0f);
  EXPECT_EQ(y[1], 3.5f);
  EXPECT_EQ(y[16], 1.0f);
  EXPECT_EQ(y[17], -0.5f);
  EXPECT_EQ(y[2], 0.0f);
}

TEST(QuantizedFormats, ZeroBlocksAndTiesOfMagnitude) {
  float zeros[kQuantBlock] = {};
  for (const KvStorage s : {KvStorage::q8_0, KvStorage::q4_0}) {
    for (const float v : round_trip(s, zeros, kQuantBlock)) EXPECT_EQ(v, 0.0f);
  }
  // q4_0 takes the first value of largest magnitude, here +2: d = -0.25,
  // and -2 (x / d = 8) clips to q - 8 = 7, which reads back as -1.75.
  float x[kQuantBlock] = {};
  x[3] = 2.0f;
  x[9] = -2.0f;
  const std::vector<float> y = round_trip(KvStorage::q4_0, x, kQuantBlock);
  EXPECT_EQ(y[3], 2.0f);
  EXPECT_EQ(y[9], -1.75f);
}

// The error model of docs/numerics.md, per block of largest magnitude a:
// q8_0 |x - x'| <= d / 2 + 2^-11 |x'| with d = a / 127; q4_0 <= |d| / 2 +
// 2^-11 |x'| with |d| = a / 8, and |d| + 2^-11 |x'| for the values clipped
// at q = 15. Swept over uniform blocks and blocks with one outlier.
TEST(QuantizedFormats, ErrorWithinTheBlockBound) {
  const std::int64_t n = 64 * kQuantBlock;
  const Tensor t = random_tensor(DType::f32, {n}, 7, -1.0, 1.0);
  std::vector<float> x(t.data<float>(), t.data<float>() + n);
  for (std::int64_t b = 0; b < n / kQuantBlock; b += 3) x[b * kQuantBlock + b % 32] *= 40.0f;
  for (const KvStorage s : {KvStorage::q8_0, KvStorage::q4_0}) {
    const std::vector<float> y = round_trip(s, x.data(), n);
    double worst = 0.0;
    for (std::int64_t b = 0; b < n / kQuantBlock; ++b) {
      double a = 0.0, m = 0.0;  // largest magnitude, and that value (the first)
      for (std::int64_t i = 0; i < kQuantBlock; ++i) {
        const double xi = x[static_cast<std::size_t>(b * kQuantBlock + i)];
        if (std::fabs(xi) > a) a = std::fabs(xi), m = xi;
      }
      const double d = s == KvStorage::q8_0 ? a / 127 : a / 8;
      for (std::int64_t i = 0; i < kQuantBlock; ++i) {
        const std::size_t k = static_cast<std::size_t>(b * kQuantBlock + i);
        const double err = std::fabs(static_cast<double>(x[k]) - y[k]);
        // q4_0 clips x / (m / -8) > 7.5 (the sign opposite m's) to 7.
        const bool clipped = s == KvStorage::q4_0 && x[k] * -8.0 / m > 7.5;
        const double bound = (clipped ? d : d / 2) + std::ldexp(std::fabs(y[k]), -11);
        EXPECT_LE(err, bound) << qkv::storage_name(s) << " block " << b << " value " << i;
        worst = std::max(worst, err / d);
      }
    }
    EXPECT_GT(worst, 0.25) << "the sweep should reach the bound's scale";
  }
}

struct Sequence {
  Tensor q, k, v;  // [B, T, Hq, Dk], [B, T, Hkv, Dk], [B, T, Hkv, Dv]
};

Sequence make_sequence(std::int64_t t, std::int64_t hq, std::int64_t hkv, std::int64_t dk,
                       std::int64_t dv, std::uint32_t seed, bool outliers) {
  Sequence s{random_tensor(DType::f32, {2, t, hq, dk}, seed, -1.5, 1.5),
             random_tensor(DType::f32, {2, t, hkv, dk}, seed + 1, -1.5, 1.5),
             random_tensor(DType::f32, {2, t, hkv, dv}, seed + 2, -1.0, 1.0)};
  if (outliers) {
    // Channel 3 of keys and 5 of values 20x larger, as LLM activations have.
    for (std::int64_t b = 0; b < 2; ++b)
      for (std::int64_t j = 0; j < t; ++j)
        for (std::int64_t h = 0; h < hkv; ++h) {
          s.k.set({b, j, h, 3}, 20 * s.k.get({b, j, h, 3}));
          s.v.set({b, j, h, 5}, 20 * s.v.get({b, j, h, 5}));
        }
  }
  return s;
}

KvCacheConfig config(const Sequence& s, KvStorage keys, KvStorage values, std::int64_t page_size) {
  KvCacheConfig c;
  c.batch = s.k.size(0);
  c.kv_heads = s.k.size(2);
  c.head_dim = s.k.size(3);
  c.value_dim = s.v.size(3);
  c.capacity = s.k.size(1);
  c.key_storage = keys;
  c.value_storage = values;
  c.page_size = page_size;
  return c;
}

// x [B, T, H, D] with each head's row replaced by its round trip through
// `storage` (f32: unchanged).
Tensor dequantized(const Tensor& x, KvStorage storage) {
  Tensor out = qkv::to_dtype(x, DType::f32);
  if (!qkv::cache::is_quantized(storage)) return out;
  const std::int64_t d = x.size(3);
  float* p = out.data<float>();
  for (std::int64_t row = 0; row < out.numel() / d; ++row) {
    const std::vector<float> y = round_trip(storage, p + row * d, d);
    std::copy(y.begin(), y.end(), p + row * d);
  }
  return out;
}

// Appends the sequence `step` tokens at a time, decoding after each step.
Tensor decode_all(const Tensor& q, const Tensor& k, const Tensor& v, KvCache& cache,
                  std::int64_t step) {
  const std::int64_t total = q.size(1);
  Tensor out(DType::f32, {q.size(0), total, q.size(2), v.size(3)});
  for (std::int64_t t = 0; t < total; t += step) {
    const std::int64_t n = std::min(step, total - t);
    cache.append(k.view().slice(1, t, n), v.view().slice(1, t, n));
    qkv::decode_attention_into(q.view().slice(1, t, n), cache, out.view().slice(1, t, n), {}, {});
  }
  return out;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.numel() == b.numel() &&
         std::memcmp(a.data<float>(), b.data<float>(),
                     sizeof(float) * static_cast<std::size_t>(a.numel())) == 0;
}

// The stored bytes of key row (b, t, h) are the quantizer's of the appended
// row, and reading a quantized cache is reading the dequantized values: the
// decode output equals, bit for bit, that of an f32 cache holding them.
TEST(QuantizedCache, DecodesAsAnF32CacheOfTheDequantizedValues) {
  const Sequence s = make_sequence(45, 8, 2, 64, 96, 11, true);
  const KvStorage pairs[][2] = {{KvStorage::q8_0, KvStorage::q8_0},
                                {KvStorage::q4_0, KvStorage::q4_0},
                                {KvStorage::q8_0, KvStorage::q4_0},
                                {KvStorage::q4_0, KvStorage::f32},
                                {KvStorage::f32, KvStorage::q8_0}};
  for (const auto& pair : pairs) {
    const std::string label =
        std::string(qkv::storage_name(pair[0])) + "/" + qkv::storage_name(pair[1]);
    const Tensor k = dequantized(s.k, pair[0]), v = dequantized(s.v, pair[1]);
    KvCache exact(config(s, KvStorage::f32, KvStorage::f32, 0));
    const Tensor expected = decode_all(s.q, k, v, exact, 3);
    for (const std::int64_t page : {0, 16}) {
      KvCache cache(config(s, pair[0], pair[1], page));
      EXPECT_TRUE(same_bits(decode_all(s.q, s.k, s.v, cache, 3), expected))
          << label << " page " << page;
    }
  }
}

TEST(QuantizedCache, StoredBytesAreTheQuantizers) {
  const Sequence s = make_sequence(5, 2, 2, 64, 32, 21, false);
  KvCache cache(config(s, KvStorage::q8_0, KvStorage::q4_0, 4));
  cache.append(s.k, s.v);
  for (std::int64_t b = 0; b < 2; ++b)
    for (std::int64_t t = 0; t < 5; ++t)
      for (std::int64_t h = 0; h < 2; ++h) {
        BlockQ8_0 key[2];
        BlockQ4_0 value[1];
        qkv::cache::quantize_q8_0(s.k.data<float>() + ((b * 5 + t) * 2 + h) * 64, 64, key);
        qkv::cache::quantize_q4_0(s.v.data<float>() + ((b * 5 + t) * 2 + h) * 32, 32, value);
        const auto* kp = static_cast<const std::byte*>(cache.key_page(b, t / 4));
        const auto* vp = static_cast<const std::byte*>(cache.value_page(b, t / 4));
        EXPECT_EQ(std::memcmp(kp + ((t % 4) * 2 + h) * sizeof key, key, sizeof key), 0);
        EXPECT_EQ(std::memcmp(vp + ((t % 4) * 2 + h) * sizeof value, value, sizeof value), 0);
      }
}

TEST(QuantizedCache, EveryHighwayTargetThisCpuRuns) {
  const Sequence s = make_sequence(40, 4, 2, 32, 64, 31, false);
  const Tensor k = dequantized(s.k, KvStorage::q4_0), v = dequantized(s.v, KvStorage::q8_0);
  std::vector<std::string> ran;
  for (const std::int64_t target : hwy::SupportedAndGeneratedTargets()) {
    hwy::SetSupportedTargetsForTest(target);
    ran.push_back(qkv::cpu::flash_target());
    KvCache exact(config(s, KvStorage::f32, KvStorage::f32, 0));
    KvCache cache(config(s, KvStorage::q4_0, KvStorage::q8_0, 8));
    EXPECT_TRUE(same_bits(decode_all(s.q, s.k, s.v, cache, 2), decode_all(s.q, k, v, exact, 2)))
        << ran.back();
  }
  hwy::SetSupportedTargetsForTest(0);
  EXPECT_GE(ran.size(), 2u);
}

// Against the f32 cache: if every score of a row moves by at most delta
// (here scale * sum_c |q_c| |k_c - k'_c|, the largest over the keys the row
// sees) each weight moves by a factor within e^(+-2 delta), so |out_q - out|
// <= max|v - v'| + (e^(2 delta) - 1) max|v|. The f32 rounding of both runs
// is far below this; the printed errors are what docs/numerics.md reports.
TEST(QuantizedCache, DecodeErrorWithinTheQuantizationBound) {
  const std::int64_t t_total = 300, hq = 8, hkv = 2, dk = 64;
  for (const bool outliers : {false, true}) {
    const Sequence s = make_sequence(t_total, hq, hkv, dk, 64, 41, outliers);
    KvCache f32(config(s, KvStorage::f32, KvStorage::f32, 0));
    const Tensor exact = decode_all(s.q, s.k, s.v, f32, 4);
    for (const KvStorage storage : {KvStorage::q8_0, KvStorage::q4_0}) {
      const Tensor k = dequantized(s.k, storage), v = dequantized(s.v, storage);
      // Raw rows: q [B, T, Hq, Dk], k and k' [B, T, Hkv, Dk] (f32).
      const float* qd = s.q.data<float>();
      const float* k0 = s.k.data<float>();
      const float* k1 = k.data<float>();
      double delta = 0.0;
      for (std::int64_t b = 0; b < 2; ++b)
        for (std::int64_t t = 0; t < t_total; ++t)
          for (std::int64_t h = 0; h < hq; ++h) {
            const float* qr = qd + ((b * t_total + t) * hq + h) * dk;
            for (std::int64_t j = 0; j <= t; ++j) {
              const std::int64_t at = ((b * t_total + j) * hkv + h / (hq / hkv)) * dk;
              double sum = 0.0;
              for (std::int64_t c = 0; c < dk; ++c) {
                sum += std::fabs(static_cast<double>(qr[c])) *
                       std::fabs(static_cast<double>(k0[at + c]) - k1[at + c]);
              }
              delta = std::max(delta, sum / 8.0);  // scale 1/sqrt(64)
            }
          }
      KvCache cache(config(s, storage, storage, 0));
      const Tensor out = decode_all(s.q, s.k, s.v, cache, 4);
      const double bound = max_abs_diff(v, s.v) + std::expm1(2 * delta) * max_abs(s.v);
      const double err = max_abs_diff(out, exact);
      EXPECT_LE(err, bound) << qkv::storage_name(storage) << (outliers ? " outliers" : "");
      EXPECT_GT(err, 0.0);
      std::printf("[ quantized ] %s%s: max error %.3g, bound %.3g (max|v| %.3g)\n",
                  qkv::storage_name(storage), outliers ? " (outlier channels)" : "", err, bound,
                  max_abs(s.v));
    }
  }
}

// KvCacheConfig::rotate: keys and values stored rotated by the Hadamard
// transform, queries rotated and outputs turned back by the kernel. With f32
// storage the result is the plain one up to the f32 rounding of the
// rotations; quantized, with an outlier channel, the rotation spreads the
// outlier over the row, and the error against the f32 cache drops.
TEST(QuantizedCache, HadamardRotation) {
  const Sequence s = make_sequence(120, 8, 2, 64, 64, 61, true);
  KvCache plain(config(s, KvStorage::f32, KvStorage::f32, 0));
  const Tensor exact = decode_all(s.q, s.k, s.v, plain, 3);
  KvCacheConfig c = config(s, KvStorage::f32, KvStorage::f32, 8);
  c.rotate = true;
  KvCache rotated_f32(c);
  // Each rotation (log2 64 = 6 butterfly stages and a scaling) moves a row by
  // at most g = 8u of its norm: the scores by delta <= scale * 3g * max||q||
  // * max||k|| (q and k rotated, k rounded), the outputs by e^(2 delta) - 1
  // of max|v| and 3g of max||v|| (v rotated and rounded, the output turned
  // back).
  const auto max_norm = [](const Tensor& x) {
    const std::int64_t d = x.size(3);
    double most = 0.0;
    for (std::int64_t row = 0; row < x.numel() / d; ++row) {
      double sum = 0.0;
      for (std::int64_t i = 0; i < d; ++i) sum += std::pow(x.data<float>()[row * d + i], 2);
      most = std::max(most, std::sqrt(sum));
    }
    return most;
  };
  const double g = 8 * std::ldexp(1.0, -24);
  const double delta = 3 * g * max_norm(s.q) * max_norm(s.k) / 8.0;
  const double rounding = std::expm1(2 * delta) * max_abs(s.v) + 3 * g * max_norm(s.v);
  EXPECT_LE(max_abs_diff(decode_all(s.q, s.k, s.v, rotated_f32, 3), exact), rounding);
  for (const KvStorage storage : {KvStorage::q8_0, KvStorage::q4_0}) {
    KvCache flat(config(s, storage, storage, 0));
    const double err_flat = max_abs_diff(decode_all(s.q, s.k, s.v, flat, 3), exact);
    c.key_storage = c.value_storage = storage;
    KvCache turned(c);
    const Tensor out = decode_all(s.q, s.k, s.v, turned, 3);
    const double err_rotated = max_abs_diff(out, exact);
    std::printf("[ quantized ] %s with outlier channels: max error %.3g, rotated %.3g\n",
                qkv::storage_name(storage), err_flat, err_rotated);
    EXPECT_LT(err_rotated, err_flat / 2) << qkv::storage_name(storage);
    // The reference reads the same cache (un-rotating its rows in double).
    qkv::AttentionOptions ref;
    ref.backend = qkv::Backend::reference;
    const Tensor q_last = qkv::to_dtype(s.q.view().slice(1, 119, 1), DType::f32);
    EXPECT_LE(max_abs_diff(qkv::decode_attention(q_last, turned).out,
                           qkv::decode_attention(q_last, turned, ref).out),
              rounding);
  }
  c.head_dim = 48;
  c.value_dim = 24;
  c.key_storage = c.value_storage = KvStorage::f32;
  const auto e = error_of([&] { KvCache cache(c); });
  ASSERT_TRUE(e.has_value());
  expect_contains(e->what(),
                  {"config.rotate: the Hadamard transform needs head_dim a power of two, got 48",
                   "config.rotate: the Hadamard transform needs value_dim a power of two, got 24"});
}

TEST(QuantizedCache, BadConfigsThrowNamingTheField) {
  KvCacheConfig c;
  c.head_dim = 48;
  c.value_dim = 40;
  c.capacity = 4;
  c.key_storage = KvStorage::q8_0;
  c.value_storage = KvStorage::q4_0;
  auto e = error_of([&] { KvCache cache(c); });
  ASSERT_TRUE(e.has_value());
  expect_contains(e->what(),
                  {"config.key_storage: q8_0 stores blocks of 32 values: expected head_dim a "
                   "multiple of 32, got 48",
                   "config.value_storage: q4_0 stores blocks of 32 values: expected value_dim a "
                   "multiple of 32, got 40"});
  c.value_dim = 0;
  c.head_dim = 32;
  c.value_storage = static_cast<KvStorage>(9);
  e = error_of([&] { KvCache cache(c); });
  ASSERT_TRUE(e.has_value());
  expect_contains(e->what(), {"config.value_storage: expected one of auto, f32, bf16, f16, "
                              "q8_0, q4_0, got value 9"});
  // Both storages given: the dtype is not used, so f64 is not refused.
  c.value_storage = KvStorage::q8_0;
  c.dtype = DType::f64;
  EXPECT_NO_THROW(KvCache cache(c));
}

TEST(QuantizedCache, UnquantizableValuesThrowChangingNothing) {
  const Sequence s = make_sequence(3, 2, 1, 32, 32, 51, false);
  KvCache cache(config(s, KvStorage::q8_0, KvStorage::q4_0, 2));
  cache.append(s.k.view().slice(1, 0, 1), s.v.view().slice(1, 0, 1));
  const std::vector<std::byte> before(static_cast<const std::byte*>(cache.key_page(1, 0)),
                                      static_cast<const std::byte*>(cache.key_page(1, 0)) + 2 * 34);
  Tensor k = qkv::to_dtype(s.k, DType::f32);
  k.set({1, 2, 0, 7}, std::nan(""));
  auto e = error_of([&] { cache.append(k.view().slice(1, 1, 2), s.v.view().slice(1, 1, 2)); });
  ASSERT_TRUE(e.has_value());
  expect_contains(e->what(), {"k_new: q8_0 storage holds finite values", "at [1, 1, 0, 7]"});
  Tensor v = qkv::to_dtype(s.v, DType::f32);
  v.set({0, 0, 0, 1}, 1e6);  // above 8 * 65504: the f16 scale would overflow
  const qkv::ConstTensorView k0(s.k.data<float>(), DType::f32, {1, 1, 32});  // b 0, t 0
  const qkv::ConstTensorView v0(v.data<float>(), DType::f32, {1, 1, 32});
  e = error_of([&] { cache.append_to(0, k0, v0); });
  ASSERT_TRUE(e.has_value());
  expect_contains(e->what(), {"v_new: q4_0 storage holds finite values of magnitude <= 524032"});
  EXPECT_EQ(cache.length(0), 1);
  EXPECT_EQ(cache.length(1), 1);
  EXPECT_EQ(std::memcmp(before.data(), cache.key_page(1, 0), before.size()), 0);
}

}  // namespace
