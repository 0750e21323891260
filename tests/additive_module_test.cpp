// qkv::nn::AdditiveAttention: forward and backward against plain loops over
// the explicit concatenation, backward against finite differences, the
// masking properties, thread-count independence, validation, and PyTorch's
// outputs and autograd gradients (tests/data/additive_golden.safetensors).
//
// Tolerances follow the tests' error model: the module's error against the
// loops run in long double may be at most twice the error of the same loops
// run in the compute precision, plus the rounding of the output at its
// magnitude.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "module_checks.hpp"
#include "qkv/modules/additive.hpp"
#include "qkv/modules/safetensors.hpp"

namespace qkv::test {
namespace {

Tensor tensor_of(const std::vector<double>& v, std::initializer_list<std::int64_t> sizes) {
  Tensor t(DType::f64, sizes);
  std::copy(v.begin(), v.end(), t.data<double>());
  return t;
}

// Forward and backward of the essay's module by loops in T, with the
// concatenation built explicitly: concat[s] = [enc[b, s], hidden[b]] (2H),
// energy = tanh(attn.weight concat + attn.bias); softmax over s < len.
template <class T>
struct Loops {
  Tensor context, weights;         // [B, H], [B, S]
  Tensor d_hidden, d_enc;          // [B, H], [B, S, H]
  Tensor d_attn_w, d_attn_b, d_v;  // [H, 2H], [H], [1, H]
};

template <class T>
Loops<T> additive_loops(const nn::AdditiveAttention& m, ConstTensorView hidden, ConstTensorView enc,
                        const std::vector<std::int64_t>& lengths, ConstTensorView d_context = {},
                        ConstTensorView d_weights = {}) {
  const std::int64_t B = enc.size(0), S = enc.size(1), H = enc.size(2);
  const auto hv = values_of<T>(hidden), ev = values_of<T>(enc);
  const auto W = values_of<T>(m.attn_weight.value), bias = values_of<T>(m.attn_bias.value);
  const auto v = values_of<T>(m.v_weight.value);
  const bool grads = d_context.defined();
  const auto dc = grads ? values_of<T>(d_context) : std::vector<T>();
  const auto dwv = d_weights.defined() ? values_of<T>(d_weights)
                                       : std::vector<T>(static_cast<std::size_t>(B * S));
  std::vector<double> ctx(B * H), wts(B * S), dh(B * H), de(B * S * H), gw(H * 2 * H), gb(H), gv(H);
  for (std::int64_t b = 0; b < B; ++b) {
    const std::int64_t len = lengths[b];
    std::vector<T> energy(S * H), score(S), w(S);
    for (std::int64_t s = 0; s < len; ++s) {
      std::vector<T> concat(2 * H);
      for (std::int64_t k = 0; k < H; ++k) {
        concat[k] = ev[(b * S + s) * H + k];
        concat[H + k] = hv[b * H + k];
      }
      T sc = 0;
      for (std::int64_t h = 0; h < H; ++h) {
        T a = bias[h];
        for (std::int64_t k = 0; k < 2 * H; ++k) a += W[h * 2 * H + k] * concat[k];
        energy[s * H + h] = std::tanh(a);
        sc += v[h] * energy[s * H + h];
      }
      score[s] = sc;
    }
    T top = -std::numeric_limits<T>::infinity(), sum = 0;
    for (std::int64_t s = 0; s < len; ++s) top = std::max(top, score[s]);
    for (std::int64_t s = 0; s < len; ++s) sum += (w[s] = std::exp(score[s] - top));
    for (std::int64_t s = 0; s < len; ++s) {
      w[s] /= sum;
      wts[b * S + s] = static_cast<double>(w[s]);
    }
    for (std::int64_t h = 0; h < H; ++h) {
      T c = 0;
      for (std::int64_t s = 0; s < len; ++s) c += w[s] * ev[(b * S + s) * H + h];
      ctx[b * H + h] = static_cast<double>(c);
    }
    if (!grads) continue;
    std::vector<T> dw(S);
    T dot = 0;
    for (std::int64_t s = 0; s < len; ++s) {
      dw[s] = dwv[b * S + s];
      for (std::int64_t h = 0; h < H; ++h) dw[s] += dc[b * H + h] * ev[(b * S + s) * H + h];
      dot += w[s] * dw[s];
    }
    std::vector<T> dhb(H);
    for (std::int64_t s = 0; s < len; ++s) {
      const T dscore = w[s] * (dw[s] - dot);
      std::vector<T> da(H);
      for (std::int64_t h = 0; h < H; ++h) {
        const T e = energy[s * H + h];
        da[h] = dscore * v[h] * (T(1) - e * e);
        gv[h] += static_cast<double>(dscore * e);
        gb[h] += static_cast<double>(da[h]);
        for (std::int64_t k = 0; k < H; ++k) {
          gw[h * 2 * H + k] += static_cast<double>(da[h] * ev[(b * S + s) * H + k]);
          gw[h * 2 * H + H + k] += static_cast<double>(da[h] * hv[b * H + k]);
        }
      }
      for (std::int64_t k = 0; k < H; ++k) {
        T d_e = w[s] * dc[b * H + k], d_h = 0;
        for (std::int64_t h = 0; h < H; ++h) {
          d_e += da[h] * W[h * 2 * H + k];
          d_h += da[h] * W[h * 2 * H + H + k];
        }
        de[(b * S + s) * H + k] = static_cast<double>(d_e);
        dhb[k] += d_h;
      }
    }
    for (std::int64_t k = 0; k < H; ++k) dh[b * H + k] = static_cast<double>(dhb[k]);
  }
  return {tensor_of(ctx, {B, H}),   tensor_of(wts, {B, S}),    tensor_of(dh, {B, H}),
          tensor_of(de, {B, S, H}), tensor_of(gw, {H, 2 * H}), tensor_of(gb, {H}),
          tensor_of(gv, {1, H})};
}

double tolerance(ConstTensorView exact, ConstTensorView loops, DType dtype) {
  return 2.0 * max_abs_diff(loops, exact) +
         (dtype == DType::f64 ? std::ldexp(1.0, -53) : unit_roundoff(dtype)) * max_abs(exact);
}

// [B, S, H] of `dtype` read through a non-contiguous view ([S, B, H] transposed).
struct Inputs {
  Tensor hidden, enc_base;
  ConstTensorView enc;
};
Inputs inputs(DType dtype, std::int64_t B, std::int64_t S, std::int64_t H, std::uint32_t seed) {
  Inputs in{random_tensor(dtype, {B, H}, seed), random_tensor(dtype, {S, B, H}, seed + 1), {}};
  in.enc = in.enc_base.view().transpose(0, 1);
  return in;
}

TEST(AdditiveModule, ForwardMatchesLoopsOverTheConcatenation) {
  struct Case {
    std::int64_t B, S, H;
    std::vector<std::int64_t> lengths;
  };
  for (const Case& c :
       {Case{3, 5, 8, {5, 3, 1}}, Case{2, 1, 17, {}}, Case{4, 9, 33, {9, 0, 4, 7}}}) {
    nn::AdditiveAttention att(c.H);
    nn::init_uniform(att.named_parameters(), 3);
    const Inputs in = inputs(DType::f32, c.B, c.S, c.H, 4);
    const std::vector<std::int64_t> lengths =
        c.lengths.empty() ? std::vector<std::int64_t>(c.B, c.S) : c.lengths;
    const auto out = att.forward(in.hidden, in.enc, c.lengths);
    const auto exact = additive_loops<long double>(att, in.hidden, in.enc, lengths);
    const auto naive = additive_loops<float>(att, in.hidden, in.enc, lengths);
    EXPECT_LE(max_abs_diff(out.context, exact.context),
              tolerance(exact.context, naive.context, DType::f32))
        << "H = " << c.H;
    EXPECT_LE(max_abs_diff(out.weights, exact.weights),
              tolerance(exact.weights, naive.weights, DType::f32))
        << "H = " << c.H;
  }
}

TEST(AdditiveModule, BackwardMatchesLoops) {
  nn::AdditiveAttention att(12);
  nn::init_uniform(att.named_parameters(), 7);
  const Inputs in = inputs(DType::f32, 3, 6, 12, 8);
  const std::vector<std::int64_t> lengths{6, 2, 4};
  const Tensor dc = random_tensor(DType::f32, {3, 12}, 10);
  const Tensor dw = random_tensor(DType::f32, {3, 6}, 11);
  const auto grads = att.backward(in.hidden, in.enc, lengths, dc, dw);
  const auto exact = additive_loops<long double>(att, in.hidden, in.enc, lengths, dc, dw);
  const auto naive = additive_loops<float>(att, in.hidden, in.enc, lengths, dc, dw);
  const auto check = [](ConstTensorView got, ConstTensorView want, ConstTensorView loops,
                        const char* name) {
    EXPECT_LE(max_abs_diff(got, want), tolerance(want, loops, DType::f32)) << name;
  };
  check(grads.d_decoder_hidden, exact.d_hidden, naive.d_hidden, "d_decoder_hidden");
  check(grads.d_encoder_outputs, exact.d_enc, naive.d_enc, "d_encoder_outputs");
  check(att.attn_weight.grad, exact.d_attn_w, naive.d_attn_w, "attn.weight");
  check(att.attn_bias.grad, exact.d_attn_b, naive.d_attn_b, "attn.bias");
  check(att.v_weight.grad, exact.d_v, naive.d_v, "v.weight");
}

TEST(AdditiveModule, BackwardMatchesFiniteDifferences) {
  // The checker's loss sums w * [context | weights]: its first H columns are
  // d_context and the rest d_weights (strided views into it); without
  // d_weights those columns of w are zero.
  for (bool with_d_weights : {true, false}) {
    const std::int64_t B = 3, S = 4, H = 5;
    nn::AdditiveAttention att(H, DType::f64);
    nn::init_uniform(att.named_parameters(), 21);
    Tensor hidden = random_tensor(DType::f64, {B, H}, 22);
    Tensor enc = random_tensor(DType::f64, {B, S, H}, 23);
    const std::vector<std::int64_t> lengths{4, 2, 0};
    Tensor w = random_tensor(DType::f64, {B, H + S}, 24);
    if (!with_d_weights) {
      for (std::int64_t b = 0; b < B; ++b) {
        for (std::int64_t s = 0; s < S; ++s) w.set({b, H + s}, 0.0);
      }
    }
    const ConstTensorView d_context = w.view().slice(1, 0, H);
    const ConstTensorView d_weights =
        with_d_weights ? ConstTensorView(w.view().slice(1, H, S)) : ConstTensorView();
    const auto grads = att.backward(hidden, enc, lengths, d_context, d_weights);
    const auto forward = [&] {
      const auto out = att.forward(hidden, enc, lengths);
      Tensor joined(DType::f64, {B, H + S});
      copy(out.context, joined.view().slice(1, 0, H));
      copy(out.weights, joined.view().slice(1, H, S));
      return joined;
    };
    SCOPED_TRACE(with_d_weights ? "with d_weights" : "without d_weights");
    expect_gradients_match_fd(forward, w,
                              {{"decoder_hidden", hidden, grads.d_decoder_hidden},
                               {"encoder_outputs", enc, grads.d_encoder_outputs},
                               {"attn.weight", att.attn_weight.value, att.attn_weight.grad},
                               {"attn.bias", att.attn_bias.value, att.attn_bias.grad},
                               {"v.weight", att.v_weight.value, att.v_weight.grad}});
  }
}

TEST(AdditiveModule, PaddedPositionsGetExactlyZeroAndChangeNothing) {
  const std::int64_t B = 3, S = 6, H = 7;
  nn::AdditiveAttention att(H);
  nn::init_uniform(att.named_parameters(), 31);
  Tensor hidden = random_tensor(DType::f32, {B, H}, 32);
  Tensor enc = random_tensor(DType::f32, {B, S, H}, 33);
  const std::vector<std::int64_t> lengths{6, 2, 0};
  const auto out = att.forward(hidden, enc, lengths);
  for (std::int64_t b = 0; b < B; ++b) {
    double sum = 0.0;
    for (std::int64_t s = 0; s < S; ++s) {
      const double w = out.weights.get({b, s});
      if (s >= lengths[b]) {
        EXPECT_EQ(w, 0.0) << b << ", " << s;
      } else {
        EXPECT_GT(w, 0.0) << b << ", " << s;
      }
      sum += w;
    }
    // Each weight is e_s / sum, with sum's len - 1 additions and the
    // division rounded in f32: within 2 len roundings of 1.
    if (lengths[b] > 0) {
      EXPECT_NEAR(sum, 1.0, 2 * lengths[b] * unit_roundoff(DType::f32)) << b;
    }
  }
  // A row of length 0 has zero weights and a zero context.
  for (std::int64_t h = 0; h < H; ++h) EXPECT_EQ(out.context.get({2, h}), 0.0);

  // Whatever padded positions hold (here NaN) changes no output and no gradient.
  Tensor poisoned = enc;
  for (std::int64_t b = 1; b < B; ++b) {
    for (std::int64_t s = lengths[b]; s < S; ++s) {
      for (std::int64_t h = 0; h < H; ++h) poisoned.set({b, s, h}, std::nan(""));
    }
  }
  const auto again = att.forward(hidden, poisoned, lengths);
  EXPECT_EQ(max_abs_diff(again.context, out.context), 0.0);
  EXPECT_EQ(max_abs_diff(again.weights, out.weights), 0.0);
  const Tensor dc = random_tensor(DType::f32, {B, H}, 34);
  const auto clean = att.backward(hidden, enc, lengths, dc);
  const Tensor clean_w = att.attn_weight.grad;
  nn::zero_grad(att.named_parameters());
  const auto dirty = att.backward(hidden, poisoned, lengths, dc);
  EXPECT_EQ(max_abs_diff(dirty.d_encoder_outputs, clean.d_encoder_outputs), 0.0);
  EXPECT_EQ(max_abs_diff(dirty.d_decoder_hidden, clean.d_decoder_hidden), 0.0);
  EXPECT_EQ(max_abs_diff(att.attn_weight.grad, clean_w), 0.0);
  for (std::int64_t s = lengths[1]; s < S; ++s) {
    for (std::int64_t h = 0; h < H; ++h) EXPECT_EQ(dirty.d_encoder_outputs.get({1, s, h}), 0.0);
  }
}

TEST(AdditiveModule, EmptySourceGivesZeroContext) {
  nn::AdditiveAttention att(3);
  nn::init_uniform(att.named_parameters(), 61);
  const Tensor hidden = random_tensor(DType::f32, {2, 3}, 62);
  const Tensor enc(DType::f32, {2, 0, 3});
  const auto out = att.forward(hidden, enc);
  EXPECT_EQ(out.weights.numel(), 0);
  EXPECT_EQ(max_abs(out.context), 0.0);
  const auto grads = att.backward(hidden, enc, {}, random_tensor(DType::f32, {2, 3}, 63));
  EXPECT_EQ(max_abs(grads.d_decoder_hidden), 0.0);
  EXPECT_EQ(max_abs(att.attn_weight.grad), 0.0);
}

TEST(AdditiveModule, ResultsDoNotDependOnTheThreadCount) {
  // Eight sequences of 64-wide rows: the attention kernels and GEMMs split
  // this among the threads.
  nn::AdditiveAttention att(64);
  nn::init_uniform(att.named_parameters(), 41);
  const Tensor hidden = random_tensor(DType::f32, {8, 64}, 42);
  const Tensor enc = random_tensor(DType::f32, {8, 40, 64}, 43);
  const Tensor dc = random_tensor(DType::f32, {8, 64}, 44);
  const Tensor dw = random_tensor(DType::f32, {8, 40}, 45);
  const std::vector<std::int64_t> lengths{40, 1, 17, 0, 39, 40, 8, 23};
  const auto run = [&] {
    nn::zero_grad(att.named_parameters());
    const auto out = att.forward(hidden, enc, lengths);
    const auto grads = att.backward(hidden, enc, lengths, dc, dw);
    std::vector<float> all;
    for (ConstTensorView t :
         {ConstTensorView(out.context), ConstTensorView(out.weights),
          ConstTensorView(grads.d_decoder_hidden), ConstTensorView(grads.d_encoder_outputs),
          ConstTensorView(att.attn_weight.grad), ConstTensorView(att.attn_bias.grad),
          ConstTensorView(att.v_weight.grad)}) {
      const auto* p = static_cast<const float*>(t.data());
      all.insert(all.end(), p, p + t.numel());
    }
    return all;
  };
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  const std::vector<float> one = run();
  omp_set_num_threads(2);
  const std::vector<float> two = run();
  omp_set_num_threads(saved);
  ASSERT_EQ(one.size(), two.size());
  EXPECT_EQ(std::memcmp(one.data(), two.data(), one.size() * sizeof(float)), 0);
}

TEST(AdditiveModule, SixteenBitInputsRoundOnce) {
  nn::AdditiveAttention att(16, DType::bf16);
  nn::init_uniform(att.named_parameters(), 51);
  const Tensor hidden = random_tensor(DType::bf16, {2, 16}, 52);
  const Tensor enc = random_tensor(DType::bf16, {2, 7, 16}, 53);
  const std::vector<std::int64_t> lengths{7, 5};
  const auto out = att.forward(hidden, enc, lengths);
  EXPECT_EQ(out.context.dtype(), DType::bf16);
  EXPECT_EQ(out.weights.dtype(), DType::bf16);
  const auto exact = additive_loops<long double>(att, hidden, enc, lengths);
  const auto naive = additive_loops<float>(att, hidden, enc, lengths);
  EXPECT_LE(max_abs_diff(out.context, exact.context),
            tolerance(exact.context, naive.context, DType::bf16));
  EXPECT_LE(max_abs_diff(out.weights, exact.weights),
            tolerance(exact.weights, naive.weights, DType::bf16));
}

TEST(AdditiveModule, ValidationNamesEveryProblem) {
  EXPECT_THROW(nn::AdditiveAttention(0), Error);
  nn::AdditiveAttention att(4);
  const Tensor hidden(DType::f32, {2, 4}), enc(DType::f32, {2, 3, 4});
  try {
    att.forward(Tensor(DType::f64, {3, 5}), enc, std::vector<std::int64_t>{1, 4, -1});
    FAIL() << "expected qkv::Error";
  } catch (const Error& e) {
    const std::string what = e.what();
    ASSERT_EQ(e.reasons().size(), 4u) << what;
    EXPECT_NE(what.find("decoder_hidden: expected H = hidden_size = 4"), std::string::npos);
    EXPECT_NE(what.find("expected the batch size B = 3"), std::string::npos);
    EXPECT_NE(what.find("decoder_hidden: expected the dtype of encoder_outputs (f32)"),
              std::string::npos);
    EXPECT_NE(what.find("source_lengths: expected B = 2 entries"), std::string::npos);
  }
  try {
    att.forward(hidden, enc, std::vector<std::int64_t>{4, -1});
    FAIL() << "expected qkv::Error";
  } catch (const Error& e) {
    ASSERT_EQ(e.reasons().size(), 2u) << e.what();
    EXPECT_NE(std::string(e.what()).find("source_lengths[0]: expected 0 to S = 3, got 4"),
              std::string::npos);
    EXPECT_NE(std::string(e.what()).find("source_lengths[1]"), std::string::npos);
  }
  try {
    att.backward(hidden, enc, {}, Tensor(DType::f32, {2, 5}), Tensor(DType::boolean, {2, 3}));
    FAIL() << "expected qkv::Error";
  } catch (const Error& e) {
    ASSERT_EQ(e.reasons().size(), 2u) << e.what();
    EXPECT_NE(std::string(e.what()).find("d_context: expected [B, H] = [2, 4], got [2, 5]"),
              std::string::npos);
    EXPECT_NE(std::string(e.what()).find("d_weights: expected dtype f32"), std::string::npos);
  }
}

// PyTorch's float64 outputs and autograd gradients for the essay's module
// (concatenation order encoder first). Both it and the module carry f64
// rounding errors within the error model's bound of the exact result.
TEST(AdditiveModule, MatchesPyTorchGolden) {
  nn::TensorMap file = nn::load_safetensors(test_data("additive_golden.safetensors"));
  nn::AdditiveAttention att(8, DType::f64);
  nn::TensorMap state;
  for (const char* name : {"attn.weight", "attn.bias", "v.weight"}) state[name] = file.at(name);
  nn::load_parameters(att.named_parameters(), state);
  const Tensor& hidden = file.at("input.hidden");
  const Tensor& enc = file.at("input.encoder_outputs");
  std::vector<std::int64_t> lengths;
  for (double l : values_of<double>(file.at("input.lengths"))) {
    lengths.push_back(static_cast<std::int64_t>(l));
  }
  const Tensor& dc = file.at("grad.d_context");
  const Tensor& dw = file.at("grad.d_weights");
  const auto exact = additive_loops<long double>(att, hidden, enc, lengths, dc, dw);
  const auto loops = additive_loops<double>(att, hidden, enc, lengths, dc, dw);
  const auto expect = [](ConstTensorView got, ConstTensorView torch, ConstTensorView want,
                         ConstTensorView naive, const char* name) {
    const double tol = tolerance(want, naive, DType::f64);
    EXPECT_LE(max_abs_diff(got, torch), 2 * tol) << name;
  };
  const auto out = att.forward(hidden, enc, lengths);
  expect(out.context, file.at("output.context"), exact.context, loops.context, "context");
  expect(out.weights, file.at("output.weights"), exact.weights, loops.weights, "weights");
  const auto grads = att.backward(hidden, enc, lengths, dc, dw);
  expect(grads.d_decoder_hidden, file.at("grad.hidden"), exact.d_hidden, loops.d_hidden,
         "d_decoder_hidden");
  expect(grads.d_encoder_outputs, file.at("grad.encoder_outputs"), exact.d_enc, loops.d_enc,
         "d_encoder_outputs");
  expect(att.attn_weight.grad, file.at("grad.attn.weight"), exact.d_attn_w, loops.d_attn_w,
         "attn.weight");
  expect(att.attn_bias.grad, file.at("grad.attn.bias"), exact.d_attn_b, loops.d_attn_b,
         "attn.bias");
  expect(att.v_weight.grad, file.at("grad.v.weight"), exact.d_v, loops.d_v, "v.weight");
}

}  // namespace
}  // namespace qkv::test
