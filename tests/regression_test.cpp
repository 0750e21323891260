// Reproductions of defects that fuzzing and an independent float64 check
// found (docs/reliability.md lists them), one test each: crashes, silent
// wrong results, the wrong kind of error and undefined behaviour. Each test
// is the smallest input that showed the defect; all of them failed before
// the fix that names them.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <limits>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "attention_checks.hpp"
#include "qkv/modules/positional.hpp"
#include "qkv/modules/safetensors.hpp"
#include "qkv/modules/vision.hpp"
#include "qkv/qkv.hpp"
#include "test_util.hpp"

namespace {

using qkv::AttentionOptions;
using qkv::Backend;
using qkv::ConstTensorView;
using qkv::DType;
using qkv::Tensor;
using qkv::TensorView;
using qkv::test::max_abs_diff;
using qkv::test::random_tensor;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();

// The qkv::Error message of f(), or "" when it does not throw one (any other
// exception fails the test).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const qkv::Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw " << typeid(e).name() << " instead of qkv::Error: " << e.what();
    return "(not a qkv::Error)";
  }
  return "";
}

struct Qkv {
  Tensor q, k, v;
};
Qkv inputs(std::int64_t nq, std::int64_t nk, std::int64_t h = 1, std::int64_t d = 4,
           std::uint32_t seed = 1) {
  return {random_tensor(DType::f32, {1, nq, h, d}, seed),
          random_tensor(DType::f32, {1, nk, h, d}, seed + 1),
          random_tensor(DType::f32, {1, nk, h, d}, seed + 2)};
}

// Runs both backends; returns {fast, reference} (with lse).
std::pair<qkv::AttentionResult, qkv::AttentionResult> both(const Qkv& x, AttentionOptions o) {
  o.return_lse = true;
  o.backend = Backend::fast;
  qkv::AttentionResult fast = qkv::attention(x.q, x.k, x.v, o);
  o.backend = Backend::reference;
  qkv::AttentionResult ref = qkv::attention(x.q, x.k, x.v, o);
  return {std::move(fast), std::move(ref)};
}

// ---- crashes ------------------------------------------------------------

// Defect 1: heads * q_blocks * k_blocks wrapped to 0, so an empty `bits` was
// accepted and attention read past it.
TEST(Regression, BlockSparseLayoutSizeOverflowIsAnError) {
  const std::string message = error_of([] {
    qkv::SparsePattern::block_sparse({1, std::int64_t{1} << 32, std::int64_t{1} << 32, 1, {}});
  });
  EXPECT_NE(message.find("overflows"), std::string::npos) << message;
}

// Defect 2: a dilation near INT64_MAX overflowed in the pattern arithmetic
// and in the per-residue strided views, then attention crashed.
TEST(Regression, HugeDilationRunsLikeTheReference) {
  const Qkv x = inputs(9, 9);
  AttentionOptions o;
  o.sparse = qkv::SparsePattern::dilated_window(0, 0, kMax - 1);
  const auto [fast, ref] = both(x, o);
  EXPECT_LE(max_abs_diff(fast.out, ref.out), 1e-6);
  o.sparse = qkv::SparsePattern::dilated_window(kMax / 2, kMax / 2, kMax - 1) |
             qkv::SparsePattern::strided(kMax) | qkv::SparsePattern::fixed(kMax, kMax);
  o.causal = true;
  const auto [fast2, ref2] = both(x, o);
  EXPECT_LE(max_abs_diff(fast2.out, ref2.out), 1e-6);
}

// Defect 3: an additive score of attention size A = 0 was accepted and the
// fast kernel read through a null pointer.
TEST(Regression, AdditiveScoreWithNoAttentionUnitsIsAnError) {
  const Qkv x = inputs(3, 3);
  const Tensor w_q(DType::f32, {0, 4}), w_k(DType::f32, {0, 4}), v(DType::f32, {0});
  AttentionOptions o;
  o.score = qkv::Score::additive;
  o.additive = {w_q, w_k, v, {}};
  for (Backend b : {Backend::fast, Backend::reference, Backend::automatic}) {
    o.backend = b;
    const std::string message = error_of([&] { qkv::attention(x.q, x.k, x.v, o); });
    EXPECT_NE(message.find("options.additive.w_q: expected attention size"), std::string::npos)
        << message;
  }
}

qkv::KvCache small_cache() {
  qkv::KvCache cache({1, 1, 4, 0, 8, DType::f32, 0, 0});
  const Tensor k = random_tensor(DType::f32, {1, 3, 1, 4}, 4);
  cache.append(k, k);
  return cache;
}

// Defect 4: decode never checked q's and out's memory.
TEST(Regression, DecodeChecksTheMemoryOfQAndOut) {
  const qkv::KvCache cache = small_cache();
  Tensor q = random_tensor(DType::f32, {1, 1, 1, 4}, 5);
  Tensor out(DType::f32, {1, 1, 1, 4});
  for (Backend b : {Backend::fast, Backend::reference}) {
    AttentionOptions o;
    o.backend = b;
    const TensorView null_out(nullptr, DType::f32, {1, 1, 1, 4});
    const ConstTensorView null_q(nullptr, DType::f32, {1, 1, 1, 4});
    EXPECT_NE(error_of([&] {
                qkv::decode_attention_into(q, cache, null_out, {}, o);
              }).find("out: data is null"),
              std::string::npos);
    EXPECT_NE(error_of([&] {
                qkv::decode_attention_into(null_q, cache, out, {}, o);
              }).find("q: data is null"),
              std::string::npos);
    EXPECT_NE(error_of([&] { qkv::decode_attention(null_q, cache, o); }).find("q: data is null"),
              std::string::npos);
    // An extent past int64.
    const ConstTensorView huge_q(q.view().data(), DType::f32, {1, 1, 1, 4}, {1, 1, 1, kMax / 2});
    EXPECT_NE(error_of([&] {
                qkv::decode_attention_into(huge_q, cache, out, {}, o);
              }).find("overflow int64"),
              std::string::npos);
    // out aliasing q, and an out whose elements overlap (stride 0).
    EXPECT_NE(error_of([&] {
                qkv::decode_attention_into(q, cache, q, {}, o);
              }).find("out: memory overlaps q"),
              std::string::npos);
    const TensorView stride0(out.view().data(), DType::f32, {1, 1, 1, 4}, {4, 4, 4, 0});
    EXPECT_NE(error_of([&] {
                qkv::decode_attention_into(q, cache, stride0, {}, o);
              }).find("out: has overlapping elements"),
              std::string::npos);
  }
}

std::string temp_file(const std::string& name, const std::string& bytes) {
  const std::string path = ::testing::TempDir() + "qkv_regression_" + name;
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  file.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  return path;
}

std::string safetensors_bytes(const std::string& header) {
  std::string length(8, '\0');
  for (int i = 0; i < 8; ++i) length[i] = static_cast<char>(header.size() >> (8 * i));
  return length + header;
}

// Defect 5: formatting the error for a deeply nested "shape" recursed once
// per level and overflowed the stack.
TEST(Regression, DeeplyNestedSafetensorsShapeIsAnError) {
  constexpr int kDepth = 100000;
  const std::string header = "{\"t\":{\"dtype\":\"F32\",\"shape\":" + std::string(kDepth, '[') +
                             std::string(kDepth, ']') + ",\"data_offsets\":[0,0]}}";
  const std::string path = temp_file("nested.safetensors", safetensors_bytes(header));
  const std::string message = error_of([&] { qkv::nn::load_safetensors(path); });
  EXPECT_NE(message.find("tensor \"t\": \"shape\": expected non-negative integer sizes"),
            std::string::npos)
      << message.substr(0, 300);
  EXPECT_LT(message.size(), 1000u);
  std::remove(path.c_str());
}

// ---- silent wrong results -----------------------------------------------

// Defect 6: pos - window_left overflowed in the fast path's tile
// classification (and in the reference), giving rows of 0.
TEST(Regression, HugeWindowMatchesTheReference) {
  const Qkv x = inputs(7, 3);
  for (std::int64_t left : {kMax, kMax - 1, kMax / 2}) {
    for (std::int64_t right : {std::int64_t{-1}, std::int64_t{0}, kMax}) {
      AttentionOptions o;
      o.window_left = left;
      o.window_right = right;
      const auto [fast, ref] = both(x, o);
      EXPECT_LE(max_abs_diff(fast.out, ref.out), 1e-6) << left << ", " << right;
      int mismatches = 0;
      EXPECT_LE(qkv::test::finite_diff(fast.lse, ref.lse, &mismatches), 1e-5);
      EXPECT_EQ(mismatches, 0) << left << ", " << right;
    }
  }
}

// Defect 7: a softcap beyond the f32 range (or whose inverse is) was
// accepted; the fast kernels then computed inf * 0.
TEST(Regression, SoftcapOutsideTheF32RangeIsAnError) {
  const Qkv x = inputs(2, 2);
  const qkv::KvCache cache = small_cache();
  const Tensor q = random_tensor(DType::f32, {1, 1, 1, 4}, 5);
  for (double cap : {1e39, 1e-46, 1e-40, 3.5e38}) {
    AttentionOptions o;
    o.softcap = cap;
    EXPECT_NE(error_of([&] { qkv::attention(x.q, x.k, x.v, o); }).find("options.softcap"),
              std::string::npos)
        << cap;
    EXPECT_NE(error_of([&] { qkv::decode_attention(q, cache, o); }).find("options.softcap"),
              std::string::npos)
        << cap;
  }
  for (double cap : {1e37, 1e-37}) {  // in range: both backends agree
    AttentionOptions o;
    o.softcap = cap;
    const auto [fast, ref] = both(x, o);
    EXPECT_LE(max_abs_diff(fast.out, ref.out), 1e-6) << cap;
  }
}

// Defect 8: an infinity in a value row that a row never admits reached the
// row through 0 * inf on the fast path.
TEST(Regression, NonFiniteValuesOfDroppedKeysDoNotReachTheRow) {
  Qkv x = inputs(5, 5);
  x.v.set({0, 4, 0, 1}, kInf);
  x.v.set({0, 3, 0, 2}, kNaN);
  AttentionOptions causal;
  causal.causal = true;
  const auto [fast, ref] = both(x, causal);
  for (std::int64_t i = 0; i < 3; ++i) {
    for (std::int64_t c = 0; c < 4; ++c) {
      EXPECT_TRUE(std::isfinite(fast.out.get({0, i, 0, c}))) << i << ", " << c;
      EXPECT_NEAR(fast.out.get({0, i, 0, c}), ref.out.get({0, i, 0, c}), 1e-6);
    }
  }
  // A bool mask that drops every key of row 1.
  Tensor mask(DType::boolean, {5, 5});
  for (std::int64_t i = 0; i < 5; ++i) {
    for (std::int64_t j = 0; j < 5; ++j) mask.set({i, j}, i != 1 && j <= 2);
  }
  AttentionOptions masked;
  masked.mask = mask;
  const auto [fast2, ref2] = both(x, masked);
  EXPECT_FALSE(qkv::test::has_non_finite(fast2.out));
  EXPECT_LE(max_abs_diff(fast2.out, ref2.out), 1e-6);
  EXPECT_EQ(fast2.lse.get({0, 0, 1}), -kInf);

  // The backward: rows and keys that never meet contribute nothing.
  for (Backend b : {Backend::fast, Backend::reference}) {
    masked.backend = b;
    masked.return_lse = true;
    const qkv::AttentionResult f = qkv::attention(x.q, x.k, x.v, masked);
    Tensor dout = random_tensor(DType::f32, {1, 5, 1, 4}, 9);
    const qkv::AttentionGradients g =
        qkv::attention_backward(x.q, x.k, x.v, f.out, dout, f.lse, masked);
    EXPECT_FALSE(qkv::test::has_non_finite(g.dq)) << static_cast<int>(b);
    EXPECT_FALSE(qkv::test::has_non_finite(g.dk)) << static_cast<int>(b);
    for (std::int64_t j = 0; j < 3; ++j) {
      for (std::int64_t c = 0; c < 4; ++c) EXPECT_TRUE(std::isfinite(g.dv.get({0, j, 0, c})));
    }
  }
}

// Defect 9: with Nq = 0 the fast backward left dk and dv as the caller had
// them; outputs are overwritten.
TEST(Regression, BackwardWithoutQueriesWritesZeroGradients) {
  const Qkv x = inputs(0, 3);
  const Tensor out(DType::f32, {1, 0, 1, 4}), dout(DType::f32, {1, 0, 1, 4});
  const Tensor lse(DType::f32, {1, 1, 0});
  for (Backend b : {Backend::fast, Backend::reference}) {
    AttentionOptions o;
    o.backend = b;
    Tensor dq(DType::f32, {1, 0, 1, 4});
    Tensor dk = random_tensor(DType::f32, {1, 3, 1, 4}, 3, 1.0, 2.0);
    Tensor dv = random_tensor(DType::f32, {1, 3, 1, 4}, 4, 1.0, 2.0);
    qkv::attention_backward_into(x.q, x.k, x.v, out, dout, lse, {dq, dk, dv}, o);
    EXPECT_EQ(qkv::test::max_abs(dk), 0.0) << static_cast<int>(b);
    EXPECT_EQ(qkv::test::max_abs(dv), 0.0) << static_cast<int>(b);
  }
}

// Defect 10: fast decode accepted options that every other path rejects.
TEST(Regression, DecodeRejectsWhatAttentionRejects) {
  const qkv::KvCache cache = small_cache();
  const Tensor q = random_tensor(DType::f32, {1, 1, 1, 4}, 5);
  const std::vector<std::pair<std::string, AttentionOptions>> cases = [] {
    std::vector<std::pair<std::string, AttentionOptions>> c;
    AttentionOptions o;
    o.scale = kNaN;
    c.emplace_back("options.scale", o);
    o = {};
    o.softcap = kInf;
    c.emplace_back("options.softcap", o);
    o = {};
    static const float nan_slope[] = {std::numeric_limits<float>::quiet_NaN()};
    o.alibi_slopes = nan_slope;
    c.emplace_back("options.alibi_slopes[0]", o);
    o = {};
    o.score = static_cast<qkv::Score>(7);
    c.emplace_back("options.score", o);
    o = {};
    o.align = static_cast<qkv::Align>(9);
    c.emplace_back("options.align", o);
    o = {};
    o.score = qkv::Score::dot;
    o.scale = 0.5;
    c.emplace_back("options.scale", o);
    return c;
  }();
  for (const auto& [name, options] : cases) {
    for (Backend b : {Backend::fast, Backend::reference, Backend::automatic}) {
      AttentionOptions o = options;
      o.backend = b;
      EXPECT_NE(error_of([&] { qkv::decode_attention(q, cache, o); }).find(name), std::string::npos)
          << name;
    }
  }
  AttentionOptions bad_backend;
  bad_backend.backend = static_cast<Backend>(5);
  EXPECT_NE(error_of([&] { qkv::decode_attention(q, cache, bad_backend); }).find("options.backend"),
            std::string::npos);
}

// Defect 11: fast probabilities were exp(s - lse) with lse rounded to f32,
// so a row summed to 1 + 2^-11 in this example.
TEST(Regression, FastProbabilitiesAreNormalized) {
  const float q[] = {1.0f};
  const float k[] = {16000.0f, 15992.375f};
  const float v[] = {1.0f, 0.0f};
  AttentionOptions o;
  o.score = qkv::Score::dot;
  o.return_probs = true;
  o.backend = Backend::fast;
  const qkv::AttentionResult r =
      qkv::attention(ConstTensorView(q, {1, 1, 1, 1}), ConstTensorView(k, {1, 2, 1, 1}),
                     ConstTensorView(v, {1, 2, 1, 1}), o);
  const double p1 = 1.0 / (1.0 + std::exp(-7.625));
  EXPECT_NEAR(r.probs.get({0, 0, 0, 0}), p1, 4e-7);
  EXPECT_NEAR(r.probs.get({0, 0, 0, 1}), 1.0 - p1, 4e-7 * (1.0 - p1) + 1e-12);
}

// Defect 12: the reference backward rebuilt the weights as exp(s - lse) from
// the caller's f32 lse, half an ulp of |lse| off in the exponent.
TEST(Regression, ReferenceBackwardRecomputesItsLogsumexp) {
  const float q[] = {1.0f};
  const float k[] = {16000.0005f};
  const float v[] = {1.0f};
  const float dout[] = {1.0f};
  AttentionOptions o;
  o.score = qkv::Score::dot;
  o.return_lse = true;
  const ConstTensorView qv(q, {1, 1, 1, 1}), kv(k, {1, 1, 1, 1}), vv(v, {1, 1, 1, 1});
  for (Backend b : {Backend::reference, Backend::fast}) {
    o.backend = b;
    const qkv::AttentionResult f = qkv::attention(qv, kv, vv, o);
    const qkv::AttentionGradients g =
        qkv::attention_backward(qv, kv, vv, f.out, ConstTensorView(dout, {1, 1, 1, 1}), f.lse, o);
    EXPECT_EQ(g.dv.get({0, 0, 0, 0}), 1.0) << static_cast<int>(b);
  }
  // The additive score, on its fast backward (automatic) and the reference.
  const float w_q[] = {1.0f}, w_k[] = {0.0f}, v_a[] = {5000.0f}, q_a[] = {0.3f}, k_a[] = {0.0f};
  AttentionOptions a;
  a.score = qkv::Score::additive;
  a.additive = {
      ConstTensorView(w_q, {1, 1}), ConstTensorView(w_k, {1, 1}), ConstTensorView(v_a, {1}), {}};
  a.return_lse = true;
  const ConstTensorView qa(q_a, {1, 1, 1, 1}), ka(k_a, {1, 1, 1, 1});
  for (Backend b : {Backend::automatic, Backend::reference}) {
    a.backend = b;
    const qkv::AttentionResult f = qkv::attention(qa, ka, vv, a);
    const qkv::AttentionGradients g =
        qkv::attention_backward(qa, ka, vv, f.out, ConstTensorView(dout, {1, 1, 1, 1}), f.lse, a);
    EXPECT_EQ(g.dv.get({0, 0, 0, 0}), 1.0) << static_cast<int>(b);
  }
}

// ---- the wrong kind of error, undefined behaviour -------------------------

// Found by fuzz_modules: a DType cast from an integer out of the enum's
// range was "floating" and 0 bytes wide, so a module allocated a 64-byte
// parameter of [1, 2^63 - 1] elements.
TEST(Regression, OutOfRangeDTypeIsAnError) {
  const auto bad = static_cast<DType>(6);
  EXPECT_FALSE(qkv::is_floating(bad));
  EXPECT_NE(error_of([&] { Tensor(bad, {2}); }), "");
  float x = 0;
  EXPECT_NE(error_of([&] { ConstTensorView(&x, bad, {1}); }), "");
  EXPECT_NE(error_of([&] { qkv::nn::LearnedPositionalEmbedding(1, kMax, bad); }), "");
}

// Found by fuzz_modules: RelativePositionBias::bias(2^62, 0) visited 2^62
// empty rows (a hang on valid input).
TEST(Regression, EmptyRelativeBiasReturnsAtOnce) {
  const qkv::nn::RelativePositionBias rpb(2, 8, 16, true);
  const Tensor b = rpb.bias(std::int64_t{1} << 62, 0);
  EXPECT_EQ(b.size(1), std::int64_t{1} << 62);
  EXPECT_EQ(b.numel(), 0);
}

// An ImageLayout cast from an integer out of range was read as nchw.
TEST(Regression, OutOfRangeImageLayoutIsAnError) {
  const qkv::nn::SqueezeExcitation se(8);
  const Tensor x = random_tensor(DType::f32, {1, 8, 2, 2}, 3);
  EXPECT_NE(error_of([&] {
              se.forward(x, static_cast<qkv::nn::ImageLayout>(7));
            }).find("layout: expected ImageLayout::nchw or ImageLayout::nhwc, got value 7"),
            std::string::npos);
}

// Found by fuzz_linear (UBSan): with a custom map, D = 0 is valid, and q and
// k are then empty views that may have null data; the causal kernel's row
// prefetch offset their null pointers.
TEST(Regression, CustomMapOverEmptyRowsMatchesTheReference) {
  qkv::LinearAttentionOptions o;
  o.causal = true;
  o.feature_map = qkv::FeatureMap::custom;
  o.custom.features = 1;
  o.custom.map = [](std::span<const double>, std::span<double> phi) { phi[0] = 1.0; };
  const ConstTensorView q(nullptr, DType::f32, {2, 50, 2, 0}),
      k(nullptr, DType::f32, {2, 50, 2, 0});
  const Tensor v = random_tensor(DType::f32, {2, 50, 2, 3}, 11);
  o.backend = Backend::fast;
  const Tensor fast = qkv::linear_attention(q, k, v, o).out;
  o.backend = Backend::reference;
  const Tensor ref = qkv::linear_attention(q, k, v, o).out;
  // Every weight is 1: row i is the mean of v over keys 0..i.
  EXPECT_LE(max_abs_diff(fast, ref), 1e-6);
}

// Found by fuzz_attention (UBSan): keys or values of head dim 0 with null
// data (valid: empty rows) made the fused forward offset the null pointer
// while packing rows.
TEST(Regression, EmptyHeadsWithoutMemoryMatchTheReference) {
  const ConstTensorView q(nullptr, DType::f32, {1, 20, 2, 0}),
      k(nullptr, DType::f32, {1, 40, 2, 0});
  const Tensor v = random_tensor(DType::f32, {1, 40, 2, 3}, 12);
  qkv::AttentionOptions o;
  o.causal = true;
  o.scale = 1.0;  // the default 1/sqrt(Dk) needs Dk >= 1
  o.backend = Backend::fast;
  const Tensor fast = qkv::attention(q, k, v, o).out;
  o.backend = Backend::reference;
  const Tensor ref = qkv::attention(q, k, v, o).out;
  // Every score is 0: row i is the mean of v over its keys.
  EXPECT_LE(max_abs_diff(fast, ref), 1e-6);
  const ConstTensorView none(nullptr, DType::f32, {1, 40, 2, 0});
  const Tensor q3 = random_tensor(DType::f32, {1, 20, 2, 3}, 13);
  const Tensor k3 = random_tensor(DType::f32, {1, 40, 2, 3}, 14);
  o.backend = Backend::fast;
  const Tensor empty = qkv::attention(q3, k3, none, o).out;
  EXPECT_EQ(empty.size(3), 0);
}

// Found by fuzz_linear (UBSan): the self-overlap check of an output view
// multiplied stride by size in int64 before the memory check had rejected
// an extent past int64.
TEST(Regression, OutputExtentPastInt64IsAnErrorWithoutOverflow) {
  const Tensor x = random_tensor(DType::f32, {3, 1, 1, 3}, 13);
  Tensor storage(DType::f32, {16});
  const TensorView out(storage.view().data(), DType::f32, {3, 1, 1, 3},
                       {std::int64_t{1} << 62, 3, 3, 1});
  EXPECT_NE(error_of([&] { qkv::linear_attention_into(x, x, x, out); }).find("out"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              qkv::attention_into(x, x, x, {out, {}, {}});
            }).find("out"),
            std::string::npos);
}

// Defect 13: std::bad_alloc instead of qkv::Error.
// Found by fuzz_attention (ASan): a BigBird layout of 2^62 blocks fits
// int64 but no memory; a sanitizer's `new` aborts where the system's
// throws, so the layout asks for its memory without throwing first.
TEST(Regression, BigBirdLayoutBeyondMemoryIsAnError) {
  qkv::BigBirdConfig c;
  c.nq = c.nk = std::int64_t{1} << 31;
  c.block_size = 1;
  EXPECT_NE(error_of([&] { qkv::bigbird_layout(c); }).find("does not fit in memory"),
            std::string::npos);
}

TEST(Regression, AbsurdSizesAreErrorsNotBadAlloc) {
  const qkv::KvCache cache = small_cache();
  const Tensor q_storage(DType::f32, {4});
  const ConstTensorView q(q_storage.view().data(), DType::f32, {1, 1, std::int64_t{1} << 40, 4},
                          {0, 0, 0, 1});
  EXPECT_NE(error_of([&] { qkv::decode_attention(q, cache); }), "");
  EXPECT_NE(error_of([] {
              qkv::KvCache({std::int64_t{1} << 40, 1, 4, 0, 1, DType::f32, 0, 0});
            }),
            "");
  // Paged with a pool of one page: the storage is small but the per-sequence
  // lengths exceed what a std::vector can hold (std::length_error, found by
  // fuzz_decode).
  EXPECT_NE(error_of([] {
              qkv::KvCache({std::int64_t{1} << 62, 1, 4, 0, 1, DType::f32, 1, 1});
            }),
            "");
  EXPECT_NE(error_of([] {
              Tensor(DType::f32, {std::int64_t{1} << 40, std::int64_t{1} << 20});
            }),
            "");
}

// Defect 14: numel() overflowed, copy() accepted partially overlapping views
// (and produced all 1s from 1..8), and empty views with null data reached
// memcpy.
TEST(Regression, CopyHandlesOverlapAndEmptyViews) {
  float data[9] = {1, 2, 3, 4, 5, 6, 7, 8, 0};
  const ConstTensorView src(data, {8});
  const TensorView dst(data + 1, {8});
  const std::string message = error_of([&] { qkv::copy(src, dst); });
  EXPECT_NE(message.find("overlap"), std::string::npos) << message;
  EXPECT_EQ(data[8], 0.0f);  // nothing written
  qkv::copy(ConstTensorView(nullptr, DType::f32, {0, 3}), TensorView(nullptr, DType::f32, {0, 3}));
  const ConstTensorView huge(data, DType::f32, {kMax, kMax, 0}, {0, 0, 0});
  EXPECT_EQ(huge.numel(), 0);
  EXPECT_NE(error_of([&] {
              qkv::copy(ConstTensorView(data, DType::f32, {2, 2}, {kMax, 1}),
                        TensorView(data, DType::f32, {2, 2}, {kMax, 1}));
            }),
            "");
}

// Defect 15: the element-count error of a safetensors shape named neither
// the file nor the tensor.
TEST(Regression, SafetensorsShapeOverflowNamesFileAndTensor) {
  const std::string header =
      "{\"big\":{\"dtype\":\"F32\",\"shape\":[0,4611686018427387904,4611686018427387904],"
      "\"data_offsets\":[0,0]}}";
  const std::string path = temp_file("overflow.safetensors", safetensors_bytes(header));
  const std::string message = error_of([&] { qkv::nn::load_safetensors(path); });
  EXPECT_NE(message.find(path + ": tensor \"big\""), std::string::npos) << message;
  std::remove(path.c_str());
}

// Found by an independent float64 check: a NaN in the newest cached key made
// the fused decode return out = 0 and lse = -inf. A key block whose last
// score is NaN leaves the running maximum NaN (the vector maximum returns its
// second operand when one is NaN), and the merge of the key splits took the
// maximum of the splits' maxima with std::max, which skips a NaN, so it read
// the split as empty. A NaN or +inf score makes its row NaN (docs/semantics.md):
// the bad key first, in the middle, last and at the boundary of two key
// splits, contiguous and paged caches of every storage dtype, one and two
// new tokens (the first of two does not see the newest key).
TEST(Regression, NonFiniteCachedKeysMatchTheReference) {
  // Non-finite exactly where the reference is (the same value), near it elsewhere.
  const auto expect_like = [](double got, double want, const std::string& what) {
    if (std::isfinite(want)) {
      EXPECT_NEAR(got, want, 1e-5) << what;
    } else {
      EXPECT_TRUE(std::isnan(want) ? std::isnan(got) : got == want) << what << ": " << got;
    }
  };
  for (const DType dtype : {DType::f32, DType::bf16, DType::f16}) {
    for (const std::int64_t page : {0, 3}) {
      // 1100 keys: two splits of 550 (cpu/decode.cpp, kMinSplitKeys = 512).
      for (const std::int64_t length : {2, 40, 1100}) {
        std::vector<std::int64_t> positions = {0, length / 2, length - 2, length - 1};
        if (length == 1100) positions.insert(positions.end(), {549, 550});
        std::sort(positions.begin(), positions.end());
        positions.erase(std::unique(positions.begin(), positions.end()), positions.end());
        for (const std::int64_t bad : positions) {
          for (const double value : {kNaN, kInf}) {
            Tensor k = random_tensor(DType::f32, {1, length, 1, 4}, 7);
            const Tensor v = random_tensor(DType::f32, {1, length, 1, 4}, 8);
            k.set({0, bad, 0, 1}, value);
            qkv::KvCache cache({1, 1, 4, 4, length, dtype, page, 0});
            cache.append(k, v);
            for (const auto& [n, window] : {std::pair{1, -1}, {2, -1}, {1, 0}, {2, 0}}) {
              const std::string label = std::string(qkv::dtype_name(dtype)) + " page " +
                                        std::to_string(page) + " length " + std::to_string(length) +
                                        " bad key " + std::to_string(bad) + " " +
                                        std::to_string(value) + " n " + std::to_string(n) +
                                        " window " + std::to_string(window);
              const Tensor q = random_tensor(DType::f32, {1, n, 2, 4}, 9);
              AttentionOptions o;
              o.window_left = window;
              o.return_lse = true;
              o.backend = Backend::fast;
              const qkv::AttentionResult fast = qkv::decode_attention(q, cache, o);
              o.backend = Backend::reference;
              const qkv::AttentionResult ref = qkv::decode_attention(q, cache, o);
              for (std::int64_t h = 0; h < 2; ++h) {
                for (std::int64_t t = 0; t < n; ++t) {
                  const std::string row =
                      label + ", head " + std::to_string(h) + " row " + std::to_string(t);
                  expect_like(fast.lse.get({0, h, t}), ref.lse.get({0, h, t}), row + " lse");
                  for (std::int64_t c = 0; c < 4; ++c) {
                    expect_like(fast.out.get({0, t, h, c}), ref.out.get({0, t, h, c}), row);
                  }
                }
              }
            }
          }
        }
      }
    }
  }
  // The case as found: B = 1, one KV head, Dk = 4, the second of two keys NaN.
  Tensor k = random_tensor(DType::f32, {1, 2, 1, 4}, 3);
  k.set({0, 1, 0, 2}, kNaN);
  qkv::KvCache cache({1, 1, 4, 4, 2, DType::f32, 0, 0});
  cache.append(k, random_tensor(DType::f32, {1, 2, 1, 4}, 4));
  AttentionOptions o;
  o.return_lse = true;
  o.backend = Backend::fast;
  const qkv::AttentionResult r =
      qkv::decode_attention(random_tensor(DType::f32, {1, 1, 1, 4}, 5), cache, o);
  EXPECT_TRUE(std::isnan(r.lse.get({0, 0, 0})));
  for (std::int64_t c = 0; c < 4; ++c) EXPECT_TRUE(std::isnan(r.out.get({0, 0, 0, c}))) << c;
}

// Found by an independent check (UBSan, the asan preset): a dimension that
// is never stepped, in an empty view or of size 1, may have any stride
// (validation bounds only the extents of views with elements), yet the
// fused forward and backward turned the row and element strides of q, k and
// v into byte steps up front (PrepareQueries, PackRows), overflowing int64
// for strides of 2^62.
TEST(Regression, StridesThatAreNeverSteppedDoNotOverflow) {
  constexpr std::int64_t kHuge = std::int64_t{1} << 62;
  const auto gradients = [](ConstTensorView q, ConstTensorView k, ConstTensorView v,
                            Backend backend) {
    AttentionOptions o;
    o.backend = backend;
    o.return_lse = true;
    o.scale = 1.0;  // the default 1/sqrt(Dk) needs Dk >= 1
    const qkv::AttentionResult r = qkv::attention(q, k, v, o);
    const Tensor dout = random_tensor(DType::f32, {q.size(0), q.size(1), q.size(2), v.size(3)}, 6);
    return std::pair{r, qkv::attention_backward(q, k, v, r.out, dout, r.lse, o)};
  };
  // No query heads: q is empty, without memory (its second dimension has a
  // valid extent, 2^62 elements). With head dim 0, k is empty too.
  const ConstTensorView no_heads(nullptr, DType::f32, {1, 2, 0, 4}, {kHuge, kHuge, kHuge, kHuge});
  const ConstTensorView no_dims(nullptr, DType::f32, {1, 2, 0, 0}, {kHuge, kHuge, kHuge, kHuge});
  const ConstTensorView empty_keys(nullptr, DType::f32, {1, 2, 1, 0}, {kHuge, kHuge, kHuge, kHuge});
  const Tensor k = random_tensor(DType::f32, {1, 5, 1, 4}, 1);
  const Tensor v = random_tensor(DType::f32, {1, 5, 1, 4}, 2);
  for (const Backend b : {Backend::fast, Backend::reference}) {
    for (const auto& [q, k_view, v_view] :
         {std::tuple<ConstTensorView, ConstTensorView, ConstTensorView>{no_heads, k, v},
          {no_dims, empty_keys, v.view().slice(1, 0, 2)}}) {
      const auto [r, g] = gradients(q, k_view, v_view, b);
      EXPECT_EQ(r.out.numel(), 0);
      EXPECT_EQ(qkv::test::max_abs(g.dk), 0.0);
      EXPECT_EQ(qkv::test::max_abs(g.dv), 0.0);
    }
  }
  // One query, key and head, D = 1: every dimension but the stepped one (the
  // keys' rows, the values' elements) has a stride of 2^62.
  const float q1[] = {0.5f}, k2[] = {0.25f, -1.0f}, v3[] = {1.0f, 2.0f, 3.0f};
  const ConstTensorView q(q1, DType::f32, {1, 1, 1, 1}, {kHuge, kHuge, kHuge, kHuge});
  const ConstTensorView k_rows(k2, DType::f32, {1, 2, 1, 1}, {kHuge, 1, kHuge, kHuge});
  const ConstTensorView v_rows(v3, DType::f32, {1, 2, 1, 1}, {kHuge, 2, kHuge, kHuge});
  const auto [fast, fast_g] = gradients(q, k_rows, v_rows, Backend::fast);
  const auto [ref, ref_g] = gradients(q, k_rows, v_rows, Backend::reference);
  EXPECT_LE(max_abs_diff(fast.out, ref.out), 1e-6);
  EXPECT_LE(max_abs_diff(fast.lse, ref.lse), 1e-6);
  EXPECT_LE(max_abs_diff(fast_g.dq, ref_g.dq), 1e-6);
  EXPECT_LE(max_abs_diff(fast_g.dk, ref_g.dk), 1e-6);
  EXPECT_LE(max_abs_diff(fast_g.dv, ref_g.dv), 1e-6);
}

}  // namespace
