// Bad input to the KV cache, RoPE and decode attention: every row starts from
// a valid call, breaks one thing, and checks that qkv::Error (not another
// exception, not a crash) names the argument, the expected and the actual
// value, and that the rejected call changed nothing: not the cache (lengths,
// block tables, free pages, stored keys and values), not its outputs.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "bad_input.hpp"
#include "qkv/qkv.hpp"

namespace {

using qkv::AttentionOptions;
using qkv::ConstTensorView;
using qkv::DType;
using qkv::KvCache;
using qkv::KvCacheConfig;
using qkv::RopeConfig;
using qkv::TensorView;
using qkv::test::BadRow;
using qkv::test::Buffers;
using qkv::test::error_of;
using qkv::test::expect_contains;
using qkv::test::expect_rejected;
using qkv::test::expect_row;
using qkv::test::expect_valid;
using qkv::test::join;
using qkv::test::kInf;
using qkv::test::kMaxInt64;
using qkv::test::kNaN;
using qkv::test::row_name;
using qkv::test::view_rows;

// 2^62: a size whose element count overflows int64 in a view of more than
// one row.
constexpr std::int64_t kFar = std::int64_t{1} << 62;

// Everything a rejected call must leave as it was.
struct CacheState {
  std::vector<std::int64_t> lengths;
  std::vector<std::vector<std::int64_t>> tables;
  std::int64_t free_pages = 0;
  std::vector<std::byte> stored;  // the bytes of every page a sequence holds, keys then values

  bool operator==(const CacheState&) const = default;
};

CacheState state_of(const KvCache& cache) {
  const KvCacheConfig& c = cache.config();
  CacheState s;
  s.lengths.assign(cache.lengths().begin(), cache.lengths().end());
  s.free_pages = cache.free_pages();
  const auto page_bytes = [&](std::int64_t dim) {
    return static_cast<std::size_t>(cache.page_size() * c.kv_heads * dim) *
           qkv::dtype_size(c.dtype);
  };
  for (std::int64_t b = 0; b < c.batch; ++b) {
    const auto table = cache.block_table(b);
    s.tables.emplace_back(table.begin(), table.end());
    for (std::int64_t i = 0; i < static_cast<std::int64_t>(table.size()); ++i) {
      const auto* k = static_cast<const std::byte*>(cache.key_page(b, i));
      const auto* v = static_cast<const std::byte*>(cache.value_page(b, i));
      s.stored.insert(s.stored.end(), k, k + page_bytes(c.head_dim));
      s.stored.insert(s.stored.end(), v, v + page_bytes(cache.value_dim()));
    }
  }
  return s;
}

// ---- KvCache construction --------------------------------------------------

struct ConfigCall {
  KvCacheConfig config{.batch = 2, .kv_heads = 2, .head_dim = 4, .capacity = 8, .page_size = 4};
};

const std::vector<BadRow<ConfigCall>>& bad_configs() {
  static const std::vector<BadRow<ConfigCall>> rows = {
      {"batch_zero",
       [](ConfigCall& c) { c.config.batch = 0; },
       {"config.batch: expected >= 1, got 0"}},
      {"batch_negative",
       [](ConfigCall& c) { c.config.batch = -3; },
       {"config.batch: expected >= 1, got -3"}},
      {"kv_heads_zero",
       [](ConfigCall& c) { c.config.kv_heads = 0; },
       {"config.kv_heads: expected >= 1, got 0"}},
      {"head_dim_zero",
       [](ConfigCall& c) { c.config.head_dim = 0; },
       {"config.head_dim: expected >= 1, got 0"}},
      {"value_dim_negative",
       [](ConfigCall& c) { c.config.value_dim = -1; },
       {"config.value_dim: expected >= 0 (0 = head_dim), got -1"}},
      {"capacity_zero",
       [](ConfigCall& c) { c.config.capacity = 0; },
       {"config.capacity: expected >= 1, got 0"}},
      {"page_size_negative",
       [](ConfigCall& c) { c.config.page_size = -4; },
       {"config.page_size: expected >= 0 (0 = contiguous), got -4"}},
      {"num_pages_negative",
       [](ConfigCall& c) { c.config.num_pages = -2; },
       {"config.num_pages: expected >= 0 (0 = batch * the pages a sequence may hold), got -2"}},
      {"num_pages_contiguous",
       [](ConfigCall& c) {
         c.config.page_size = 0;
         c.config.num_pages = 3;
       },
       {"config.num_pages: only used by the paged layout (page_size > 0), got 3 with page_size 0"}},
      {"dtype_f64",
       [](ConfigCall& c) { c.config.dtype = DType::f64; },
       {"config.dtype: expected f32, bf16 or f16 storage, got f64"}},
      {"dtype_bool",
       [](ConfigCall& c) { c.config.dtype = DType::boolean; },
       {"config.dtype: expected f32, bf16 or f16 storage, got bool"}},
      {"dtype_out_of_range",
       [](ConfigCall& c) { c.config.dtype = static_cast<DType>(6); },
       {"config.dtype: expected f32, bf16 or f16 storage, got value 6"}},
      {"default_pool_overflows",
       [](ConfigCall& c) {
         c.config.batch = std::int64_t{1} << 32;
         c.config.capacity = std::int64_t{1} << 40;
         c.config.page_size = 1;
       },
       {"config.num_pages: the default batch * (pages a sequence may hold) = 4294967296 * "
        "1099511627776 overflows int64"}},
      {"storage_overflows",
       [](ConfigCall& c) { c.config.num_pages = std::int64_t{1} << 60; },
       {"config: storage of 1152921504606846976 pages of 4 tokens x 2 heads x 4 elements of f32 "
        "exceeds 2^63 bytes"}},
      {"storage_contiguous_overflows",
       [](ConfigCall& c) {
         c.config.page_size = 0;
         c.config.capacity = kMaxInt64 / 2;
       },
       {"config: storage of 2 pages of 4611686018427387903 tokens", "exceeds 2^63 bytes"}},
      {"storage_does_not_fit_in_memory",
       [](ConfigCall& c) { c.config.num_pages = std::int64_t{1} << 44; },
       {"cannot allocate", "keys [17592186044416, 4, 2, 4]"}},
      {"every_field",
       [](ConfigCall& c) {
         c.config = {.batch = 0,
                     .kv_heads = -1,
                     .head_dim = 0,
                     .value_dim = -1,
                     .capacity = -5,
                     .dtype = DType::f64,
                     .page_size = -1,
                     .num_pages = -1};
       },
       {"config.batch", "config.kv_heads", "config.head_dim", "config.value_dim", "config.capacity",
        "config.page_size", "config.num_pages", "config.dtype"},
       8},
  };
  return rows;
}

class KvCacheBadConfig : public testing::TestWithParam<BadRow<ConfigCall>> {};

TEST_P(KvCacheBadConfig, ThrowsNamingTheField) {
  ConfigCall call;
  GetParam().breaks(call);
  expect_rejected([&] { KvCache cache(call.config); }, GetParam());
}

INSTANTIATE_TEST_SUITE_P(DecodeValidation, KvCacheBadConfig, testing::ValuesIn(bad_configs()),
                         row_name<ConfigCall>);

TEST(DecodeValidation, ConfigBaseAndVariantsAreValid) {
  EXPECT_NO_THROW(KvCache(ConfigCall().config));
  for (const DType dtype : {DType::f32, DType::bf16, DType::f16}) {
    KvCacheConfig c = ConfigCall().config;
    c.dtype = dtype;
    c.value_dim = 3;
    c.num_pages = 1;
    EXPECT_NO_THROW(KvCache{c}) << qkv::dtype_name(dtype);
    c.page_size = 0;
    c.num_pages = 0;
    EXPECT_NO_THROW(KvCache{c}) << qkv::dtype_name(dtype);
  }
}

// ---- append and append_to --------------------------------------------------

// A cache of 2 sequences, 2 KV heads, Dk 4, Dv 2, capacity 10, bf16 pages of
// 4 tokens in a pool of 4: sequence 0 holds 6 tokens (pages 0 and 1),
// sequence 1 holds 3 (page 2), one page is free. The valid base call
// appends one token to each sequence (append: k_new [2, 1, 2, 4], v_new
// [2, 1, 2, 2]) or to sequence 1 (append_to: [1, 2, 4] and [1, 2, 2]).
class AppendCall : public Buffers {
 public:
  AppendCall()
      : cache({.batch = 2,
               .kv_heads = 2,
               .head_dim = 4,
               .value_dim = 2,
               .capacity = 10,
               .dtype = DType::bf16,
               .page_size = 4,
               .num_pages = 4}) {
    const std::int64_t held[] = {6, 3};
    cache.append(tensor(DType::f32, {2, 6, 2, 4}), tensor(DType::f32, {2, 6, 2, 2}), held);
    k = tensor(DType::f32, {2, 1, 2, 4});
    v = tensor(DType::f32, {2, 1, 2, 2});
  }

  // Switches to append_to(b, k_new [n, 2, 4], v_new [n, 2, 2]).
  void to(std::int64_t sequence, std::int64_t n = 1) {
    single = true;
    b = sequence;
    k = tensor(DType::f32, {n, 2, 4});
    v = tensor(DType::f32, {n, 2, 2});
  }
  // Appends rows of n tokens to both sequences.
  void rows(std::int64_t n) {
    k = tensor(DType::f32, {2, n, 2, 4});
    v = tensor(DType::f32, {2, n, 2, 2});
  }
  void with_rope(const RopeConfig& config) {
    rope_config = config;
    rope = &rope_config;
  }

  static constexpr const char* kState = "the cache";
  CacheState state() const { return state_of(cache); }

  void run() {
    if (single) {
      cache.append_to(b, k, v, rope);
    } else {
      cache.append(k, v, counts, rope);
    }
  }

  KvCache cache;
  ConstTensorView k, v;
  std::span<const std::int64_t> counts;
  RopeConfig rope_config;
  const RopeConfig* rope = nullptr;
  bool single = false;  // append_to(b, ...) instead of append
  std::int64_t b = 1;
};

const char* const kSource = "(batch, kv_heads and head dims of the cache)";
const char* const kSourceN = "(batch, kv_heads and head dims of the cache, n of k_new)";

const std::vector<BadRow<AppendCall>>& bad_appends() {
  static const std::vector<BadRow<AppendCall>> rows = join<AppendCall>({
      {
          // shapes
          {"k_rank_3",
           [](AppendCall& c) {
             c.k = c.tensor(DType::f32, {2, 1, 8});
           },
           {"k_new: expected rank 4 [B, n, Hkv, Dk], got rank 3 with sizes [2, 1, 8]"}},
          {"v_rank_2",
           [](AppendCall& c) {
             c.v = c.tensor(DType::f32, {2, 4});
           },
           {"v_new: expected rank 4 [B, n, Hkv, Dv], got rank 2 with sizes [2, 4]"}},
          {"both_undefined",
           [](AppendCall& c) {
             c.k = {};
             c.v = {};
           },
           {"k_new: required tensor is undefined", "v_new: required tensor is undefined"},
           2},
          {"k_batch",
           [](AppendCall& c) {
             c.k = c.tensor(DType::f32, {3, 1, 2, 4});
           },
           {"k_new: expected sizes [B, n, Hkv, Dk] = [2, 1, 2, 4]", kSource, "got [3, 1, 2, 4]"}},
          {"k_kv_heads",
           [](AppendCall& c) {
             c.k = c.tensor(DType::f32, {2, 1, 1, 4});
           },
           {"k_new: expected sizes [B, n, Hkv, Dk] = [2, 1, 2, 4]", "got [2, 1, 1, 4]"}},
          {"k_head_dim",
           [](AppendCall& c) {
             c.k = c.tensor(DType::f32, {2, 1, 2, 5});
           },
           {"k_new: expected sizes [B, n, Hkv, Dk] = [2, 1, 2, 4]", "got [2, 1, 2, 5]"}},
          {"v_value_dim",
           [](AppendCall& c) {
             c.v = c.tensor(DType::f32, {2, 1, 2, 4});
           },
           {"v_new: expected sizes [B, n, Hkv, Dv] = [2, 1, 2, 2]", kSourceN, "got [2, 1, 2, 4]"}},
          {"v_rows_differ",
           [](AppendCall& c) {
             c.v = c.tensor(DType::f32, {2, 3, 2, 2});
           },
           {"v_new: expected sizes [B, n, Hkv, Dv] = [2, 1, 2, 2]", kSourceN, "got [2, 3, 2, 2]"}},
          // n comes from v_new when k_new cannot give it.
          {"k_rank_with_v_rows",
           [](AppendCall& c) {
             c.k = c.tensor(DType::f32, {2, 2, 8});
             c.v = c.tensor(DType::f32, {2, 2, 2, 3});
           },
           {"k_new: expected rank 4", "v_new: expected sizes [B, n, Hkv, Dv] = [2, 2, 2, 2]",
            kSource},
           2},
          // dtypes
          // memory
          {"rows_count_overflows",
           [](AppendCall& c) {
             c.k = ConstTensorView(c.k.data(), DType::f32, {2, kFar, 2, 4}, {0, 0, 0, 0});
             c.v = ConstTensorView(c.v.data(), DType::f32, {2, kFar, 2, 2}, {0, 0, 0, 0});
             c.counts = c.list<std::int64_t>({0, 0});
           },
           {"k_new: sizes [2, 4611686018427387904, 2, 4] with strides [0, 0, 0, 0] overflow int64",
            "v_new: sizes [2, 4611686018427387904, 2, 2]", "element count"},
           2},
          // counts
          {"counts_size",
           [](AppendCall& c) {
             c.counts = c.list<std::int64_t>({1, 1, 1});
           },
           {"counts: expected one count per sequence (B = 2) or none (all n rows), got 3"}},
          {"count_negative",
           [](AppendCall& c) {
             c.counts = c.list<std::int64_t>({-1, 0});
           },
           {"counts[0]: expected a count in [0, n = 1] (the rows of the inputs), got -1"}},
          {"count_above_n",
           [](AppendCall& c) {
             c.counts = c.list<std::int64_t>({0, 2});
           },
           {"counts[1]: expected a count in [0, n = 1] (the rows of the inputs), got 2"}},
          // room
          {"capacity",
           [](AppendCall& c) {
             c.rows(5);
             c.counts = c.list<std::int64_t>({5, 0});
           },
           {"append: sequence 0 would hold 11 tokens, more than capacity 10 (it holds 6, 5 "
            "appended)"}},
          {"capacity_every_sequence",
           [](AppendCall& c) { c.rows(8); },
           {"append: sequence 0 would hold 14 tokens", "append: sequence 1 would hold 11 tokens"},
           2},
          // Either sequence alone fits in the free page; both need 2.
          {"pool_exhausted",
           [](AppendCall& c) {
             c.rows(3);
             c.counts = c.list<std::int64_t>({3, 2});
           },
           {"append: the pool has 1 free pages, 2 needed"}},
          // rope
          {"rope_base_one",
           [](AppendCall& c) { c.with_rope({.base = 1.0}); },
           {"rope.base: expected a finite frequency base > 1, got 1"}},
          {"rope_base_nan",
           [](AppendCall& c) { c.with_rope({.base = kNaN}); },
           {"rope.base: expected a finite frequency base > 1, got nan"}},
          {"rope_base_inf",
           [](AppendCall& c) { c.with_rope({.base = kInf}); },
           {"rope.base: expected a finite frequency base > 1, got inf"}},
          {"rope_rotary_dim_odd",
           [](AppendCall& c) { c.with_rope({.rotary_dim = 3}); },
           {"rope.rotary_dim: expected an even number in [0, Dk = 4] (0 = the whole head), got 3"}},
          {"rope_rotary_dim_above_dk",
           [](AppendCall& c) { c.with_rope({.rotary_dim = 6}); },
           {"rope.rotary_dim: expected an even number in [0, Dk = 4]", "got 6"}},
          {"rope_rotary_dim_negative",
           [](AppendCall& c) { c.with_rope({.rotary_dim = -2}); },
           {"rope.rotary_dim: expected an even number in [0, Dk = 4]", "got -2"}},
          {"several",
           [](AppendCall& c) {
             c.k = c.tensor(DType::boolean, {2, 1, 2, 4});
             c.v = c.tensor(DType::f32, {2, 1, 3, 2});
             c.counts = c.list<std::int64_t>({1, 4});
             c.with_rope({.base = 0.0});
           },
           {"k_new: expected dtype", "v_new: expected sizes", "counts[1]", "rope.base"},
           4},
          // append_to
          {"to_unknown_sequence",
           [](AppendCall& c) { c.to(2); },
           {"append_to: unknown sequence 2 (batch is 2)"}},
          {"to_negative_sequence",
           [](AppendCall& c) { c.to(-1); },
           {"append_to: unknown sequence -1 (batch is 2)"}},
          {"to_k_rank_4",
           [](AppendCall& c) {
             c.to(1);
             c.k = c.tensor(DType::f32, {1, 1, 2, 4});
           },
           {"k_new: expected rank 3 [n, Hkv, Dk], got rank 4 with sizes [1, 1, 2, 4]"}},
          {"to_k_kv_heads",
           [](AppendCall& c) {
             c.to(1);
             c.k = c.tensor(DType::f32, {1, 3, 4});
           },
           {"k_new: expected sizes [n, Hkv, Dk] = [1, 2, 4] (kv_heads and head dims of the cache), "
            "got [1, 3, 4]"}},
          {"to_v_rows_differ",
           [](AppendCall& c) {
             c.to(1);
             c.v = c.tensor(DType::f32, {2, 2, 2});
           },
           {"v_new: expected sizes [n, Hkv, Dv] = [1, 2, 2] (kv_heads and head dims of the cache, "
            "n "
            "of k_new), got [2, 2, 2]"}},
          {"to_capacity",
           [](AppendCall& c) { c.to(0, 5); },
           {"append_to: sequence 0 would hold 11 tokens, more than capacity 10 (it holds 6, 5 "
            "appended)"}},
          {"to_pool_exhausted",
           [](AppendCall& c) { c.to(1, 6); },
           {"append_to: the pool has 1 free pages, 2 needed"}},
          {"to_rope",
           [](AppendCall& c) {
             c.to(1);
             c.with_rope({.rotary_dim = 5});
           },
           {"rope.rotary_dim: expected an even number in [0, Dk = 4]", "got 5"}},
          {"to_unknown_sequence_and_shape",
           [](AppendCall& c) {
             c.to(7);
             c.k = c.tensor(DType::f32, {1, 2, 3});
           },
           {"append_to: unknown sequence 7", "k_new: expected sizes [n, Hkv, Dk] = [1, 2, 4]"},
           2},
      },
      view_rows<AppendCall>({.name = "k_new", .sizes = {2, 1, 2, 4}},
                            [](AppendCall& c, TensorView t) { c.k = t; }),
      view_rows<AppendCall>({.name = "v_new", .sizes = {2, 1, 2, 2}, .dtype = DType::f16},
                            [](AppendCall& c, TensorView t) { c.v = t; }),
      view_rows<AppendCall>(
          {.name = "k_new", .sizes = {1, 2, 4}, .dtype = DType::bf16, .label = "to_k_new"},
          [](AppendCall& c, TensorView t) {
            c.to(1);
            c.k = t;
          }),
      view_rows<AppendCall>({.name = "v_new", .sizes = {1, 2, 2}, .label = "to_v_new"},
                            [](AppendCall& c, TensorView t) {
                              c.to(0);
                              c.v = t;
                            }),
  });
  return rows;
}

class KvCacheBadAppend : public testing::TestWithParam<BadRow<AppendCall>> {};

TEST_P(KvCacheBadAppend, ThrowsAndChangesNothing) {
  expect_row<AppendCall>(GetParam(), [](AppendCall& call) {
    // The cache still works: a valid append after the rejected one succeeds.
    const CacheState before = call.state();
    const AppendCall valid;
    call.cache.append(valid.k, valid.v);
    EXPECT_EQ(call.cache.length(0), before.lengths[0] + 1);
    EXPECT_EQ(call.cache.length(1), before.lengths[1] + 1);
  });
}

INSTANTIATE_TEST_SUITE_P(DecodeValidation, KvCacheBadAppend, testing::ValuesIn(bad_appends()),
                         row_name<AppendCall>);

TEST(DecodeValidation, AppendBaseAndVariantsAreValid) {
  expect_valid<AppendCall>({
      {"append", [](AppendCall&) {}},
      {"append_to", [](AppendCall& c) { c.to(1); }},
      {"mixed input dtypes",
       [](AppendCall& c) {
         c.v = c.tensor(DType::f64, {2, 1, 2, 2});
       }},
      {"no rows", [](AppendCall& c) { c.rows(0); }},
      {"counts of 0",
       [](AppendCall& c) {
         c.counts = c.list<std::int64_t>({0, 0});
       }},
      {"to capacity and the last page",
       [](AppendCall& c) {
         c.rows(4);
         c.counts = c.list<std::int64_t>({4, 0});
       }},
      {"broadcast (stride 0) rows",
       [](AppendCall& c) {
         c.k = ConstTensorView(c.k.data(), DType::f32, {2, 1, 2, 4}, {0, 0, 0, 1});
       }},
      {"rope on a partial head",
       [](AppendCall& c) { c.with_rope({.base = 1.5, .interleaved = true, .rotary_dim = 2}); }},
  });
}

TEST(DecodeValidation, ReleaseOfAnUnknownSequenceChangesNothing) {
  for (const std::int64_t b : {std::int64_t{2}, std::int64_t{-1}, kMaxInt64}) {
    AppendCall call;
    const CacheState before = state_of(call.cache);
    const auto error = error_of([&] { call.cache.release(b); });
    ASSERT_TRUE(error);
    expect_contains(error->what(),
                    {"release: unknown sequence " + std::to_string(b) + " (batch is 2)"});
    EXPECT_TRUE(state_of(call.cache) == before) << b;
  }
  AppendCall call;
  call.cache.release(0);
  EXPECT_EQ(call.cache.length(0), 0);
  EXPECT_EQ(call.cache.free_pages(), 3);
}

// ---- apply_rope and apply_rope_backward ------------------------------------

// Rotates x [2, 3, 2, 6] (f32) in place from start positions {0, 4}.
class RopeCall : public Buffers {
 public:
  RopeCall() {
    x = tensor(DType::f32, {2, 3, 2, 6});
    start = list<std::int64_t>({0, 4});
  }
  static constexpr const char* kState = "nothing";  // x is one of its buffers
  int state() const { return 0; }

  void run() const {
    if (backward) {
      qkv::apply_rope_backward(x, start, rope);
    } else {
      qkv::apply_rope(x, start, rope);
    }
  }

  TensorView x;
  std::span<const std::int64_t> start;
  RopeConfig rope;
  bool backward = false;
};

const std::vector<BadRow<RopeCall>>& bad_ropes() {
  static const std::vector<BadRow<RopeCall>> rows = join<RopeCall>({
      {
          {"x_rank_3",
           [](RopeCall& c) {
             c.x = c.tensor(DType::f32, {2, 3, 12});
           },
           {"x: expected rank 4 [B, n, H, D], got rank 3 with sizes [2, 3, 12]"}},
          // A row broadcast over n would be rotated at n positions, once per row.
          {"x_stride_0",
           [](RopeCall& c) {
             c.x = TensorView(c.x.data(), DType::f32, {2, 3, 2, 6}, {36, 0, 6, 1});
           },
           {"x: has overlapping elements: dimension 1 (size 3) has stride 0"}},
          {"x_heads_overlap",
           [](RopeCall& c) {
             c.x = TensorView(c.x.data(), DType::f32, {2, 3, 2, 6}, {36, 12, 3, 1});
           },
           {"x: has overlapping elements: dimension 2 (size 2) has stride 3, expected at least 6"}},
          {"start_count",
           [](RopeCall& c) { c.start = c.list<std::int64_t>({0}); },
           {"start_positions: expected one position per sequence (B = 2), got 1"}},
          {"start_none",
           [](RopeCall& c) { c.start = {}; },
           {"start_positions: expected one position per sequence (B = 2), got 0"}},
          {"start_negative",
           [](RopeCall& c) {
             c.start = c.list<std::int64_t>({0, -1});
           },
           {"start_positions[1]: expected a position >= 0, got -1"}},
          {"start_overflows",
           [](RopeCall& c) {
             c.start = c.list<std::int64_t>({kMaxInt64 - 1, 0});
           },
           {"start_positions[0]: 9223372036854775806 + 2 (its last row) overflows int64"}},
          {"base_below_one",
           [](RopeCall& c) { c.rope.base = 0.5; },
           {"rope.base: expected a finite frequency base > 1, got 0.5"}},
          {"base_nan",
           [](RopeCall& c) { c.rope.base = kNaN; },
           {"rope.base: expected a finite frequency base > 1, got nan"}},
          {"base_negative",
           [](RopeCall& c) { c.rope.base = -1e-300; },
           {"rope.base: expected a finite frequency base > 1, got -1e-300"}},
          {"rotary_dim_odd",
           [](RopeCall& c) { c.rope.rotary_dim = 5; },
           {"rope.rotary_dim: expected an even number in [0, D = 6] (0 = the whole head), got 5"}},
          {"rotary_dim_above_d",
           [](RopeCall& c) { c.rope.rotary_dim = 8; },
           {"rope.rotary_dim: expected an even number in [0, D = 6]", "got 8"}},
          {"rotary_dim_whole_odd_head",
           [](RopeCall& c) {
             c.x = c.tensor(DType::f32, {2, 3, 2, 5});
           },
           {"rope.rotary_dim: 0 rotates the whole head, which needs an even head dim, got D = 5"}},
          // Without a usable x, the head-independent rope checks still run.
          {"x_rank_and_rope",
           [](RopeCall& c) {
             c.x = c.tensor(DType::f32, {2, 3});
             c.rope = {.base = kInf, .rotary_dim = -1};
           },
           {"x: expected rank 4", "rope.base", "got inf",
            "rope.rotary_dim: expected an even number >= 0 (0 = the whole head), got -1"},
           3},
          {"grad_stride_0",
           [](RopeCall& c) {
             c.backward = true;
             c.x = TensorView(c.x.data(), DType::bf16, {2, 3, 2, 6}, {0, 12, 6, 1});
           },
           {"grad: has overlapping elements: dimension 0 (size 2) has stride 0"}},
          {"grad_rope",
           [](RopeCall& c) {
             c.backward = true;
             c.rope.rotary_dim = 3;
           },
           {"rope.rotary_dim: expected an even number in [0, D = 6]", "got 3"}},
      },
      view_rows<RopeCall>({.name = "x", .sizes = {2, 3, 2, 6}},
                          [](RopeCall& c, TensorView t) { c.x = t; }),
      view_rows<RopeCall>({.name = "grad", .sizes = {2, 3, 2, 6}, .dtype = DType::bf16},
                          [](RopeCall& c, TensorView t) {
                            c.backward = true;
                            c.x = t;
                          }),
  });
  return rows;
}

QKV_BAD_INPUT_TEST(DecodeValidation, RopeBadCall, RopeCall, bad_ropes());

TEST(DecodeValidation, RopeBaseAndVariantsAreValid) {
  expect_valid<RopeCall>({
      {"base", [](RopeCall&) {}},
      {"backward", [](RopeCall& c) { c.backward = true; }},
      // A size-1 dimension may have any stride, 0 included.
      {"stride 0 of a size-1 dimension",
       [](RopeCall& c) {
         c.x = TensorView(c.x.data(), DType::f32, {2, 1, 2, 6}, {12, 0, 6, 1});
       }},
      {"no rows, any start",
       [](RopeCall& c) {
         c.x = c.tensor(DType::f32, {2, 0, 2, 6});
         c.start = c.list<std::int64_t>({kMaxInt64, kMaxInt64});
       }},
      {"last position representable",
       [](RopeCall& c) {
         c.start = c.list<std::int64_t>({kMaxInt64 - 2, 0});
       }},
      {"odd head, even rotary_dim",
       [](RopeCall& c) {
         c.x = c.tensor(DType::f16, {2, 3, 2, 5});
         c.rope.rotary_dim = 4;
       }},
  });
}

// ---- decode_attention and decode_attention_into -----------------------------

// q [2, 2, 4, 8] (f32, two query heads per KV head) against a paged f32
// cache of 2 sequences holding 5 and 3 tokens (2 KV heads, Dk 8, Dv 4), into
// out [2, 2, 4, 4] and lse [2, 4, 2] when `into`.
class DecodeCall : public Buffers {
 public:
  DecodeCall()
      : cache({.batch = 2,
               .kv_heads = 2,
               .head_dim = 8,
               .value_dim = 4,
               .capacity = 16,
               .page_size = 4}) {
    const std::int64_t counts[] = {5, 3};
    cache.append(tensor(DType::f32, {2, 5, 2, 8}), tensor(DType::f32, {2, 5, 2, 4}), counts);
    q = tensor(DType::f32, {2, 2, 4, 8});
  }

  void use_outputs() {
    into = true;
    out = tensor(DType::f32, {2, 2, 4, 4});
    lse = tensor(DType::f32, {2, 4, 2});
  }

  static constexpr const char* kState = "the cache";
  CacheState state() const { return state_of(cache); }

  void run() const {
    if (into) {
      qkv::decode_attention_into(q, cache, out, lse, options);
    } else {
      (void)qkv::decode_attention(q, cache, options);
    }
  }

  KvCache cache;
  TensorView q, out, lse;  // mutable so that rows can alias outputs onto q
  AttentionOptions options;
  bool into = false;
};

const std::vector<BadRow<DecodeCall>>& bad_decodes() {
  static const std::vector<BadRow<DecodeCall>> rows = join<DecodeCall>({
      {
          // q
          {"q_rank_3",
           [](DecodeCall& c) {
             c.q = c.tensor(DType::f32, {2, 2, 32});
           },
           {"q: expected rank 4 [B, n, Hq, Dk], got rank 3 with sizes [2, 2, 32]"}},
          {"q_batch",
           [](DecodeCall& c) {
             c.q = c.tensor(DType::f32, {3, 2, 4, 8});
           },
           {"q: expected batch size (dim 0) 2 to match the cache, got 3"}},
          {"q_no_new_tokens",
           [](DecodeCall& c) {
             c.q = c.tensor(DType::f32, {2, 0, 4, 8});
           },
           {"q: expected 1 to 16 new tokens (dim 1), got 0"}},
          {"q_too_many_new_tokens",
           [](DecodeCall& c) {
             c.q = c.tensor(DType::f32, {2, 17, 4, 8});
           },
           {"q: expected 1 to 16 new tokens (dim 1), got 17 (use qkv::attention",
            "cache: sequence 0 holds 5 tokens, fewer than the 17 new queries",
            "cache: sequence 1 holds 3 tokens, fewer than the 17 new queries"},
           3},
          {"sequence_shorter_than_n",
           [](DecodeCall& c) {
             c.q = c.tensor(DType::f32, {2, 4, 4, 8});
           },
           {"cache: sequence 1 holds 3 tokens, fewer than the 4 new queries (append their keys and "
            "values first)"}},
          {"hq_not_multiple_of_hkv",
           [](DecodeCall& c) {
             c.q = c.tensor(DType::f32, {2, 2, 3, 8});
           },
           {"q: expected query heads Hq (dim 2) a positive multiple of the cache's KV heads 2, got "
            "3"}},
          {"hq_zero",
           [](DecodeCall& c) {
             c.q = c.tensor(DType::f32, {2, 2, 0, 8});
           },
           {"q: expected query heads Hq (dim 2) a positive multiple of the cache's KV heads 2, got "
            "0"}},
          {"q_head_dim",
           [](DecodeCall& c) {
             c.q = c.tensor(DType::f32, {2, 2, 4, 6});
           },
           {"q: expected head dim (dim 3) 8 to match the cache, got 6"}},
          {"fast_backend_f64",
           [](DecodeCall& c) {
             c.q = c.tensor(DType::f64, {2, 2, 4, 8});
             c.options.backend = qkv::Backend::fast;
           },
           {"options.backend: Backend::fast computes in f32 and takes f32, f16 or bf16 inputs, got "
            "f64"}},
          // options decode does not take
          {"mask",
           [](DecodeCall& c) {
             c.options.mask = c.tensor(DType::boolean, {2, 1, 2, 5});
           },
           {"options.mask: not supported by decode_attention"}},
          {"key_lengths",
           [](DecodeCall& c) {
             c.options.key_lengths = c.list<std::int64_t>({5, 3});
           },
           {"options.key_lengths: not supported by decode_attention"}},
          {"cu_seqlens",
           [](DecodeCall& c) {
             c.options.cu_seqlens_q = c.list<std::int64_t>({0, 2});
             c.options.cu_seqlens_k = c.list<std::int64_t>({0, 5});
           },
           {"options.cu_seqlens_q: not supported by decode_attention",
            "options.cu_seqlens_k: not supported by decode_attention"},
           2},
          {"relative_bias",
           [](DecodeCall& c) {
             c.options.relative_bias.table = c.tensor(DType::f32, {4, 32});
           },
           {"options.relative_bias: not supported by decode_attention"}},
          {"score_mod",
           [](DecodeCall& c) {
             c.options.score_mod = [](double s, std::int64_t, std::int64_t, std::int64_t,
                                      std::int64_t) { return s; };
           },
           {"options.score_mod: not supported by decode_attention"}},
          {"mask_mod",
           [](DecodeCall& c) {
             c.options.mask_mod = [](std::int64_t, std::int64_t, std::int64_t, std::int64_t) {
               return true;
             };
           },
           {"options.mask_mod: not supported by decode_attention"}},
          {"sparse",
           [](DecodeCall& c) {
             c.options.sparse = qkv::SparsePattern::window(2, 0) |
                                qkv::SparsePattern::block_sparse({1, 1, 1, 64, {1}});
           },
           {"options.sparse: block layouts index query rows, which decode_attention does not "
            "have"}},
          {"additive_score",
           [](DecodeCall& c) { c.options.score = qkv::Score::additive; },
           {"options.score: Score::additive is not supported by decode_attention"}},
          {"dropout",
           [](DecodeCall& c) { c.options.dropout_p = 0.1; },
           {"options.dropout_p: not supported by decode_attention"}},
          {"dropout_out_of_range",
           [](DecodeCall& c) { c.options.dropout_p = -1e-9; },
           {"options.dropout_p: expected a probability in [0, 1), got -1e-09",
            "options.dropout_p: not supported by decode_attention"},
           2},
          {"window_right",
           [](DecodeCall& c) { c.options.window_right = 0; },
           {"options.window_right: not supported by decode_attention"}},
          {"window_left",
           [](DecodeCall& c) { c.options.window_left = -2; },
           {"options.window_left: expected -1 (unbounded) or a size >= 0, got -2"}},
          // scale, softcap, ALiBi
          {"scale_nan",
           [](DecodeCall& c) { c.options.scale = kNaN; },
           {"options.scale: expected a finite number within the f32 range", "got nan"}},
          {"scale_infinite",
           [](DecodeCall& c) { c.options.scale = -kInf; },
           {"options.scale: expected a finite number within the f32 range", "got -inf"}},
          {"scale_beyond_f32",
           [](DecodeCall& c) { c.options.scale = 1e39; },
           {"options.scale: expected a finite number within the f32 range", "got 1e+39"}},
          {"scale_with_dot",
           [](DecodeCall& c) {
             c.options.score = qkv::Score::dot;
             c.options.scale = 0.5;
           },
           {"options.scale: only used by Score::scaled_dot, but score is Score::dot"}},
          {"softcap_negative",
           [](DecodeCall& c) { c.options.softcap = -1.0; },
           {"options.softcap: expected 0 (off) or a value in [2^-126, 2^126]", "got -1"}},
          {"softcap_subnormal",
           [](DecodeCall& c) { c.options.softcap = 1e-39; },
           {"options.softcap: expected 0 (off)", "got 1e-39"}},
          {"alibi_count",
           [](DecodeCall& c) {
             c.options.alibi_slopes = c.list<float>({1, 1, 1});
           },
           {"options.alibi_slopes: expected Hq = 4 or B * Hq = 2 * 4 slopes, got 3"}},
          {"alibi_nan",
           [](DecodeCall& c) {
             c.options.alibi_slopes =
                 c.list<float>({1, 1, std::numeric_limits<float>::quiet_NaN(), 1});
           },
           {"options.alibi_slopes[2]: expected a finite slope, got nan"}},
          {"alibi_inf",
           [](DecodeCall& c) {
             c.options.alibi_slopes =
                 c.list<float>({1, 1, 1, -std::numeric_limits<float>::infinity()});
           },
           {"options.alibi_slopes[3]: expected a finite slope, got -inf"}},
          // enum values outside the enum
          {"backend_out_of_range",
           [](DecodeCall& c) { c.options.backend = static_cast<qkv::Backend>(7); },
           {"options.backend: expected Backend::automatic, Backend::reference or Backend::fast, "
            "got "
            "value 7"}},
          {"matmul_precision_out_of_range",
           [](DecodeCall& c) { c.options.matmul_precision = static_cast<qkv::MatmulPrecision>(3); },
           {"options.matmul_precision: expected MatmulPrecision::highest, MatmulPrecision::medium "
            "or MatmulPrecision::int8, got value 3"}},
          {"score_out_of_range",
           [](DecodeCall& c) { c.options.score = static_cast<qkv::Score>(9); },
           {"options.score: expected Score::scaled_dot, Score::dot or Score::additive, got value "
            "9"}},
          {"align_out_of_range",
           [](DecodeCall& c) { c.options.align = static_cast<qkv::Align>(5); },
           {"options.align: expected Align::top_left or Align::bottom_right, got value 5",
            "options.align: not supported by decode_attention"},
           2},
          // outputs
          {"out_sizes",
           [](DecodeCall& c) {
             c.use_outputs();
             c.out = c.tensor(DType::f32, {2, 2, 4, 8});
           },
           {"out: expected sizes [2, 2, 4, 4], got [2, 2, 4, 8]"}},
          {"out_rank",
           [](DecodeCall& c) {
             c.use_outputs();
             c.out = c.tensor(DType::f32, {2, 2, 16});
           },
           {"out: expected rank 4, got rank 3 with sizes [2, 2, 16]"}},
          {"out_dtype",
           [](DecodeCall& c) {
             c.use_outputs();
             c.out = c.tensor(DType::bf16, {2, 2, 4, 4});
           },
           {"out: expected dtype f32, got bf16"}},
          {"out_aliases_q",
           [](DecodeCall& c) {
             c.use_outputs();
             c.out = TensorView(c.q.data(), DType::f32, {2, 2, 4, 4});
           },
           {"out: memory overlaps q (outputs must not alias an input or another output)"}},
          {"out_stride_0",
           [](DecodeCall& c) {
             c.use_outputs();
             c.out = TensorView(c.out.data(), DType::f32, {2, 2, 4, 4}, {16, 0, 4, 1});
           },
           {"out: has overlapping elements: dimension 1 (size 2) has stride 0"}},
          {"lse_sizes",
           [](DecodeCall& c) {
             c.use_outputs();
             c.lse = c.tensor(DType::f32, {2, 2, 4});
           },
           {"lse: expected sizes [2, 4, 2], got [2, 2, 4]"}},
          {"lse_dtype",
           [](DecodeCall& c) {
             c.use_outputs();
             c.lse = c.tensor(DType::f64, {2, 4, 2});
           },
           {"lse: expected dtype f32, got f64"}},
          {"lse_overlaps_out",
           [](DecodeCall& c) {
             c.use_outputs();
             c.lse = TensorView(static_cast<float*>(c.out.data()) + 60, DType::f32, {2, 4, 2});
           },
           {"lse: memory overlaps out (outputs must not alias an input or another output)"}},
          {"lse_aliases_q",
           [](DecodeCall& c) {
             c.use_outputs();
             c.lse = TensorView(c.q.data(), DType::f32, {2, 4, 2});
           },
           {"lse: memory overlaps q"}},
          {"outputs_and_options",
           [](DecodeCall& c) {
             c.use_outputs();
             c.out = c.tensor(DType::f16, {2, 2, 4, 4});
             c.lse = TensorView(c.out.data(), DType::f32, {2, 4, 2});
             c.options.dropout_p = 0.5;
             c.options.key_lengths = c.list<std::int64_t>({1, 1});
           },
           {"out: expected dtype f32, got f16", "lse: memory overlaps out", "options.dropout_p",
            "options.key_lengths"},
           4},
      },
      view_rows<DecodeCall>({.name = "q", .sizes = {2, 2, 4, 8}},
                            [](DecodeCall& c, TensorView t) { c.q = t; }),
      view_rows<DecodeCall>({.name = "out", .sizes = {2, 2, 4, 4}, .dtypes = "f32"},
                            [](DecodeCall& c, TensorView t) {
                              c.use_outputs();
                              c.out = t;
                            }),
      view_rows<DecodeCall>({.name = "lse", .sizes = {2, 4, 2}, .optional = true, .dtypes = "f32"},
                            [](DecodeCall& c, TensorView t) {
                              c.use_outputs();
                              c.lse = t;
                            }),
  });
  return rows;
}

QKV_BAD_INPUT_TEST(DecodeValidation, DecodeBadCall, DecodeCall, bad_decodes());

TEST(DecodeValidation, DecodeBaseAndVariantsAreValid) {
  expect_valid<DecodeCall>({
      {"decode_attention", [](DecodeCall&) {}},
      {"decode_attention_into", [](DecodeCall& c) { c.use_outputs(); }},
      {"into without lse",
       [](DecodeCall& c) {
         c.use_outputs();
         c.lse = {};
       }},
      {"n = the shortest sequence",
       [](DecodeCall& c) {
         c.q = c.tensor(DType::f32, {2, 3, 4, 8});
       }},
      {"multi-query heads",
       [](DecodeCall& c) {
         c.q = c.tensor(DType::bf16, {2, 1, 2, 8});
       }},
      {"f64 on the reference",
       [](DecodeCall& c) {
         c.q = c.tensor(DType::f64, {2, 2, 4, 8});
         c.use_outputs();
         c.out = c.tensor(DType::f64, {2, 2, 4, 4});
         c.lse = c.tensor(DType::f64, {2, 4, 2});
         c.options.backend = qkv::Backend::reference;
       }},
      {"options decode applies",
       [](DecodeCall& c) {
         c.options.scale = 0.5;
         c.options.softcap = 20.0;
         c.options.window_left = 2;
         c.options.alibi_slopes = c.list<float>({1, 2, 3, 4, 1, 2, 3, 4});
         c.options.return_lse = true;
       }},
      {"broadcast (stride 0) q",
       [](DecodeCall& c) {
         c.q = TensorView(c.q.data(), DType::f32, {2, 2, 4, 8}, {0, 0, 8, 1});
       }},
  });
}

}  // namespace
