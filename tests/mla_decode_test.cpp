// Multi-head latent attention (DeepSeek's MLA) decoding on a latent cache
// (KvCacheConfig::values_in_keys): one row per token [c (Dc) | k_pe (Dr)]
// is every head's key, its first Dc values every head's value. The absorbed
// form (query pre-multiplied by W_UK, output post-multiplied by W_UV) is
// checked against the naive form that expands per-head keys and values from
// the latent; the kernel at DeepSeek's shape (576 = 512 + 64, 128 heads)
// against the reference decode over the same cache, f32, bf16 and q8_0.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "bad_input.hpp"
#include "hwy/targets.h"
#include "test_util.hpp"

namespace {

using qkv::DType;
using qkv::KvCache;
using qkv::KvCacheConfig;
using qkv::KvStorage;
using qkv::Tensor;
using qkv::test::error_of;
using qkv::test::expect_contains;
using qkv::test::max_abs;
using qkv::test::max_abs_diff;
using qkv::test::random_tensor;

// Sizes of a small MLA layer: H query heads, latent Dc, RoPE part Dr,
// per-head key part Dn (no RoPE) and value Dv, L cached tokens.
struct Mla {
  std::int64_t h = 16, dc = 64, dr = 32, dn = 32, dv = 24, l = 150;
  double scale() const { return 1.3 * 1.3 / std::sqrt(static_cast<double>(dn + dr)); }
};

double at(const Tensor& t, std::int64_t i) { return t.get({i}); }

// Row `row` of W [rows, Dc] times the latent c_j, in T.
template <class T>
T times_latent(const Tensor& w, std::int64_t row, const Tensor& c, std::int64_t j,
               std::int64_t dc) {
  T sum = 0;
  for (std::int64_t x = 0; x < dc; ++x) {
    sum += static_cast<T>(at(w, row * dc + x)) * static_cast<T>(at(c, j * dc + x));
  }
  return sum;
}

// The naive form, in T: per head h, keys [W_UK[h] c_j | k_pe_j] and values
// W_UV[h] c_j expanded for every token, then softmax(q k^T scale) v for the
// newest token's query [q_nope_h | q_pe_h]. Returns out [H * Dv] in double.
template <class T>
std::vector<double> naive(const Mla& m, const Tensor& c, const Tensor& kpe, const Tensor& wuk,
                          const Tensor& wuv, const Tensor& qn, const Tensor& qp) {
  std::vector<double> out(static_cast<std::size_t>(m.h * m.dv));
  for (std::int64_t h = 0; h < m.h; ++h) {
    std::vector<T> s(static_cast<std::size_t>(m.l));
    T top = -INFINITY;
    for (std::int64_t j = 0; j < m.l; ++j) {
      T dot = 0;
      for (std::int64_t a = 0; a < m.dn; ++a) {  // q_nope_h . (W_UK[h] c_j)
        const T k = times_latent<T>(wuk, h * m.dn + a, c, j, m.dc);
        dot += static_cast<T>(at(qn, h * m.dn + a)) * k;
      }
      for (std::int64_t r = 0; r < m.dr; ++r) {
        dot += static_cast<T>(at(qp, h * m.dr + r)) * static_cast<T>(at(kpe, j * m.dr + r));
      }
      s[j] = dot * static_cast<T>(m.scale());
      top = std::max(top, s[j]);
    }
    T sum = 0;
    for (T& x : s) sum += (x = std::exp(x - top));
    for (std::int64_t e = 0; e < m.dv; ++e) {
      T o = 0;
      for (std::int64_t j = 0; j < m.l; ++j) {
        const T v = times_latent<T>(wuv, h * m.dv + e, c, j, m.dc);  // (W_UV[h] c_j)[e]
        o += s[j] * v;
      }
      out[static_cast<std::size_t>(h * m.dv + e)] = static_cast<double>(o / sum);
    }
  }
  return out;
}

double max_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double most = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) most = std::max(most, std::fabs(a[i] - b[i]));
  return most;
}

TEST(MlaDecode, AbsorbedLatentCacheMatchesTheNaiveForm) {
  const Mla m;
  const Tensor c = random_tensor(DType::f32, {m.l * m.dc}, 1);
  const Tensor kpe = random_tensor(DType::f32, {m.l * m.dr}, 2);
  const Tensor wuk = random_tensor(DType::f32, {m.h * m.dn * m.dc}, 3);
  const Tensor wuv = random_tensor(DType::f32, {m.h * m.dv * m.dc}, 4);
  const Tensor qn = random_tensor(DType::f32, {m.h * m.dn}, 5);
  const Tensor qp = random_tensor(DType::f32, {m.h * m.dr}, 6);
  const std::vector<double> exact = naive<double>(m, c, kpe, wuk, wuv, qn, qp);
  const std::vector<double> stock = naive<float>(m, c, kpe, wuk, wuv, qn, qp);

  for (const std::int64_t page : {0, 7}) {
    SCOPED_TRACE("page size " + std::to_string(page));
    // The latent cache: rows [c_j | k_pe_j], values their first Dc.
    const KvCacheConfig config{.batch = 1,
                               .kv_heads = 1,
                               .head_dim = m.dc + m.dr,
                               .value_dim = m.dc,
                               .capacity = m.l,
                               .page_size = page,
                               .values_in_keys = true};
    KvCache cache(config);
    Tensor rows(DType::f32, {1, m.l, 1, m.dc + m.dr});
    for (std::int64_t j = 0; j < m.l; ++j) {
      for (std::int64_t x = 0; x < m.dc; ++x) rows.set({0, j, 0, x}, at(c, j * m.dc + x));
      for (std::int64_t r = 0; r < m.dr; ++r) rows.set({0, j, 0, m.dc + r}, at(kpe, j * m.dr + r));
    }
    cache.append(rows, {});
    // Absorbed query: [W_UK[h]^T q_nope_h | q_pe_h], computed in double.
    Tensor q(DType::f32, {1, 1, m.h, m.dc + m.dr});
    for (std::int64_t h = 0; h < m.h; ++h) {
      for (std::int64_t x = 0; x < m.dc; ++x) {
        double sum = 0.0;
        for (std::int64_t a = 0; a < m.dn; ++a) {
          sum += at(wuk, (h * m.dn + a) * m.dc + x) * at(qn, h * m.dn + a);
        }
        q.set({0, 0, h, x}, sum);
      }
      for (std::int64_t r = 0; r < m.dr; ++r) q.set({0, 0, h, m.dc + r}, at(qp, h * m.dr + r));
    }
    qkv::AttentionOptions o;
    o.scale = m.scale();
    const Tensor latent = qkv::decode_attention(q, cache, o).out;  // [1, 1, H, Dc]
    ASSERT_EQ(latent.size(3), m.dc);
    // Output: W_UV[h] times the head's latent output, in double.
    std::vector<double> got(exact.size());
    for (std::int64_t h = 0; h < m.h; ++h) {
      for (std::int64_t e = 0; e < m.dv; ++e) {
        double sum = 0.0;
        for (std::int64_t x = 0; x < m.dc; ++x) {
          sum += at(wuv, (h * m.dv + e) * m.dc + x) * latent.get({0, 0, h, x});
        }
        got[static_cast<std::size_t>(h * m.dv + e)] = sum;
      }
    }
    // Error model: within twice the error of the naive form in f32, plus
    // 4 ulps of f32 of the largest output.
    double largest = 0.0;
    for (const double x : exact) largest = std::max(largest, std::fabs(x));
    const double err = max_diff(got, exact), stock_err = max_diff(stock, exact);
    std::printf("[ mla ] absorbed, page size %lld: error %.3g, naive f32 %.3g\n",
                static_cast<long long>(page), err, stock_err);
    EXPECT_LE(err, 2 * stock_err + 4 * std::ldexp(largest, -23));
  }
}

// A paged latent cache of rows of dk values, the first dv the value, in
// `storage`; the last tail_dim in tail_storage.
KvCache latent_cache(std::int64_t batch, std::int64_t dk, std::int64_t dv, std::int64_t capacity,
                     std::int64_t page_size, KvStorage storage, std::int64_t tail_dim,
                     KvStorage tail_storage) {
  return KvCache({.batch = batch,
                  .kv_heads = 1,
                  .head_dim = dk,
                  .value_dim = dv,
                  .capacity = capacity,
                  .page_size = page_size,
                  .key_storage = storage,
                  .values_in_keys = true,
                  .tail_dim = tail_dim,
                  .tail_storage = tail_storage});
}

// DeepSeek's shape: a 576-value latent row (512 + 64 RoPE), 512-value
// outputs, 128 heads, split across threads and pages; every storage the
// latent may have, the kernel against the reference decode over the same
// cache (f32 arithmetic against f64 on the same stored values).
TEST(MlaDecode, DeepSeekShapeMatchesTheReference) {
  const std::int64_t hq = 128, dk = 576, dv = 512, l = 300, n = 2;
  const Tensor rows = random_tensor(DType::f32, {2, l, 1, dk}, 7);
  const Tensor q = random_tensor(DType::f32, {2, n, hq, dk}, 8);
  // The storage of the row, and of its RoPE part where it has its own.
  struct Latent {
    KvStorage storage;
    std::int64_t tail_dim;
    KvStorage tail_storage;
  };
  for (const Latent latent :
       {Latent{KvStorage::f32, 0, KvStorage::bf16}, Latent{KvStorage::bf16, 0, KvStorage::bf16},
        Latent{KvStorage::q8_0, 0, KvStorage::bf16}, Latent{KvStorage::q8_0, 64, KvStorage::bf16},
        Latent{KvStorage::q4_0, 64, KvStorage::f16}}) {
    const KvStorage storage = latent.storage;
    SCOPED_TRACE(std::string(qkv::storage_name(storage)) + " tail " +
                 std::to_string(latent.tail_dim));
    KvCache cache = latent_cache(2, dk, dv, l, 64, storage, latent.tail_dim, latent.tail_storage);
    const std::int64_t counts[] = {l, l - 77};
    cache.append(rows, {}, counts);
    EXPECT_EQ(cache.value_token_bytes(), cache.key_token_bytes());
    EXPECT_EQ(cache.key_token_bytes(), qkv::stored_bytes(storage, dk - latent.tail_dim) +
                                           qkv::stored_bytes(latent.tail_storage, latent.tail_dim));
    qkv::AttentionOptions o;
    o.scale = 1.0 / std::sqrt(192.0);
    qkv::AttentionOptions ref = o;
    ref.backend = qkv::Backend::reference;
    const Tensor got = qkv::decode_attention(q, cache, o).out;
    ASSERT_EQ(got.size(3), dv);
    // The decode error model of the cache tests: score error delta from the
    // f32 dot products, each weight within e^(+-2 delta), plus the f32 sums.
    const double g = 8 * std::ldexp(1.0, -24);
    const double norm = std::sqrt(static_cast<double>(dk));  // elements in [-1, 1]
    const double delta = 3 * g * *o.scale * norm * norm * max_abs(q) * max_abs(rows);
    const double bound = std::expm1(2 * delta) * max_abs(rows) + 3 * g * norm * max_abs(rows);
    const double diff = max_abs_diff(got, qkv::decode_attention(q, cache, ref).out);
    std::printf("[ mla ] 128 heads, %s latent, tail %lld: kernel vs reference %.3g (bound %.3g)\n",
                qkv::storage_name(storage), static_cast<long long>(latent.tail_dim), diff, bound);
    EXPECT_LE(diff, bound);
  }
}

// A quantized latent row whose RoPE part is kept in 16 bits: the tail holds
// the appended values rounded once to bf16, bit for bit, and a decode whose
// rows carry large RoPE values (as rotated positions do) moves less from the
// f32 cache's output than with the whole row quantized. Odd head counts and
// lengths take the kernel's partial tiles, on every Highway target this CPU
// runs.
TEST(MlaDecode, UnquantizedTailKeepsTheRopePart) {
  const std::int64_t hq = 7, dk = 96, dv = 64, tail = 32, l = 45;
  Tensor rows = random_tensor(DType::f32, {1, l, 1, dk}, 21);
  for (std::int64_t j = 0; j < l; ++j) {
    for (std::int64_t x = dk - tail; x < dk; ++x) {
      rows.set({0, j, 0, x}, 8.0 * rows.get({0, j, 0, x}));  // a RoPE part with larger values
    }
  }
  const Tensor q = random_tensor(DType::f32, {1, 1, hq, dk}, 22);
  const auto cache_of = [&](KvStorage storage, std::int64_t tail_dim) {
    KvCache cache = latent_cache(1, dk, dv, l, 16, storage, tail_dim, KvStorage::bf16);
    cache.append(rows, {});
    return cache;
  };
  const KvCache exact = cache_of(KvStorage::f32, 0);
  const KvCache whole = cache_of(KvStorage::q8_0, 0);
  const KvCache tailed = cache_of(KvStorage::q8_0, tail);
  for (std::int64_t j = 0; j < l; ++j) {
    const auto* row = static_cast<const std::byte*>(tailed.key_page(0, j / 16)) +
                      (j % 16) * tailed.key_token_bytes();
    const auto* bits =
        reinterpret_cast<const std::uint16_t*>(row + qkv::stored_bytes(KvStorage::q8_0, dk - tail));
    for (std::int64_t x = 0; x < tail; ++x) {
      const float want = static_cast<float>(rows.get({0, j, 0, dk - tail + x}));
      ASSERT_EQ(bits[x], qkv::to_bf16(want).bits) << "token " << j << ", tail value " << x;
    }
  }
  qkv::AttentionOptions o;
  o.scale = 0.05;
  qkv::AttentionOptions ref = o;
  ref.backend = qkv::Backend::reference;
  const Tensor want = qkv::decode_attention(q, exact, ref).out;
  const double whole_error = max_abs_diff(qkv::decode_attention(q, whole, o).out, want);
  const double tail_error = max_abs_diff(qkv::decode_attention(q, tailed, o).out, want);
  std::printf("[ mla ] q8_0 latent against f32: whole row %.3g, bf16 RoPE part %.3g\n", whole_error,
              tail_error);
  EXPECT_LT(tail_error, whole_error);
  // The kernel against the reference on the same stored rows (the error
  // model of DeepSeekShapeMatchesTheReference).
  const double g = 8 * std::ldexp(1.0, -24);
  const double norm = std::sqrt(static_cast<double>(dk));
  const double delta = 3 * g * *o.scale * norm * norm * max_abs(q) * max_abs(rows);
  const double bound = std::expm1(2 * delta) * max_abs(rows) + 3 * g * norm * max_abs(rows);
  const Tensor reference = qkv::decode_attention(q, tailed, ref).out;
  for (const std::int64_t target : hwy::SupportedAndGeneratedTargets()) {
    hwy::SetSupportedTargetsForTest(target);
    EXPECT_LE(max_abs_diff(qkv::decode_attention(q, tailed, o).out, reference), bound)
        << hwy::TargetName(target);
  }
  hwy::SetSupportedTargetsForTest(0);
}

TEST(MlaDecode, LatentCacheRefusesWhatItCannotHold) {
  const auto message = [](const KvCacheConfig& config) {
    const auto e = error_of([&] { KvCache cache(config); });
    return e ? std::string(e->what()) : std::string();
  };
  const KvCacheConfig good{.batch = 1,
                           .kv_heads = 1,
                           .head_dim = 96,
                           .value_dim = 64,
                           .capacity = 8,
                           .values_in_keys = true};
  EXPECT_NO_THROW(KvCache{good});
  KvCacheConfig c = good;
  c.kv_heads = 2;
  expect_contains(message(c), {"config.values_in_keys: expected kv_heads 1", "got 2"});
  c = good;
  c.value_dim = 128;
  expect_contains(message(c), {"expected value_dim <= head_dim 96, got 128"});
  c = good;
  c.value_storage = KvStorage::bf16;
  expect_contains(message(c), {"config.value_storage: values_in_keys", "got bf16"});
  c = good;
  c.key_storage = KvStorage::q8_0;
  c.value_dim = 40;
  expect_contains(message(c), {"config.value_dim: the values of a latent row in q8_0",
                               "multiple of 32, got 40"});
  c = good;
  c.rotate = true;
  c.head_dim = 64;
  c.value_dim = 32;
  expect_contains(message(c), {"config.rotate: not with values_in_keys"});
  c = good;
  c.tail_dim = 32;
  expect_contains(message(c), {"config.tail_dim: an unquantized tail is for latent caches",
                               "expected 0, got 32"});
  c.key_storage = KvStorage::q8_0;
  c.values_in_keys = false;
  c.value_dim = 64;
  expect_contains(message(c), {"config.tail_dim: an unquantized tail", "got 32"});
  c.values_in_keys = true;
  EXPECT_NO_THROW(KvCache{c});
  c.tail_dim = 64;
  expect_contains(message(c), {"expected 0 <= tail_dim <= head_dim - value_dim = 32, got 64"});
  c.tail_dim = -1;
  expect_contains(message(c), {"expected 0 <= tail_dim <= head_dim - value_dim = 32, got -1"});
  c.tail_dim = std::numeric_limits<std::int64_t>::min();  // no overflow on the way
  expect_contains(message(c), {"expected 0 <= tail_dim <= head_dim - value_dim = 32, got -9"});
  c.tail_dim = 16;
  expect_contains(message(c), {"config.key_storage: q8_0 stores blocks of 32 values: expected "
                               "head_dim - tail_dim a multiple of 32, got 80"});
  c.tail_dim = 32;
  c.tail_storage = KvStorage::f32;
  expect_contains(message(c), {"config.tail_storage: expected bf16 or f16, got f32"});

  KvCache cache(good);
  const Tensor k = random_tensor(DType::f32, {1, 2, 1, 96}, 9);
  const Tensor v = random_tensor(DType::f32, {1, 2, 1, 64}, 10);
  expect_contains(error_of([&] { cache.append(k, v); })->what(),
                  {"v_new: the cache takes its values from the keys (values_in_keys)"});
  const qkv::RopeConfig rope;
  expect_contains(error_of([&] { cache.append(k, {}, {}, &rope); })->what(),
                  {"rope: not with values_in_keys"});
  EXPECT_EQ(cache.length(0), 0);
  cache.append_to(0, random_tensor(DType::f32, {2, 1, 96}, 11), {});
  EXPECT_EQ(cache.length(0), 2);
}

}  // namespace
