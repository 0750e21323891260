// Sparse attention patterns: their element-wise definitions, the tile
// coverage the kernels skip by (sound for every tile, exact where the
// pattern allows), the fused forward and backward against the reference
// (docs/numerics.md's tolerance policy, see attention_checks.hpp), and
// validation.
#include "core/sparse.hpp"

#include <gtest/gtest.h>
#include <omp.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "attention_checks.hpp"
#include "qkv/decode.hpp"
#include "qkv/sparse.hpp"
#include "sweep_sample.hpp"
#include "test_util.hpp"

namespace {

using qkv::AttentionOptions;
using qkv::BlockLayout;
using qkv::DType;
using qkv::SparsePattern;
using qkv::Tensor;
using qkv::detail::Coverage;
using qkv::detail::PatternTile;
using qkv::test::expect_backward_matches;
using qkv::test::expect_matches_reference;
using qkv::test::make_inputs;
using qkv::test::SweepSample;

std::int64_t floor_div(std::int64_t x, std::int64_t m) {
  return x >= 0 ? x / m : -((-x + m - 1) / m);
}

BlockLayout random_layout(std::int64_t heads, std::int64_t q_blocks, std::int64_t k_blocks,
                          std::int64_t block_size, std::uint32_t seed) {
  BlockLayout L{heads, q_blocks, k_blocks, block_size, {}};
  std::mt19937 gen(seed);
  for (std::int64_t x = 0; x < heads * q_blocks * k_blocks; ++x) L.bits.push_back(gen() % 3 == 0);
  return L;
}

// Every kind of pattern, alone and composed, with small parameters.
std::vector<SparsePattern> all_patterns() {
  const SparsePattern layout = SparsePattern::block_sparse(random_layout(2, 8, 8, 8, 3));
  return {SparsePattern::window(5, 2),
          SparsePattern::window(-1, 3),
          SparsePattern::dilated_window(4, 1, 3),
          SparsePattern::strided(6),
          SparsePattern::fixed(8, 2),
          SparsePattern::global_tokens({0, 7, 30}),
          SparsePattern::prefix(13),
          SparsePattern::prefix_lm(9),
          layout,
          SparsePattern::window(3, 3) | SparsePattern::global_tokens({2, 40}),
          SparsePattern::strided(5) & SparsePattern::window(20, 0),
          qkv::or_patterns({SparsePattern::fixed(16, 4), layout, SparsePattern::window(1, 1)}),
          qkv::and_patterns({SparsePattern::dilated_window(8, 8, 2), SparsePattern::fixed(16, 4)})};
}

TEST(SparsePattern, ElementDefinitions) {
  // The formulas of qkv/sparse.hpp, written out independently.
  for (std::int64_t p = -3; p < 40; ++p) {
    const std::int64_t i = p + 3;
    for (std::int64_t j = 0; j < 40; ++j) {
      const std::int64_t d = p - j;
      EXPECT_EQ(SparsePattern::window(5, 2).admits(0, i, p, j), d >= -2 && d <= 5);
      EXPECT_EQ(SparsePattern::window(-1, 0).admits(0, i, p, j), d >= 0);
      bool dilated = false;
      for (std::int64_t t = -1; t <= 4; ++t) dilated = dilated || d == 3 * t;
      EXPECT_EQ(SparsePattern::dilated_window(4, 1, 3).admits(0, i, p, j), dilated);
      EXPECT_EQ(SparsePattern::strided(6).admits(0, i, p, j),
                (d > -6 && d < 6) || (d % 6 + 6) % 6 == 0);
      EXPECT_EQ(SparsePattern::fixed(8, 2).admits(0, i, p, j),
                floor_div(p, 8) == floor_div(j, 8) || j % 8 >= 6);
      EXPECT_EQ(SparsePattern::global_tokens({7, 0, 7}).admits(0, i, p, j),
                p == 0 || p == 7 || j == 0 || j == 7);
      const SparsePattern u = SparsePattern::window(1, 1) | SparsePattern::global_tokens({9});
      EXPECT_EQ(u.admits(0, i, p, j), (d >= -1 && d <= 1) || p == 9 || j == 9);
      const SparsePattern x = SparsePattern::strided(4) & SparsePattern::window(-1, 0);
      EXPECT_EQ(x.admits(0, i, p, j), d >= 0 && (d < 4 || d % 4 == 0));
      EXPECT_EQ(SparsePattern::prefix(6).admits(0, i, p, j), j < 6);
      // Prefix LM: every query sees the prefix; past it, keys up to its own position.
      EXPECT_EQ(SparsePattern::prefix_lm(6).admits(0, i, p, j), j < 6 || j <= p);
    }
  }
  const BlockLayout L = random_layout(2, 6, 5, 8, 1);
  const SparsePattern b = SparsePattern::block_sparse(L);
  for (std::int64_t h = 0; h < 2; ++h)
    for (std::int64_t i = 0; i < 48; ++i)
      for (std::int64_t j = 0; j < 40; ++j) EXPECT_EQ(b.admits(h, i, i, j), L.at(h, i / 8, j / 8));
  EXPECT_TRUE(SparsePattern().admits(0, 3, 3, 100));
  EXPECT_EQ((SparsePattern::window(1, 0) | SparsePattern::strided(3)).describe(),
            "(window(1, 0) | strided(3))");
}

// For random tiles: the element mask equals admits(); coverage `none` means
// nothing is admitted and `all` everything (the kernels skip by these).
TEST(SparsePattern, TileCoverageIsSoundAndMasksMatch) {
  std::mt19937 gen(11);
  std::vector<std::uint8_t> keep;
  int none = 0, all = 0, some = 0;
  for (const SparsePattern& pattern : all_patterns()) {
    for (int trial = 0; trial < 400; ++trial) {
      PatternTile t;
      t.h = gen() % 2;
      t.i0 = gen() % 40;
      t.rows = 1 + gen() % 24;
      t.p0 = t.i0 + static_cast<std::int64_t>(gen() % 7) - 3;
      t.j0 = gen() % 40;
      t.cols = 1 + gen() % 24;
      if (t.i0 + t.rows > 64 || t.j0 + t.cols > 64) continue;  // inside the layouts
      keep.assign(static_cast<std::size_t>(t.rows * t.cols), 7);
      qkv::detail::fill_admitted(pattern, t, keep.data());
      std::int64_t admitted = 0;
      for (std::int64_t c = 0; c < t.cols; ++c) {
        for (std::int64_t r = 0; r < t.rows; ++r) {
          const bool a = pattern.admits(t.h, t.i0 + r, t.p0 + r, t.j0 + c);
          ASSERT_EQ(keep[c * t.rows + r] != 0, a) << pattern.describe() << " r " << r << " c " << c;
          admitted += a;
        }
      }
      const Coverage cov = qkv::detail::coverage(pattern, t);
      if (cov == Coverage::none) {
        EXPECT_EQ(admitted, 0) << pattern.describe();
      }
      if (cov == Coverage::all) {
        EXPECT_EQ(admitted, t.rows * t.cols) << pattern.describe();
      }
      none += cov == Coverage::none;
      all += cov == Coverage::all;
      some += cov == Coverage::some;
    }
  }
  // The sweep reaches all three classes.
  EXPECT_GT(none, 100);
  EXPECT_GT(all, 100);
  EXPECT_GT(some, 100);
}

// Window, strided, global and layout coverage is exact: `some` only for
// tiles with both admitted and rejected pairs.
TEST(SparsePattern, CoverageIsExactForSimplePatterns) {
  std::mt19937 gen(5);
  const std::vector<SparsePattern> exact = {
      SparsePattern::window(5, 2), SparsePattern::strided(6),
      SparsePattern::global_tokens({0, 7, 30}), SparsePattern::prefix(13),
      SparsePattern::block_sparse(random_layout(1, 8, 8, 8, 9))};
  for (const SparsePattern& pattern : exact) {
    for (int trial = 0; trial < 400; ++trial) {
      const PatternTile t{0, 0, 0, 0, 0, 0};
      PatternTile u = t;
      u.i0 = gen() % 40;
      u.rows = 1 + gen() % 24;
      u.p0 = u.i0;
      u.j0 = gen() % 40;
      u.cols = 1 + gen() % 24;
      std::int64_t admitted = 0;
      for (std::int64_t c = 0; c < u.cols; ++c)
        for (std::int64_t r = 0; r < u.rows; ++r)
          admitted += pattern.admits(0, u.i0 + r, u.p0 + r, u.j0 + c);
      const Coverage expected = admitted == 0                 ? Coverage::none
                                : admitted == u.rows * u.cols ? Coverage::all
                                                              : Coverage::some;
      EXPECT_EQ(qkv::detail::coverage(pattern, u), expected) << pattern.describe();
    }
  }
}

// The reference backend: a pattern is exactly the equivalent bool mask.
TEST(SparseAttention, ReferenceEqualsEquivalentBoolMask) {
  const auto in = make_inputs(1, 37, 45, 2, 1, 8, 8, DType::f64, 3);
  for (const SparsePattern& pattern : all_patterns()) {
    for (const bool causal : {false, true}) {
      AttentionOptions a;
      a.backend = qkv::Backend::reference;
      a.causal = causal;
      a.sparse = pattern;
      Tensor mask(DType::boolean, {1, 2, 37, 45});
      for (std::int64_t h = 0; h < 2; ++h)
        for (std::int64_t i = 0; i < 37; ++i)
          for (std::int64_t j = 0; j < 45; ++j)  // bottom-right: p = i + 8
            mask.set({0, h, i, j}, pattern.admits(h, i, i + 8, j) ? 1.0 : 0.0);
      AttentionOptions b = a;
      b.sparse = {};
      b.mask = mask;
      const Tensor x = qkv::attention(in.q, in.k, in.v, a).out;
      const Tensor y = qkv::attention(in.q, in.k, in.v, b).out;
      EXPECT_EQ(qkv::test::max_abs_diff(x, y), 0.0) << pattern.describe();
    }
  }
}

class SparseSweep : public ::testing::TestWithParam<DType> {};

TEST_P(SparseSweep, ForwardMatchesReference) {
  const DType dtype = GetParam();
  struct Case {
    std::int64_t nq, nk, hq, hkv, d;
  };
  // Tiles of 96 rows and 256 keys: sizes across their boundaries.
  const Case shapes[] = {{97, 97, 2, 1, 64}, {300, 300, 2, 2, 59}, {77, 600, 4, 2, 32}};
  const std::size_t kPatterns = 8;
  const SweepSample sample(std::size(shapes) * kPatterns * 2);
  SCOPED_TRACE(sample.note());
  std::size_t index = 0;
  for (const Case c : shapes) {
    const auto in = make_inputs(1, c.nq, c.nk, c.hq, c.hkv, c.d, c.d, dtype, 7);
    const BlockLayout layout = qkv::bigbird_layout({.heads = c.hq,
                                                    .nq = c.nq,
                                                    .nk = c.nk,
                                                    .block_size = 32,
                                                    .window_blocks = 1,
                                                    .global_blocks = 1,
                                                    .random_blocks = 2,
                                                    .seed = 4});
    const std::vector<SparsePattern> patterns = {
        SparsePattern::window(40, 13),
        SparsePattern::dilated_window(16, 16, 4),
        SparsePattern::strided(24),
        SparsePattern::fixed(64, 8),
        SparsePattern::window(32, 32) | SparsePattern::global_tokens({0, 1, 150}),
        SparsePattern::block_sparse(layout),
        SparsePattern::block_sparse(layout) & SparsePattern::window(-1, 0),
        SparsePattern::prefix_lm(c.nk / 3),
    };
    ASSERT_EQ(patterns.size(), kPatterns);
    for (const SparsePattern& pattern : patterns) {
      for (const bool causal : {false, true}) {
        if (!sample.runs(index++)) continue;
        AttentionOptions opt;
        opt.causal = causal;
        opt.sparse = pattern;
        expect_matches_reference(in.q, in.k, in.v, opt,
                                 pattern.describe() + (causal ? " causal " : " ") +
                                     std::to_string(c.nq) + "x" + std::to_string(c.nk));
      }
    }
  }
}

TEST_P(SparseSweep, BackwardMatchesReference) {
  const DType dtype = GetParam();
  const auto in = make_inputs(1, 200, 200, 2, 1, 32, 32, dtype, 9);
  const BlockLayout layout = qkv::bigbird_layout(
      {.heads = 1, .nq = 200, .nk = 200, .block_size = 16, .random_blocks = 1, .seed = 2});
  for (const SparsePattern& pattern :
       {SparsePattern::window(30, 0) | SparsePattern::global_tokens({0, 77}),
        SparsePattern::dilated_window(10, 10, 3), SparsePattern::strided(16),
        SparsePattern::fixed(32, 4), SparsePattern::block_sparse(layout),
        SparsePattern::prefix_lm(70)}) {
    AttentionOptions opt;
    opt.causal =
        pattern.describe().rfind("strided", 0) == 0 || pattern.describe().rfind("fixed", 0) == 0;
    opt.sparse = pattern;
    expect_backward_matches(in.q, in.k, in.v, opt, pattern.describe());
  }
}

INSTANTIATE_TEST_SUITE_P(Sparse, SparseSweep,
                         ::testing::Values(DType::f32, DType::bf16, DType::f16),
                         [](const auto& p) { return std::string(qkv::dtype_name(p.param)); });

// A pattern window and the options' window admit the same keys.
TEST(SparseAttention, PatternWindowMatchesOptionsWindow) {
  const auto in = make_inputs(2, 333, 333, 2, 2, 64, 64, DType::f32, 1);
  AttentionOptions a;
  a.sparse = SparsePattern::window(100, 0);
  AttentionOptions b;
  b.window_left = 100;
  b.window_right = 0;
  const Tensor x = qkv::attention(in.q, in.k, in.v, a).out;
  const Tensor y = qkv::attention(in.q, in.k, in.v, b).out;
  // Same math, blocks cut at different keys: the online softmax rounds
  // differently, within a few ulps of f32 at outputs of order 1.
  EXPECT_LE(qkv::test::max_abs_diff(x, y), 16 * qkv::test::unit_roundoff(DType::f32));
}

TEST(SparseAttention, RowsThePatternEmptiesAreZero) {
  // Global token 5 only, causal: rows 0..4 see only keys that are not
  // global and are not global themselves, so they see nothing.
  const auto in = make_inputs(1, 20, 20, 1, 1, 8, 8, DType::f32, 2);
  AttentionOptions opt;
  opt.sparse = SparsePattern::global_tokens({5});
  opt.causal = true;
  opt.return_lse = true;
  const qkv::AttentionResult r = qkv::attention(in.q, in.k, in.v, opt);
  for (std::int64_t i = 0; i < 5; ++i) {
    EXPECT_EQ(r.lse.get({0, 0, i}), -qkv::test::kInf);
    for (std::int64_t c = 0; c < 8; ++c) EXPECT_EQ(r.out.get({0, i, 0, c}), 0.0);
  }
  expect_matches_reference(in.q, in.k, in.v, opt, "global only, causal");
}

TEST(SparseAttention, BitwiseIdenticalForAnyThreadCount) {
  const auto in = make_inputs(1, 700, 700, 4, 2, 64, 64, DType::f32, 4);
  AttentionOptions opt;
  opt.sparse = SparsePattern::dilated_window(64, 0, 2) | SparsePattern::global_tokens({3});
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  const Tensor one = qkv::attention(in.q, in.k, in.v, opt).out;
  for (const int threads : {2, 3}) {
    omp_set_num_threads(threads);
    const Tensor many = qkv::attention(in.q, in.k, in.v, opt).out;
    EXPECT_EQ(std::memcmp(one.data<float>(), many.data<float>(), one.numel() * sizeof(float)), 0)
        << threads << " threads";
  }
  omp_set_num_threads(saved);
}

TEST(BigBirdLayout, WindowGlobalAndSeededRandomBlocks) {
  const qkv::BigBirdConfig config{.heads = 3,
                                  .nq = 640,
                                  .nk = 640,
                                  .block_size = 64,
                                  .window_blocks = 1,
                                  .global_blocks = 2,
                                  .random_blocks = 3,
                                  .seed = 17};
  const BlockLayout L = qkv::bigbird_layout(config);
  ASSERT_EQ(L.q_blocks, 10);
  ASSERT_EQ(L.k_blocks, 10);
  for (std::int64_t h = 0; h < 3; ++h) {
    for (std::int64_t a = 0; a < 10; ++a) {
      std::int64_t set = 0;
      for (std::int64_t b = 0; b < 10; ++b) set += L.at(h, a, b);
      if (a < 2) {
        EXPECT_EQ(set, 10);  // global rows see everything
        continue;
      }
      for (std::int64_t b = 0; b < 10; ++b) {
        if (b < 2 || (b >= a - 1 && b <= a + 1)) {
          EXPECT_TRUE(L.at(h, a, b)) << a << " " << b;
        }
      }
      const std::int64_t fixed_blocks =
          2 + std::min<std::int64_t>(a + 1, 9) - std::max<std::int64_t>(a - 1, 2) + 1;
      EXPECT_EQ(set, std::min<std::int64_t>(fixed_blocks + 3, 10)) << "row " << a;
    }
  }
  EXPECT_EQ(qkv::bigbird_layout(config).bits, L.bits);
  qkv::BigBirdConfig other = config;
  other.seed = 18;
  EXPECT_NE(qkv::bigbird_layout(other).bits, L.bits);
}

TEST(SparsePattern, InvalidParametersAndLayoutsAreRejected) {
  EXPECT_THROW(SparsePattern::window(-2, 0), qkv::Error);
  EXPECT_THROW(SparsePattern::dilated_window(3, 3, 0), qkv::Error);
  EXPECT_THROW(SparsePattern::strided(0), qkv::Error);
  EXPECT_THROW(SparsePattern::fixed(8, 9), qkv::Error);
  EXPECT_THROW(SparsePattern::global_tokens({-1}), qkv::Error);
  EXPECT_THROW(SparsePattern::prefix(-1), qkv::Error);
  EXPECT_THROW(SparsePattern::prefix_lm(-3), qkv::Error);
  EXPECT_THROW(SparsePattern::block_sparse(BlockLayout{1, 2, 2, 8, {1, 0, 1}}), qkv::Error);
  EXPECT_THROW(SparsePattern::window(1, 1) | SparsePattern(), qkv::Error);

  const auto in = make_inputs(1, 40, 40, 4, 2, 8, 8, DType::f32, 1);
  AttentionOptions opt;
  // Two layouts: 3 heads (neither 1 nor Hq) and too few key blocks.
  opt.sparse = SparsePattern::block_sparse(random_layout(3, 5, 5, 8, 1)) |
               SparsePattern::block_sparse(random_layout(1, 5, 4, 8, 1));
  try {
    qkv::attention(in.q, in.k, in.v, opt);
    ADD_FAILURE() << "expected qkv::Error";
  } catch (const qkv::Error& e) {
    ASSERT_EQ(e.reasons().size(), 2u) << e.what();
    EXPECT_NE(e.reasons()[0].find("3 heads"), std::string::npos) << e.what();
    EXPECT_NE(e.reasons()[1].find("does not cover sequence 0"), std::string::npos) << e.what();
  }

  qkv::KvCache cache({.batch = 1, .kv_heads = 2, .head_dim = 8, .capacity = 16});
  const Tensor q1 = qkv::test::random_tensor(DType::f32, {1, 1, 4, 8}, 3, -1, 1);
  cache.append(in.k.view().slice(1, 0, 1), in.v.view().slice(1, 0, 1));
  // Decode takes patterns of positions, not block layouts (query rows).
  AttentionOptions dec;
  dec.sparse =
      SparsePattern::window(4, 0) | SparsePattern::block_sparse(random_layout(1, 2, 2, 8, 5));
  EXPECT_THROW(qkv::decode_attention(q1, cache, dec), qkv::Error);
  dec.sparse = SparsePattern::window(4, 0);
  EXPECT_NO_THROW(qkv::decode_attention(q1, cache, dec));
}

}  // namespace
