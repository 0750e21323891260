// qkv::nn::SqueezeExcitation and qkv::nn::Cbam: forward against plain loops
// (NCHW and NHWC, strided views, 16-bit inputs), backward against finite
// differences, thread-count independence, validation, and timm's outputs
// (tests/data/*_golden.safetensors, written by make_golden_vision.py).
//
// Tolerances follow the tests' error model: the module's error against the
// loops run in long double (the exact result, rounded once to double) may be
// at most twice the error of the same loops run in the compute precision,
// plus the rounding of the output at its magnitude.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "module_checks.hpp"
#include "modules/feature_map.hpp"
#include "qkv/modules/safetensors.hpp"
#include "qkv/modules/vision.hpp"

namespace qkv::test {
namespace {

using nn::ImageLayout;

// The bias's values, or zeros when the layer has none.
template <class T>
std::vector<T> bias_of(const nn::Parameter& p, std::int64_t n) {
  return p.defined() ? values_of<T>(p.value) : std::vector<T>(static_cast<std::size_t>(n));
}

template <class T>
T sigmoid(T z) {
  return T(1) / (T(1) + std::exp(-z));
}

// fc2(relu(fc1(v))) with weights w1 [R, C], w2 [C, R].
template <class T>
std::vector<T> mlp(const std::vector<T>& v, const std::vector<T>& w1, const std::vector<T>& b1,
                   const std::vector<T>& w2, const std::vector<T>& b2) {
  const std::size_t C = v.size(), R = b1.size();
  std::vector<T> hidden(R), out(C);
  for (std::size_t r = 0; r < R; ++r) {
    T s = b1[r];
    for (std::size_t c = 0; c < C; ++c) s += w1[r * C + c] * v[c];
    hidden[r] = std::max(s, T(0));
  }
  for (std::size_t c = 0; c < C; ++c) {
    T s = b2[c];
    for (std::size_t r = 0; r < R; ++r) s += w2[c * R + r] * hidden[r];
    out[c] = s;
  }
  return out;
}

// SE on an NCHW x with every operation in T, as in timm's SEModule.forward.
template <class T>
Tensor se_loops(const nn::SqueezeExcitation& m, ConstTensorView x) {
  const std::int64_t B = x.size(0), C = x.size(1), P = x.size(2) * x.size(3);
  const std::int64_t R = m.rd_channels();
  const auto xv = values_of<T>(x), w1 = values_of<T>(m.fc1_weight.value);
  const auto w2 = values_of<T>(m.fc2_weight.value);
  const auto b1 = bias_of<T>(m.fc1_bias, R), b2 = bias_of<T>(m.fc2_bias, C);
  Tensor y(DType::f64, x.size_span());
  double* yp = y.data<double>();
  for (std::int64_t b = 0; b < B; ++b) {
    std::vector<T> mean(static_cast<std::size_t>(C));
    for (std::int64_t c = 0; c < C; ++c) {
      T s = 0;
      for (std::int64_t p = 0; p < P; ++p) s += xv[(b * C + c) * P + p];
      mean[c] = s / T(P);
    }
    const std::vector<T> logits = mlp(mean, w1, b1, w2, b2);
    for (std::int64_t c = 0; c < C; ++c) {
      const T g = sigmoid(logits[c]);
      for (std::int64_t p = 0; p < P; ++p) {
        const std::int64_t e = (b * C + c) * P + p;
        yp[e] = static_cast<double>(xv[e] * g);
      }
    }
  }
  return y;
}

// CBAM on an NCHW x with every operation in T, as in timm's
// CbamModule.forward in eval() mode (BatchNorm with running statistics).
template <class T>
Tensor cbam_loops(const nn::Cbam& m, ConstTensorView x, double eps = 1e-5) {
  const std::int64_t B = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3), P = H * W;
  const std::int64_t R = m.rd_channels(), K = m.kernel_size(), r = K / 2;
  const auto xv = values_of<T>(x), w1 = values_of<T>(m.channel_fc1_weight.value);
  const auto w2 = values_of<T>(m.channel_fc2_weight.value);
  const auto b1 = bias_of<T>(m.channel_fc1_bias, R), b2 = bias_of<T>(m.channel_fc2_bias, C);
  const auto kernel = values_of<T>(m.spatial_conv_weight.value);
  const T gamma = static_cast<T>(m.spatial_bn_weight.value.get({0}));
  const T beta = static_cast<T>(m.spatial_bn_bias.value.get({0}));
  const T mu = static_cast<T>(m.spatial_bn_running_mean.value.get({0}));
  const T var = static_cast<T>(m.spatial_bn_running_var.value.get({0}));
  Tensor y(DType::f64, x.size_span());
  double* yp = y.data<double>();
  for (std::int64_t b = 0; b < B; ++b) {
    std::vector<T> avg(static_cast<std::size_t>(C)), top(static_cast<std::size_t>(C));
    for (std::int64_t c = 0; c < C; ++c) {
      T s = 0, mx = xv[(b * C + c) * P];
      for (std::int64_t p = 0; p < P; ++p) {
        s += xv[(b * C + c) * P + p];
        mx = std::max(mx, xv[(b * C + c) * P + p]);
      }
      avg[c] = s / T(P);
      top[c] = mx;
    }
    const auto ua = mlp(avg, w1, b1, w2, b2), um = mlp(top, w1, b1, w2, b2);
    std::vector<T> x1(static_cast<std::size_t>(C * P));
    for (std::int64_t c = 0; c < C; ++c) {
      const T s = sigmoid(ua[c] + um[c]);
      for (std::int64_t p = 0; p < P; ++p) x1[c * P + p] = xv[(b * C + c) * P + p] * s;
    }
    // The two pooled planes, [2, H, W].
    std::vector<T> pooled(static_cast<std::size_t>(2 * P));
    for (std::int64_t p = 0; p < P; ++p) {
      T s = 0, mx = x1[p];
      for (std::int64_t c = 0; c < C; ++c) {
        s += x1[c * P + p];
        mx = std::max(mx, x1[c * P + p]);
      }
      pooled[p] = s / T(C);
      pooled[P + p] = mx;
    }
    for (std::int64_t i = 0; i < H; ++i) {
      for (std::int64_t j = 0; j < W; ++j) {
        T t = 0;
        for (std::int64_t k = 0; k < 2; ++k) {
          for (std::int64_t di = 0; di < K; ++di) {
            for (std::int64_t dj = 0; dj < K; ++dj) {
              const std::int64_t ii = i + di - r, jj = j + dj - r;
              if (ii < 0 || ii >= H || jj < 0 || jj >= W) continue;
              t += kernel[(k * K + di) * K + dj] * pooled[k * P + ii * W + jj];
            }
          }
        }
        const T z = (t - mu) / std::sqrt(var + static_cast<T>(eps)) * gamma + beta;
        const T gate = sigmoid(z);
        for (std::int64_t c = 0; c < C; ++c) {
          yp[(b * C + c) * P + i * W + j] = static_cast<double>(x1[c * P + i * W + j] * gate);
        }
      }
    }
  }
  return y;
}

// [B, H, W, C] view of an NCHW view (no copy).
ConstTensorView as_nhwc(ConstTensorView nchw) { return nchw.transpose(1, 2).transpose(2, 3); }

// Error bound of the tests' model for an output of `dtype` computed in f32
// (f64 for f64): twice the error of the loops in that precision plus the
// output's rounding.
double tolerance(ConstTensorView exact, ConstTensorView loops, DType dtype) {
  return 2.0 * max_abs_diff(loops, exact) +
         (dtype == DType::f64 ? std::ldexp(1.0, -53) : unit_roundoff(dtype)) * max_abs(exact);
}

// x [B, C, H, W] of `dtype` read through a non-contiguous view: a [B, C, W, H]
// tensor with its last two dimensions exchanged.
struct StridedInput {
  Tensor base;
  ConstTensorView x;
};
StridedInput strided_input(DType dtype, std::int64_t B, std::int64_t C, std::int64_t H,
                           std::int64_t W, std::uint32_t seed) {
  StridedInput in{random_tensor(dtype, {B, C, W, H}, seed), {}};
  in.x = in.base.view().transpose(2, 3);
  return in;
}

struct SeCase {
  std::int64_t channels;
  nn::SqueezeExcitationOptions options;
  std::int64_t batch, height, width;
};

TEST(VisionModules, MakeDivisibleMirrorsTimm) {
  // Values from timm.layers.helpers.make_divisible.
  EXPECT_EQ(nn::make_divisible(4.0, 8, 0, 0.0), 8);
  EXPECT_EQ(nn::make_divisible(4.0, 1, 0, 0.0), 4);
  EXPECT_EQ(nn::make_divisible(16.0, 8, 0, 0.0), 16);
  EXPECT_EQ(nn::make_divisible(0.625, 8, 0, 0.0), 8);
  EXPECT_EQ(nn::make_divisible(0.625, 1, 0, 0.0), 1);
  EXPECT_EQ(nn::make_divisible(2.5, 1, 0, 0.0), 3);
  EXPECT_EQ(nn::make_divisible(1.5, 1, 0, 0.0), 2);
  EXPECT_EQ(nn::make_divisible(37.5, 8), 40);
  EXPECT_EQ(nn::make_divisible(9.0, 8), 16);  // 8 < 0.9 * 9, one divisor more
  EXPECT_EQ(nn::make_divisible(10.0, 4), 12);
  EXPECT_EQ(nn::make_divisible(3.2, 8, 16), 16);
  EXPECT_THROW(nn::make_divisible(1.0, 0), Error);
  // The hidden widths timm derives: SEModule(64) has 8, CbamModule(64) 4.
  EXPECT_EQ(nn::SqueezeExcitation(64).rd_channels(), 8);
  EXPECT_EQ(nn::Cbam(64).rd_channels(), 4);
  EXPECT_EQ(nn::SqueezeExcitation(10).rd_channels(), 8);
  EXPECT_EQ(nn::Cbam(10).rd_channels(), 1);
  EXPECT_EQ(nn::SqueezeExcitation(64, {.rd_channels = 5}).rd_channels(), 5);
}

TEST(VisionModules, SqueezeExcitationForwardMatchesLoopsInBothLayouts) {
  const std::vector<SeCase> cases{
      {32, {}, 2, 7, 9},
      {17, {.rd_channels = 5, .bias = false}, 3, 1, 1},
      {5, {.rd_ratio = 0.5, .rd_divisor = 1}, 1, 4, 33},  // 132 pixels: two pixel blocks
  };
  for (const SeCase& c : cases) {
    nn::SqueezeExcitation se(c.channels, c.options);
    nn::init_uniform(se.named_parameters(), 5);
    const StridedInput in = strided_input(DType::f32, c.batch, c.channels, c.height, c.width, 6);
    const Tensor exact = se_loops<long double>(se, in.x);
    const double tol = tolerance(exact, se_loops<float>(se, in.x), DType::f32);
    const Tensor y = se.forward(in.x);
    EXPECT_LE(max_abs_diff(y, exact), tol) << "nchw C = " << c.channels;
    const Tensor y_nhwc = se.forward(as_nhwc(in.x), ImageLayout::nhwc);
    ASSERT_EQ(y_nhwc.size(3), c.channels);
    EXPECT_LE(max_abs_diff(y_nhwc, as_nhwc(exact)), tol) << "nhwc C = " << c.channels;
    EXPECT_LE(max_abs_diff(y_nhwc, as_nhwc(y)), 2 * tol) << "nchw vs nhwc C = " << c.channels;
  }
}

TEST(VisionModules, SqueezeExcitationSixteenBitInputsRoundOnce) {
  for (DType dt : {DType::bf16, DType::f16}) {
    nn::SqueezeExcitation se(24, {.dtype = dt});
    nn::init_uniform(se.named_parameters(), 8);
    const Tensor x = random_tensor(dt, {2, 24, 5, 6}, 9);
    const Tensor y = se.forward(x);
    EXPECT_EQ(y.dtype(), dt);
    const Tensor exact = se_loops<long double>(se, x);
    // The f32 loops' error twice, plus one rounding to dt.
    EXPECT_LE(max_abs_diff(y, exact), tolerance(exact, se_loops<float>(se, x), dt))
        << dtype_name(dt);
  }
}

void set_batch_norm(nn::Cbam& m, double weight, double bias, double mean, double var) {
  m.spatial_bn_weight.value.set({0}, weight);
  m.spatial_bn_bias.value.set({0}, bias);
  m.spatial_bn_running_mean.value.set({0}, mean);
  m.spatial_bn_running_var.value.set({0}, var);
}

struct CbamCase {
  std::int64_t channels;
  nn::CbamOptions options;
  std::int64_t batch, height, width;
};

TEST(VisionModules, CbamForwardMatchesLoopsInBothLayouts) {
  const std::vector<CbamCase> cases{
      {32, {}, 2, 7, 9},
      {17, {.rd_channels = 3, .mlp_bias = true, .spatial_kernel_size = 3}, 3, 1, 1},
      {5, {.rd_ratio = 0.5, .spatial_kernel_size = 5}, 1, 4, 33},
      {8, {.mlp_bias = true}, 2, 12, 13},  // 156 pixels: two pixel blocks
  };
  for (const CbamCase& c : cases) {
    nn::Cbam cbam(c.channels, c.options);
    nn::init_uniform(cbam.named_parameters(), 15);
    set_batch_norm(cbam, 1.3, -0.2, 0.1, 0.7);
    const StridedInput in = strided_input(DType::f32, c.batch, c.channels, c.height, c.width, 16);
    const Tensor exact = cbam_loops<long double>(cbam, in.x);
    const double tol = tolerance(exact, cbam_loops<float>(cbam, in.x), DType::f32);
    const Tensor y = cbam.forward(in.x);
    EXPECT_LE(max_abs_diff(y, exact), tol) << "nchw C = " << c.channels;
    const Tensor y_nhwc = cbam.forward(as_nhwc(in.x), ImageLayout::nhwc);
    EXPECT_LE(max_abs_diff(y_nhwc, as_nhwc(exact)), tol) << "nhwc C = " << c.channels;
    EXPECT_LE(max_abs_diff(y_nhwc, as_nhwc(y)), 2 * tol) << "nchw vs nhwc C = " << c.channels;
  }
}

TEST(VisionModules, CbamSixteenBitInputsRoundOnce) {
  nn::Cbam cbam(16, {.dtype = DType::bf16});
  nn::init_uniform(cbam.named_parameters(), 18);
  set_batch_norm(cbam, 0.9, 0.1, -0.05, 1.2);
  const Tensor x = random_tensor(DType::bf16, {2, 16, 6, 7}, 19);
  const Tensor y = cbam.forward(x);
  EXPECT_EQ(y.dtype(), DType::bf16);
  const Tensor exact = cbam_loops<long double>(cbam, x);
  EXPECT_LE(max_abs_diff(y, exact), tolerance(exact, cbam_loops<float>(cbam, x), DType::bf16));
}

// x as a contiguous f64 tensor in `layout`, from an NCHW tensor.
Tensor in_layout(const Tensor& nchw, ImageLayout layout) {
  return layout == ImageLayout::nhwc ? to_dtype(as_nhwc(nchw), DType::f64) : nchw;
}

// dL/dparameter for every parameter with a gradient, as finite-difference targets.
std::vector<GradientTarget> parameter_targets(const nn::NamedParameters& params) {
  std::vector<GradientTarget> targets;
  for (const nn::NamedParameter& p : params) {
    if (p.parameter->grad.defined()) {
      targets.push_back({p.name, p.parameter->value, p.parameter->grad});
    }
  }
  return targets;
}

TEST(VisionModules, SqueezeExcitationBackwardMatchesFiniteDifferences) {
  for (bool bias : {true, false}) {
    for (ImageLayout layout : {ImageLayout::nchw, ImageLayout::nhwc}) {
      nn::SqueezeExcitation se(6, {.rd_channels = 3, .bias = bias, .dtype = DType::f64});
      nn::init_uniform(se.named_parameters(), 31);
      Tensor x = in_layout(random_tensor(DType::f64, {2, 6, 3, 4}, 32), layout);
      const Tensor weights = in_layout(random_tensor(DType::f64, {2, 6, 3, 4}, 33), layout);
      const Tensor dx = se.backward(x, weights, layout);
      std::vector<GradientTarget> targets = parameter_targets(se.named_parameters());
      EXPECT_EQ(targets.size(), bias ? 4u : 2u);
      targets.push_back({"x", x.view(), dx.view()});
      SCOPED_TRACE(std::string(layout == ImageLayout::nhwc ? "nhwc" : "nchw") +
                   (bias ? " with bias" : " without bias"));
      expect_gradients_match_fd([&] { return se.forward(x, layout); }, weights, targets);
    }
  }
}

TEST(VisionModules, CbamBackwardMatchesFiniteDifferences) {
  struct Case {
    bool mlp_bias;
    std::int64_t kernel;
  };
  for (const Case c : {Case{false, 7}, Case{true, 3}}) {
    for (ImageLayout layout : {ImageLayout::nchw, ImageLayout::nhwc}) {
      nn::Cbam cbam(6, {.rd_channels = 2,
                        .mlp_bias = c.mlp_bias,
                        .spatial_kernel_size = c.kernel,
                        .dtype = DType::f64});
      nn::init_uniform(cbam.named_parameters(), 41);
      set_batch_norm(cbam, 1.3, -0.2, 0.1, 0.7);
      Tensor x = in_layout(random_tensor(DType::f64, {2, 6, 4, 5}, 42), layout);
      const Tensor weights = in_layout(random_tensor(DType::f64, {2, 6, 4, 5}, 43), layout);
      const Tensor dx = cbam.backward(x, weights, layout);
      std::vector<GradientTarget> targets = parameter_targets(cbam.named_parameters());
      // MLP weights (and biases), the convolution and BatchNorm's affine
      // pair; the running statistics get no gradient.
      EXPECT_EQ(targets.size(), c.mlp_bias ? 7u : 5u);
      EXPECT_FALSE(cbam.spatial_bn_running_mean.grad.defined());
      EXPECT_FALSE(cbam.spatial_bn_running_var.grad.defined());
      targets.push_back({"x", x.view(), dx.view()});
      SCOPED_TRACE(std::string(layout == ImageLayout::nhwc ? "nhwc" : "nchw") + " kernel " +
                   std::to_string(c.kernel));
      expect_gradients_match_fd([&] { return cbam.forward(x, layout); }, weights, targets);
    }
  }
}

// The outputs and gradients of one forward and backward, as raw bytes.
template <class Module>
std::vector<std::vector<char>> run_bytes(Module& m, const Tensor& x, const Tensor& dy,
                                         ImageLayout layout) {
  nn::zero_grad(m.named_parameters());
  std::vector<std::vector<char>> out;
  const auto add = [&](ConstTensorView t) {
    const auto* p = static_cast<const char*>(t.data());
    out.emplace_back(p, p + t.numel() * static_cast<std::int64_t>(dtype_size(t.dtype())));
  };
  const Tensor y = m.forward(x, layout);
  const Tensor dx = m.backward(x, dy, layout);
  add(y);
  add(dx);
  for (const nn::NamedParameter& p : m.named_parameters()) {
    if (p.parameter->grad.defined()) add(p.parameter->grad);
  }
  return out;
}

template <class Module>
void expect_thread_count_invariant(Module& m, std::int64_t batch) {
  const int saved = omp_get_max_threads();
  for (ImageLayout layout : {ImageLayout::nchw, ImageLayout::nhwc}) {
    // 300 or 1200 pixels (several pixel blocks), and enough elements for the
    // passes to use threads.
    const std::int64_t height = batch == 1 ? 40 : 20, width = batch == 1 ? 30 : 15;
    const Tensor x = random_tensor(DType::f32, {batch, 16, height, width}, 51);
    const Tensor dy = random_tensor(DType::f32, {batch, 16, height, width}, 52);
    ASSERT_GE(x.numel(), nn::detail::kMinThreadedElements);
    const Tensor xl = layout == ImageLayout::nhwc ? to_dtype(as_nhwc(x), DType::f32) : x;
    const Tensor dyl = layout == ImageLayout::nhwc ? to_dtype(as_nhwc(dy), DType::f32) : dy;
    omp_set_num_threads(1);
    const auto one = run_bytes(m, xl, dyl, layout);
    omp_set_num_threads(2);
    const auto two = run_bytes(m, xl, dyl, layout);
    EXPECT_EQ(one, two) << (layout == ImageLayout::nhwc ? "nhwc" : "nchw") << " B = " << batch;
  }
  omp_set_num_threads(saved);
}

TEST(VisionModules, ResultsDoNotDependOnTheThreadCount) {
  nn::SqueezeExcitation se(16, {.rd_channels = 4});
  nn::init_uniform(se.named_parameters(), 53);
  nn::Cbam cbam(16, {.mlp_bias = true});
  nn::init_uniform(cbam.named_parameters(), 54);
  set_batch_norm(cbam, 1.1, 0.05, 0.02, 0.9);
  // B = 1 makes the MLP's products matrix-vector ones.
  for (std::int64_t batch : {4, 1}) {
    expect_thread_count_invariant(se, batch);
    expect_thread_count_invariant(cbam, batch);
  }
}

TEST(VisionModules, EmptyBatchGivesEmptyResults) {
  nn::SqueezeExcitation se(4);
  nn::Cbam cbam(4);
  for (ImageLayout layout : {ImageLayout::nchw, ImageLayout::nhwc}) {
    const Tensor x(DType::f32, {0, 4, 4, 4});
    EXPECT_EQ(se.forward(x, layout).size(0), 0);
    EXPECT_EQ(cbam.forward(x, layout).size(0), 0);
    EXPECT_EQ(se.backward(x, x, layout).size(0), 0);
    EXPECT_EQ(cbam.backward(x, x, layout).size(0), 0);
  }
  // No image, no gradient.
  EXPECT_EQ(max_abs(se.fc1_weight.grad), 0.0);
  EXPECT_EQ(max_abs(cbam.spatial_conv_weight.grad), 0.0);
}

bool mentions(const std::vector<std::string>& reasons, const std::string& text) {
  return std::any_of(reasons.begin(), reasons.end(),
                     [&](const std::string& r) { return r.find(text) != std::string::npos; });
}

TEST(VisionModules, ValidationNamesEveryProblem) {
  auto r = reasons_of([] {
    nn::SqueezeExcitation(
        0, {.rd_ratio = 0.0, .rd_channels = -1, .rd_divisor = 0, .dtype = DType::boolean});
  });
  EXPECT_EQ(r.size(), 5u);
  EXPECT_TRUE(mentions(r, "channels: expected >= 1"));
  EXPECT_TRUE(mentions(r, "rd_ratio"));
  r = reasons_of([] { nn::Cbam(8, {.spatial_kernel_size = 4, .bn_eps = -1.0}); });
  EXPECT_EQ(r.size(), 2u);
  EXPECT_TRUE(mentions(r, "spatial_kernel_size: expected an odd size"));
  EXPECT_TRUE(mentions(r, "bn_eps"));

  nn::SqueezeExcitation se(4);
  r = reasons_of([&] { se.forward(Tensor(DType::boolean, {2, 4, 3})); });
  EXPECT_EQ(r.size(), 2u);
  EXPECT_TRUE(mentions(r, "x: expected dtype f32"));
  EXPECT_TRUE(mentions(r, "x: expected rank 4 [B, C, H, W]"));
  r = reasons_of([&] { se.forward(Tensor(DType::f32, {2, 3, 0, 4})); });
  EXPECT_EQ(r.size(), 2u);
  EXPECT_TRUE(mentions(r, "expected C = 4 channels"));
  EXPECT_TRUE(mentions(r, "expected H, W >= 1"));
  // NHWC reads the channels from the last dimension.
  EXPECT_NO_THROW(se.forward(Tensor(DType::f32, {2, 3, 5, 4}), ImageLayout::nhwc));
  r = reasons_of([&] {
    se.backward(Tensor(DType::f32, {2, 4, 3, 3}), Tensor(DType::f32, {2, 4, 3, 2}));
  });
  ASSERT_EQ(r.size(), 1u);
  EXPECT_TRUE(mentions(r, "dy: expected the sizes of x [2, 4, 3, 3]"));

  nn::Cbam cbam(4);
  cbam.spatial_bn_running_var.value.set({0}, -1.0);
  r = reasons_of([&] { cbam.forward(Tensor(DType::f32, {1, 5, 2, 2})); });
  EXPECT_EQ(r.size(), 2u);
  EXPECT_TRUE(mentions(r, "spatial.conv.bn.running_var"));
  EXPECT_TRUE(mentions(r, "expected C = 4 channels"));
}

TEST(VisionModules, ParameterNamesAreTimms) {
  std::vector<std::string> names;
  nn::SqueezeExcitation se(64);
  for (const auto& p : se.named_parameters("se.")) names.push_back(p.name);
  EXPECT_EQ(names, (std::vector<std::string>{"se.fc1.weight", "se.fc1.bias", "se.fc2.weight",
                                             "se.fc2.bias"}));
  names.clear();
  nn::Cbam cbam(64);
  for (const auto& p : cbam.named_parameters()) names.push_back(p.name);
  EXPECT_EQ(names, (std::vector<std::string>{"channel.fc1.weight", "channel.fc2.weight",
                                             "spatial.conv.conv.weight", "spatial.conv.bn.weight",
                                             "spatial.conv.bn.bias", "spatial.conv.bn.running_mean",
                                             "spatial.conv.bn.running_var"}));
  EXPECT_EQ(cbam.spatial_conv_weight.value.size(3), 7);
  // A fresh BatchNorm, as PyTorch's.
  EXPECT_EQ(cbam.spatial_bn_weight.value.get({0}), 1.0);
  EXPECT_EQ(cbam.spatial_bn_running_var.value.get({0}), 1.0);
}

// Loads a golden file's state dict into `params` (strictly: every name is
// timm's) and returns its input and output.
std::pair<Tensor, Tensor> load_golden(const char* name, const nn::NamedParameters& params) {
  nn::TensorMap file = nn::load_safetensors(test_data(name));
  std::pair<Tensor, Tensor> io{file.at("input.x"), file.at("output.y")};
  file.erase("input.x");
  file.erase("output.y");
  nn::load_parameters(params, file);
  return io;
}

// timm's float64 output against the module in both layouts. Both carry f64
// rounding errors: each is within the error model's bound of the exact
// result, so they differ by at most twice that.
TEST(VisionModules, SqueezeExcitationMatchesTimmGolden) {
  nn::SqueezeExcitation se(64, {.dtype = DType::f64});
  const auto [x, want] = load_golden("se_golden.safetensors", se.named_parameters());
  const Tensor exact = se_loops<long double>(se, x);
  const double tol = tolerance(exact, se_loops<double>(se, x), DType::f64);
  EXPECT_LE(max_abs_diff(se.forward(x), want), 2 * tol);
  EXPECT_LE(max_abs_diff(se.forward(as_nhwc(x), ImageLayout::nhwc), as_nhwc(want)), 2 * tol);
  // The golden output differs from the input's gating by much more than that.
  EXPECT_GT(max_abs_diff(want, x), 1e3 * tol);
}

TEST(VisionModules, CbamMatchesTimmGolden) {
  nn::Cbam cbam(64, {.dtype = DType::f64});
  const auto [x, want] = load_golden("cbam_golden.safetensors", cbam.named_parameters());
  EXPECT_EQ(cbam.spatial_bn_running_var.value.get({0}), 0.8);
  const Tensor exact = cbam_loops<long double>(cbam, x);
  const double tol = tolerance(exact, cbam_loops<double>(cbam, x), DType::f64);
  EXPECT_LE(max_abs_diff(cbam.forward(x), want), 2 * tol);
  EXPECT_LE(max_abs_diff(cbam.forward(as_nhwc(x), ImageLayout::nhwc), as_nhwc(want)), 2 * tol);
  EXPECT_GT(max_abs_diff(want, x), 1e3 * tol);
}

TEST(VisionModules, ReplacedParametersAreErrorsAndBackwardChangesNothingOnError) {
  nn::SqueezeExcitation se(16);
  se.fc1_weight = nn::make_parameter(DType::f32, {1, 16, 1, 1});  // rd is 8
  const Tensor x = random_tensor(DType::f32, {1, 16, 3, 3}, 1);
  const std::vector<std::string> r = reasons_of([&] { se.forward(x); });
  ASSERT_EQ(r.size(), 1u);
  EXPECT_NE(r[0].find("fc1.weight"), std::string::npos) << r[0];

  nn::Cbam cbam(16);
  nn::init_uniform(cbam.named_parameters(), 2);
  cbam.spatial_bn_running_var.value.set({0}, 1.0);
  // An f64 gradient left on one parameter: the f32 backward refuses before
  // any gradient (BatchNorm's among them) is changed.
  cbam.channel_fc1_weight.grad = Tensor(DType::f64, {1, 16, 1, 1});
  EXPECT_THROW(cbam.backward(x, x), Error);
  EXPECT_FALSE(cbam.spatial_bn_weight.grad.defined());
  EXPECT_FALSE(cbam.spatial_conv_weight.grad.defined());
}

}  // namespace
}  // namespace qkv::test
