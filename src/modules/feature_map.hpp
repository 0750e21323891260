// Plumbing shared by the feature-map modules (SqueezeExcitation, Cbam):
// geometry and validation of [B, C, H, W] / [B, H, W, C] inputs, fixed-order
// sums that the compiler can vectorize, and the pooled channel MLP
// fc2(relu(fc1(.))) on OpenBLAS.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "modules/common.hpp"
#include "qkv/modules/vision.hpp"

namespace qkv::nn::detail {

// Elements below which a feature-map pass runs on the calling thread alone:
// waking the OpenMP team costs more than such a pass (and far more when the
// cores are busy). Which thread runs a task never changes a result.
inline constexpr std::int64_t kMinThreadedElements = 1 << 14;

// A feature map seen as `batch` planes of [channels, pixels] (nchw) or
// [pixels, channels] (nhwc), pixels = height * width.
struct FeatureMap {
  std::int64_t batch = 0;
  std::int64_t channels = 0;
  std::int64_t height = 0;
  std::int64_t width = 0;
  std::int64_t pixels = 0;
  bool nhwc = false;

  std::int64_t numel() const { return batch * channels * pixels; }
  std::int64_t image_numel() const { return channels * pixels; }
  bool threaded() const { return numel() >= kMinThreadedElements; }

  // The forwards run their passes chunk of images by chunk, so that the
  // later passes find a chunk in L2 where the first one left it: one image
  // when it holds kMinThreadedElements elements or more, else as many as
  // make that count (so the passes still use threads). Images per chunk:
  std::int64_t chunk_images() const {
    const std::int64_t per_image = std::max<std::int64_t>(image_numel(), 1);
    return std::clamp<std::int64_t>((kMinThreadedElements + per_image - 1) / per_image, 1,
                                    std::max<std::int64_t>(batch, 1));
  }
  // The same map restricted to `n` images.
  FeatureMap images(std::int64_t n) const {
    FeatureMap part = *this;
    part.batch = n;
    return part;
  }
};

// Calls f(part, b0, offset) for each chunk of images: `part` is the chunk's
// geometry, b0 its first image and offset that image's first element.
template <class F>
void for_each_chunk(const FeatureMap& g, F&& f) {
  const std::int64_t chunk = g.chunk_images();
  for (std::int64_t b0 = 0; b0 < g.batch; b0 += chunk) {
    const FeatureMap part = g.images(std::min(chunk, g.batch - b0));
    f(part, b0, b0 * g.image_numel());
  }
}

// The geometry of `x` under `layout`; appends the reasons it cannot be used
// by a module of `channels` channels.
inline FeatureMap feature_map(const char* name, ConstTensorView x, std::int64_t channels,
                              ImageLayout layout, Reasons& reasons) {
  if (layout != ImageLayout::nchw && layout != ImageLayout::nhwc) {
    reasons.push_back("layout: expected ImageLayout::nchw or ImageLayout::nhwc, got value " +
                      std::to_string(static_cast<int>(layout)));
  }
  const bool nhwc = layout == ImageLayout::nhwc;
  const char* shape = nhwc ? "[B, H, W, C]" : "[B, C, H, W]";
  FeatureMap m;
  m.nhwc = nhwc;
  if (!check_input(name, x, 4, shape, reasons)) return m;
  m.batch = x.size(0);
  m.channels = x.size(nhwc ? 3 : 1);
  m.height = x.size(nhwc ? 1 : 2);
  m.width = x.size(nhwc ? 2 : 3);
  m.pixels = m.height * m.width;
  if (m.channels != channels) {
    reasons.push_back(std::string(name) + ": expected C = " + std::to_string(channels) +
                      " channels in " + shape + ", got " + shape_string(x.size_span()) +
                      (nhwc ? "" : " (pass ImageLayout::nhwc for channels-last inputs)"));
  }
  if (m.pixels == 0) {
    reasons.push_back(std::string(name) + ": expected H, W >= 1 in " + shape + ", got " +
                      shape_string(x.size_span()));
  }
  return m;
}

// Appends a reason unless dy has the sizes of x.
inline void check_same_sizes(ConstTensorView x, ConstTensorView dy, Reasons& reasons) {
  if (!check_input("dy", dy, 4, "(the sizes of x)", reasons)) return;
  if (x.defined() && x.rank() == 4 &&
      !std::equal(x.size_span().begin(), x.size_span().end(), dy.size_span().begin())) {
    reasons.push_back("dy: expected the sizes of x " + shape_string(x.size_span()) + ", got " +
                      shape_string(dy.size_span()));
  }
}

// Checks the channel-reduction settings that SE and CBAM share (appending
// reasons) and returns the MLP's hidden width: rd_channels when given, else
// timm's make_divisible(channels * rd_ratio, rd_divisor, round_limit = 0);
// 0 when a check failed.
inline std::int64_t reduced_channels(std::int64_t channels, double rd_ratio,
                                     std::int64_t rd_divisor, std::int64_t rd_channels, DType dtype,
                                     Reasons& r) {
  const std::size_t before = r.size();
  if (channels < 1) r.push_back("channels: expected >= 1, got " + std::to_string(channels));
  if (!(rd_ratio > 0.0 && std::isfinite(rd_ratio))) {
    r.push_back("rd_ratio: expected a finite value > 0, got " + num(rd_ratio));
  }
  if (rd_divisor < 1) r.push_back("rd_divisor: expected >= 1, got " + std::to_string(rd_divisor));
  if (rd_channels < 0) {
    r.push_back("rd_channels: expected >= 0 (0 derives it from rd_ratio), got " +
                std::to_string(rd_channels));
  }
  check_floating("dtype", dtype, r);
  if (r.size() != before) return 0;
  if (rd_channels > 0) return rd_channels;
  const double width = static_cast<double>(channels) * rd_ratio;
  // make_divisible's own bound, named by the arguments that exceed it.
  if (!(width < 0x1p52)) {
    r.push_back("rd_ratio: expected channels * rd_ratio below 2^52, got " +
                std::to_string(channels) + " * " + num(rd_ratio) + " = " + num(width) +
                " (or give rd_channels)");
    return 0;
  }
  return make_divisible(width, rd_divisor, 0, 0.0);
}

// Pixels per task of the passes that split planes into pixel blocks: fixed,
// so that the partial sums and the order they are combined in do not depend
// on the thread count. 128 f32 pixels of 64 channels (32 KiB) fit in L1/L2.
inline constexpr std::int64_t kPixelBlock = 128;

inline std::int64_t pixel_blocks(std::int64_t pixels) {
  return (pixels + kPixelBlock - 1) / kPixelBlock;
}

// Independent partial sums of the fixed-order reductions: their count fixes
// the summation order (lane l takes elements l, l + kLanes, ..., combined
// pairwise), and being independent they vectorize without reassociation.
// The lane loops carry `omp simd`: GCC does not vectorize the unrolled lanes
// of a maximum on its own, and the pragma changes no result (every lane
// keeps its own order).
inline constexpr int kLanes = 16;

template <class T>
T combine_lanes(T (&acc)[kLanes]) {
  for (int w = kLanes / 2; w > 0; w /= 2) {
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  }
  return acc[0];
}

// sum_i a[i], in the fixed order above.
template <class T>
T fixed_sum(const T* a, std::int64_t n) {
  T acc[kLanes] = {};
  std::int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
#pragma omp simd
    for (int l = 0; l < kLanes; ++l) acc[l] += a[i + l];
  }
  for (int l = 0; i + l < n; ++l) acc[l] += a[i + l];
  return combine_lanes(acc);
}

// sum_i a[i] * b[i], in the fixed order above.
template <class T>
T fixed_dot(const T* a, const T* b, std::int64_t n) {
  T acc[kLanes] = {};
  std::int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
#pragma omp simd
    for (int l = 0; l < kLanes; ++l) acc[l] += a[i + l] * b[i + l];
  }
  for (int l = 0; i + l < n; ++l) acc[l] += a[i + l] * b[i + l];
  return combine_lanes(acc);
}

template <class T>
T sigmoid(T z) {
  return T(1) / (T(1) + std::exp(-z));
}

// The channel MLP out = fc2(relu(fc1(in))) of both modules, applied to rows
// of pooled channel values. Weights are timm's [out, in, 1, 1] convolutions,
// read as [out, in] matrices of the compute type.
template <class T>
struct ChannelMlp {
  std::int64_t channels = 0;
  std::int64_t hidden = 0;
  const T* w1 = nullptr;  // [hidden, channels]
  const T* b1 = nullptr;  // [hidden]; null without bias
  const T* w2 = nullptr;  // [channels, hidden]
  const T* b2 = nullptr;  // [channels]; null without bias
};

// in [n, channels] -> out [n, channels]; pre [n, hidden] receives fc1's output
// (kept for relu's derivative) and act [n, hidden] relu of it.
template <class T>
void mlp_forward(const ChannelMlp<T>& m, std::int64_t n, const T* in, T* pre, T* act, T* out) {
  constexpr DType dt = dtype_of_v<T>;
  gemm(dt, false, true, n, m.hidden, m.channels, 1.0, in, m.channels, m.w1, m.channels, 0.0, pre,
       m.hidden, m.b1);
  for (std::int64_t i = 0; i < n * m.hidden; ++i) act[i] = std::max(pre[i], T(0));
  gemm(dt, false, true, n, m.channels, m.hidden, 1.0, act, m.hidden, m.w2, m.hidden, 0.0, out,
       m.channels, m.b2);
}

// Gradients of the MLP for d_out [n, channels], given the forward's in, pre
// and act: adds to gw1 [hidden, channels], gw2 [channels, hidden] and the
// bias gradients gb1 [hidden], gb2 [channels] (null without bias), and
// writes d_in [n, channels].
template <class T>
void mlp_backward(const ChannelMlp<T>& m, std::int64_t n, const T* in, const T* pre, const T* act,
                  const T* d_out, T* gw1, T* gb1, T* gw2, T* gb2, T* d_in) {
  constexpr DType dt = dtype_of_v<T>;
  gemm(dt, true, false, m.channels, m.hidden, n, 1.0, d_out, m.channels, act, m.hidden, 1.0, gw2,
       m.hidden);
  if (gb2 != nullptr) add_column_sums(dt, d_out, n, m.channels, gb2);
  std::vector<T> d_pre(static_cast<std::size_t>(n * m.hidden));
  gemm(dt, false, false, n, m.hidden, m.channels, 1.0, d_out, m.channels, m.w2, m.hidden, 0.0,
       d_pre.data(), m.hidden);
  // relu'(z) = [z > 0], as PyTorch.
  for (std::int64_t i = 0; i < n * m.hidden; ++i) {
    if (!(pre[i] > T(0))) d_pre[i] = T(0);
  }
  gemm(dt, true, false, m.hidden, m.channels, n, 1.0, d_pre.data(), m.hidden, in, m.channels, 1.0,
       gw1, m.channels);
  if (gb1 != nullptr) add_column_sums(dt, d_pre.data(), n, m.hidden, gb1);
  gemm(dt, false, false, n, m.channels, m.hidden, 1.0, d_pre.data(), m.hidden, m.w1, m.channels,
       0.0, d_in, m.channels);
}

// The module's parameter as contiguous values of the compute type T.
template <class T>
struct TypedParameter {
  Dense dense;
  const T* get() const { return static_cast<const T*>(dense.data); }
};

template <class T>
TypedParameter<T> typed(const Parameter& p) {
  if (!p.defined()) return {};
  return {detail::dense(p.value, dtype_of_v<T>)};
}

// p.grad as T*, allocated and zeroed on first use; null for an undefined p.
template <class T>
T* typed_grad(Parameter& p) {
  if (!p.defined()) return nullptr;
  return static_cast<T*>(grad_of(p, dtype_of_v<T>).view().data());
}

}  // namespace qkv::nn::detail
