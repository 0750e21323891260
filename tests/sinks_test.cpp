// Learned attention sinks (options.sinks): each row's softmax denominator
// gains e^(S_h), the output gains nothing (qkv/attention.hpp). The fast
// paths against the reference, the reference against an explicit extra key,
// empty rows, the gradient d_sinks against finite differences, and sinks of
// -inf against no sinks, bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "attention_checks.hpp"
#include "qkv/attention.hpp"
#include "qkv/backward.hpp"
#include "qkv/decode.hpp"
#include "qkv/kv_cache.hpp"
#include "reference/attention.hpp"
#include "test_util.hpp"

namespace {

using qkv::AttentionOptions;
using qkv::ConstTensorView;
using qkv::DType;
using qkv::Tensor;
using qkv::test::make_inputs;
using qkv::test::max_abs;
using qkv::test::max_abs_diff;
using qkv::test::random_tensor;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Hq logits around the scores' range, some above every score.
std::vector<float> sample_sinks(std::int64_t hq) {
  std::vector<float> s(static_cast<std::size_t>(hq));
  for (std::int64_t h = 0; h < hq; ++h) s[h] = 0.3f + 1.7f * static_cast<float>(h % 5) - 2.5f;
  return s;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.numel() == b.numel() && a.dtype() == b.dtype() &&
         std::memcmp(a.view().data(), b.view().data(),
                     static_cast<std::size_t>(a.numel()) * qkv::dtype_size(a.dtype())) == 0;
}

struct ShapeCase {
  const char* name;
  std::int64_t b, nq, nk, hq, hkv, d;
  bool causal;
};

class SinksFast : public ::testing::TestWithParam<DType> {};

TEST_P(SinksFast, ForwardAndBackwardMatchTheReference) {
  const DType dtype = GetParam();
  const ShapeCase shapes[] = {
      {"dense", 2, 97, 130, 4, 4, 64, false},
      {"causal", 2, 130, 130, 4, 4, 59, true},
      {"gqa", 1, 65, 257, 8, 2, 64, false},
      {"gqa_causal", 1, 257, 300, 8, 2, 17, true},
  };
  for (const ShapeCase& s : shapes) {
    const std::string label = std::string(s.name) + " " + std::string(qkv::dtype_name(dtype));
    const auto in = make_inputs(s.b, s.nq, s.nk, s.hq, s.hkv, s.d, s.d, dtype, 7);
    const std::vector<float> sinks = sample_sinks(s.hq);
    AttentionOptions o;
    o.causal = s.causal;
    o.sinks = sinks;
    qkv::test::expect_matches_reference(in.q, in.k, in.v, o, label);
    qkv::test::expect_backward_matches(in.q, in.k, in.v, o, label);
  }
}

TEST_P(SinksFast, VarlenMatchesTheReference) {
  const DType dtype = GetParam();
  const std::vector<std::int64_t> cu_q = {0, 17, 114, 130}, cu_k = {0, 40, 137, 300};
  const auto in = make_inputs(1, 130, 300, 8, 2, 64, 64, dtype, 11);
  const std::vector<float> sinks = sample_sinks(8);
  for (const bool causal : {false, true}) {
    AttentionOptions o;
    o.cu_seqlens_q = cu_q;
    o.cu_seqlens_k = cu_k;
    o.causal = causal;
    o.sinks = sinks;
    const std::string label = std::string("varlen causal=") + (causal ? "1 " : "0 ") +
                              std::string(qkv::dtype_name(dtype));
    qkv::test::expect_matches_reference(in.q, in.k, in.v, o, label);
    qkv::test::expect_backward_matches(in.q, in.k, in.v, o, label);
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, SinksFast, ::testing::Values(DType::f32, DType::bf16),
                         [](const auto& p) { return std::string(qkv::dtype_name(p.param)); });

// The reference with sinks equals attention with one more key per row, of
// score S_h (a zero key and a float mask adding S_h) and a zero value.
TEST(Sinks, ReferenceEqualsAnExtraKeyWithTheSinkAsScore) {
  constexpr std::int64_t B = 2, Nq = 7, Nk = 11, Hq = 4, Hkv = 2, D = 8;
  const auto in = make_inputs(B, Nq, Nk, Hq, Hkv, D, D, DType::f64, 21);
  const std::vector<float> sinks = sample_sinks(Hq);
  Tensor k1(DType::f64, {B, Nk + 1, Hkv, D}), v1(DType::f64, {B, Nk + 1, Hkv, D});
  Tensor mask(DType::f64, {B, Hq, Nq, Nk + 1});
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t j = 0; j <= Nk; ++j)
      for (std::int64_t h = 0; h < Hkv; ++h)
        for (std::int64_t c = 0; c < D; ++c) {
          k1.set({b, j, h, c}, j < Nk ? in.k.get({b, j, h, c}) : 0.0);
          v1.set({b, j, h, c}, j < Nk ? in.v.get({b, j, h, c}) : 0.0);
        }
    for (std::int64_t h = 0; h < Hq; ++h)
      for (std::int64_t i = 0; i < Nq; ++i)
        for (std::int64_t j = 0; j <= Nk; ++j)
          mask.set({b, h, i, j}, j < Nk ? 0.0 : static_cast<double>(sinks[h]));
  }
  AttentionOptions with_sinks;
  with_sinks.backend = qkv::Backend::reference;
  with_sinks.return_lse = true;
  with_sinks.sinks = sinks;
  AttentionOptions extra_key;
  extra_key.backend = qkv::Backend::reference;
  extra_key.return_lse = true;
  extra_key.mask = mask;
  const auto got = qkv::attention(in.q, in.k, in.v, with_sinks);
  const auto want = qkv::attention(in.q, k1, v1, extra_key);
  EXPECT_LE(max_abs_diff(got.out, want.out), 1e-14);
  EXPECT_LE(max_abs_diff(got.lse, want.lse), 1e-13);
}

// A row without keys: out = 0, lse = S_h, on every backend; its gradients
// are zero.
TEST(Sinks, FullyMaskedRowHasZeroOutputAndTheSinkAsLse) {
  constexpr std::int64_t B = 2, N = 33, Hq = 4, Hkv = 2, D = 16;
  const auto in = make_inputs(B, N, N, Hq, Hkv, D, D, DType::f32, 31);
  const std::vector<float> sinks = sample_sinks(Hq);
  const std::vector<std::int64_t> lengths = {0, 20};
  for (const qkv::Backend backend : {qkv::Backend::fast, qkv::Backend::reference}) {
    AttentionOptions o;
    o.backend = backend;
    o.sinks = sinks;
    o.key_lengths = lengths;
    o.return_lse = true;
    const auto r = qkv::attention(in.q, in.k, in.v, o);
    for (std::int64_t h = 0; h < Hq; ++h)
      for (std::int64_t i = 0; i < N; ++i) {
        EXPECT_EQ(r.lse.get({0, h, i}), static_cast<double>(sinks[h]));
        for (std::int64_t c = 0; c < D; ++c) EXPECT_EQ(r.out.get({0, i, h, c}), 0.0);
      }
    const Tensor dout = random_tensor(DType::f32, {B, N, Hq, D}, 32);
    const auto g = qkv::attention_backward(in.q, in.k, in.v, r.out, dout, r.lse, o);
    for (std::int64_t i = 0; i < N; ++i)
      for (std::int64_t h = 0; h < Hq; ++h)
        for (std::int64_t c = 0; c < D; ++c) EXPECT_EQ(g.dq.get({0, i, h, c}), 0.0);
    EXPECT_FALSE(qkv::test::has_non_finite(g.d_sinks));
  }
}

TEST(Sinks, GradientMatchesCentralDifferences) {
  struct Case {
    const char* name;
    bool causal, varlen;
    double dropout;
  };
  for (const Case& c : {Case{"dense", false, false, 0.0}, Case{"causal", true, false, 0.0},
                        Case{"varlen", true, true, 0.0}, Case{"dropout", false, false, 0.2}}) {
    SCOPED_TRACE(c.name);
    const auto in = make_inputs(c.varlen ? 1 : 2, 13, 17, 4, 2, 8, 8, DType::f64, 41);
    Tensor dout = random_tensor(DType::f64, {in.q.size(0), 13, 4, 8}, 42, -0.1, 0.1);
    std::vector<float> sinks = {0.3f, -1.2f, 2.0f, 0.0f};
    const std::vector<std::int64_t> cu_q = {0, 5, 13}, cu_k = {0, 9, 17};
    AttentionOptions o;
    o.backend = qkv::Backend::reference;
    o.causal = c.causal;
    o.dropout_p = c.dropout;
    o.dropout_seed = 3;
    if (c.varlen) {
      o.cu_seqlens_q = cu_q;
      o.cu_seqlens_k = cu_k;
    }
    o.sinks = sinks;
    o.return_lse = true;
    const auto fwd = qkv::attention(in.q, in.k, in.v, o);
    // dout = out + noise: D_i = <dout_i, out_i> > 0 mostly, so that the
    // rows' terms of d_sinks do not cancel and the difference quotient's
    // rounding (about 1e-10 of L / h) stays far below 1e-6 of the gradient.
    for (std::int64_t e = 0; e < dout.numel(); ++e) {
      dout.data<double>()[e] += fwd.out.data<double>()[e];
    }
    const auto g = qkv::attention_backward(in.q, in.k, in.v, fwd.out, dout, fwd.lse, o);
    ASSERT_EQ(g.d_sinks.dtype(), DType::f64);
    for (std::size_t h = 0; h < sinks.size(); ++h) {
      const float s = sinks[h];
      // The steps the f32 logits can take: h = 1e-6 rounded to f32.
      const float up = static_cast<float>(s + 1e-6), down = static_cast<float>(s - 1e-6);
      sinks[h] = up;
      const double l_up = qkv::test::output_loss(in, dout, o);
      sinks[h] = down;
      const double l_down = qkv::test::output_loss(in, dout, o);
      sinks[h] = s;
      const double fd = (l_up - l_down) / (static_cast<double>(up) - static_cast<double>(down));
      const double got = g.d_sinks.get({static_cast<std::int64_t>(h)});
      EXPECT_LT(std::fabs(got - fd), 1e-6 * std::fabs(fd)) << "head " << h;
    }
  }
}

// Sinks of -inf are no sinks: every path gives the same bits.
TEST(Sinks, MinusInfinityIsBitwiseNoSink) {
  const auto in = make_inputs(2, 70, 90, 4, 2, 32, 32, DType::f32, 51);
  const std::vector<float> off(4, kNegInf);
  const Tensor dout = random_tensor(DType::f32, {2, 70, 4, 32}, 52);
  for (const qkv::Backend backend : {qkv::Backend::fast, qkv::Backend::reference}) {
    AttentionOptions plain;
    plain.backend = backend;
    plain.causal = true;
    plain.return_lse = true;
    plain.return_probs = true;
    AttentionOptions sunk = plain;
    sunk.sinks = off;
    const auto a = qkv::attention(in.q, in.k, in.v, plain);
    const auto b = qkv::attention(in.q, in.k, in.v, sunk);
    EXPECT_TRUE(same_bits(a.out, b.out));
    EXPECT_TRUE(same_bits(a.lse, b.lse));
    EXPECT_TRUE(same_bits(a.probs, b.probs));
    const auto ga = qkv::attention_backward(in.q, in.k, in.v, a.out, dout, a.lse, plain);
    const auto gb = qkv::attention_backward(in.q, in.k, in.v, b.out, dout, b.lse, sunk);
    EXPECT_TRUE(same_bits(ga.dq, gb.dq));
    EXPECT_TRUE(same_bits(ga.dk, gb.dk));
    EXPECT_TRUE(same_bits(ga.dv, gb.dv));
    EXPECT_EQ(max_abs(gb.d_sinks), 0.0);
  }
  // Decode, with split-KV merges.
  qkv::KvCacheConfig config;
  config.batch = 1;
  config.kv_heads = 2;
  config.head_dim = 32;
  config.capacity = 3000;
  qkv::KvCache cache(config);
  cache.append(random_tensor(DType::f32, {1, 3000, 2, 32}, 53),
               random_tensor(DType::f32, {1, 3000, 2, 32}, 54));
  const Tensor q = random_tensor(DType::f32, {1, 2, 4, 32}, 55);
  AttentionOptions plain;
  plain.return_lse = true;
  AttentionOptions sunk = plain;
  sunk.sinks = off;
  const auto a = qkv::decode_attention(q, cache, plain);
  const auto b = qkv::decode_attention(q, cache, sunk);
  EXPECT_TRUE(same_bits(a.out, b.out));
  EXPECT_TRUE(same_bits(a.lse, b.lse));
}

// Decode against the reference forward of the new rows (causal,
// bottom-right) over the cached keys: contiguous and paged caches, short
// and long (split-KV merges), by the tolerance policy.
TEST(Sinks, DecodeMatchesTheReference) {
  constexpr std::int64_t Hq = 8, Hkv = 2, D = 64, n = 2;
  for (const std::int64_t length : {std::int64_t{40}, std::int64_t{3000}}) {
    for (const std::int64_t page : {std::int64_t{0}, std::int64_t{16}}) {
      const std::string label =
          "length " + std::to_string(length) + (page > 0 ? " paged" : " contiguous");
      const std::int64_t B = 2;
      const auto in = make_inputs(B, length, length, Hq, Hkv, D, D, DType::f32, 61);
      qkv::KvCacheConfig config;
      config.batch = B;
      config.kv_heads = Hkv;
      config.head_dim = D;
      config.capacity = length;
      config.page_size = page;
      qkv::KvCache cache(config);
      cache.append(in.k, in.v);
      const ConstTensorView q_new = in.q.view().slice(1, length - n, n);
      const std::vector<float> sinks = sample_sinks(Hq);
      AttentionOptions o;
      o.sinks = sinks;
      o.return_lse = true;
      qkv::test::expect_decode_matches_causal(q_new, in.k, in.v, cache, o, label);
      AttentionOptions ref_opt = o;
      ref_opt.causal = true;
      ref_opt.backend = qkv::Backend::reference;
      const auto ref =
          qkv::attention(qkv::to_dtype(q_new, DType::f64), qkv::to_dtype(in.k, DType::f64),
                         qkv::to_dtype(in.v, DType::f64), ref_opt);
      // Backend::reference decodes through the reference too.
      AttentionOptions slow = o;
      slow.backend = qkv::Backend::reference;
      const auto r = qkv::decode_attention(q_new, cache, slow);
      EXPECT_LE(max_abs_diff(r.out, ref.out), 1e-6) << label;
      EXPECT_LE(max_abs_diff(r.lse, ref.lse), 1e-6) << label;
    }
  }
}

TEST(Sinks, ValidationNamesTheBadLogit) {
  const auto in = make_inputs(1, 4, 4, 2, 2, 8, 8, DType::f32, 71);
  auto message = [&](std::vector<float> sinks) {
    AttentionOptions o;
    o.sinks = sinks;
    try {
      qkv::attention(in.q, in.k, in.v, o);
    } catch (const qkv::Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(message({0.f}).find("options.sinks: expected Hq = 2"), std::string::npos);
  EXPECT_NE(message({0.f, std::nanf("")}).find("options.sinks[1]"), std::string::npos);
  EXPECT_NE(message({std::numeric_limits<float>::infinity(), 0.f}).find("options.sinks[0]"),
            std::string::npos);
  EXPECT_EQ(message({kNegInf, 1.f}), "");
  // d_sinks is required exactly when sinks are given.
  AttentionOptions o;
  o.return_lse = true;
  const auto fwd = qkv::attention(in.q, in.k, in.v, o);
  Tensor dq(DType::f32, {1, 4, 2, 8}), dk(DType::f32, {1, 4, 2, 8}), dv(DType::f32, {1, 4, 2, 8});
  Tensor d_sinks(DType::f32, {2});
  qkv::GradientOutputs grads{dq, dk, dv};
  grads.d_sinks = d_sinks;
  EXPECT_THROW(qkv::attention_backward_into(in.q, in.k, in.v, fwd.out, fwd.out, fwd.lse, grads, o),
               qkv::Error);
  const std::vector<float> sinks = {0.5f, -0.5f};
  o.sinks = sinks;
  grads.d_sinks = {};
  try {
    qkv::attention_backward_into(in.q, in.k, in.v, fwd.out, fwd.out, fwd.lse, grads, o);
    ADD_FAILURE() << "expected a qkv::Error";
  } catch (const qkv::Error& e) {
    EXPECT_NE(std::string(e.what()).find("d_sinks: required"), std::string::npos) << e.what();
  }
}

}  // namespace
