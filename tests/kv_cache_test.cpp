// The key/value cache (contiguous and paged storage, page allocation, the
// strong guarantee of a throwing append) and rotary position embedding.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bad_input.hpp"
#include "test_util.hpp"

namespace {

using qkv::ConstTensorView;
using qkv::DType;
using qkv::KvCache;
using qkv::KvCacheConfig;
using qkv::RopeConfig;
using qkv::Tensor;
using qkv::TensorView;
using qkv::test::error_of;
using qkv::test::expect_contains;
using qkv::test::random_tensor;
using Table = std::vector<std::int64_t>;

// x rounded once (RNE) to `dtype`.
double rounded(DType dtype, double x) {
  Tensor t(dtype, {1});
  t.set({0}, x);
  return t.get({0});
}

// Element d of head h of token t of sequence b, found through the block
// table as a decode kernel finds it.
double stored_key(const KvCache& c, std::int64_t b, std::int64_t t, std::int64_t h,
                  std::int64_t d) {
  const void* page = c.key_page(b, t / c.page_size());
  const std::int64_t row = t % c.page_size();
  return qkv::detail::load(page, c.config().dtype,
                           (row * c.config().kv_heads + h) * c.config().head_dim + d);
}
double stored_value(const KvCache& c, std::int64_t b, std::int64_t t, std::int64_t h,
                    std::int64_t d) {
  const void* page = c.value_page(b, t / c.page_size());
  const std::int64_t row = t % c.page_size();
  return qkv::detail::load(page, c.config().dtype,
                           (row * c.config().kv_heads + h) * c.value_dim() + d);
}

Table table_of(const KvCache& c, std::int64_t b) {
  const auto t = c.block_table(b);
  return {t.begin(), t.end()};
}

// What a cache should hold: per sequence, per token, the appended key and
// value heads as the input's exact values (rounded only when compared).
class Expected {
 public:
  explicit Expected(const KvCache& cache)
      : keys_(static_cast<std::size_t>(cache.config().batch)), values_(keys_.size()) {}

  // Records rows [0, count) of k [n, Hkv, Dk] and v [n, Hkv, Dv] for sequence b.
  void add(std::int64_t b, ConstTensorView k, ConstTensorView v, std::int64_t count) {
    for (std::int64_t t = 0; t < count; ++t) {
      keys_[b].push_back(heads(k, t));
      values_[b].push_back(heads(v, t));
    }
  }
  // Records what KvCache::append of the same arguments adds.
  void add_batch(ConstTensorView k, ConstTensorView v, std::span<const std::int64_t> counts) {
    for (std::int64_t b = 0; b < k.size(0); ++b) {
      add(b, sequence(k, b), sequence(v, b), counts.empty() ? k.size(1) : counts[b]);
    }
  }
  void release(std::int64_t b) {
    keys_[b].clear();
    values_[b].clear();
  }

  // Checks lengths and every stored element, which must equal the input
  // rounded once to the storage dtype.
  void check(const KvCache& cache) const {
    const DType dtype = cache.config().dtype;
    for (std::size_t b = 0; b < keys_.size(); ++b) {
      const auto bi = static_cast<std::int64_t>(b);
      ASSERT_EQ(cache.length(bi), static_cast<std::int64_t>(keys_[b].size())) << "sequence " << b;
      for (std::size_t t = 0; t < keys_[b].size(); ++t) {
        const auto ti = static_cast<std::int64_t>(t);
        const auto& k = keys_[b][t];
        const auto& v = values_[b][t];
        const auto dk = static_cast<std::int64_t>(k.size()) / cache.config().kv_heads;
        const auto dv = static_cast<std::int64_t>(v.size()) / cache.config().kv_heads;
        for (std::int64_t h = 0; h < cache.config().kv_heads; ++h) {
          for (std::int64_t d = 0; d < dk; ++d) {
            ASSERT_EQ(stored_key(cache, bi, ti, h, d), rounded(dtype, k[h * dk + d]))
                << "key b " << b << " t " << t << " h " << h << " d " << d;
          }
          for (std::int64_t d = 0; d < dv; ++d) {
            ASSERT_EQ(stored_value(cache, bi, ti, h, d), rounded(dtype, v[h * dv + d]))
                << "value b " << b << " t " << t << " h " << h << " d " << d;
          }
        }
      }
    }
  }

 private:
  // Sequence b of x [B, n, H, D] as a view [n, H, D].
  static ConstTensorView sequence(ConstTensorView x, std::int64_t b) {
    const std::int64_t sizes[] = {x.size(1), x.size(2), x.size(3)};
    const std::int64_t strides[] = {x.stride(1), x.stride(2), x.stride(3)};
    return {x.slice(0, b, 1).data(), x.dtype(), sizes, strides};
  }
  // Row t of x [n, H, D] as H * D values.
  static std::vector<double> heads(ConstTensorView x, std::int64_t t) {
    std::vector<double> out;
    for (std::int64_t h = 0; h < x.size(1); ++h) {
      for (std::int64_t d = 0; d < x.size(2); ++d) {
        out.push_back(x.get({t, h, d}));
      }
    }
    return out;
  }

  std::vector<std::vector<std::vector<double>>> keys_, values_;  // [B][tokens][H * D]
};

// Everything observable about a cache: lengths, tables, free pages, and the
// bytes of every page a sequence owns (all rows, not just the filled ones).
struct State {
  std::vector<std::int64_t> lengths;
  std::vector<Table> tables;
  std::int64_t free_pages = 0;
  std::vector<unsigned char> bytes;
  bool operator==(const State&) const = default;
};

State state_of(const KvCache& c) {
  State s;
  s.lengths.assign(c.lengths().begin(), c.lengths().end());
  s.free_pages = c.free_pages();
  const std::size_t esize = qkv::dtype_size(c.config().dtype);
  const auto page_elements = [&](std::int64_t d) {
    return static_cast<std::size_t>(c.page_size() * c.config().kv_heads * d);
  };
  for (std::int64_t b = 0; b < c.config().batch; ++b) {
    s.tables.push_back(table_of(c, b));
    for (std::size_t i = 0; i < s.tables.back().size(); ++i) {
      const auto ii = static_cast<std::int64_t>(i);
      for (auto [page, n] : {std::pair{c.key_page(b, ii), page_elements(c.config().head_dim)},
                             {c.value_page(b, ii), page_elements(c.value_dim())}}) {
        const auto* p = static_cast<const unsigned char*>(page);
        s.bytes.insert(s.bytes.end(), p, p + n * esize);
      }
    }
  }
  return s;
}

// ---- storage -----------------------------------------------------------

class KvCacheStorage : public ::testing::TestWithParam<DType> {};

TEST_P(KvCacheStorage, ContiguousHoldsWhatWasAppended) {
  KvCacheConfig config{.batch = 2, .kv_heads = 3, .head_dim = 5, .value_dim = 4, .capacity = 9};
  config.dtype = GetParam();
  KvCache cache(config);
  EXPECT_FALSE(cache.paged());
  EXPECT_EQ(cache.page_size(), 9);
  EXPECT_EQ(cache.value_dim(), 4);
  EXPECT_EQ(cache.free_pages(), 0);
  EXPECT_EQ(table_of(cache, 0), Table{0});
  EXPECT_EQ(table_of(cache, 1), Table{1});
  Expected expected(cache);

  const Tensor k1 = random_tensor(DType::f32, {2, 4, 3, 5}, 1);
  const Tensor v1 = random_tensor(DType::f32, {2, 4, 3, 4}, 2);
  cache.append(k1, v1);
  expected.add_batch(k1, v1, {});
  const Tensor k2 = random_tensor(DType::f32, {2, 5, 3, 5}, 3);
  const Tensor v2 = random_tensor(DType::f32, {2, 5, 3, 4}, 4);
  const std::int64_t counts[] = {5, 2};
  cache.append(k2, v2, counts);
  expected.add_batch(k2, v2, counts);
  const Tensor k3 = random_tensor(DType::f32, {1, 3, 5}, 5);
  const Tensor v3 = random_tensor(DType::f32, {1, 3, 4}, 6);
  cache.append_to(1, k3, v3);
  expected.add(1, k3, v3, 1);

  EXPECT_EQ(cache.length(0), 9);
  EXPECT_EQ(cache.length(1), 7);
  EXPECT_EQ(table_of(cache, 0), Table{0});
  EXPECT_EQ(table_of(cache, 1), Table{1});
  EXPECT_EQ(cache.free_pages(), 0);
  expected.check(cache);
  // A full sequence sits in one page of `capacity` tokens after the other.
  EXPECT_EQ(static_cast<const std::byte*>(cache.key_page(1, 0)) -
                static_cast<const std::byte*>(cache.key_page(0, 0)),
            static_cast<std::ptrdiff_t>(9 * 3 * 5 * qkv::dtype_size(config.dtype)));

  // Released, a sequence starts again at slot 0.
  cache.release(0);
  expected.release(0);
  EXPECT_EQ(table_of(cache, 0), Table{0});
  cache.append_to(0, k3, v3);
  expected.add(0, k3, v3, 1);
  expected.check(cache);
}

TEST_P(KvCacheStorage, PagedHoldsWhatWasAppended) {
  // Pages of 4 tokens do not divide the capacity 10: a full sequence has 3
  // pages, the last half empty.
  KvCacheConfig config{
      .batch = 3, .kv_heads = 2, .head_dim = 3, .value_dim = 0, .capacity = 10, .page_size = 4};
  config.dtype = GetParam();
  KvCache cache(config);
  EXPECT_TRUE(cache.paged());
  EXPECT_EQ(cache.page_size(), 4);
  EXPECT_EQ(cache.value_dim(), 3);
  EXPECT_EQ(cache.free_pages(), 9);  // 3 sequences * ceil(10 / 4)
  Expected expected(cache);

  const Tensor k1 = random_tensor(DType::f32, {3, 5, 2, 3}, 11);
  const Tensor v1 = random_tensor(DType::f32, {3, 5, 2, 3}, 12);
  const std::int64_t counts1[] = {3, 0, 5};
  cache.append(k1, v1, counts1);
  expected.add_batch(k1, v1, counts1);
  // Lowest free page first, sequences in order.
  EXPECT_EQ(table_of(cache, 0), Table{0});
  EXPECT_EQ(table_of(cache, 1), Table{});
  EXPECT_EQ(table_of(cache, 2), (Table{1, 2}));
  EXPECT_EQ(cache.free_pages(), 6);

  const Tensor k2 = random_tensor(DType::f32, {3, 5, 2, 3}, 13);
  const Tensor v2 = random_tensor(DType::f32, {3, 5, 2, 3}, 14);
  const std::int64_t counts2[] = {4, 2, 5};
  cache.append(k2, v2, counts2);
  expected.add_batch(k2, v2, counts2);
  EXPECT_EQ(table_of(cache, 0), (Table{0, 3}));
  EXPECT_EQ(table_of(cache, 1), Table{4});
  EXPECT_EQ(table_of(cache, 2), (Table{1, 2, 5}));
  EXPECT_EQ(cache.free_pages(), 3);
  EXPECT_EQ(cache.length(2), 10);  // full: 2.5 pages
  expected.check(cache);

  // Released pages go back to the pool and are handed out lowest first.
  cache.release(0);
  expected.release(0);
  EXPECT_EQ(cache.length(0), 0);
  EXPECT_EQ(table_of(cache, 0), Table{});
  EXPECT_EQ(cache.free_pages(), 5);
  const Tensor k3 = random_tensor(DType::f32, {7, 2, 3}, 15);
  const Tensor v3 = random_tensor(DType::f32, {7, 2, 3}, 16);
  cache.append_to(1, k3, v3);  // 2 + 7 tokens: pages 0 and 3 join page 4
  expected.add(1, k3, v3, 7);
  EXPECT_EQ(table_of(cache, 1), (Table{4, 0, 3}));
  cache.append_to(0, k3.view().slice(0, 0, 1), v3.view().slice(0, 0, 1));
  expected.add(0, k3.view().slice(0, 0, 1), v3.view().slice(0, 0, 1), 1);
  EXPECT_EQ(table_of(cache, 0), Table{6});
  EXPECT_EQ(cache.free_pages(), 2);
  expected.check(cache);
}

TEST_P(KvCacheStorage, AcceptsAnyFloatingDtypeAndStridedViews) {
  KvCacheConfig config{
      .batch = 2, .kv_heads = 2, .head_dim = 4, .value_dim = 3, .capacity = 8, .page_size = 3};
  config.dtype = GetParam();
  for (const DType input : {DType::f64, DType::f32, DType::bf16, DType::f16}) {
    SCOPED_TRACE(qkv::dtype_name(input));
    KvCache cache(config);
    Expected expected(cache);
    // k as a [B, H, n, D] tensor seen as [B, n, H, D]; v every other element
    // of a wider last dimension.
    const Tensor k_bhnd = random_tensor(input, {2, 2, 5, 4}, 21, -3.0, 3.0);
    const Tensor v_wide = random_tensor(input, {2, 5, 2, 6}, 22, -3.0, 3.0);
    const ConstTensorView k = k_bhnd.view().transpose(1, 2);
    const ConstTensorView v(v_wide.view().data(), input, {2, 5, 2, 3}, {60, 12, 6, 2});
    cache.append(k, v);
    expected.add_batch(k, v, {});
    expected.check(cache);
  }
}

INSTANTIATE_TEST_SUITE_P(KvCache, KvCacheStorage,
                         ::testing::Values(DType::f32, DType::bf16, DType::f16),
                         [](const auto& p) { return std::string(qkv::dtype_name(p.param)); });

TEST(KvCache, SixteenBitStorageRoundsToNearestEven) {
  // 1 + 2^-11 and 1 + 3 * 2^-11 are ties in f16; 1 + 2^-8 + 2^-30 lies just
  // above a bf16 tie (rounded through f32 first it would be the tie itself).
  const double key[4] = {1.0 + std::ldexp(1.0, -11), 1.0 + 3 * std::ldexp(1.0, -11),
                         1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -30), -65520.0};
  const ConstTensorView k(key, {1, 1, 1, 4});
  for (auto [dtype, want] :
       {std::pair{DType::f16, std::vector<double>{1.0, 1.0 + std::ldexp(1.0, -9),
                                                  1.0 + std::ldexp(1.0, -8), -INFINITY}},
        {DType::bf16, std::vector<double>{1.0, 1.0, 1.0 + std::ldexp(1.0, -7), -65536.0}}}) {
    KvCacheConfig config{.batch = 1, .kv_heads = 1, .head_dim = 4, .capacity = 1};
    config.dtype = dtype;
    KvCache cache(config);
    cache.append(k, k);
    for (std::int64_t d = 0; d < 4; ++d) {
      EXPECT_EQ(stored_key(cache, 0, 0, 0, d), want[d]) << qkv::dtype_name(dtype) << " " << d;
    }
  }
}

TEST(KvCache, ExplicitPoolSmallerThanTheDefault) {
  KvCache cache(
      {.batch = 4, .kv_heads = 1, .head_dim = 2, .capacity = 64, .page_size = 16, .num_pages = 5});
  EXPECT_EQ(cache.free_pages(), 5);
  const Tensor k = random_tensor(DType::f32, {4, 17, 1, 2}, 31);
  const std::int64_t counts[] = {17, 0, 16, 0};  // 2 + 1 pages
  cache.append(k, k, counts);
  EXPECT_EQ(table_of(cache, 0), (Table{0, 1}));
  EXPECT_EQ(table_of(cache, 2), Table{2});
  EXPECT_EQ(cache.free_pages(), 2);
}

// ---- bad input ---------------------------------------------------------

// The cache every bad call starts from: 2 sequences of 2 KV heads, Dk 3 and
// Dv 2, capacity 10, bf16 pages of 4 tokens in a pool of 4; sequence 0 holds
// 6 tokens (pages 0, 1), sequence 1 holds 3 (page 2), one page is free.
KvCache populated() {
  KvCache cache({.batch = 2,
                 .kv_heads = 2,
                 .head_dim = 3,
                 .value_dim = 2,
                 .capacity = 10,
                 .dtype = DType::bf16,
                 .page_size = 4,
                 .num_pages = 4});
  const Tensor k = random_tensor(DType::f32, {2, 6, 2, 3}, 41);
  const Tensor v = random_tensor(DType::f32, {2, 6, 2, 2}, 42);
  const std::int64_t counts[] = {6, 3};
  cache.append(k, v, counts);
  return cache;
}

struct BadCall {
  std::string name;
  std::function<void(KvCache&)> call;
  std::vector<std::string> message;  // substrings that what() must contain
  std::size_t reasons = 1;
};

void PrintTo(const BadCall& c, std::ostream* os) { *os << c.name; }

// Valid inputs of n rows, with a chosen dtype and sizes otherwise.
Tensor rows(std::initializer_list<std::int64_t> sizes, DType dtype = DType::f32) {
  return random_tensor(dtype == DType::boolean ? DType::f32 : dtype, sizes, 51);
}

const std::vector<BadCall>& bad_calls() {
  static const RopeConfig odd_rope{.rotary_dim = 3};
  static const std::vector<BadCall> calls = {
      {"capacity",
       [](KvCache& c) {
         const std::int64_t counts[] = {0, 8};
         c.append(rows({2, 8, 2, 3}), rows({2, 8, 2, 2}), counts);
       },
       {"append: sequence 1 would hold 11 tokens, more than capacity 10"}},
      {"capacity_every_sequence",
       [](KvCache& c) {
         c.append(rows({2, 8, 2, 3}), rows({2, 8, 2, 2}));
       },
       {"sequence 0 would hold 14 tokens", "sequence 1 would hold 11 tokens"},
       2},
      // Sequence 0 alone would fit in the free page: nothing may be written
      // before the shortage for both is known.
      {"pool",
       [](KvCache& c) {
         c.append(rows({2, 4, 2, 3}), rows({2, 4, 2, 2}));
       },
       {"append: the pool has 1 free pages, 2 needed"}},
      {"pool_append_to",
       [](KvCache& c) {
         c.append_to(1, rows({6, 2, 3}), rows({6, 2, 2}));
       },
       {"append_to: the pool has 1 free pages, 2 needed"}},
      {"capacity_append_to",
       [](KvCache& c) {
         c.append_to(0, rows({5, 2, 3}), rows({5, 2, 2}));
       },
       {"append_to: sequence 0 would hold 11 tokens, more than capacity 10"}},
      {"unknown_sequence",
       [](KvCache& c) {
         c.append_to(5, rows({1, 2, 3}), rows({1, 2, 2}));
       },
       {"append_to: unknown sequence 5 (batch is 2)"}},
      {"negative_sequence",
       [](KvCache& c) {
         c.append_to(-1, rows({1, 2, 3}), rows({1, 2, 2}));
       },
       {"append_to: unknown sequence -1 (batch is 2)"}},
      {"k_head_dim",
       [](KvCache& c) {
         c.append(rows({2, 1, 2, 4}), rows({2, 1, 2, 2}));
       },
       {"k_new: expected sizes [B, n, Hkv, Dk] = [2, 1, 2, 3]", "got [2, 1, 2, 4]"}},
      {"k_batch",
       [](KvCache& c) {
         c.append(rows({3, 1, 2, 3}), rows({2, 1, 2, 2}));
       },
       {"k_new: expected sizes [B, n, Hkv, Dk] = [2, 1, 2, 3]", "got [3, 1, 2, 3]"}},
      {"v_rows",
       [](KvCache& c) {
         c.append(rows({2, 1, 2, 3}), rows({2, 2, 2, 2}));
       },
       {"v_new: expected sizes [B, n, Hkv, Dv] = [2, 1, 2, 2]", "n of k_new", "got [2, 2, 2, 2]"}},
      {"v_heads_append_to",
       [](KvCache& c) {
         c.append_to(0, rows({1, 2, 3}), rows({1, 1, 2}));
       },
       {"v_new: expected sizes [n, Hkv, Dv] = [1, 2, 2]", "got [1, 1, 2]"}},
      {"k_rank",
       [](KvCache& c) {
         c.append(rows({2, 2, 3}), rows({2, 1, 2, 2}));
       },
       {"k_new: expected rank 4 [B, n, Hkv, Dk], got rank 3 with sizes [2, 2, 3]"}},
      {"rank_append_to",
       [](KvCache& c) {
         c.append_to(0, rows({1, 1, 2, 3}), rows({1, 2, 2}));
       },
       {"k_new: expected rank 3 [n, Hkv, Dk], got rank 4"}},
      {"undefined",
       [](KvCache& c) {
         c.append(rows({2, 1, 2, 3}), ConstTensorView());
       },
       {"v_new: required tensor is undefined"}},
      {"bool_dtype",
       [](KvCache& c) {
         std::vector<std::uint8_t> mask(12);
         c.append(ConstTensorView(mask.data(), DType::boolean, {2, 1, 2, 3}), rows({2, 1, 2, 2}));
       },
       {"k_new: expected dtype f32, f64, f16 or bf16, got bool"}},
      {"counts_size",
       [](KvCache& c) {
         const std::int64_t counts[] = {1, 1, 1};
         c.append(rows({2, 1, 2, 3}), rows({2, 1, 2, 2}), counts);
       },
       {"counts: expected one count per sequence (B = 2)", "got 3"}},
      {"count_too_large",
       [](KvCache& c) {
         const std::int64_t counts[] = {1, 3};
         c.append(rows({2, 2, 2, 3}), rows({2, 2, 2, 2}), counts);
       },
       {"counts[1]: expected a count in [0, n = 2]", "got 3"}},
      {"count_negative",
       [](KvCache& c) {
         const std::int64_t counts[] = {-1, 0};
         c.append(rows({2, 2, 2, 3}), rows({2, 2, 2, 2}), counts);
       },
       {"counts[0]: expected a count in [0, n = 2]", "got -1"}},
      {"rope",
       [](KvCache& c) {
         c.append(rows({2, 1, 2, 3}), rows({2, 1, 2, 2}), {}, &odd_rope);
       },
       {"rope.rotary_dim: expected an even number in [0, Dk = 3]", "got 3"}},
      {"rope_whole_odd_head",
       [](KvCache& c) {
         const RopeConfig rope;
         c.append_to(0, rows({1, 2, 3}), rows({1, 2, 2}), &rope);
       },
       {"rope.rotary_dim: 0 rotates the whole head, which needs an even head dim, got Dk = 3"}},
      {"several",
       [](KvCache& c) {
         const std::int64_t counts[] = {1, 5};
         c.append(rows({2, 1, 2, 3}, DType::bf16), rows({2, 1, 3, 2}), counts);
       },
       {"v_new: expected sizes", "counts[1]"},
       2},
  };
  return calls;
}

class KvCacheBadCall : public ::testing::TestWithParam<BadCall> {};

TEST_P(KvCacheBadCall, ThrowsAndChangesNothing) {
  const BadCall& c = GetParam();
  KvCache cache = populated();
  const State before = state_of(cache);
  const std::optional<qkv::Error> e = error_of([&] { c.call(cache); });
  ASSERT_TRUE(e.has_value());
  expect_contains(e->what(), c.message);
  EXPECT_EQ(e->reasons().size(), c.reasons) << e->what();
  EXPECT_TRUE(state_of(cache) == before) << "the failed call changed the cache";
  // The cache still works: a valid call after the failed one succeeds.
  cache.append_to(1, rows({1, 2, 3}), rows({1, 2, 2}));
  EXPECT_EQ(cache.length(1), 4);
}

INSTANTIATE_TEST_SUITE_P(KvCache, KvCacheBadCall, ::testing::ValuesIn(bad_calls()),
                         [](const auto& p) { return p.param.name; });

TEST(KvCache, PopulatedBaseIsAsDescribed) {
  const KvCache cache = populated();
  EXPECT_EQ(table_of(cache, 0), (Table{0, 1}));
  EXPECT_EQ(table_of(cache, 1), Table{2});
  EXPECT_EQ(cache.free_pages(), 1);
}

TEST(KvCache, AccessorsRejectUnknownSequencesAndPages) {
  KvCache cache = populated();
  const auto message = [&](const std::function<void()>& call) {
    const auto e = error_of(call);
    return e ? std::string(e->what()) : std::string();
  };
  expect_contains(message([&] { (void)cache.length(2); }), {"length: unknown sequence 2"});
  expect_contains(message([&] { (void)cache.block_table(-1); }),
                  {"block_table: unknown sequence -1 (batch is 2)"});
  expect_contains(message([&] { cache.release(7); }), {"release: unknown sequence 7"});
  expect_contains(message([&] { (void)cache.key_page(1, 1); }),
                  {"key_page: page 1 of sequence 1 does not exist (its block table has 1 pages)"});
  expect_contains(message([&] { (void)cache.value_page(0, -1); }),
                  {"value_page: page -1 of sequence 0 does not exist"});
}

TEST(KvCache, RejectsBadConfigs) {
  const auto reasons = [](const KvCacheConfig& config) {
    const auto e = error_of([&] { KvCache cache(config); });
    return e ? e->reasons() : std::vector<std::string>{};
  };
  const KvCacheConfig good{.batch = 2, .kv_heads = 2, .head_dim = 8, .capacity = 16};
  EXPECT_NO_THROW(KvCache{good});

  auto c = good;
  c.batch = 0;
  c.kv_heads = -1;
  c.head_dim = 0;
  c.value_dim = -2;
  c.capacity = 0;
  c.page_size = -4;
  c.num_pages = -1;
  const std::vector<std::string> all = reasons(c);
  ASSERT_EQ(all.size(), 7u);
  expect_contains(all[0], {"config.batch: expected >= 1, got 0"});
  expect_contains(all[1], {"config.kv_heads: expected >= 1, got -1"});
  expect_contains(all[2], {"config.head_dim: expected >= 1, got 0"});
  expect_contains(all[3], {"config.value_dim: expected >= 0 (0 = head_dim), got -2"});
  expect_contains(all[4], {"config.capacity: expected >= 1, got 0"});
  expect_contains(all[5], {"config.page_size: expected >= 0 (0 = contiguous), got -4"});
  expect_contains(all[6], {"config.num_pages: expected >= 0", "got -1"});

  c = good;
  c.dtype = DType::f64;
  ASSERT_EQ(reasons(c).size(), 1u);
  expect_contains(reasons(c)[0], {"config.dtype: expected f32, bf16 or f16 storage, got f64"});
  c.dtype = DType::boolean;
  expect_contains(reasons(c).at(0), {"got bool", "floating-point"});
  c.dtype = static_cast<DType>(9);
  expect_contains(reasons(c).at(0), {"config.dtype", "got value 9"});

  c = good;
  c.num_pages = 8;
  expect_contains(reasons(c).at(0),
                  {"config.num_pages: only used by the paged layout (page_size > 0), got 8"});

  c = good;
  c.capacity = std::int64_t{1} << 40;
  c.page_size = 1;
  c.batch = std::int64_t{1} << 30;
  expect_contains(reasons(c).at(0), {"config.num_pages: the default", "overflows int64"});
  c.num_pages = std::int64_t{1} << 60;
  expect_contains(reasons(c).at(0), {"config: storage of", "exceeds 2^63 bytes"});
}

// ---- RoPE --------------------------------------------------------------

// x [1, 1, 1, D] in f64.
Tensor vec(std::initializer_list<double> values) {
  Tensor x(DType::f64, {1, 1, 1, static_cast<std::int64_t>(values.size())});
  std::int64_t d = 0;
  for (double value : values) x.set({0, 0, 0, d++}, value);
  return x;
}

std::vector<double> elements(const Tensor& x) {
  std::vector<double> out;
  for (std::int64_t d = 0; d < x.size(3); ++d) out.push_back(x.get({0, 0, 0, d}));
  return out;
}

void rope_at(Tensor& x, std::int64_t position, const RopeConfig& rope) {
  const std::int64_t start[] = {position};
  qkv::apply_rope(x, start, rope);
}

TEST(Rope, HalfSplitMatchesAHandComputedRotation) {
  // D = 4, base 100: pair 0 = (x0, x2) turns by 3 * 100^0 = 3, pair 1 =
  // (x1, x3) by 3 * 100^(-2/4) = 0.3.
  Tensor x = vec({1, 2, 3, 4});
  rope_at(x, 3, {.base = 100.0});
  const double c3 = std::cos(3.0), s3 = std::sin(3.0), c03 = std::cos(0.3), s03 = std::sin(0.3);
  const double want[] = {1 * c3 - 3 * s3, 2 * c03 - 4 * s03, 1 * s3 + 3 * c3, 2 * s03 + 4 * c03};
  const auto got = elements(x);
  for (int d = 0; d < 4; ++d) EXPECT_NEAR(got[d], want[d], 1e-14) << d;
}

TEST(Rope, InterleavedMatchesAHandComputedRotation) {
  Tensor x = vec({1, 2, 3, 4});
  rope_at(x, 3, {.base = 100.0, .interleaved = true});
  const double c3 = std::cos(3.0), s3 = std::sin(3.0), c03 = std::cos(0.3), s03 = std::sin(0.3);
  const double want[] = {1 * c3 - 2 * s3, 1 * s3 + 2 * c3, 3 * c03 - 4 * s03, 3 * s03 + 4 * c03};
  const auto got = elements(x);
  for (int d = 0; d < 4; ++d) EXPECT_NEAR(got[d], want[d], 1e-14) << d;
}

TEST(Rope, InterleavedIsHalfSplitOnPermutedElements) {
  // Interleaved element 2i is half-split element i, 2i + 1 is i + D / 2.
  const Tensor x = random_tensor(DType::f64, {1, 1, 1, 10}, 61);
  Tensor half = x, inter(DType::f64, {1, 1, 1, 10});
  for (std::int64_t i = 0; i < 5; ++i) {
    inter.set({0, 0, 0, 2 * i}, x.get({0, 0, 0, i}));
    inter.set({0, 0, 0, 2 * i + 1}, x.get({0, 0, 0, i + 5}));
  }
  rope_at(half, 17, {});
  rope_at(inter, 17, {.interleaved = true});
  for (std::int64_t i = 0; i < 5; ++i) {
    EXPECT_EQ(inter.get({0, 0, 0, 2 * i}), half.get({0, 0, 0, i}));
    EXPECT_EQ(inter.get({0, 0, 0, 2 * i + 1}), half.get({0, 0, 0, i + 5}));
  }
  // Not the identity: position 17 turns every pair.
  EXPECT_GT(qkv::test::max_abs_diff(half, x), 1e-3);
}

TEST(Rope, PartialRotationLeavesTheTailAlone) {
  for (const bool interleaved : {false, true}) {
    const Tensor x = random_tensor(DType::f64, {1, 1, 1, 10}, 62);
    Tensor partial = x;
    rope_at(partial, 5, {.base = 500.0, .interleaved = interleaved, .rotary_dim = 6});
    // The head is rotated as a vector of rotary_dim elements would be.
    Tensor head(DType::f64, {1, 1, 1, 6});
    qkv::copy(x.view().slice(3, 0, 6), head);
    rope_at(head, 5, {.base = 500.0, .interleaved = interleaved});
    for (std::int64_t d = 0; d < 6; ++d) {
      EXPECT_EQ(partial.get({0, 0, 0, d}), head.get({0, 0, 0, d})) << d;
    }
    for (std::int64_t d = 6; d < 10; ++d) {
      EXPECT_EQ(partial.get({0, 0, 0, d}), x.get({0, 0, 0, d})) << d;
    }
  }
}

TEST(Rope, PreservesEachPairsNorm) {
  const Tensor x = random_tensor(DType::f64, {1, 1, 1, 16}, 63);
  for (const bool interleaved : {false, true}) {
    Tensor y = x;
    rope_at(y, 123457, {.interleaved = interleaved});
    for (std::int64_t i = 0; i < 8; ++i) {
      const std::int64_t a = interleaved ? 2 * i : i;
      const std::int64_t b = interleaved ? 2 * i + 1 : i + 8;
      const double before = std::hypot(x.get({0, 0, 0, a}), x.get({0, 0, 0, b}));
      const double after = std::hypot(y.get({0, 0, 0, a}), y.get({0, 0, 0, b}));
      EXPECT_NEAR(after, before, 1e-14) << "pair " << i;
      EXPECT_GT(std::fabs(y.get({0, 0, 0, a}) - x.get({0, 0, 0, a})), 0.0) << "pair " << i;
    }
  }
}

TEST(Rope, DotProductDependsOnlyOnTheRelativePosition) {
  const Tensor q = random_tensor(DType::f64, {1, 1, 1, 12}, 64);
  const Tensor k = random_tensor(DType::f64, {1, 1, 1, 12}, 65);
  for (const bool interleaved : {false, true}) {
    const RopeConfig rope{.interleaved = interleaved};
    const auto score = [&](std::int64_t pq, std::int64_t pk) {
      Tensor a = q, b = k;
      rope_at(a, pq, rope);
      rope_at(b, pk, rope);
      double dot = 0.0;
      for (std::int64_t d = 0; d < 12; ++d) dot += a.get({0, 0, 0, d}) * b.get({0, 0, 0, d});
      return dot;
    };
    const double reference = score(7, 3);
    for (auto [pq, pk] : {std::pair{4, 0}, {104, 100}, {1004, 1000}}) {
      EXPECT_NEAR(score(pq, pk), reference, 1e-12) << pq << " " << pk;
    }
    // A different distance gives a different score, so the check can fail.
    EXPECT_GT(std::fabs(score(9, 3) - reference), 1e-3);
  }
}

TEST(Rope, RowsSitAtTheirSequencesPositions) {
  // x [2, 3, 2, 4] through a [B, H, n, D] layout; start positions 0 and 7.
  const Tensor x = random_tensor(DType::f64, {2, 2, 3, 4}, 66);
  Tensor y = x;
  const std::int64_t start[] = {0, 7};
  qkv::apply_rope(y.view().transpose(1, 2), start, {});
  for (std::int64_t b = 0; b < 2; ++b) {
    for (std::int64_t t = 0; t < 3; ++t) {
      for (std::int64_t h = 0; h < 2; ++h) {
        Tensor one(DType::f64, {1, 1, 1, 4});
        qkv::copy(x.view().slice(0, b, 1).slice(1, h, 1).slice(2, t, 1).transpose(1, 2), one);
        rope_at(one, start[b] + t, {});
        for (std::int64_t d = 0; d < 4; ++d) {
          EXPECT_EQ(y.get({b, h, t, d}), one.get({0, 0, 0, d})) << b << t << h << d;
        }
      }
    }
  }
  // Position 0 is the identity.
  for (std::int64_t d = 0; d < 4; ++d) EXPECT_EQ(y.get({0, 0, 0, d}), x.get({0, 0, 0, d}));
}

TEST(Rope, RoundsTheDoubleResultOnce) {
  for (const DType dtype : {DType::f32, DType::bf16, DType::f16}) {
    const Tensor x = random_tensor(dtype, {2, 3, 2, 8}, 67);
    Tensor exact = qkv::to_dtype(x, DType::f64);
    Tensor y = x;
    const std::int64_t start[] = {5, 1000};
    qkv::apply_rope(y, start, {});
    qkv::apply_rope(exact, start, {});
    EXPECT_TRUE(qkv::test::max_abs_diff(y, qkv::to_dtype(exact, dtype)) == 0.0)
        << qkv::dtype_name(dtype);
  }
}

TEST(Rope, RejectsBadArgumentsAndLeavesXUnchanged) {
  Tensor x = random_tensor(DType::f32, {2, 3, 2, 6}, 68);
  const Tensor before = x;
  const std::int64_t two[] = {0, 4};
  const std::int64_t one[] = {0};
  const std::int64_t negative[] = {0, -2};
  const auto reasons = [&](TensorView view, std::span<const std::int64_t> start,
                           const RopeConfig& rope) {
    const auto e = error_of([&] { qkv::apply_rope(view, start, rope); });
    return e ? e->reasons() : std::vector<std::string>{};
  };
  expect_contains(reasons(x, one, {}).at(0),
                  {"start_positions: expected one position per sequence (B = 2), got 1"});
  expect_contains(reasons(x, negative, {}).at(0),
                  {"start_positions[1]: expected a position >= 0, got -2"});
  expect_contains(reasons(x, two, {.rotary_dim = 8}).at(0),
                  {"rope.rotary_dim: expected an even number in [0, D = 6]", "got 8"});
  expect_contains(reasons(x, two, {.rotary_dim = 3}).at(0), {"rope.rotary_dim", "got 3"});
  expect_contains(reasons(x, two, {.base = 1.0}).at(0),
                  {"rope.base: expected a finite frequency base > 1, got 1"});
  expect_contains(reasons(x, two, {.base = NAN}).at(0), {"rope.base", "got nan"});
  Tensor odd = random_tensor(DType::f32, {2, 3, 2, 5}, 69);
  expect_contains(reasons(odd, two, {}).at(0),
                  {"rope.rotary_dim: 0 rotates the whole head, which needs an even head dim, "
                   "got D = 5"});
  TensorView rank3(x.view().data(), DType::f32, {2, 3, 12});
  expect_contains(reasons(rank3, two, {}).at(0), {"x: expected rank 4 [B, n, H, D], got rank 3"});
  std::vector<std::uint8_t> mask(72);
  expect_contains(reasons(TensorView(mask.data(), DType::boolean, {2, 3, 2, 6}), two, {}).at(0),
                  {"x: expected dtype f32, f64, f16 or bf16, got bool"});
  // Rows that share memory would be rotated twice.
  const TensorView overlapping(x.view().data(), DType::f32, {2, 3, 2, 6}, {0, 12, 6, 1});
  expect_contains(reasons(overlapping, two, {}).at(0), {"x: has overlapping elements"});
  // Every problem at once.
  EXPECT_EQ(reasons(x, one, {.base = 0.5, .rotary_dim = -2}).size(), 3u);
  EXPECT_TRUE(qkv::test::max_abs_diff(x, before) == 0.0);
}

// ---- RoPE on append ------------------------------------------------------

TEST(KvCache, AppendWithRopeEqualsRotatingACopyFirst) {
  for (const bool interleaved : {false, true}) {
    SCOPED_TRACE(interleaved ? "interleaved" : "half-split");
    const RopeConfig rope{.base = 500.0, .interleaved = interleaved, .rotary_dim = 6};
    const KvCacheConfig config{.batch = 2,
                               .kv_heads = 2,
                               .head_dim = 8,
                               .value_dim = 4,
                               .capacity = 12,
                               .dtype = DType::bf16,
                               .page_size = 5};
    KvCache with_rope(config), plain(config);
    // Two appends, so the second starts at each sequence's length.
    for (std::uint32_t step = 0; step < 2; ++step) {
      const Tensor k = random_tensor(DType::f32, {2, 4, 2, 8}, 70 + step);
      const Tensor v = random_tensor(DType::f32, {2, 4, 2, 4}, 80 + step);
      const Tensor k_before = k;
      const std::int64_t counts[] = {4, 2 + step};
      with_rope.append(k, v, counts, &rope);
      EXPECT_TRUE(qkv::test::max_abs_diff(k, k_before) == 0.0) << "the input was modified";
      // Rotated exactly (in f64), then rounded once on the way in.
      Tensor rotated = qkv::to_dtype(k, DType::f64);
      const std::int64_t start[] = {plain.length(0), plain.length(1)};
      qkv::apply_rope(rotated, start, rope);
      plain.append(rotated, v, counts);
    }
    const Tensor k = random_tensor(DType::f32, {3, 2, 8}, 90);
    const Tensor v = random_tensor(DType::f32, {3, 2, 4}, 91);
    with_rope.append_to(1, k, v, &rope);
    Tensor rotated(DType::f64, {1, 3, 2, 8});
    qkv::copy(k, TensorView(rotated.view().data(), DType::f64, {3, 2, 8}));
    const std::int64_t start[] = {plain.length(1)};
    qkv::apply_rope(rotated, start, rope);
    plain.append_to(1, TensorView(rotated.view().data(), DType::f64, {3, 2, 8}), v);

    ASSERT_EQ(table_of(with_rope, 1), table_of(plain, 1));
    EXPECT_TRUE(state_of(with_rope) == state_of(plain));
    // The rotation happened: the key appended last (position 7) differs from
    // its unrotated value.
    ASSERT_EQ(with_rope.length(1), 8);
    EXPECT_NE(stored_key(with_rope, 1, 7, 0, 0), rounded(DType::bf16, k.get({2, 0, 0})));
  }
}

}  // namespace
