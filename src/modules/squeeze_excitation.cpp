// Squeeze-and-excitation (timm's SEModule): two passes over the feature map
// (channel means, then the gated copy) around the [B, C] MLP, chunk of
// images by chunk of images (modules/feature_map.hpp).
#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "modules/common.hpp"
#include "modules/feature_map.hpp"
#include "qkv/error.hpp"
#include "qkv/modules/vision.hpp"

namespace qkv::nn {

std::int64_t make_divisible(double value, std::int64_t divisor, std::int64_t min_value,
                            double round_limit) {
  detail::Reasons r;
  if (divisor < 1) r.push_back("divisor: expected >= 1, got " + std::to_string(divisor));
  // Bounded so that the integer arithmetic below cannot overflow.
  if (!(std::fabs(value) < 0x1p52)) {
    r.push_back("value: expected a finite number below 2^52 in magnitude, got " +
                detail::num(value));
  }
  detail::throw_if(r);
  if (min_value == 0) min_value = divisor;
  // Python's int() truncates toward zero and // rounds toward -infinity.
  const auto whole =
      static_cast<std::int64_t>(std::trunc(value + static_cast<double>(divisor) / 2));
  std::int64_t quotient = whole / divisor;
  if (whole % divisor != 0 && whole < 0) --quotient;
  std::int64_t v = std::max(min_value, quotient * divisor);
  if (static_cast<double>(v) < round_limit * value) v += divisor;
  return v;
}

namespace {

using detail::FeatureMap;

// sums[b, c] = sum over pixels p of a[b, c, p] (times w[b, c, p] when w is
// given) in a fixed order: each nchw row by one thread, nhwc planes in fixed
// pixel blocks whose partial sums are added in block order.
template <class T>
void channel_sums(const FeatureMap& g, const T* a, const T* w, T* sums) {
  const std::int64_t P = g.pixels, C = g.channels;
  if (!g.nhwc) {
#pragma omp parallel for schedule(static) if (g.threaded())
    for (std::int64_t bc = 0; bc < g.batch * C; ++bc) {
      sums[bc] = w != nullptr ? detail::fixed_dot(a + bc * P, w + bc * P, P)
                              : detail::fixed_sum(a + bc * P, P);
    }
    return;
  }
  const std::int64_t blocks = detail::pixel_blocks(P);
  std::vector<T> partial(static_cast<std::size_t>(g.batch * blocks * C));
#pragma omp parallel for schedule(static) if (g.threaded())
  for (std::int64_t task = 0; task < g.batch * blocks; ++task) {
    const std::int64_t b = task / blocks, p0 = (task % blocks) * detail::kPixelBlock;
    const std::int64_t p1 = std::min(P, p0 + detail::kPixelBlock);
    T* acc = partial.data() + task * C;
    for (std::int64_t p = p0; p < p1; ++p) {
      const std::int64_t row = (b * P + p) * C;
      if (w != nullptr) {
        for (std::int64_t c = 0; c < C; ++c) acc[c] += a[row + c] * w[row + c];
      } else {
        for (std::int64_t c = 0; c < C; ++c) acc[c] += a[row + c];
      }
    }
  }
  std::fill(sums, sums + g.batch * C, T(0));
  for (std::int64_t b = 0; b < g.batch; ++b) {
    for (std::int64_t k = 0; k < blocks; ++k) {
      const T* acc = partial.data() + (b * blocks + k) * C;
      for (std::int64_t c = 0; c < C; ++c) sums[b * C + c] += acc[c];
    }
  }
}

// out[b, c, p] = a[b, c, p] * s[b, c] (+ add[b, c] when given).
template <class T>
void scale_channels(const FeatureMap& g, const T* a, const T* s, const T* add, T* out) {
  const std::int64_t P = g.pixels, C = g.channels;
  if (!g.nhwc) {
#pragma omp parallel for schedule(static) if (g.threaded())
    for (std::int64_t bc = 0; bc < g.batch * C; ++bc) {
      const T sc = s[bc], ac = add != nullptr ? add[bc] : T(0);
      const T* src = a + bc * P;
      T* dst = out + bc * P;
      if (add != nullptr) {
        for (std::int64_t p = 0; p < P; ++p) dst[p] = src[p] * sc + ac;
      } else {
        for (std::int64_t p = 0; p < P; ++p) dst[p] = src[p] * sc;
      }
    }
    return;
  }
  const std::int64_t blocks = detail::pixel_blocks(P);
#pragma omp parallel for schedule(static) if (g.threaded())
  for (std::int64_t task = 0; task < g.batch * blocks; ++task) {
    const std::int64_t b = task / blocks, p0 = (task % blocks) * detail::kPixelBlock;
    const std::int64_t p1 = std::min(P, p0 + detail::kPixelBlock);
    const T* sb = s + b * C;
    const T* ab = add != nullptr ? add + b * C : nullptr;
    for (std::int64_t p = p0; p < p1; ++p) {
      const std::int64_t row = (b * P + p) * C;
      if (ab != nullptr) {
        for (std::int64_t c = 0; c < C; ++c) out[row + c] = a[row + c] * sb[c] + ab[c];
      } else {
        for (std::int64_t c = 0; c < C; ++c) out[row + c] = a[row + c] * sb[c];
      }
    }
  }
}

// The forward's values that the backward reuses.
template <class T>
struct SeState {
  std::vector<T> mean;  // [B, C] channel means
  std::vector<T> pre;   // [B, rd] fc1 output
  std::vector<T> act;   // [B, rd] relu of it
  std::vector<T> gate;  // [B, C] sigmoid of fc2's output
};

template <class T>
struct SeWeights {
  detail::TypedParameter<T> w1, b1, w2, b2;

  explicit SeWeights(const SqueezeExcitation& m)
      : w1(detail::typed<T>(m.fc1_weight)),
        b1(detail::typed<T>(m.fc1_bias)),
        w2(detail::typed<T>(m.fc2_weight)),
        b2(detail::typed<T>(m.fc2_bias)) {}

  detail::ChannelMlp<T> mlp(const SqueezeExcitation& m) const {
    return {m.channels(), m.rd_channels(), w1.get(), b1.get(), w2.get(), b2.get()};
  }
};

// The gates of images [b0, b0 + part.batch) (x points at image b0), into
// those images' rows of `st`.
template <class T>
void se_gates(const FeatureMap& part, std::int64_t b0, const detail::ChannelMlp<T>& mlp, const T* x,
              SeState<T>& st) {
  const std::int64_t C = part.channels, n = part.batch;
  T* mean = st.mean.data() + b0 * C;
  channel_sums<T>(part, x, nullptr, mean);
  for (std::int64_t i = 0; i < n * C; ++i) mean[i] /= static_cast<T>(part.pixels);
  std::vector<T> logits(static_cast<std::size_t>(n * C));
  detail::mlp_forward(mlp, n, mean, st.pre.data() + b0 * mlp.hidden,
                      st.act.data() + b0 * mlp.hidden, logits.data());
  for (std::int64_t i = 0; i < n * C; ++i) st.gate[b0 * C + i] = detail::sigmoid(logits[i]);
}

template <class T>
SeState<T> make_state(const FeatureMap& g, std::int64_t hidden) {
  const auto bc = static_cast<std::size_t>(g.batch * g.channels);
  const auto bh = static_cast<std::size_t>(g.batch * hidden);
  return {std::vector<T>(bc), std::vector<T>(bh), std::vector<T>(bh), std::vector<T>(bc)};
}

template <class T>
void se_forward(const SqueezeExcitation& m, const FeatureMap& g, const T* x, T* y) {
  const SeWeights<T> w(m);
  const detail::ChannelMlp<T> mlp = w.mlp(m);
  SeState<T> st = make_state<T>(g, mlp.hidden);
  // Chunk by chunk, so that the second pass finds the chunk in cache.
  detail::for_each_chunk(g, [&](const FeatureMap& part, std::int64_t b0, std::int64_t offset) {
    se_gates(part, b0, mlp, x + offset, st);
    scale_channels<T>(part, x + offset, st.gate.data() + b0 * g.channels, nullptr, y + offset);
  });
}

template <class T>
void se_backward(SqueezeExcitation& m, const FeatureMap& g, const T* x, const T* dy, T* dx) {
  const SeWeights<T> w(m);
  const detail::ChannelMlp<T> mlp = w.mlp(m);
  // The forward's gates, computed chunk by chunk as it does.
  SeState<T> st = make_state<T>(g, mlp.hidden);
  detail::for_each_chunk(g, [&](const FeatureMap& part, std::int64_t b0, std::int64_t offset) {
    se_gates(part, b0, mlp, x + offset, st);
  });
  const auto bc = static_cast<std::size_t>(g.batch * g.channels);
  // d logits = (sum_p dy x) * g (1 - g).
  std::vector<T> d_logits(bc);
  channel_sums<T>(g, dy, x, d_logits.data());
  for (std::size_t i = 0; i < bc; ++i) d_logits[i] *= st.gate[i] * (T(1) - st.gate[i]);
  std::vector<T> d_mean(bc);
  detail::mlp_backward(mlp, g.batch, st.mean.data(), st.pre.data(), st.act.data(), d_logits.data(),
                       detail::typed_grad<T>(m.fc1_weight), detail::typed_grad<T>(m.fc1_bias),
                       detail::typed_grad<T>(m.fc2_weight), detail::typed_grad<T>(m.fc2_bias),
                       d_mean.data());
  // dx = dy g + d_mean / (H W): the gated path plus the mean's.
  for (T& d : d_mean) d /= static_cast<T>(g.pixels);
  scale_channels<T>(g, dy, st.gate.data(), d_mean.data(), dx);
}

}  // namespace

SqueezeExcitation::SqueezeExcitation(std::int64_t channels, const SqueezeExcitationOptions& options)
    : channels_(channels) {
  detail::Reasons r;
  rd_ = detail::reduced_channels(channels, options.rd_ratio, options.rd_divisor,
                                 options.rd_channels, options.dtype, r);
  detail::throw_if(r);
  fc1_weight = make_parameter(options.dtype, {rd_, channels_, 1, 1});
  fc2_weight = make_parameter(options.dtype, {channels_, rd_, 1, 1});
  if (options.bias) {
    fc1_bias = make_parameter(options.dtype, {rd_});
    fc2_bias = make_parameter(options.dtype, {channels_});
  }
}

namespace {

// Reasons the public parameters no longer have this module's shapes.
void check_se_parameters(const SqueezeExcitation& m, detail::Reasons& r) {
  const std::int64_t c = m.channels(), rd = m.rd_channels();
  detail::check_parameter("fc1.weight", m.fc1_weight, {rd, c, 1, 1}, r);
  detail::check_parameter("fc2.weight", m.fc2_weight, {c, rd, 1, 1}, r);
  if (m.fc1_bias.defined() || m.fc2_bias.defined()) {
    detail::check_parameter("fc1.bias", m.fc1_bias, {rd}, r);
    detail::check_parameter("fc2.bias", m.fc2_bias, {c}, r);
  }
}

}  // namespace

Tensor SqueezeExcitation::forward(ConstTensorView x, ImageLayout layout) const {
  detail::Reasons r;
  const FeatureMap g = detail::feature_map("x", x, channels_, layout, r);
  check_se_parameters(*this, r);
  detail::throw_if(r);

  return detail::in_compute_dtype(
      x, {}, [&](const auto* xs, const auto*, auto* y) { se_forward(*this, g, xs, y); });
}

Tensor SqueezeExcitation::backward(ConstTensorView x, ConstTensorView dy, ImageLayout layout) {
  detail::Reasons r;
  const FeatureMap g = detail::feature_map("x", x, channels_, layout, r);
  detail::check_same_sizes(x, dy, r);
  check_se_parameters(*this, r);
  const DType ct = detail::compute_dtype(x.dtype());
  if (x.defined()) detail::check_grads(named_parameters(), ct, r);
  detail::throw_if(r);

  return detail::in_compute_dtype(x, dy, [&](const auto* xs, const auto* dys, auto* dx) {
    se_backward(*this, g, xs, dys, dx);
  });
}

NamedParameters SqueezeExcitation::named_parameters(std::string_view prefix) {
  const std::string p(prefix);
  NamedParameters list{{p + "fc1.weight", &fc1_weight}};
  if (fc1_bias.defined()) list.push_back({p + "fc1.bias", &fc1_bias});
  list.push_back({p + "fc2.weight", &fc2_weight});
  if (fc2_bias.defined()) list.push_back({p + "fc2.bias", &fc2_bias});
  return list;
}

}  // namespace qkv::nn
