// Decode attention against a KvCache: token-by-token decoding equals one
// causal forward over the whole sequence (the tolerance policy of
// docs/numerics.md), paged and contiguous caches agree bitwise, 16-bit
// caches stay within the error that rounding K and V causes, and results do
// not depend on the thread count.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "api/validate.hpp"
#include "cpu/flash.hpp"
#include "hwy/targets.h"
#include "reference/attention.hpp"
#include "test_util.hpp"

namespace {

using qkv::AttentionOptions;
using qkv::ConstTensorView;
using qkv::DType;
using qkv::KvCache;
using qkv::KvCacheConfig;
using qkv::Tensor;
using qkv::test::max_abs;
using qkv::test::max_abs_diff;
using qkv::test::random_tensor;
using qkv::test::unit_roundoff;

struct Sequence {
  Tensor q, k, v;  // [B, T, Hq, Dk], [B, T, Hkv, Dk], [B, T, Hkv, Dv]
};

Sequence make_sequence(std::int64_t b, std::int64_t t, std::int64_t hq, std::int64_t hkv,
                       std::int64_t dk, std::int64_t dv, std::uint32_t seed) {
  return {random_tensor(DType::f32, {b, t, hq, dk}, seed, -1.5, 1.5),
          random_tensor(DType::f32, {b, t, hkv, dk}, seed + 1, -1.5, 1.5),
          random_tensor(DType::f32, {b, t, hkv, dv}, seed + 2, -1.0, 1.0)};
}

// Decodes the whole sequence `step` tokens at a time (appending each step's
// keys and values first) and returns the outputs [B, T, Hq, Dv].
Tensor decode_all(const Sequence& s, KvCache& cache, std::int64_t step,
                  const AttentionOptions& opt) {
  const std::int64_t t_total = s.q.size(1);
  Tensor out(DType::f32, {s.q.size(0), t_total, s.q.size(2), s.v.size(3)});
  for (std::int64_t t = 0; t < t_total; t += step) {
    const std::int64_t n = std::min(step, t_total - t);
    cache.append(s.k.view().slice(1, t, n), s.v.view().slice(1, t, n));
    qkv::decode_attention_into(s.q.view().slice(1, t, n), cache, out.view().slice(1, t, n), {},
                               opt);
  }
  return out;
}

// The tolerance policy against one causal forward over the whole sequence.
void expect_matches_forward(const Sequence& s, const Tensor& decoded, AttentionOptions opt,
                            const std::string& label) {
  opt.causal = true;
  opt.align = qkv::Align::bottom_right;
  AttentionOptions ref_opt = opt;
  ref_opt.backend = qkv::Backend::reference;
  const auto ref = qkv::attention(qkv::to_dtype(s.q, DType::f64), qkv::to_dtype(s.k, DType::f64),
                                  qkv::to_dtype(s.v, DType::f64), ref_opt);
  const qkv::detail::AttentionProblem problem =
      qkv::detail::check_attention_inputs(s.q, s.k, s.v, opt);
  Tensor naive(DType::f32, decoded.view().size_span());
  qkv::reference::naive_attention(problem, s.q, s.k, s.v, {naive, {}, {}}, ref_opt, DType::f32);
  const double err = max_abs_diff(decoded, ref.out);
  const double err_naive = max_abs_diff(naive, ref.out);
  const double floor = unit_roundoff(DType::f32) * max_abs(ref.out);
  EXPECT_LE(err, 2 * err_naive + floor)
      << label << ": decode error " << err << ", naive " << err_naive << ", floor " << floor;
}

KvCacheConfig config_for(const Sequence& s, DType dtype, std::int64_t page_size) {
  KvCacheConfig c;
  c.batch = s.q.size(0);
  c.kv_heads = s.k.size(2);
  c.head_dim = s.k.size(3);
  c.value_dim = s.v.size(3);
  c.capacity = s.q.size(1);
  c.dtype = dtype;
  c.page_size = page_size;
  return c;
}

TEST(Decode, TokenByTokenEqualsCausalForward) {
  const Sequence s = make_sequence(2, 70, 8, 2, 64, 48, 1);
  for (const std::int64_t step : {1, 3, 16}) {
    KvCache cache(config_for(s, DType::f32, 0));
    const Tensor out = decode_all(s, cache, step, {});
    expect_matches_forward(s, out, {}, "step " + std::to_string(step));
  }
}

// The kernel scores two keys against four query rows at a time and adds
// P V in tiles of four rows by two vectors: shapes around those tiles
// (rows per KV head 1..6 and 9, Dk and Dv around the vector width, an odd
// number of keys past a block of 32).
TEST(Decode, ShapesAroundTheTiles) {
  struct Shape {
    std::int64_t hq, hkv, dk, dv, step;
  };
  const Shape shapes[] = {{1, 1, 1, 1, 1},  {3, 1, 7, 15, 1},  {5, 1, 8, 16, 1},
                          {6, 2, 9, 17, 2}, {4, 4, 17, 33, 1}, {9, 3, 128, 40, 2},
                          {2, 1, 64, 8, 3}, {12, 4, 24, 64, 3}};
  std::uint32_t seed = 200;
  for (const Shape& shape : shapes) {
    const Sequence s = make_sequence(1, 37, shape.hq, shape.hkv, shape.dk, shape.dv, seed += 3);
    KvCache cache(config_for(s, DType::f32, 0));
    expect_matches_forward(s, decode_all(s, cache, shape.step, {}), {},
                           "Hq " + std::to_string(shape.hq) + " Hkv " + std::to_string(shape.hkv) +
                               " Dk " + std::to_string(shape.dk) + " Dv " +
                               std::to_string(shape.dv) + " step " + std::to_string(shape.step));
  }
}

TEST(Decode, OptionsMatchTheForward) {
  const Sequence s = make_sequence(1, 45, 4, 1, 32, 32, 11);
  const std::vector<float> slopes = qkv::alibi_slopes(4);
  std::vector<std::pair<std::string, AttentionOptions>> cases;
  AttentionOptions window;
  window.window_left = 7;
  cases.emplace_back("window", window);
  AttentionOptions alibi;
  alibi.alibi_slopes = slopes;
  cases.emplace_back("alibi", alibi);
  AttentionOptions capped;
  capped.softcap = 1.2;
  capped.scale = 0.9;
  cases.emplace_back("softcap and scale", capped);
  // Patterns of positions (decode's queries are causal; these cut further).
  for (const qkv::SparsePattern& pattern :
       {qkv::SparsePattern::window(5, 0) | qkv::SparsePattern::global_tokens({0, 3}),
        qkv::SparsePattern::strided(4), qkv::SparsePattern::fixed(8, 2),
        qkv::SparsePattern::dilated_window(12, 0, 3), qkv::SparsePattern::prefix_lm(10)}) {
    AttentionOptions sparse;
    sparse.sparse = pattern;
    cases.emplace_back(pattern.describe(), sparse);
  }
  AttentionOptions sparse_alibi;
  sparse_alibi.sparse = qkv::SparsePattern::window(6, 0) | qkv::SparsePattern::prefix(2);
  sparse_alibi.alibi_slopes = slopes;
  sparse_alibi.window_left = 20;
  cases.emplace_back("pattern, ALiBi and a window", sparse_alibi);
  for (const auto& [name, opt] : cases) {
    KvCache cache(config_for(s, DType::f32, 0));
    expect_matches_forward(s, decode_all(s, cache, 2, opt), opt, name);
  }
}

// Sequences of different lengths in one batch: each row sees its own keys.
TEST(Decode, SequencesOfDifferentLengths) {
  const Sequence s = make_sequence(3, 40, 4, 2, 16, 16, 21);
  KvCache cache(config_for(s, DType::f32, 8));
  const std::int64_t counts[] = {40, 25, 9};
  cache.append(s.k, s.v, counts);
  const Tensor q = random_tensor(DType::f32, {3, 1, 4, 16}, 22);
  const auto fast = qkv::decode_attention(q, cache);
  AttentionOptions ref;
  ref.backend = qkv::Backend::reference;
  const auto slow = qkv::decode_attention(q, cache, ref);
  EXPECT_LE(max_abs_diff(fast.out, slow.out), 64 * unit_roundoff(DType::f32));
  // Sequence 2 against a forward over its 9 keys alone.
  AttentionOptions causal;
  causal.causal = true;
  causal.backend = qkv::Backend::reference;
  const auto alone =
      qkv::attention(q.view().slice(0, 2, 1), s.k.view().slice(0, 2, 1).slice(1, 0, 9),
                     s.v.view().slice(0, 2, 1).slice(1, 0, 9), causal);
  EXPECT_LE(max_abs_diff(fast.out.view().slice(0, 2, 1), alone.out),
            64 * unit_roundoff(DType::f32));
}

// Pages smaller than the kernel's 32-key blocks (several pages per block),
// a divisor of it, and pages that end inside a block.
TEST(Decode, PagedAndContiguousAgreeBitwise) {
  const Sequence s = make_sequence(2, 300, 8, 2, 64, 64, 31);
  KvCache contiguous(config_for(s, DType::f32, 0));
  const Tensor a = decode_all(s, contiguous, 5, {});
  for (const std::int64_t page : {5, 16, 100}) {
    KvCache paged(config_for(s, DType::f32, page));
    const Tensor b = decode_all(s, paged, 5, {});
    EXPECT_EQ(max_abs_diff(a, b), 0.0) << "page size " << page;
  }
}

// A 16-bit cache changes the result only by the rounding of K and V: with
// |dv| <= u |v| and every score off by at most d = u * scale * max_i ||q_i||_1
// * max|k|, each weight moves by a factor within e^(+-2d), so
// |out16 - out32| <= (u + 2 d + O(d^2)) max|v|.
TEST(Decode, SixteenBitCachesWithinInputRounding) {
  const Sequence s = make_sequence(1, 600, 8, 2, 64, 64, 41);
  KvCache f32(config_for(s, DType::f32, 0));
  const Tensor exact = decode_all(s, f32, 4, {});
  double q_l1 = 0.0;
  for (std::int64_t t = 0; t < 600; ++t)
    for (std::int64_t h = 0; h < 8; ++h) {
      double sum = 0.0;
      for (std::int64_t c = 0; c < 64; ++c) sum += std::fabs(s.q.get({0, t, h, c}));
      q_l1 = std::max(q_l1, sum);
    }
  for (const DType dtype : {DType::f16, DType::bf16}) {
    KvCache half(config_for(s, dtype, 0));
    const Tensor out = decode_all(s, half, 4, {});
    const double u = unit_roundoff(dtype);
    const double delta = u * q_l1 * max_abs(s.k) / 8.0;  // scale 1/sqrt(64)
    const double bound = (u + 2 * delta) * 1.1 * max_abs(s.v);
    EXPECT_LE(max_abs_diff(out, exact), bound) << qkv::dtype_name(dtype);
    EXPECT_GT(max_abs_diff(out, exact), 0.0) << "a 16-bit cache should round something";
  }
}

TEST(Decode, BitwiseIdenticalForAnyThreadCount) {
  // One sequence and one KV head: the keys are split across work items.
  const Sequence s = make_sequence(1, 3000, 4, 1, 64, 64, 51);
  KvCache cache(config_for(s, DType::f16, 64));
  cache.append(s.k, s.v);
  const Tensor q = random_tensor(DType::f32, {1, 2, 4, 64}, 52);
  const int saved = omp_get_max_threads();
  std::vector<Tensor> outs;
  for (int threads : {1, 2, 3, 4}) {
    omp_set_num_threads(threads);
    outs.push_back(qkv::decode_attention(q, cache).out);
  }
  omp_set_num_threads(saved);
  for (std::size_t i = 1; i < outs.size(); ++i) {
    EXPECT_EQ(std::memcmp(outs[0].data<float>(), outs[i].data<float>(),
                          sizeof(float) * static_cast<std::size_t>(outs[0].numel())),
              0);
  }
  AttentionOptions ref;
  ref.backend = qkv::Backend::reference;
  ref.return_lse = true;
  const auto slow = qkv::decode_attention(q, cache, ref);
  AttentionOptions with_lse;
  with_lse.return_lse = true;
  const auto fast = qkv::decode_attention(q, cache, with_lse);
  EXPECT_LE(max_abs_diff(fast.out, slow.out), 1e-5);
  EXPECT_LE(max_abs_diff(fast.lse, slow.lse), 1e-5);
}

TEST(Decode, EveryHighwayTargetThisCpuRuns) {
  const Sequence s = make_sequence(1, 50, 4, 2, 36, 20, 61);
  std::vector<std::string> ran;
  for (const std::int64_t target : hwy::SupportedAndGeneratedTargets()) {
    hwy::SetSupportedTargetsForTest(target);
    ran.push_back(qkv::cpu::flash_target());
    KvCache cache(config_for(s, DType::f32, 0));
    expect_matches_forward(s, decode_all(s, cache, 3, {}), {}, ran.back());
  }
  hwy::SetSupportedTargetsForTest(0);
  EXPECT_GE(ran.size(), 2u);
}

TEST(Decode, BadInputThrowsNamingTheProblem) {
  const Sequence s = make_sequence(1, 20, 4, 2, 16, 16, 71);
  KvCache cache(config_for(s, DType::f32, 0));
  cache.append(s.k.view().slice(1, 0, 2), s.v.view().slice(1, 0, 2));
  auto message = [&](ConstTensorView q, const AttentionOptions& o) -> std::string {
    try {
      qkv::decode_attention(q, cache, o);
    } catch (const qkv::Error& e) {
      return e.what();
    }
    return "";
  };
  const Tensor q3 = random_tensor(DType::f32, {1, 3, 4, 16}, 72);
  EXPECT_NE(message(q3, {}).find("holds 2 tokens, fewer than the 3 new queries"),
            std::string::npos);
  const Tensor q17 = random_tensor(DType::f32, {1, 17, 4, 16}, 73);
  EXPECT_NE(message(q17, {}).find("expected 1 to 16 new tokens"), std::string::npos);
  const Tensor q_heads = random_tensor(DType::f32, {1, 1, 3, 16}, 74);
  EXPECT_NE(message(q_heads, {}).find("multiple of the cache's KV heads 2"), std::string::npos);
  AttentionOptions masked;
  const Tensor mask(DType::boolean, {1, 1});
  masked.mask = mask;
  const Tensor q1 = random_tensor(DType::f32, {1, 1, 4, 16}, 75);
  EXPECT_NE(message(q1, masked).find("options.mask: not supported"), std::string::npos);
  AttentionOptions layout;
  layout.sparse = qkv::SparsePattern::block_sparse({1, 1, 1, 32, {1}});
  EXPECT_NE(message(q1, layout).find("options.sparse: block layouts index query rows"),
            std::string::npos);
}

}  // namespace
