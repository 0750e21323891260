// Streaming KV caches (KvCacheConfig::sink_tokens, window_tokens): which
// tokens a sequence keeps, the positions its keys are rotated at, decoding
// over what it keeps, the pool's pages, and the configs it refuses.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "bad_input.hpp"
#include "test_util.hpp"

namespace {

using qkv::DType;
using qkv::KvCache;
using qkv::KvCacheConfig;
using qkv::RopeConfig;
using qkv::Tensor;
using qkv::test::error_of;
using qkv::test::expect_contains;
using qkv::test::max_abs_diff;
using qkv::test::random_tensor;

constexpr std::int64_t kHeads = 2, kDim = 8;

KvCacheConfig streaming(std::int64_t page, std::int64_t sinks, std::int64_t window,
                        std::int64_t batch = 1) {
  return {.batch = batch,
          .kv_heads = kHeads,
          .head_dim = kDim,
          .page_size = page,
          .sink_tokens = sinks,
          .window_tokens = window};
}

// Rows [B, n, Hkv, D] whose every element is its token's index start + t
// (so that a held row tells which token it is).
Tensor numbered(std::int64_t batch, std::int64_t n, std::int64_t start) {
  Tensor x(DType::f32, {batch, n, kHeads, kDim});
  qkv::detail::for_each_index(x.sizes(), 4, [&](const qkv::Shape& i) {
    x.set({i[0], i[1], i[2], i[3]}, static_cast<double>(start + i[1]));
  });
  return x;
}

// The token indices sequence b holds, in order, read through its pages.
std::vector<std::int64_t> held(const KvCache& c, std::int64_t b) {
  std::vector<std::int64_t> tokens;
  for (std::int64_t t = 0; t < c.length(b); ++t) {
    const auto* page = static_cast<const float*>(c.key_page(b, t / c.page_size()));
    tokens.push_back(static_cast<std::int64_t>(page[(t % c.page_size()) * kHeads * kDim]));
  }
  return tokens;
}

// What StreamingLLM keeps of T tokens: the first S, then the recent ones
// from the first whole page after the sinks whose dropping would leave
// fewer than W (all of them while there are fewer than S + W + P).
std::vector<std::int64_t> expected(std::int64_t total, std::int64_t page, std::int64_t sinks,
                                   std::int64_t window) {
  std::int64_t first = sinks;  // first recent token held
  while (total - first - page >= window) first += page;
  std::vector<std::int64_t> tokens;
  for (std::int64_t t = 0; t < std::min(total, sinks); ++t) tokens.push_back(t);
  for (std::int64_t t = std::max(first, std::min(total, sinks)); t < total; ++t) {
    tokens.push_back(t);
  }
  return tokens;
}

TEST(StreamingCache, KeepsTheSinksAndTheRecentWindow) {
  struct Case {
    std::int64_t page, sinks, window;
  };
  for (const Case c : {Case{1, 4, 6}, Case{4, 4, 8}, Case{4, 0, 5}, Case{3, 6, 7}, Case{5, 5, 1},
                       Case{16, 16, 40}}) {
    SCOPED_TRACE("page " + std::to_string(c.page) + ", sinks " + std::to_string(c.sinks) +
                 ", window " + std::to_string(c.window));
    KvCache one_by_one(streaming(c.page, c.sinks, c.window));
    KvCache in_chunks(streaming(c.page, c.sinks, c.window));
    const std::int64_t pool = one_by_one.free_pages();
    std::int64_t total = 0;
    for (const std::int64_t n : {1, 7, 3, 16, 1, 40, 2, 1, 29}) {
      for (std::int64_t t = 0; t < n; ++t) {
        const Tensor k = numbered(1, 1, total + t);
        one_by_one.append(k, k);
      }
      const Tensor k = numbered(1, n, total);
      in_chunks.append(k, k);
      total += n;
      ASSERT_EQ(held(one_by_one, 0), expected(total, c.page, c.sinks, c.window));
      ASSERT_EQ(held(in_chunks, 0), held(one_by_one, 0));
      EXPECT_EQ(one_by_one.position(0), total);
      EXPECT_LE(one_by_one.length(0), c.sinks + c.window + c.page - 1);
      // Every page is held or free: none is lost.
      EXPECT_EQ(
          one_by_one.free_pages() + static_cast<std::int64_t>(one_by_one.block_table(0).size()),
          pool);
    }
    one_by_one.release(0);
    EXPECT_EQ(one_by_one.position(0), 0);
    EXPECT_EQ(one_by_one.free_pages(), pool);
  }
}

// RoPE rotates each key at the position it was appended at, not at its row:
// the held rows are the rows an unbounded cache holds for the same tokens.
TEST(StreamingCache, KeysKeepTheirPositions) {
  const RopeConfig rope{.base = 100.0};
  KvCache stream(streaming(4, 4, 6, 2));
  KvCacheConfig all = streaming(4, 0, 0, 2);
  all.capacity = 64;
  KvCache full(all);
  for (std::uint32_t step = 0; step < 6; ++step) {
    const Tensor k = random_tensor(DType::f32, {2, 7, kHeads, kDim}, 10 + step);
    const Tensor v = random_tensor(DType::f32, {2, 7, kHeads, kDim}, 20 + step);
    const std::int64_t counts[] = {7, 3};
    stream.append(k, v, counts, &rope);
    full.append(k, v, counts, &rope);
  }
  for (std::int64_t b = 0; b < 2; ++b) {
    const auto tokens = expected(full.length(b), 4, 4, 6);
    ASSERT_EQ(stream.length(b), static_cast<std::int64_t>(tokens.size()));
    EXPECT_EQ(stream.position(b), full.length(b));
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      const auto row = [&](const KvCache& c, std::int64_t t) {
        const auto* page = static_cast<const float*>(c.key_page(b, t / 4));
        return std::vector<float>(page + (t % 4) * kHeads * kDim,
                                  page + (t % 4 + 1) * kHeads * kDim);
      };
      EXPECT_EQ(row(stream, static_cast<std::int64_t>(i)), row(full, tokens[i]))
          << "sequence " << b << ", token " << tokens[i];
    }
  }
}

// Decoding reads the held tokens and nothing else: the same as a cache to
// which only they were appended, with learned sinks too.
TEST(StreamingCache, DecodesWhatItHolds) {
  KvCache stream(streaming(4, 4, 9));
  KvCacheConfig plain_config = streaming(4, 0, 0);
  plain_config.capacity = 32;
  std::vector<Tensor> keys, values;
  for (std::uint32_t step = 0; step < 8; ++step) {
    keys.push_back(random_tensor(DType::f32, {1, 5, kHeads, kDim}, 30 + step));
    values.push_back(random_tensor(DType::f32, {1, 5, kHeads, kDim}, 40 + step));
    stream.append(keys.back(), values.back());
  }
  KvCache plain(plain_config);
  for (const std::int64_t t : expected(40, 4, 4, 9)) {
    const auto row = [&](const std::vector<Tensor>& x) {
      return x[static_cast<std::size_t>(t / 5)].view().slice(1, t % 5, 1);
    };
    plain.append(row(keys), row(values));
  }
  const Tensor q = random_tensor(DType::f32, {1, 3, 4, kDim}, 50);
  const std::vector<float> sinks = {0.5f, -1.0f, 2.0f, 0.0f};  // one logit per query head
  for (const bool with_sinks : {false, true}) {
    qkv::AttentionOptions o;
    if (with_sinks) o.sinks = sinks;
    EXPECT_EQ(max_abs_diff(qkv::decode_attention(q, stream, o).out,
                           qkv::decode_attention(q, plain, o).out),
              0.0);
  }
}

TEST(StreamingCache, TheDefaultPoolNeverRunsOut) {
  KvCache cache(streaming(4, 8, 10, 3));
  EXPECT_EQ(cache.free_pages(), 3 * (2 + 4));  // S / P + ceil((W + P - 1) / P) each
  for (std::uint32_t step = 0; step < 20; ++step) {
    const Tensor k = random_tensor(DType::f32, {3, 11, kHeads, kDim}, 60 + step);
    const std::int64_t counts[] = {11, step % 3, 1};
    cache.append(k, k, counts);
  }
  EXPECT_EQ(cache.position(0), 220);
  EXPECT_EQ(cache.length(0), static_cast<std::int64_t>(expected(220, 4, 8, 10).size()));
}

TEST(StreamingCache, RejectsBadConfigs) {
  const auto message = [](const KvCacheConfig& config) {
    const auto e = error_of([&] { KvCache cache(config); });
    return e ? std::string(e->what()) : std::string();
  };
  KvCacheConfig c = streaming(4, 4, 8);
  EXPECT_NO_THROW(KvCache{c});
  c.capacity = 16;
  expect_contains(message(c), {"config.capacity: expected 0 with window_tokens > 0", "got 16"});
  c = streaming(0, 0, 8);
  expect_contains(message(c), {"config.window_tokens: streaming drops whole pages",
                               "expected page_size > 0 (paged), got 0"});
  c = streaming(4, 6, 8);
  expect_contains(message(c), {"config.sink_tokens: expected a multiple of page_size 4", "got 6"});
  c = streaming(4, 4, 0);
  c.capacity = 16;
  expect_contains(message(c), {"config.sink_tokens: only kept by streaming", "got 4"});
  c = streaming(4, -4, -1);
  expect_contains(message(c), {"config.sink_tokens: expected >= 0, got -4",
                               "config.window_tokens: expected >= 0 (0 = no streaming), got -1"});
  c = streaming(4, 0, std::numeric_limits<std::int64_t>::max() - 2);
  expect_contains(message(c), {"config.window_tokens: sink_tokens + window_tokens + page_size "
                               "overflows int64"});
}

}  // namespace
