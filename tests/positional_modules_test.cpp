// Position encodings: MAE's 2-D sin-cos table, the RoPE backward, ALiBi
// slopes against the paper's recipe, and the learned modules
// (LearnedPositionalEmbedding, T5's RelativePositionBias) against loops,
// finite differences and attention with an explicit mask.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "module_checks.hpp"
#include "qkv/modules/positional.hpp"
#include "qkv/modules/safetensors.hpp"

namespace qkv::test {
namespace {

void expect_reason(const std::vector<std::string>& reasons, const std::string& part) {
  std::string all;
  for (const std::string& r : reasons) {
    if (r.find(part) != std::string::npos) return;
    all += "\n  " + r;
  }
  ADD_FAILURE() << "no reason contains \"" << part << "\":" << all;
}

// ---- sinusoidal_positions_2d ---------------------------------------------

// MAE's util/pos_embed.py step by step (numpy's float64 arithmetic):
//   grid = np.meshgrid(grid_w, grid_h)        # grid[0][i][j] = j, grid[1][i][j] = i
//   emb_h = get_1d(D / 2, grid[0]); emb_w = get_1d(D / 2, grid[1])
//   emb = np.concatenate([emb_h, emb_w], axis=1)
// with get_1d(E, pos): omega = arange(E / 2) / (E / 2); omega = 1 / 10000**omega;
// out = outer(pos, omega); concatenate([sin(out), cos(out)], axis=1).
std::vector<std::vector<double>> mae_1d(std::int64_t e, const std::vector<double>& pos) {
  std::vector<double> omega(static_cast<std::size_t>(e / 2));
  for (std::size_t t = 0; t < omega.size(); ++t) {
    omega[t] = static_cast<double>(t) / (static_cast<double>(e) / 2.0);
    omega[t] = 1.0 / std::pow(10000.0, omega[t]);
  }
  std::vector<std::vector<double>> emb;
  for (const double p : pos) {
    std::vector<double> row;
    for (const double w : omega) row.push_back(std::sin(p * w));
    for (const double w : omega) row.push_back(std::cos(p * w));
    emb.push_back(row);
  }
  return emb;
}

std::vector<std::vector<double>> mae_2d(std::int64_t dim, std::int64_t h, std::int64_t w) {
  std::vector<double> grid0, grid1;  // meshgrid(grid_w, grid_h), flattened row-major
  for (std::int64_t i = 0; i < h; ++i) {
    for (std::int64_t j = 0; j < w; ++j) {
      grid0.push_back(static_cast<double>(j));
      grid1.push_back(static_cast<double>(i));
    }
  }
  std::vector<std::vector<double>> emb = mae_1d(dim / 2, grid0);
  const std::vector<std::vector<double>> emb_w = mae_1d(dim / 2, grid1);
  for (std::size_t m = 0; m < emb.size(); ++m) {
    emb[m].insert(emb[m].end(), emb_w[m].begin(), emb_w[m].end());
  }
  return emb;
}

TEST(PositionalSinCos2d, EqualsMaesFormula) {
  for (auto [h, w, dim] : {std::tuple{4, 4, 8}, {3, 5, 16}, {1, 7, 4}, {14, 14, 64}}) {
    const Tensor pe = sinusoidal_positions_2d(h, w, dim, 10000.0, DType::f64);
    ASSERT_EQ(pe.size(0), h * w);
    ASSERT_EQ(pe.size(1), dim);
    const auto want = mae_2d(dim, h, w);
    // The same double operations in the same order: equal to the bit.
    int mismatches = 0;
    for (std::int64_t p = 0; p < h * w; ++p) {
      for (std::int64_t c = 0; c < dim; ++c) mismatches += pe.get({p, c}) != want[p][c];
    }
    EXPECT_EQ(mismatches, 0) << h << "x" << w << " dim " << dim;
    // Other dtypes round the double table once.
    for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
      EXPECT_EQ(max_abs_diff(sinusoidal_positions_2d(h, w, dim, 10000.0, dt), to_dtype(pe, dt)),
                0.0);
    }
  }
}

TEST(PositionalSinCos2d, FirstHalfEncodesTheColumn) {
  // Patch (y = 1, x = 2) of a 3 x 4 grid is patch 1 * 4 + 2 = 6; dim 8 has one
  // frequency 1 and one 10000^(-1/2) per sine and cosine block.
  const Tensor pe = sinusoidal_positions_2d(3, 4, 8, 10000.0, DType::f64);
  const double f = 0.01;
  const double want[] = {std::sin(2.0), std::sin(2 * f), std::cos(2.0), std::cos(2 * f),
                         std::sin(1.0), std::sin(f),     std::cos(1.0), std::cos(f)};
  for (std::int64_t c = 0; c < 8; ++c) EXPECT_NEAR(pe.get({6, c}), want[c], 1e-15) << c;
}

TEST(PositionalSinCos2d, RejectsBadArguments) {
  const auto r = reasons_of([] { sinusoidal_positions_2d(-1, 2, 6, 1.0, DType::boolean); });
  EXPECT_EQ(r.size(), 4u);
  expect_reason(r, "height must be >= 0, got -1");
  expect_reason(r, "dim must be a positive multiple of 4");
  expect_reason(r, "base must be finite and > 1");
  expect_reason(r, "dtype must be f32, f64, f16 or bf16, got bool");
  EXPECT_THROW(sinusoidal_positions_2d(2, 2, 0), Error);
  EXPECT_EQ(sinusoidal_positions_2d(0, 5, 4).size(0), 0);
}

// ---- apply_rope_backward -------------------------------------------------

const RopeConfig kRopes[] = {{},
                             {.interleaved = true},
                             {.base = 500.0, .rotary_dim = 6},
                             {.base = 500.0, .interleaved = true, .rotary_dim = 6}};

std::string describe(const RopeConfig& rope) {
  return std::string(rope.interleaved ? "interleaved" : "half-split") +
         " rotary_dim=" + std::to_string(rope.rotary_dim);
}

TEST(RopeBackward, UndoesTheForwardRotation) {
  const std::int64_t start[] = {0, 1000};
  for (const RopeConfig& rope : kRopes) {
    for (DType dt : {DType::f64, DType::f32}) {
      const Tensor x = random_tensor(dt, {2, 5, 3, 10}, 41);
      Tensor y = x;
      apply_rope(y, start, rope);
      apply_rope_backward(y, start, rope);
      // Both calls use the same angles, so the rotations cancel up to each
      // call's error per element: a * cos - b * sin in double (cos, sin, two
      // products and a sum: at most 4 double ulps of |a| + |b|) and the
      // rounding to dt (u_dt |result|), with |a| + |b| <= 2 max|x|. The
      // rotation back keeps the first error's norm. 2x the sum of both calls.
      const double u = dt == DType::f64 ? std::ldexp(1.0, -53) : std::ldexp(1.0, -24);
      const double tol = 2.0 * 2.0 * (u + 4.0 * std::ldexp(1.0, -53)) * 2.0 * max_abs(x);
      EXPECT_LE(max_abs_diff(y, x), tol) << describe(rope) << " " << dtype_name(dt);
    }
  }
}

double dot(ConstTensorView a, ConstTensorView b) {
  double s = 0.0;
  detail::for_each_index(a.sizes(), a.rank(), [&](const Shape& idx) {
    s += detail::load(a.data(), a.dtype(), detail::offset(idx, a.strides(), a.rank())) *
         detail::load(b.data(), b.dtype(), detail::offset(idx, b.strides(), b.rank()));
  });
  return s;
}

TEST(RopeBackward, IsTheAdjointOfTheRotation) {
  const std::int64_t start[] = {3, 17};
  for (const RopeConfig& rope : kRopes) {
    const Tensor x = random_tensor(DType::f64, {2, 4, 3, 12}, 42);
    const Tensor y = random_tensor(DType::f64, {2, 4, 3, 12}, 43);
    Tensor rx = x, rty = y;
    apply_rope(rx, start, rope);
    apply_rope_backward(rty, start, rope);
    // <R x, y> = <x, R^T y>. Each rotated element carries a few ulps of error
    // (cos, sin, two products, a sum: at most 8u of its pair's magnitude <= 2
    // with |x|, |y| < 1), and each of the n products of the dot an ulp more:
    // |difference| <= 2 n (8 u * 2 + u), doubled.
    const double n = static_cast<double>(x.numel());
    const double tol = 2.0 * 2.0 * n * 17.0 * std::ldexp(1.0, -53);
    EXPECT_NEAR(dot(rx, y), dot(x, rty), tol) << describe(rope);
    // A rotation in the wrong direction would not be the adjoint.
    Tensor ry = y;
    apply_rope(ry, start, rope);
    EXPECT_GT(std::fabs(dot(rx, y) - dot(x, ry)), 1e3 * tol) << describe(rope);
  }
}

TEST(RopeBackward, MatchesFiniteDifferences) {
  const std::int64_t start[] = {5};
  for (const RopeConfig& rope : kRopes) {
    SCOPED_TRACE(describe(rope));
    Tensor x = random_tensor(DType::f64, {1, 3, 2, 10}, 44);
    const Tensor w = random_tensor(DType::f64, {1, 3, 2, 10}, 45);
    Tensor dx = w;  // dL/dy for L = sum(w * y)
    apply_rope_backward(dx, start, rope);
    expect_gradients_match_fd(
        [&] {
          Tensor y = x;
          apply_rope(y, start, rope);
          return y;
        },
        w, {{"x", x.view(), dx.view()}});
  }
}

TEST(RopeBackward, RejectsBadArgumentsNamingGrad) {
  Tensor g = random_tensor(DType::f32, {1, 2, 1, 5}, 46);
  const Tensor before = g;
  const std::int64_t start[] = {0};
  const std::int64_t two[] = {0, 0};
  expect_reason(reasons_of([&] { apply_rope_backward(g, start, {}); }),
                "rope.rotary_dim: 0 rotates the whole head");
  expect_reason(reasons_of([&] { apply_rope_backward(g, two, {.rotary_dim = 4}); }),
                "start_positions: expected one position per sequence (B = 1), got 2");
  TensorView rank3(g.view().data(), DType::f32, {2, 1, 5});
  expect_reason(reasons_of([&] { apply_rope_backward(rank3, start, {}); }),
                "grad: expected rank 4 [B, n, H, D]");
  EXPECT_EQ(max_abs_diff(g, before), 0.0);
}

// ---- alibi_slopes ----------------------------------------------------------

// The ALiBi paper's get_slopes (ofirpress/attention_with_linear_biases):
//   def get_slopes_power_of_2(n):
//       start = 2 ** (-2 ** -(math.log2(n) - 3)); ratio = start
//       return [start * ratio ** i for i in range(n)]
//   if math.log2(n).is_integer(): return get_slopes_power_of_2(n)
//   closest = 2 ** math.floor(math.log2(n))
//   return get_slopes_power_of_2(closest) + get_slopes(2 * closest)[0::2][:n - closest]
std::vector<double> paper_slopes(int n) {
  const auto power_of_2 = [](int m) {
    const double start = std::pow(2.0, -std::pow(2.0, -(std::log2(double(m)) - 3)));
    std::vector<double> s;
    for (int i = 0; i < m; ++i) s.push_back(start * std::pow(start, i));
    return s;
  };
  const double l = std::log2(double(n));
  if (l == std::floor(l)) return power_of_2(n);
  const int closest = 1 << static_cast<int>(std::floor(l));
  std::vector<double> s = power_of_2(closest);
  const std::vector<double> upper = paper_slopes(2 * closest);
  for (int i = 0; i < n - closest; ++i) s.push_back(upper[2 * i]);
  return s;
}

TEST(PositionalAlibi, NonPowerOfTwoHeadCountsFollowThePapersRecipe) {
  for (int n : {6, 12, 20, 8, 1}) {
    const std::vector<float> got = alibi_slopes(n);
    const std::vector<double> want = paper_slopes(n);
    ASSERT_EQ(got.size(), want.size()) << n;
    for (int h = 0; h < n; ++h) {
      // qkv rounds 2^(-8 (i + 1) / m) to float once; the recipe's repeated
      // products in double sit within a few double ulps of that value.
      const double tol = (std::ldexp(1.0, -24) + 1e-14) * want[h];
      EXPECT_NEAR(got[h], want[h], tol) << n << " heads, head " << h;
    }
  }
}

// ---- LearnedPositionalEmbedding -------------------------------------------

TEST(PositionalLearnedEmbedding, AddsTheRowsOfTheirPositions) {
  nn::LearnedPositionalEmbedding pe(10, 6);
  nn::init_uniform(pe.named_parameters(), 3);
  // x [2, 3, 6] read through a transposed view of [3, 2, 6].
  const Tensor base = random_tensor(DType::f32, {3, 2, 6}, 4);
  const ConstTensorView x = base.view().transpose(0, 1);
  const std::int64_t start = 4;
  const Tensor y = pe.forward(x, start);
  ASSERT_EQ(y.dtype(), DType::f32);
  int mismatches = 0;
  for (std::int64_t b = 0; b < 2; ++b) {
    for (std::int64_t n = 0; n < 3; ++n) {
      for (std::int64_t c = 0; c < 6; ++c) {
        // One f32 addition, as the module computes in f32.
        const float want = static_cast<float>(x.get({b, n, c})) +
                           static_cast<float>(pe.weight.value.get({start + n, c}));
        mismatches += y.get({b, n, c}) != want;
      }
    }
  }
  EXPECT_EQ(mismatches, 0);

  // bf16 input and table: widened exactly, added in f32, rounded once.
  nn::LearnedPositionalEmbedding pe16(4, 5, DType::bf16);
  nn::init_uniform(pe16.named_parameters(), 5);
  const Tensor x16 = random_tensor(DType::bf16, {1, 4, 5}, 6);
  const Tensor y16 = pe16.forward(x16);
  ASSERT_EQ(y16.dtype(), DType::bf16);
  for (std::int64_t n = 0; n < 4; ++n) {
    for (std::int64_t c = 0; c < 5; ++c) {
      const float sum = static_cast<float>(x16.get({0, n, c})) +
                        static_cast<float>(pe16.weight.value.get({n, c}));
      EXPECT_EQ(y16.get({0, n, c}), to_float(to_bf16(sum))) << n << " " << c;
    }
  }
}

TEST(PositionalLearnedEmbedding, BackwardMatchesFiniteDifferences) {
  nn::LearnedPositionalEmbedding pe(7, 4, DType::f64);
  nn::init_uniform(pe.named_parameters(), 8);
  Tensor x = random_tensor(DType::f64, {2, 3, 4}, 9);
  const Tensor w = random_tensor(DType::f64, {2, 3, 4}, 10);
  const std::int64_t start = 2;
  const Tensor dx = pe.backward(x, w, start);
  // Rows outside [start, start + 3) get zero gradient, which the finite
  // differences check too.
  expect_gradients_match_fd(
      [&] { return pe.forward(x, start); }, w,
      {{"x", x.view(), dx.view()}, {"weight", pe.weight.value, pe.weight.grad}});
}

TEST(PositionalLearnedEmbedding, GradientsAccumulate) {
  nn::LearnedPositionalEmbedding pe(5, 2);
  const Tensor x = random_tensor(DType::f32, {3, 2, 2}, 11);
  const Tensor dy = random_tensor(DType::f32, {3, 2, 2}, 12);
  const Tensor dx = pe.backward(x, dy, 1);
  EXPECT_EQ(max_abs_diff(dx, dy), 0.0);
  pe.backward(x, dy, 2);
  // Calls at start 1 and 2 cover rows 1-2 and 2-3: row 2 collects both. The
  // f32 gradient adds dy's rows to it one sequence at a time, in order.
  for (std::int64_t c = 0; c < 2; ++c) {
    const auto add_batch = [&](float g, std::int64_t n) {
      for (std::int64_t b = 0; b < 3; ++b) g += static_cast<float>(dy.get({b, n, c}));
      return g;
    };
    EXPECT_EQ(pe.weight.grad.get({0, c}), 0.0);
    EXPECT_EQ(pe.weight.grad.get({1, c}), add_batch(0.0f, 0));
    EXPECT_EQ(pe.weight.grad.get({2, c}), add_batch(add_batch(0.0f, 1), 0));
    EXPECT_EQ(pe.weight.grad.get({3, c}), add_batch(0.0f, 1));
    EXPECT_EQ(pe.weight.grad.get({4, c}), 0.0);
  }
}

TEST(PositionalLearnedEmbedding, RejectsBadArguments) {
  expect_reason(reasons_of([] { nn::LearnedPositionalEmbedding(0, 4); }),
                "max_positions: expected >= 1, got 0");
  EXPECT_EQ(reasons_of([] { nn::LearnedPositionalEmbedding(0, 0, DType::boolean); }).size(), 3u);
  nn::LearnedPositionalEmbedding pe(8, 4);
  const Tensor x = random_tensor(DType::f32, {2, 3, 4}, 13);
  expect_reason(reasons_of([&] { pe.forward(x, 6); }),
                "start: positions start + N = 6 + 3 exceed max_positions = 8");
  expect_reason(reasons_of([&] { pe.forward(x, -1); }), "start: expected a position >= 0, got -1");
  expect_reason(reasons_of([&] {
                  pe.forward(random_tensor(DType::f32, {2, 3, 5}, 14));
                }),
                "x: expected last dimension dim = 4, got [2, 3, 5]");
  expect_reason(reasons_of([&] {
                  pe.forward(random_tensor(DType::f32, {3, 4}, 14));
                }),
                "x: expected rank 3 [B, N, dim]");
  const auto r = reasons_of([&] { pe.backward(x, random_tensor(DType::f32, {2, 2, 4}, 15), 7); });
  EXPECT_EQ(r.size(), 2u);
  expect_reason(r, "dy: expected the sizes of x [2, 3, 4], got [2, 2, 4]");
  EXPECT_FALSE(pe.weight.grad.defined());
}

// ---- RelativePositionBias ---------------------------------------------------

TEST(PositionalRelativeBias, HasT5sParameterLayoutAndName) {
  nn::RelativePositionBias rb(3, 8, 20);
  EXPECT_EQ(rb.weight.value.size(0), 8);  // nn.Embedding(num_buckets, n_heads)
  EXPECT_EQ(rb.weight.value.size(1), 3);
  const nn::NamedParameters ps = rb.named_parameters("encoder.block.0.layer.0.SelfAttention.");
  ASSERT_EQ(ps.size(), 1u);
  EXPECT_EQ(ps[0].name, "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight");

  // A T5 checkpoint's [num_buckets, n_heads] table loads as it is stored.
  const Tensor table = random_tensor(DType::f32, {8, 3}, 16);
  const std::string path = ::testing::TempDir() + "qkv_positional_t5_bias.safetensors";
  nn::save_safetensors(path, {{ps[0].name, table}});
  nn::load_parameters(ps, path);
  EXPECT_EQ(max_abs_diff(rb.weight.value, table), 0.0);

  // options(): the transposed [H, num_buckets] view of the parameter itself.
  const qkv::RelativePositionBias o = rb.options();
  EXPECT_EQ(o.table.data(), rb.weight.value.view().data());
  ASSERT_EQ(o.table.size(0), 3);
  ASSERT_EQ(o.table.size(1), 8);
  for (std::int64_t h = 0; h < 3; ++h) {
    for (std::int64_t k = 0; k < 8; ++k) EXPECT_EQ(o.table.get({h, k}), table.get({k, h}));
  }
  EXPECT_EQ(o.max_distance, 20);
  EXPECT_TRUE(o.bidirectional);
}

TEST(PositionalRelativeBias, DenseBiasFollowsHfComputeBias) {
  // HF T5: relative_position = memory_position - context_position = j - i,
  // bucketed by _relative_position_bucket; values[i, j, h] = weight[bucket, h].
  nn::RelativePositionBias enc(2, 32, 128, true);
  nn::RelativePositionBias dec(2, 32, 128, false);
  for (nn::RelativePositionBias* m : {&enc, &dec}) {
    for (std::int64_t k = 0; k < 32; ++k) {
      for (std::int64_t h = 0; h < 2; ++h) m->weight.value.set({k, h}, 100.0 * h + k);
    }
  }
  const Tensor e = enc.bias(3, 40);
  const Tensor d = dec.bias(3, 40);
  ASSERT_EQ(e.size(0), 2);
  ASSERT_EQ(e.size(1), 3);
  ASSERT_EQ(e.size(2), 40);
  // Encoder (bidirectional, 16 buckets a side, 8 exact): key 1 after query 0
  // is bucket 16 + 1; key 0 one before query 2 is bucket 2; key 39 is 37 after
  // query 2: 16 + 8 + int(log(37 / 8) / log(128 / 8) * 8) = 16 + 8 + 4.
  EXPECT_EQ(e.get({0, 0, 1}), 17.0);
  EXPECT_EQ(e.get({1, 2, 0}), 102.0);
  EXPECT_EQ(e.get({0, 2, 39}), 28.0);
  // Decoder (causal buckets): keys after the query share bucket 0; a key 2
  // before is bucket 2.
  EXPECT_EQ(d.get({0, 0, 39}), 0.0);
  EXPECT_EQ(d.get({1, 2, 0}), 102.0);
  // Every entry is the table at t5_relative_bucket(j - i).
  int mismatches = 0;
  for (std::int64_t h = 0; h < 2; ++h) {
    for (std::int64_t i = 0; i < 3; ++i) {
      for (std::int64_t j = 0; j < 40; ++j) {
        mismatches += e.get({h, i, j}) != 100.0 * h + t5_relative_bucket(j - i, 32, 128, true);
        mismatches += d.get({h, i, j}) != 100.0 * h + t5_relative_bucket(j - i, 32, 128, false);
      }
    }
  }
  EXPECT_EQ(mismatches, 0);
}

AttentionOptions reference_options(Align align) {
  AttentionOptions o;
  o.align = align;
  o.backend = Backend::reference;
  return o;
}

struct AttentionCase {
  std::int64_t nq, nk;
  Align align;
  bool bidirectional;
};

TEST(PositionalRelativeBias, AttentionWithItEqualsAttentionWithItsDenseMask) {
  for (const AttentionCase c :
       {AttentionCase{7, 7, Align::bottom_right, true},
        AttentionCase{7, 7, Align::bottom_right, false}, AttentionCase{3, 9, Align::top_left, true},
        AttentionCase{9, 4, Align::top_left, false}}) {
    SCOPED_TRACE(std::to_string(c.nq) + "x" + std::to_string(c.nk));
    // 8 buckets, 2 exact a side: distances beyond 2 use the log buckets and
    // beyond max_distance 5 saturate.
    nn::RelativePositionBias rb(4, 8, 5, c.bidirectional, DType::f64);
    nn::init_uniform(rb.named_parameters(), 17);
    const Tensor q = random_tensor(DType::f64, {2, c.nq, 4, 8}, 18);
    const Tensor k = random_tensor(DType::f64, {2, c.nk, 2, 8}, 19);
    const Tensor v = random_tensor(DType::f64, {2, c.nk, 2, 5}, 20);
    AttentionOptions with_bias = reference_options(c.align);
    with_bias.relative_bias = rb.options();
    AttentionOptions with_mask = reference_options(c.align);
    const Tensor mask = rb.bias(c.nq, c.nk);  // [H, nq, nk], broadcast over the batch
    with_mask.mask = mask;
    // The reference adds the table entry or the equal mask entry to the same
    // score in double: the results agree to the bit.
    EXPECT_EQ(max_abs_diff(attention(q, k, v, with_bias).out, attention(q, k, v, with_mask).out),
              0.0);
  }
}

TEST(PositionalRelativeBias, BottomRightQueriesUseTheLastRowsOfTheSquareBias) {
  nn::RelativePositionBias rb(2, 8, 5, true, DType::f64);
  nn::init_uniform(rb.named_parameters(), 21);
  const std::int64_t nq = 3, nk = 9;
  const Tensor q = random_tensor(DType::f64, {1, nq, 2, 4}, 22);
  const Tensor k = random_tensor(DType::f64, {1, nk, 2, 4}, 23);
  const Tensor v = random_tensor(DType::f64, {1, nk, 2, 4}, 24);
  AttentionOptions with_bias = reference_options(Align::bottom_right);
  with_bias.relative_bias = rb.options();
  const Tensor square = rb.bias(nk, nk);
  AttentionOptions with_mask = reference_options(Align::bottom_right);
  with_mask.mask = square.view().slice(1, nk - nq, nq);
  EXPECT_EQ(max_abs_diff(attention(q, k, v, with_bias).out, attention(q, k, v, with_mask).out),
            0.0);
}

TEST(PositionalRelativeBias, BackwardAccumulatesTheTransposedTableGradient) {
  nn::RelativePositionBias rb(3, 4);
  // d_table [3, 4] read through a transposed view of [4, 3]: the gradient,
  // shaped like the parameter, is then exactly `base`.
  const Tensor base = random_tensor(DType::f32, {4, 3}, 25);
  rb.backward(base.view().transpose(0, 1));
  ASSERT_EQ(rb.weight.grad.dtype(), DType::f32);
  EXPECT_EQ(max_abs_diff(rb.weight.grad, base), 0.0);
  rb.backward(base.view().transpose(0, 1));
  for (std::int64_t k = 0; k < 4; ++k) {
    for (std::int64_t h = 0; h < 3; ++h) {
      EXPECT_EQ(rb.weight.grad.get({k, h}), 2.0 * base.get({k, h}));
    }
  }
  expect_reason(reasons_of([&] {
                  rb.backward(Tensor(DType::f32, {4, 3}));
                }),
                "d_table: expected [H, num_buckets] = [3, 4], got [4, 3]");
  // f64 gradients after f32 ones need zero_grad first.
  EXPECT_THROW(rb.backward(Tensor(DType::f64, {3, 4})), Error);
}

TEST(PositionalRelativeBias, GradientThroughAttentionMatchesFiniteDifferences) {
  for (bool bidirectional : {true, false}) {
    SCOPED_TRACE(bidirectional ? "bidirectional" : "causal buckets");
    nn::RelativePositionBias rb(2, 8, 5, bidirectional, DType::f64);
    nn::init_uniform(rb.named_parameters(), 26);
    const Tensor q = random_tensor(DType::f64, {2, 5, 2, 4}, 27);
    const Tensor k = random_tensor(DType::f64, {2, 7, 2, 4}, 28);
    const Tensor v = random_tensor(DType::f64, {2, 7, 2, 3}, 29);
    const Tensor w = random_tensor(DType::f64, {2, 5, 2, 3}, 30);
    AttentionOptions o = reference_options(Align::bottom_right);
    o.causal = !bidirectional;
    o.return_lse = true;
    o.relative_bias = rb.options();
    const AttentionResult r = attention(q, k, v, o);
    const AttentionGradients g = attention_backward(q, k, v, r.out, w, r.lse, o);
    rb.backward(g.d_relative_bias);
    // options() is a view of the parameter: perturbing it changes the forward.
    expect_gradients_match_fd(
        [&] { return attention(q, k, v, o).out; }, w,
        {{"relative_attention_bias.weight", rb.weight.value, rb.weight.grad}});
  }
}

TEST(PositionalRelativeBias, RejectsBadArguments) {
  expect_reason(reasons_of([] { nn::RelativePositionBias(0); }), "num_heads: expected >= 1, got 0");
  expect_reason(reasons_of([] { nn::RelativePositionBias(2, 3); }),
                "num_buckets: expected >= 4 (bidirectional), got 3");
  expect_reason(reasons_of([] { nn::RelativePositionBias(2, 32, 8); }),
                "max_distance: expected more than the 8 exact buckets of num_buckets = 32, got 8");
  nn::RelativePositionBias(2, 2, 2, false);  // causal: 1 exact bucket
  EXPECT_EQ(reasons_of([] { nn::RelativePositionBias(0, 1, 0, true, DType::boolean); }).size(), 3u);
  nn::RelativePositionBias rb(2);
  expect_reason(reasons_of([&] { rb.bias(-1, 2); }), "nq: expected >= 0, got -1");
  // Attention checks the table against q's heads.
  const Tensor q = random_tensor(DType::f32, {1, 2, 3, 4}, 31);
  AttentionOptions o;
  o.relative_bias = rb.options();
  EXPECT_THROW(attention(q, q, q, o), Error);
}

}  // namespace
}  // namespace qkv::test
