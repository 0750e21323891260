// qkv::nn::MultiHeadAttention against a hand-built composition of its
// definition (projection loops + qkv::attention's reference backend + output
// loop), finite differences of its backward, decoding through a KV cache, and
// validation.
#include "qkv/modules/multihead_attention.hpp"

#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <vector>

#include "module_checks.hpp"
#include "qkv/modules/safetensors.hpp"

namespace qkv::test {
namespace {

using nn::MultiHeadAttention;
using nn::MultiHeadAttentionConfig;
using nn::MultiHeadAttentionOptions;
using nn::Position;

// y [B, N, out] = x [B, N, in] W[row0 : row0 + out]^T + b[row0 : row0 + out],
// accumulated in T (float: the naive f32 computation; double: the exact one).
template <class T>
Tensor project(ConstTensorView x, ConstTensorView w, ConstTensorView b, std::int64_t row0,
               std::int64_t out) {
  const std::int64_t batch = x.size(0), n = x.size(1), in = x.size(2);
  Tensor y(dtype_of_v<T>, {batch, n, out});
  for (std::int64_t s = 0; s < batch; ++s) {
    for (std::int64_t t = 0; t < n; ++t) {
      for (std::int64_t o = 0; o < out; ++o) {
        T acc = b.defined() ? T(b.get({row0 + o})) : T(0);
        for (std::int64_t i = 0; i < in; ++i) acc += T(x.get({s, t, i})) * T(w.get({row0 + o, i}));
        y.set({s, t, o}, double(acc));
      }
    }
  }
  return y;
}

// The module's definition written out: T = double gives the exact result,
// T = float the naive f32 one (inputs and weights rounded to f32 first).
template <class T>
Tensor compose(MultiHeadAttention& m, ConstTensorView query, ConstTensorView key,
               ConstTensorView value, AttentionOptions ao, Tensor* probs = nullptr) {
  const MultiHeadAttentionConfig& c = m.config();
  const std::int64_t e = c.embed_dim, h = c.num_heads, hkv = c.num_kv_heads, dh = m.head_dim();
  const std::int64_t kv = hkv * dh;
  const DType dt = dtype_of_v<T>;
  const Tensor xq = to_dtype(query, dt), xk = to_dtype(key, dt), xv = to_dtype(value, dt);
  const ConstTensorView b = m.in_proj_bias.value;
  Tensor q, k, v;
  if (m.in_proj_weight.defined()) {
    const Tensor w = to_dtype(m.in_proj_weight.value, dt);
    q = project<T>(xq, w, b, 0, e);
    k = project<T>(xk, w, b, e, kv);
    v = project<T>(xv, w, b, e + kv, kv);
  } else {
    const Tensor wq = to_dtype(m.q_proj_weight.value, dt);
    const Tensor wk = to_dtype(m.k_proj_weight.value, dt);
    const Tensor wv = to_dtype(m.v_proj_weight.value, dt);
    q = project<T>(xq, wq, b, 0, e);
    // The bias rows of K and V follow Q's in in_proj_bias: shift by viewing.
    k = project<T>(xk, wk, b.defined() ? b.slice(0, e, kv) : b, 0, kv);
    v = project<T>(xv, wv, b.defined() ? b.slice(0, e + kv, kv) : b, 0, kv);
  }
  const std::int64_t batch = query.size(0), nq = query.size(1), nk = key.size(1);
  TensorView q4(q.view().data(), dt, {batch, nq, h, dh});
  TensorView k4(k.view().data(), dt, {batch, nk, hkv, dh});
  const TensorView v4(v.view().data(), dt, {batch, nk, hkv, dh});
  if (c.position == Position::rope) {
    const std::vector<std::int64_t> start(std::size_t(batch), 0);
    apply_rope(q4, start, c.rope);
    apply_rope(k4, start, c.rope);
  }
  const std::vector<float> slopes = alibi_slopes(h);
  if (c.position == Position::alibi) ao.alibi_slopes = slopes;
  if (c.position == Position::relative_bias) {
    ao.relative_bias.table = m.relative_bias->weight.value.view().transpose(0, 1);
    ao.relative_bias.max_distance = c.max_distance;
    ao.relative_bias.bidirectional = c.bidirectional;
  }
  ao.align = Align::top_left;
  ao.backend = Backend::reference;
  ao.return_probs = probs != nullptr;
  AttentionResult a = attention(q4, k4, v4, ao);
  if (probs != nullptr) *probs = std::move(a.probs);
  const Tensor wo = to_dtype(m.out_proj.weight.value, dt);
  return project<T>(ConstTensorView(a.out.view().data(), dt, {batch, nq, e}), wo,
                    m.out_proj.bias.value, 0, e);
}

MultiHeadAttentionConfig config(std::int64_t e, std::int64_t h, std::int64_t hkv = 0,
                                Position position = Position::none, DType dtype = DType::f32) {
  MultiHeadAttentionConfig c;
  c.embed_dim = e;
  c.num_heads = h;
  c.num_kv_heads = hkv;
  c.position = position;
  c.dtype = dtype;
  return c;
}

// The f32 module against the exact composition, within 2x the naive f32
// composition's error plus a floor of a few output roundings (the policy of
// docs/numerics.md, "The tolerance policy").
void expect_matches_composition(MultiHeadAttention& m, ConstTensorView query, ConstTensorView key,
                                ConstTensorView value, const MultiHeadAttentionOptions& o,
                                const AttentionOptions& equivalent, const char* what) {
  const Tensor got = m.forward(query, key, value, o).out;
  const Tensor exact = compose<double>(m, query, key, value, equivalent);
  const Tensor naive = compose<float>(m, query, key, value, equivalent);
  const double naive_err = max_abs_diff(naive, exact);
  const double floor = 8.0 * unit_roundoff(DType::f32) * (max_abs(exact) + 1.0);
  EXPECT_LE(max_abs_diff(got, exact), 2.0 * naive_err + floor)
      << what << ": naive f32 error " << naive_err;
}

TEST(MultiHeadAttentionModule, SelfAndCrossAttentionMatchComposition) {
  for (auto [e, h, hkv] : {std::tuple{16, 4, 0}, {24, 6, 2}, {16, 4, 1}}) {
    MultiHeadAttention m(config(e, h, hkv));
    nn::init_uniform(m.named_parameters(), 7);
    const Tensor x = random_tensor(DType::f32, {2, 9, e}, 1);
    expect_matches_composition(m, x, x, x, {}, {}, "self");
    const Tensor mem = random_tensor(DType::f32, {2, 13, e}, 2);
    expect_matches_composition(m, x, mem, mem, {}, {}, "cross");
  }
}

TEST(MultiHeadAttentionModule, SeparateKeyValueDimsAndNoBias) {
  MultiHeadAttentionConfig c = config(16, 4, 2);
  c.kdim = 5;
  c.vdim = 7;
  c.bias = false;
  MultiHeadAttention m(c);
  EXPECT_FALSE(m.in_proj_weight.defined());
  EXPECT_EQ(m.k_proj_weight.value.size(1), 5);
  nn::init_uniform(m.named_parameters(), 3);
  const Tensor q = random_tensor(DType::f32, {2, 6, 16}, 1);
  const Tensor k = random_tensor(DType::f32, {2, 11, 5}, 2);
  const Tensor v = random_tensor(DType::f32, {2, 11, 7}, 3);
  expect_matches_composition(m, q, k, v, {}, {}, "kdim/vdim");
}

TEST(MultiHeadAttentionModule, MasksFollowTorchConventions) {
  MultiHeadAttention m(config(16, 4));
  nn::init_uniform(m.named_parameters(), 5);
  const std::int64_t batch = 2, nq = 7, nk = 10;
  const Tensor q = random_tensor(DType::f32, {batch, nq, 16}, 1);
  const Tensor kv = random_tensor(DType::f32, {batch, nk, 16}, 2);

  // Padding at the end of each row (runs as key lengths) and in the middle
  // (runs as a mask): true = padding.
  for (bool suffix : {true, false}) {
    Tensor pad(DType::boolean, {batch, nk});
    Tensor keep(DType::boolean, {batch, 1, 1, nk});
    for (std::int64_t b = 0; b < batch; ++b) {
      for (std::int64_t j = 0; j < nk; ++j) {
        const bool padded = suffix ? j >= nk - 3 * b - 1 : (j + b) % 3 == 1;
        pad.set({b, j}, padded);
        keep.set({b, 0, 0, j}, !padded);
      }
    }
    MultiHeadAttentionOptions o;
    o.key_padding_mask = pad;
    AttentionOptions eq;
    eq.mask = keep;
    expect_matches_composition(m, q, kv, kv, o, eq, suffix ? "suffix padding" : "padding");
  }

  // A bool [Nq, Nk] attn_mask, a float [B * H, Nq, Nk] one, and both with
  // padding and causal.
  Tensor bad(DType::boolean, {nq, nk}), good(DType::boolean, {nq, nk});
  Tensor pad(DType::boolean, {batch, nk});
  Tensor combined(DType::f32, {batch, 4, nq, nk});
  const Tensor added = random_tensor(DType::f32, {batch * 4, nq, nk}, 9, -2.0, 2.0);
  for (std::int64_t i = 0; i < nq; ++i) {
    for (std::int64_t j = 0; j < nk; ++j) {
      bad.set({i, j}, (i * 3 + j) % 4 == 0);
      good.set({i, j}, (i * 3 + j) % 4 != 0);
    }
  }
  for (std::int64_t j = 0; j < nk; ++j) pad.set({1, j}, j == 2);
  for (std::int64_t b = 0; b < batch; ++b) {
    for (std::int64_t hh = 0; hh < 4; ++hh) {
      for (std::int64_t i = 0; i < nq; ++i) {
        for (std::int64_t j = 0; j < nk; ++j) {
          const bool masked = bad.get({i, j}) != 0.0 || pad.get({b, j}) != 0.0;
          combined.set({b, hh, i, j}, masked ? -INFINITY : 0.0);
        }
      }
    }
  }
  {
    MultiHeadAttentionOptions o;
    o.attn_mask = bad;
    AttentionOptions eq;
    eq.mask = good;
    expect_matches_composition(m, q, kv, kv, o, eq, "bool attn_mask");
  }
  {
    MultiHeadAttentionOptions o;
    o.attn_mask = added;
    AttentionOptions eq;
    eq.mask = ConstTensorView(added.view().data(), DType::f32, {batch, 4, nq, nk});
    expect_matches_composition(m, q, kv, kv, o, eq, "float attn_mask");
  }
  {
    MultiHeadAttentionOptions o;
    o.attn_mask = bad;
    o.key_padding_mask = pad;
    o.causal = true;
    AttentionOptions eq;
    eq.mask = combined;
    eq.causal = true;
    expect_matches_composition(m, q, kv, kv, o, eq, "attn_mask + padding + causal");
  }
}

TEST(MultiHeadAttentionModule, MoreMaskFormsWithGroupedHeads) {
  MultiHeadAttention m(config(16, 4, 2));
  nn::init_uniform(m.named_parameters(), 8);
  const std::int64_t batch = 2, nq = 5, nk = 9;
  const Tensor q = random_tensor(DType::f32, {batch, nq, 16}, 1);
  const Tensor kv = random_tensor(DType::f32, {batch, nk, 16}, 2);
  // A float key_padding_mask (added), and a bool [B * H, Nq, Nk] attn_mask.
  const Tensor added = random_tensor(DType::f32, {batch, nk}, 3, -3.0, 3.0);
  Tensor bad(DType::boolean, {batch * 4, nq, nk}), good(DType::boolean, {batch, 4, nq, nk});
  for (std::int64_t bh = 0; bh < batch * 4; ++bh) {
    for (std::int64_t i = 0; i < nq; ++i) {
      for (std::int64_t j = 0; j < nk; ++j) {
        const bool masked = (bh + 2 * i + j) % 3 == 0;
        bad.set({bh, i, j}, masked);
        good.set({bh / 4, bh % 4, i, j}, !masked);
      }
    }
  }
  {
    MultiHeadAttentionOptions o;
    o.key_padding_mask = added;
    AttentionOptions eq;
    eq.mask = ConstTensorView(added.view().data(), DType::f32, {batch, 1, 1, nk});
    expect_matches_composition(m, q, kv, kv, o, eq, "float key_padding_mask");
  }
  {
    MultiHeadAttentionOptions o;
    o.attn_mask = bad;
    AttentionOptions eq;
    eq.mask = good;
    expect_matches_composition(m, q, kv, kv, o, eq, "bool [B * H, Nq, Nk] attn_mask");
  }
  // A sequence whose keys are all padding: its output is the output
  // projection's bias (zero attention), not NaN.
  Tensor pad(DType::boolean, {batch, nk});
  for (std::int64_t j = 0; j < nk; ++j) pad.set({1, j}, 1.0);
  MultiHeadAttentionOptions o;
  o.key_padding_mask = pad;
  const Tensor out = m.forward(q, kv, kv, o).out;
  for (std::int64_t i = 0; i < nq; ++i) {
    for (std::int64_t c = 0; c < 16; ++c) {
      EXPECT_EQ(out.get({1, i, c}), m.out_proj.bias.value.get({c})) << i << "," << c;
    }
  }
}

TEST(MultiHeadAttentionModule, PositionMethodsMatchComposition) {
  for (Position p : {Position::rope, Position::alibi, Position::relative_bias}) {
    MultiHeadAttentionConfig c = config(24, 6, 3, p);
    c.rope.interleaved = true;
    c.num_buckets = 8;
    c.max_distance = 16;
    MultiHeadAttention m(c);
    nn::init_uniform(m.named_parameters(), 11);
    const Tensor x = random_tensor(DType::f32, {2, 12, 24}, 4);
    MultiHeadAttentionOptions o;
    o.causal = true;
    AttentionOptions eq;
    eq.causal = true;
    expect_matches_composition(m, x, x, x, o, eq, "position");
  }
}

TEST(MultiHeadAttentionModule, WeightsAreTheSoftmaxPerHeadOrAveraged) {
  MultiHeadAttention m(config(16, 4, 2));
  nn::init_uniform(m.named_parameters(), 5);
  const Tensor q = random_tensor(DType::f64, {2, 5, 16}, 1);
  const Tensor kv = random_tensor(DType::f64, {2, 8, 16}, 2);
  Tensor probs;
  compose<double>(m, q, kv, kv, {}, &probs);
  MultiHeadAttentionOptions o;
  o.need_weights = true;
  o.average_attn_weights = false;
  const Tensor per_head = m.forward(q, kv, kv, o).weights;
  EXPECT_LE(max_abs_diff(per_head, probs), 1e-14);
  o.average_attn_weights = true;
  const Tensor mean = m.forward(q, kv, kv, o).weights;
  ASSERT_EQ(mean.rank(), 3);
  for (std::int64_t b = 0; b < 2; ++b) {
    for (std::int64_t i = 0; i < 5; ++i) {
      double row = 0.0;
      for (std::int64_t j = 0; j < 8; ++j) {
        double s = 0.0;
        for (std::int64_t hh = 0; hh < 4; ++hh) s += probs.get({b, hh, i, j});
        EXPECT_NEAR(mean.get({b, i, j}), s / 4.0, 1e-15);
        row += mean.get({b, i, j});
      }
      EXPECT_NEAR(row, 1.0, 1e-14);
    }
  }
}

TEST(MultiHeadAttentionModule, SixteenBitParametersAndInputs) {
  for (DType dt : {DType::bf16, DType::f16}) {
    MultiHeadAttention m(config(16, 4, 2, Position::none, dt));
    nn::init_uniform(m.named_parameters(), 2);
    const Tensor x = random_tensor(dt, {2, 6, 16}, 3);
    const Tensor y = m.forward(x, x, x).out;
    EXPECT_EQ(y.dtype(), dt);
    // The module widens the exact 16-bit values to f32 and rounds its output
    // once; the exact result of those values differs by the f32 composition's
    // error (tiny) plus that one rounding.
    const Tensor exact = compose<double>(m, x, x, x, {});
    EXPECT_LE(max_abs_diff(y, exact), 2.0 * unit_roundoff(dt) * max_abs(exact) + 1e-5)
        << dtype_name(dt);
  }
}

// L = sum(w * out) through the module in f64; every input and parameter.
void check_backward(MultiHeadAttentionConfig c, const MultiHeadAttentionOptions& base, bool self,
                    std::int64_t nq, std::int64_t nk) {
  c.dtype = DType::f64;
  MultiHeadAttention m(c);
  nn::init_uniform(m.named_parameters(), 31);
  const std::int64_t e = c.embed_dim;
  Tensor query = random_tensor(DType::f64, {2, nq, e}, 1);
  Tensor key = self ? query : random_tensor(DType::f64, {2, nk, c.kdim ? c.kdim : e}, 2);
  Tensor value = self ? query : random_tensor(DType::f64, {2, nk, c.vdim ? c.vdim : e}, 3);
  const Tensor w = random_tensor(DType::f64, {2, nq, e}, 4);
  MultiHeadAttentionOptions o = base;
  o.save_for_backward = true;
  const auto forward = [&] {
    return self ? m.forward(query, query, query, o).out : m.forward(query, key, value, o).out;
  };
  const nn::MultiHeadAttentionResult r =
      self ? m.forward(query, query, query, o) : m.forward(query, key, value, o);
  const nn::MultiHeadAttentionGradients g = self ? m.backward(query, query, query, r.saved, w, o)
                                                 : m.backward(query, key, value, r.saved, w, o);
  std::vector<GradientTarget> targets;
  Tensor dx;
  if (self) {
    dx = Tensor(DType::f64, {2, nq, e});
    for (std::int64_t i = 0; i < dx.numel(); ++i) {
      dx.data<double>()[i] =
          g.dquery.data<double>()[i] + g.dkey.data<double>()[i] + g.dvalue.data<double>()[i];
    }
    targets.push_back({"x", query.view(), dx.view()});
  } else {
    targets.push_back({"query", query.view(), g.dquery.view()});
    targets.push_back({"key", key.view(), g.dkey.view()});
    targets.push_back({"value", value.view(), g.dvalue.view()});
  }
  for (const nn::NamedParameter& p : m.named_parameters()) {
    targets.push_back({p.name, p.parameter->value, p.parameter->grad});
  }
  expect_gradients_match_fd(forward, w, targets);
}

TEST(MultiHeadAttentionModule, BackwardMatchesFiniteDifferences) {
  MultiHeadAttentionOptions none;
  check_backward(config(8, 2), none, true, 5, 5);
  MultiHeadAttentionConfig cross = config(12, 4, 2);
  cross.kdim = 5;
  cross.vdim = 3;
  check_backward(cross, none, false, 4, 6);
  MultiHeadAttentionOptions causal;
  causal.causal = true;
  Tensor pad(DType::boolean, {2, 6});
  pad.set({1, 4}, 1.0);
  pad.set({1, 5}, 1.0);
  causal.key_padding_mask = pad;
  for (Position p : {Position::rope, Position::alibi, Position::relative_bias}) {
    MultiHeadAttentionConfig c = config(8, 2, 1, p);
    c.num_buckets = 4;
    c.max_distance = 8;
    check_backward(c, causal, true, 6, 6);
  }
  // Training with dropout: the mask is a function of (seed, offset, b, h, i,
  // j), so the forward is a differentiable function of the inputs and the
  // backward regenerates the same mask.
  MultiHeadAttentionConfig dropped = config(8, 2);
  dropped.dropout = 0.3;
  MultiHeadAttentionOptions training;
  training.training = true;
  training.dropout_seed = 99;
  training.dropout_offset = 5;
  check_backward(dropped, training, true, 7, 7);
}

TEST(MultiHeadAttentionModule, DropoutOnlyInTraining) {
  MultiHeadAttentionConfig c = config(16, 4);
  c.dropout = 0.5;
  MultiHeadAttention m(c);
  nn::init_uniform(m.named_parameters(), 3);
  const Tensor x = random_tensor(DType::f32, {2, 9, 16}, 1);
  MultiHeadAttentionOptions eval;
  expect_matches_composition(m, x, x, x, eval, {}, "eval ignores dropout");
  MultiHeadAttentionOptions train;
  train.training = true;
  train.dropout_seed = 1;
  const Tensor a = m.forward(x, x, x, train).out;
  train.dropout_seed = 2;
  const Tensor b = m.forward(x, x, x, train).out;
  EXPECT_GT(max_abs_diff(a, b), 1e-3) << "the seed selects the dropped weights";
  AttentionOptions eq;
  eq.dropout_p = 0.5;
  eq.dropout_seed = 2;
  expect_matches_composition(m, x, x, x, train, eq, "training");
}

TEST(MultiHeadAttentionModule, DecodingThroughTheCacheEqualsOneCausalForward) {
  for (Position p : {Position::none, Position::rope, Position::alibi}) {
    MultiHeadAttention m(config(32, 4, 2, p));
    nn::init_uniform(m.named_parameters(), 13);
    const std::int64_t batch = 2, n = 11;
    const Tensor x = random_tensor(DType::f32, {batch, n, 32}, 8);
    MultiHeadAttentionOptions o;
    o.causal = true;
    const Tensor full = m.forward(x, x, x, o).out;
    KvCacheConfig kc;
    kc.batch = batch;
    kc.kv_heads = 2;
    kc.head_dim = m.head_dim();
    kc.capacity = n;
    KvCache cache(kc);
    // A prefill of 4 tokens, then one token at a time.
    Tensor stepped(DType::f32, {batch, n, 32});
    std::int64_t t = 0;
    for (std::int64_t len : {4, 1, 1, 1, 1, 1, 1, 1}) {
      const Tensor y = m.forward_step(x.view().slice(1, t, len), cache);
      copy(y, stepped.view().slice(1, t, len));
      t += len;
    }
    ASSERT_EQ(t, n);
    // Both are f32 computations of the same function that differ in order
    // (cache split, GEMM shapes): within a few roundings of each term.
    EXPECT_LE(max_abs_diff(stepped, full), 64.0 * unit_roundoff(DType::f32) * (max_abs(full) + 1))
        << int(p);
  }
}

TEST(MultiHeadAttentionModule, ValidationNamesEveryProblem) {
  MultiHeadAttentionConfig bad = config(10, 4, 3);
  bad.dropout = 1.0;
  try {
    MultiHeadAttention m(bad);
    FAIL() << "expected qkv::Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.reasons().size(), 3u) << e.what();
  }
  MultiHeadAttention m(config(8, 2));
  const Tensor q(DType::f32, {2, 3, 8}), k(DType::f32, {2, 4, 6});
  MultiHeadAttentionOptions o;
  const Tensor pad(DType::boolean, {2, 5});
  o.key_padding_mask = pad;
  try {
    m.forward(q, k, k, o);
    FAIL() << "expected qkv::Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.reasons().size(), 3u) << e.what();
    EXPECT_NE(std::string(e.what()).find("key_padding_mask"), std::string::npos) << e.what();
  }
  MultiHeadAttentionOptions save;
  save.save_for_backward = false;
  const nn::MultiHeadAttentionResult r = m.forward(q, q, q, save);
  EXPECT_THROW(m.backward(q, q, q, r.saved, q, save), Error);
}

}  // namespace
}  // namespace qkv::test

namespace qkv::test {
namespace {

// The tensors of `file` whose names start with `prefix`, without it.
nn::TensorMap with_prefix(const nn::TensorMap& file, const std::string& prefix) {
  nn::TensorMap out;
  for (const auto& [name, t] : file) {
    if (name.rfind(prefix, 0) == 0) out.emplace(name.substr(prefix.size()), t);
  }
  return out;
}

// Both sides compute in double from the same values; they differ by the
// order of the sums (GEMM blocking, the kernels' online softmax): a few
// hundred roundings of terms of order 1 at most.
constexpr double kDoubleTolerance = 1e-12;

TEST(MultiHeadAttentionModule, MatchesTorchGoldenSelfAttentionWithGradients) {
  const nn::TensorMap file = nn::load_safetensors(test_data("mha_golden.safetensors"));
  nn::MultiHeadAttention m(config(16, 4, 0, Position::none, DType::f64));
  nn::load_parameters(m.named_parameters(), with_prefix(file, "self.param."));
  const Tensor& x = file.at("self.input.x");
  // The masks are stored as 0/1 values; torch's bool masks are true = masked.
  const Tensor attn_mask = to_dtype(file.at("self.input.attn_mask"), DType::boolean);
  const Tensor padding = to_dtype(file.at("self.input.key_padding_mask"), DType::boolean);
  MultiHeadAttentionOptions o;
  o.attn_mask = attn_mask;
  o.key_padding_mask = padding;
  o.need_weights = true;
  o.save_for_backward = true;
  const nn::MultiHeadAttentionResult r = m.forward(x, x, x, o);
  EXPECT_LE(max_abs_diff(r.out, file.at("self.output.out")), kDoubleTolerance);
  EXPECT_LE(max_abs_diff(r.weights, file.at("self.output.weights")), kDoubleTolerance);

  const nn::MultiHeadAttentionGradients g =
      m.backward(x, x, x, r.saved, file.at("self.grad.dout"), o);
  Tensor dx(DType::f64, {2, 6, 16});
  for (std::int64_t i = 0; i < dx.numel(); ++i) {
    dx.data<double>()[i] =
        g.dquery.data<double>()[i] + g.dkey.data<double>()[i] + g.dvalue.data<double>()[i];
  }
  EXPECT_LE(max_abs_diff(dx, file.at("self.grad.x")), kDoubleTolerance);
  for (const nn::NamedParameter& p : m.named_parameters()) {
    EXPECT_LE(max_abs_diff(p.parameter->grad, file.at("self.grad." + p.name)), kDoubleTolerance)
        << p.name;
  }
}

TEST(MultiHeadAttentionModule, MatchesTorchGoldenCrossAttentionWithKdimVdim) {
  const nn::TensorMap file = nn::load_safetensors(test_data("mha_golden.safetensors"));
  MultiHeadAttentionConfig c = config(12, 3, 0, Position::none, DType::f64);
  c.kdim = 5;
  c.vdim = 7;
  nn::MultiHeadAttention m(c);
  nn::load_parameters(m.named_parameters(), with_prefix(file, "cross.param."));
  MultiHeadAttentionOptions o;
  o.attn_mask = file.at("cross.input.attn_mask");
  o.need_weights = true;
  o.average_attn_weights = false;
  const nn::MultiHeadAttentionResult r = m.forward(
      file.at("cross.input.query"), file.at("cross.input.key"), file.at("cross.input.value"), o);
  EXPECT_LE(max_abs_diff(r.out, file.at("cross.output.out")), kDoubleTolerance);
  EXPECT_LE(max_abs_diff(r.weights, file.at("cross.output.weights")), kDoubleTolerance);
  // The same weights in f32 reproduce torch's output within f32 rounding.
  MultiHeadAttentionConfig c32 = c;
  c32.dtype = DType::f32;
  nn::MultiHeadAttention m32(c32);
  nn::load_parameters(m32.named_parameters(), with_prefix(file, "cross.param."));
  const Tensor out32 = m32.forward(to_dtype(file.at("cross.input.query"), DType::f32),
                                   to_dtype(file.at("cross.input.key"), DType::f32),
                                   to_dtype(file.at("cross.input.value"), DType::f32), o)
                           .out;
  EXPECT_LE(max_abs_diff(out32, file.at("cross.output.out")), 1e-5);
}

}  // namespace
}  // namespace qkv::test

namespace qkv::test {
namespace {

TEST(MultiHeadAttentionModule, BitwiseIdenticalForAnyThreadCount) {
  MultiHeadAttention m(config(64, 4, 2, Position::rope));
  nn::init_uniform(m.named_parameters(), 17);
  const Tensor x = random_tensor(DType::f32, {2, 70, 64}, 3);
  const Tensor dy = random_tensor(DType::f32, {2, 70, 64}, 4);
  MultiHeadAttentionOptions o;
  o.causal = true;
  o.save_for_backward = true;
  std::vector<Tensor> outs, dxs, dws;
  for (int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    nn::zero_grad(m.named_parameters());
    const nn::MultiHeadAttentionResult r = m.forward(x, x, x, o);
    outs.push_back(r.out);
    dxs.push_back(m.backward(x, x, x, r.saved, dy, o).dquery);
    dws.push_back(m.in_proj_weight.grad);
  }
  omp_set_num_threads(omp_get_num_procs());
  for (std::size_t t = 1; t < outs.size(); ++t) {
    EXPECT_EQ(max_abs_diff(outs[t], outs[0]), 0.0) << t;
    EXPECT_EQ(max_abs_diff(dxs[t], dxs[0]), 0.0) << t;
    EXPECT_EQ(max_abs_diff(dws[t], dws[0]), 0.0) << t;
  }
}

}  // namespace
}  // namespace qkv::test
