// CBAM (timm's CbamModule). The forward reads each chunk of images
// (modules/feature_map.hpp) three times: channel pooling (mean and max per
// channel), spatial pooling of x * s (mean and max over channels per pixel),
// and the output y = x * s[c] * m[p]; the gated map x * s is never stored.
// Between them run the channel MLP on both poolings at once ([2, C] rows per
// image) and the k x k convolution of the two pooled planes, a direct loop
// over output rows with contiguous inner loops.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "modules/common.hpp"
#include "modules/feature_map.hpp"
#include "qkv/error.hpp"
#include "qkv/modules/vision.hpp"

namespace qkv::nn {

namespace {

using detail::FeatureMap;
using detail::kLanes;
using detail::kPixelBlock;

template <class T>
T max_of(T a, T b) {
  return b > a ? b : a;
}

// Sum and maximum of value(i) for i < n, in the fixed lane order.
template <class T, class Value>
void sum_max(std::int64_t n, Value value, T& sum, T& max) {
  T s[kLanes] = {};
  T m[kLanes];
  std::fill(m, m + kLanes, -std::numeric_limits<T>::infinity());
  std::int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
#pragma omp simd
    for (int l = 0; l < kLanes; ++l) {
      const T v = value(i + l);
      s[l] += v;
      m[l] = max_of(m[l], v);
    }
  }
  for (int l = 0; i + l < n; ++l) {
    const T v = value(i + l);
    s[l] += v;
    m[l] = max_of(m[l], v);
  }
  for (int l = 1; l < kLanes; ++l) m[0] = max_of(m[0], m[l]);
  sum = detail::combine_lanes(s);
  max = m[0];
}

// Sum and maximum of one contiguous row.
template <class T>
void row_sum_max(const T* a, std::int64_t n, T& sum, T& max) {
  sum_max(
      n, [a](std::int64_t i) { return a[i]; }, sum, max);
}

// Channel pooling: pooled [B, 2, C] holds each image's means over pixels,
// then its maxima (the MLP's two input rows).
template <class T>
void channel_pool(const FeatureMap& g, const T* x, T* pooled) {
  const std::int64_t P = g.pixels, C = g.channels, B = g.batch;
  if (!g.nhwc) {
#pragma omp parallel for schedule(static) if (g.threaded())
    for (std::int64_t bc = 0; bc < B * C; ++bc) {
      T* mean = pooled + bc / C * 2 * C + bc % C;
      row_sum_max(x + bc * P, P, *mean, mean[C]);
      *mean /= static_cast<T>(P);
    }
    return;
  }
  // nhwc: partial sums and maxima per pixel block, combined in block order.
  const std::int64_t blocks = detail::pixel_blocks(P);
  std::vector<T> part_sum(static_cast<std::size_t>(B * blocks * C));
  std::vector<T> part_max(part_sum.size(), -std::numeric_limits<T>::infinity());
#pragma omp parallel for schedule(static) if (g.threaded())
  for (std::int64_t task = 0; task < B * blocks; ++task) {
    const std::int64_t b = task / blocks, p0 = (task % blocks) * kPixelBlock;
    const std::int64_t p1 = std::min(P, p0 + kPixelBlock);
    T* s = part_sum.data() + task * C;
    T* m = part_max.data() + task * C;
    for (std::int64_t p = p0; p < p1; ++p) {
      const T* row = x + (b * P + p) * C;
      for (std::int64_t c = 0; c < C; ++c) {
        s[c] += row[c];
        m[c] = max_of(m[c], row[c]);
      }
    }
  }
  for (std::int64_t b = 0; b < B; ++b) {
    T* mean = pooled + 2 * b * C;
    T* max = mean + C;
    std::fill(mean, mean + C, T(0));
    std::fill(max, max + C, -std::numeric_limits<T>::infinity());
    for (std::int64_t k = 0; k < blocks; ++k) {
      const T* s = part_sum.data() + (b * blocks + k) * C;
      const T* m = part_max.data() + (b * blocks + k) * C;
      for (std::int64_t c = 0; c < C; ++c) {
        mean[c] += s[c];
        max[c] = max_of(max[c], m[c]);
      }
    }
    for (std::int64_t c = 0; c < C; ++c) mean[c] /= static_cast<T>(P);
  }
}

// Spatial pooling of x1 = x * s[b, c]: mean[b, p] and max[b, p] over channels.
template <class T>
void spatial_pool(const FeatureMap& g, const T* x, const T* s, T* mean, T* max) {
  const std::int64_t P = g.pixels, C = g.channels;
  const std::int64_t blocks = detail::pixel_blocks(P);
#pragma omp parallel for schedule(static) if (g.threaded())
  for (std::int64_t task = 0; task < g.batch * blocks; ++task) {
    const std::int64_t b = task / blocks, p0 = (task % blocks) * kPixelBlock;
    const std::int64_t n = std::min(P - p0, kPixelBlock);
    const T* sb = s + b * C;
    T* mean_b = mean + b * P + p0;
    T* max_b = max + b * P + p0;
    if (!g.nhwc) {
      // Channels in order for every pixel of the block, pixels contiguous.
      T sum[kPixelBlock] = {};
      T top[kPixelBlock];
      std::fill(top, top + n, -std::numeric_limits<T>::infinity());
      for (std::int64_t c = 0; c < C; ++c) {
        const T* row = x + (b * C + c) * P + p0;
        const T sc = sb[c];
        for (std::int64_t j = 0; j < n; ++j) {
          const T v = row[j] * sc;
          sum[j] += v;
          top[j] = max_of(top[j], v);
        }
      }
      for (std::int64_t j = 0; j < n; ++j) {
        mean_b[j] = sum[j] / static_cast<T>(C);
        max_b[j] = top[j];
      }
    } else {
      for (std::int64_t j = 0; j < n; ++j) {
        const T* row = x + (b * P + p0 + j) * C;
        T sum;
        sum_max(
            C, [row, sb](std::int64_t c) { return row[c] * sb[c]; }, sum, max_b[j]);
        mean_b[j] = sum / static_cast<T>(C);
      }
    }
  }
}

// out[j] += sum over taps (di, dj) of k[di * K + dj] * in[i + di - r, j + dj - r]
// for j < W, r = K / 2, taps outside the [H, W] plane skipped (zero padding):
// row i of a K x K cross-correlation (PyTorch's conv2d), one contiguous
// multiply-add loop per tap.
template <class T>
void correlate_row(const T* in, std::int64_t H, std::int64_t W, const T* k, std::int64_t K,
                   std::int64_t i, T* out) {
  const std::int64_t r = K / 2;
  for (std::int64_t di = 0; di < K; ++di) {
    const std::int64_t row = i + di - r;
    if (row < 0 || row >= H) continue;
    const T* src = in + row * W;
    for (std::int64_t dj = 0; dj < K; ++dj) {
      const T w = k[di * K + dj];
      const std::int64_t shift = dj - r;
      const std::int64_t j0 = std::max<std::int64_t>(0, -shift);
      const std::int64_t j1 = std::min(W, W - shift);
      for (std::int64_t j = j0; j < j1; ++j) out[j] += w * src[j + shift];
    }
  }
}

template <class T>
struct CbamWeights {
  detail::TypedParameter<T> w1, b1, w2, b2, conv;
  // BatchNorm as the affine map z = t * alpha + beta, alpha = weight /
  // sqrt(running_var + eps), beta = bias - running_mean * alpha (PyTorch's
  // inference form); inv_std = 1 / sqrt(running_var + eps) and the running
  // mean for the weight's gradient.
  T alpha = 0, beta = 0, inv_std = 0, mean = 0, gamma = 0;

  explicit CbamWeights(const Cbam& m, double eps)
      : w1(detail::typed<T>(m.channel_fc1_weight)),
        b1(detail::typed<T>(m.channel_fc1_bias)),
        w2(detail::typed<T>(m.channel_fc2_weight)),
        b2(detail::typed<T>(m.channel_fc2_bias)),
        conv(detail::typed<T>(m.spatial_conv_weight)) {
    gamma = static_cast<T>(m.spatial_bn_weight.value.get({0}));
    mean = static_cast<T>(m.spatial_bn_running_mean.value.get({0}));
    const T var = static_cast<T>(m.spatial_bn_running_var.value.get({0}));
    inv_std = T(1) / std::sqrt(var + static_cast<T>(eps));
    alpha = gamma * inv_std;
    beta = static_cast<T>(m.spatial_bn_bias.value.get({0})) - mean * alpha;
  }

  detail::ChannelMlp<T> mlp(const Cbam& m) const {
    return {m.channels(), m.rd_channels(), w1.get(), b1.get(), w2.get(), b2.get()};
  }
};

// Everything the forward computes before its output pass (the backward
// reuses all of it).
template <class T>
struct CbamState {
  std::vector<T> pooled;  // [B, 2, C] channel means and maxima
  std::vector<T> pre;     // [B, 2, rd] fc1 outputs
  std::vector<T> act;     // [B, 2, rd] relu of them
  std::vector<T> s;       // [B, C] channel gates
  std::vector<T> mean;    // [B, P] mean over channels of x * s
  std::vector<T> max;     // [B, P] max over channels of x * s
  std::vector<T> conv;    // [B, P] convolution output (before BatchNorm)
  std::vector<T> m;       // [B, P] spatial gates

  CbamState(const FeatureMap& g, std::int64_t rd)
      : pooled(static_cast<std::size_t>(2 * g.batch * g.channels)),
        pre(static_cast<std::size_t>(2 * g.batch * rd)),
        act(pre.size()),
        s(static_cast<std::size_t>(g.batch * g.channels)),
        mean(static_cast<std::size_t>(g.batch * g.pixels)),
        max(mean.size()),
        conv(mean.size()),
        m(mean.size()) {}
};

// The gates of images [b0, b0 + part.batch) (x points at image b0), into
// those images' entries of `st`.
template <class T>
void cbam_gates(const Cbam& mod, const CbamWeights<T>& w, const FeatureMap& part, std::int64_t b0,
                const T* x, CbamState<T>& st) {
  const std::int64_t n = part.batch, C = part.channels, P = part.pixels, rd = mod.rd_channels();
  T* pooled = st.pooled.data() + 2 * b0 * C;
  channel_pool(part, x, pooled);
  std::vector<T> logits(static_cast<std::size_t>(2 * n * C));
  detail::mlp_forward(w.mlp(mod), 2 * n, pooled, st.pre.data() + 2 * b0 * rd,
                      st.act.data() + 2 * b0 * rd, logits.data());
  T* s = st.s.data() + b0 * C;
  for (std::int64_t b = 0; b < n; ++b) {
    for (std::int64_t c = 0; c < C; ++c) {
      s[b * C + c] = detail::sigmoid(logits[2 * b * C + c] + logits[(2 * b + 1) * C + c]);
    }
  }
  T* mean = st.mean.data() + b0 * P;
  T* max = st.max.data() + b0 * P;
  spatial_pool(part, x, s, mean, max);

  const std::int64_t H = part.height, W = part.width, K = mod.kernel_size();
  const T* k_mean = w.conv.get();
  const T* k_max = k_mean + K * K;
#pragma omp parallel for schedule(static) if (part.threaded())
  for (std::int64_t bi = 0; bi < n * H; ++bi) {
    const std::int64_t b = bi / H, i = bi % H;
    T* t = st.conv.data() + (b0 + b) * P + i * W;
    correlate_row(mean + b * P, H, W, k_mean, K, i, t);
    correlate_row(max + b * P, H, W, k_max, K, i, t);
    T* m = st.m.data() + (b0 + b) * P + i * W;
    for (std::int64_t j = 0; j < W; ++j) m[j] = detail::sigmoid(t[j] * w.alpha + w.beta);
  }
}

// y = x * s[c] * m[p] for the images of `part` (x, y, s and m point at its
// first image).
template <class T>
void gate_output(const FeatureMap& part, const T* x, const T* s, const T* m, T* y) {
  const std::int64_t B = part.batch, C = part.channels, P = part.pixels;
  if (!part.nhwc) {
#pragma omp parallel for schedule(static) if (part.threaded())
    for (std::int64_t bc = 0; bc < B * C; ++bc) {
      const T sc = s[bc];
      const T* mb = m + (bc / C) * P;
      const T* src = x + bc * P;
      T* dst = y + bc * P;
      for (std::int64_t p = 0; p < P; ++p) dst[p] = src[p] * sc * mb[p];
    }
    return;
  }
  const std::int64_t blocks = detail::pixel_blocks(P);
#pragma omp parallel for schedule(static) if (part.threaded())
  for (std::int64_t task = 0; task < B * blocks; ++task) {
    const std::int64_t b = task / blocks, p0 = (task % blocks) * kPixelBlock;
    const std::int64_t p1 = std::min(P, p0 + kPixelBlock);
    const T* sb = s + b * C;
    for (std::int64_t p = p0; p < p1; ++p) {
      const T mp = m[b * P + p];
      const T* src = x + (b * P + p) * C;
      T* dst = y + (b * P + p) * C;
      for (std::int64_t c = 0; c < C; ++c) dst[c] = src[c] * sb[c] * mp;
    }
  }
}

// The forward's gates of every image, chunk by chunk as the forward runs.
template <class T>
CbamState<T> all_gates(const Cbam& mod, const CbamWeights<T>& w, const FeatureMap& g, const T* x) {
  CbamState<T> st(g, mod.rd_channels());
  detail::for_each_chunk(g, [&](const FeatureMap& part, std::int64_t b0, std::int64_t offset) {
    cbam_gates(mod, w, part, b0, x + offset, st);
  });
  return st;
}

template <class T>
void cbam_forward(const Cbam& mod, double eps, const FeatureMap& g, const T* x, T* y) {
  const CbamWeights<T> w(mod, eps);
  CbamState<T> st(g, mod.rd_channels());
  // Chunk by chunk, so that the later passes find the chunk in cache.
  detail::for_each_chunk(g, [&](const FeatureMap& part, std::int64_t b0, std::int64_t offset) {
    cbam_gates(mod, w, part, b0, x + offset, st);
    gate_output(part, x + offset, st.s.data() + b0 * g.channels, st.m.data() + b0 * g.pixels,
                y + offset);
  });
}

// The first pixel of each channel plane holding its maximum (row 1 of each
// image's pooled [2, C]), [B, C]; -1 when none equals it (a plane of NaNs).
template <class T>
std::vector<std::int64_t> channel_argmax(const FeatureMap& g, const T* x, const T* pooled) {
  const std::int64_t B = g.batch, C = g.channels, P = g.pixels;
  std::vector<std::int64_t> first(static_cast<std::size_t>(B * C), -1);
  if (!g.nhwc) {
#pragma omp parallel for schedule(static) if (g.threaded())
    for (std::int64_t bc = 0; bc < B * C; ++bc) {
      const T* row = x + bc * P;
      const T* hit = std::find(row, row + P, pooled[(2 * (bc / C) + 1) * C + bc % C]);
      if (hit != row + P) first[bc] = hit - row;
    }
    return first;
  }
#pragma omp parallel for schedule(static) if (g.threaded())
  for (std::int64_t b = 0; b < B; ++b) {
    std::int64_t* fb = first.data() + b * C;
    const T* mb = pooled + (2 * b + 1) * C;
    std::int64_t found = 0;
    for (std::int64_t p = 0; p < P && found < C; ++p) {
      const T* row = x + (b * P + p) * C;
      for (std::int64_t c = 0; c < C; ++c) {
        if (fb[c] < 0 && row[c] == mb[c]) {
          fb[c] = p;
          ++found;
        }
      }
    }
  }
  return first;
}

// The first channel of each pixel where x * s attains the spatial maximum,
// [B, P]; -1 when none does (NaNs).
template <class T>
std::vector<std::int64_t> spatial_argmax(const FeatureMap& g, const T* x, const T* s,
                                         const T* max) {
  const std::int64_t B = g.batch, C = g.channels, P = g.pixels;
  const std::int64_t blocks = detail::pixel_blocks(P);
  std::vector<std::int64_t> first(static_cast<std::size_t>(B * P), -1);
#pragma omp parallel for schedule(static) if (g.threaded())
  for (std::int64_t task = 0; task < B * blocks; ++task) {
    const std::int64_t b = task / blocks, p0 = (task % blocks) * kPixelBlock;
    const std::int64_t p1 = std::min(P, p0 + kPixelBlock);
    const T* sb = s + b * C;
    const T* max_b = max + b * P;
    std::int64_t* first_b = first.data() + b * P;
    if (!g.nhwc) {
      // Channels in descending order, so the lowest maximal one is kept.
      for (std::int64_t c = C - 1; c >= 0; --c) {
        const T* row = x + (b * C + c) * P;
        for (std::int64_t p = p0; p < p1; ++p) {
          if (row[p] * sb[c] == max_b[p]) first_b[p] = c;
        }
      }
    } else {
      for (std::int64_t i = b * P + p0; i < b * P + p1; ++i) {
        for (std::int64_t c = 0; c < C; ++c) {
          if (x[i * C + c] * sb[c] == max[i]) {
            first[i] = c;
            break;
          }
        }
      }
    }
  }
  return first;
}

// The steps of cbam_backward, in the order it runs them. Each adds to its
// parameters' gradients; st holds the forward's gates and intermediates.

// dz[b, p] = (sum_c dy * x * s) * m (1 - m): through the spatial gate,
// channels summed in order as in spatial_pool.
template <class T>
std::vector<T> spatial_gate_backward(const FeatureMap& g, const CbamState<T>& st, const T* x,
                                     const T* dy) {
  const std::int64_t B = g.batch, C = g.channels, P = g.pixels;
  const std::int64_t blocks = detail::pixel_blocks(P);
  const auto bp = static_cast<std::size_t>(B * P);
  std::vector<T> dz(bp);
#pragma omp parallel for schedule(static) if (g.threaded())
  for (std::int64_t task = 0; task < B * blocks; ++task) {
    const std::int64_t b = task / blocks, p0 = (task % blocks) * kPixelBlock;
    const std::int64_t n = std::min(P - p0, kPixelBlock);
    const T* sb = st.s.data() + b * C;
    T sum[kPixelBlock] = {};
    if (!g.nhwc) {
      for (std::int64_t c = 0; c < C; ++c) {
        const std::int64_t row = (b * C + c) * P + p0;
        const T sc = sb[c];
        for (std::int64_t j = 0; j < n; ++j) sum[j] += dy[row + j] * (x[row + j] * sc);
      }
    } else {
      for (std::int64_t j = 0; j < n; ++j) {
        const std::int64_t row = (b * P + p0 + j) * C;
        for (std::int64_t c = 0; c < C; ++c) sum[j] += dy[row + c] * (x[row + c] * sb[c]);
      }
    }
    for (std::int64_t j = 0; j < n; ++j) {
      const T m = st.m[b * P + p0 + j];
      dz[b * P + p0 + j] = sum[j] * m * (T(1) - m);
    }
  }
  return dz;
}

// BatchNorm's weight and bias, in pixel order.
template <class T>
void spatial_bn_backward(Cbam& mod, const CbamWeights<T>& w, const CbamState<T>& st,
                         const std::vector<T>& dz) {
  const std::size_t bp = dz.size();
  T d_gamma = 0, d_beta = 0;
  for (std::size_t i = 0; i < bp; ++i) {
    d_gamma += dz[i] * ((st.conv[i] - w.mean) * w.inv_std);
    d_beta += dz[i];
  }
  detail::typed_grad<T>(mod.spatial_bn_weight)[0] += d_gamma;
  detail::typed_grad<T>(mod.spatial_bn_bias)[0] += d_beta;
}

// The pooled maps' gradients d_mean and d_max [B, P] through the convolution
// (dt = dz alpha correlated with the kernel rotated by 180 degrees), and the
// kernel's gradient.
template <class T>
void spatial_conv_backward(Cbam& mod, const CbamWeights<T>& w, const FeatureMap& g,
                           const CbamState<T>& st, const std::vector<T>& dz, std::vector<T>& d_mean,
                           std::vector<T>& d_max) {
  const std::int64_t B = g.batch, P = g.pixels, H = g.height, W = g.width;
  const std::int64_t K = mod.kernel_size();
  const std::size_t bp = dz.size();
  std::vector<T> dt(bp);
  for (std::size_t i = 0; i < bp; ++i) dt[i] = dz[i] * w.alpha;
  const T* kernel = w.conv.get();
  std::vector<T> flipped(static_cast<std::size_t>(2 * K * K));
  for (std::int64_t ch = 0; ch < 2; ++ch) {
    for (std::int64_t t = 0; t < K * K; ++t)
      flipped[ch * K * K + t] = kernel[ch * K * K + K * K - 1 - t];
  }
#pragma omp parallel for schedule(static) if (g.threaded())
  for (std::int64_t bi = 0; bi < B * H; ++bi) {
    const std::int64_t b = bi / H, i = bi % H;
    correlate_row(dt.data() + b * P, H, W, flipped.data(), K, i, d_mean.data() + b * P + i * W);
    correlate_row(dt.data() + b * P, H, W, flipped.data() + K * K, K, i,
                  d_max.data() + b * P + i * W);
  }
  // Kernel gradient, one tap per task: sum over b, i, j of
  // dt[b, i, j] * input[b, i + di - r, j + dj - r].
  T* g_conv = detail::typed_grad<T>(mod.spatial_conv_weight);
  const std::int64_t r = K / 2;
#pragma omp parallel for schedule(static) if (g.threaded())
  for (std::int64_t tap = 0; tap < 2 * K * K; ++tap) {
    const std::int64_t ch = tap / (K * K), di = tap % (K * K) / K, dj = tap % K;
    const std::vector<T>& in = ch == 0 ? st.mean : st.max;
    const std::int64_t j0 = std::max<std::int64_t>(0, r - dj), j1 = std::min(W, W + r - dj);
    T sum = 0;
    for (std::int64_t b = 0; b < B; ++b) {
      for (std::int64_t i = std::max<std::int64_t>(0, r - di); i < std::min(H, H + r - di); ++i) {
        const T* src = in.data() + b * P + (i + di - r) * W + (j0 + dj - r);
        sum += detail::fixed_dot(dt.data() + b * P + i * W + j0, src, j1 - j0);
      }
    }
    g_conv[tap] += sum;
  }
}

// Gradient of x1 = x * s: the output's direct path dy * m, the spatial
// mean's d_mean / C and the spatial max's d_max at its first maximal
// channel. Writes dx = dx1 * s and returns ds[b, c] = sum_p dx1 * x.
template <class T>
std::vector<T> gated_input_backward(const FeatureMap& g, const CbamState<T>& st, const T* x,
                                    const T* dy, std::vector<T>& d_mean,
                                    const std::vector<T>& d_max, T* dx) {
  const std::int64_t B = g.batch, C = g.channels, P = g.pixels;
  const std::int64_t blocks = detail::pixel_blocks(P);
  const std::vector<std::int64_t> spatial_first = spatial_argmax(g, x, st.s.data(), st.max.data());
  for (T& d : d_mean) d /= static_cast<T>(C);
  std::vector<T> ds(static_cast<std::size_t>(B * C));
  if (!g.nhwc) {
#pragma omp parallel for schedule(static) if (g.threaded())
    for (std::int64_t bc = 0; bc < B * C; ++bc) {
      const std::int64_t b = bc / C, c = bc % C;
      const T* dyr = dy + bc * P;
      const T* m = st.m.data() + b * P;
      const T* dmean = d_mean.data() + b * P;
      const T* dmax = d_max.data() + b * P;
      const std::int64_t* first = spatial_first.data() + b * P;
      T* out = dx + bc * P;
      for (std::int64_t p = 0; p < P; ++p) {
        out[p] = dyr[p] * m[p] + dmean[p] + (first[p] == c ? dmax[p] : T(0));
      }
      ds[bc] = detail::fixed_dot(out, x + bc * P, P);
      const T sc = st.s[bc];
      for (std::int64_t p = 0; p < P; ++p) out[p] *= sc;
    }
  } else {
    std::vector<T> partial(static_cast<std::size_t>(B * blocks * C));
#pragma omp parallel for schedule(static) if (g.threaded())
    for (std::int64_t task = 0; task < B * blocks; ++task) {
      const std::int64_t b = task / blocks, p0 = (task % blocks) * kPixelBlock;
      const std::int64_t p1 = std::min(P, p0 + kPixelBlock);
      const T* sb = st.s.data() + b * C;
      T* acc = partial.data() + task * C;
      for (std::int64_t p = p0; p < p1; ++p) {
        const std::int64_t i = b * P + p;
        const T mp = st.m[i], dmean = d_mean[i];
        for (std::int64_t c = 0; c < C; ++c) {
          const T d = dy[i * C + c] * mp + dmean;
          dx[i * C + c] = d;
          acc[c] += d * x[i * C + c];
        }
        // The maximum's gradient, added to the one channel that attains it.
        const std::int64_t top = spatial_first[i];
        if (top >= 0) {
          dx[i * C + top] += d_max[i];
          acc[top] += d_max[i] * x[i * C + top];
        }
        for (std::int64_t c = 0; c < C; ++c) dx[i * C + c] *= sb[c];
      }
    }
    for (std::int64_t b = 0; b < B; ++b) {
      for (std::int64_t k = 0; k < blocks; ++k) {
        const T* acc = partial.data() + (b * blocks + k) * C;
        for (std::int64_t c = 0; c < C; ++c) ds[b * C + c] += acc[c];
      }
    }
  }
  return ds;
}

// Through the channel gate to both MLP branches (the same d logits), then to
// the poolings: the mean spreads evenly, the max goes to its first maximal
// pixel. Adds to dx.
template <class T>
void channel_gate_backward(Cbam& mod, const detail::ChannelMlp<T>& mlp, const FeatureMap& g,
                           const CbamState<T>& st, const T* x, const std::vector<T>& ds, T* dx) {
  const std::int64_t B = g.batch, C = g.channels, P = g.pixels;
  std::vector<T> d_logits(static_cast<std::size_t>(2 * B * C));
  for (std::int64_t i = 0; i < B * C; ++i) {
    const std::int64_t row = 2 * (i / C) * C + i % C;
    d_logits[row] = d_logits[row + C] = ds[i] * st.s[i] * (T(1) - st.s[i]);
  }
  std::vector<T> d_pooled(d_logits.size());
  detail::mlp_backward(mlp, 2 * B, st.pooled.data(), st.pre.data(), st.act.data(), d_logits.data(),
                       detail::typed_grad<T>(mod.channel_fc1_weight),
                       detail::typed_grad<T>(mod.channel_fc1_bias),
                       detail::typed_grad<T>(mod.channel_fc2_weight),
                       detail::typed_grad<T>(mod.channel_fc2_bias), d_pooled.data());
  // d_pooled [B, 2, C]: the means' gradients, then the maxima's.
  const std::vector<std::int64_t> channel_first = channel_argmax(g, x, st.pooled.data());
  std::vector<T> d_mean_pixel(static_cast<std::size_t>(B * C));
  for (std::int64_t i = 0; i < B * C; ++i) {
    d_mean_pixel[i] = d_pooled[2 * (i / C) * C + i % C] / static_cast<T>(P);
  }
  if (!g.nhwc) {
#pragma omp parallel for schedule(static) if (g.threaded())
    for (std::int64_t bc = 0; bc < B * C; ++bc) {
      T* out = dx + bc * P;
      const T add = d_mean_pixel[bc];
      for (std::int64_t p = 0; p < P; ++p) out[p] += add;
    }
  } else {
#pragma omp parallel for schedule(static) if (g.threaded())
    for (std::int64_t i = 0; i < B * P; ++i) {
      const T* add = d_mean_pixel.data() + i / P * C;
      T* out = dx + i * C;
      for (std::int64_t c = 0; c < C; ++c) out[c] += add[c];
    }
  }
  for (std::int64_t bc = 0; bc < B * C; ++bc) {
    const std::int64_t at = channel_first[bc];
    if (at < 0) continue;
    const std::int64_t b = bc / C, c = bc % C;
    dx[g.nhwc ? (b * P + at) * C + c : bc * P + at] += d_pooled[(2 * b + 1) * C + c];
  }
}

template <class T>
void cbam_backward(Cbam& mod, double eps, const FeatureMap& g, const T* x, const T* dy, T* dx) {
  const CbamWeights<T> w(mod, eps);
  const detail::ChannelMlp<T> mlp = w.mlp(mod);
  const CbamState<T> st = all_gates(mod, w, g, x);
  const std::vector<T> dz = spatial_gate_backward(g, st, x, dy);
  spatial_bn_backward(mod, w, st, dz);
  std::vector<T> d_mean(dz.size()), d_max(dz.size());
  spatial_conv_backward(mod, w, g, st, dz, d_mean, d_max);
  const std::vector<T> ds = gated_input_backward(g, st, x, dy, d_mean, d_max, dx);
  channel_gate_backward(mod, mlp, g, st, x, ds, dx);
}

}  // namespace

Cbam::Cbam(std::int64_t channels, const CbamOptions& options)
    : channels_(channels), kernel_(options.spatial_kernel_size), eps_(options.bn_eps) {
  detail::Reasons r;
  rd_ = detail::reduced_channels(channels, options.rd_ratio, options.rd_divisor,
                                 options.rd_channels, options.dtype, r);
  if (options.spatial_kernel_size < 1 || options.spatial_kernel_size % 2 == 0) {
    r.push_back("spatial_kernel_size: expected an odd size >= 1, got " +
                std::to_string(options.spatial_kernel_size));
  }
  if (!(options.bn_eps >= 0.0 && std::isfinite(options.bn_eps))) {
    r.push_back("bn_eps: expected a finite value >= 0, got " + detail::num(options.bn_eps));
  }
  detail::throw_if(r);
  const DType dt = options.dtype;
  channel_fc1_weight = make_parameter(dt, {rd_, channels_, 1, 1});
  channel_fc2_weight = make_parameter(dt, {channels_, rd_, 1, 1});
  if (options.mlp_bias) {
    channel_fc1_bias = make_parameter(dt, {rd_});
    channel_fc2_bias = make_parameter(dt, {channels_});
  }
  spatial_conv_weight = make_parameter(dt, {1, 2, kernel_, kernel_});
  spatial_bn_weight = make_parameter(dt, {1});
  spatial_bn_bias = make_parameter(dt, {1});
  spatial_bn_running_mean = make_parameter(dt, {1});
  spatial_bn_running_var = make_parameter(dt, {1});
  spatial_bn_weight.value.set({0}, 1.0);
  spatial_bn_running_var.value.set({0}, 1.0);
}

namespace {

void check_running_var(const Cbam& m, double eps, detail::Reasons& reasons) {
  const double var = m.spatial_bn_running_var.value.get({0});
  if (!(var + eps > 0.0) || !std::isfinite(var)) {
    reasons.push_back("spatial.conv.bn.running_var: expected running_var + eps > 0 (eps = " +
                      detail::num(eps) + "), got running_var = " + detail::num(var));
  }
}

}  // namespace

namespace {

// Reasons the public parameters no longer have this module's shapes.
void check_cbam_parameters(const Cbam& m, detail::Reasons& r) {
  const std::int64_t c = m.channels(), rd = m.rd_channels(), k = m.kernel_size();
  detail::check_parameter("channel.fc1.weight", m.channel_fc1_weight, {rd, c, 1, 1}, r);
  detail::check_parameter("channel.fc2.weight", m.channel_fc2_weight, {c, rd, 1, 1}, r);
  if (m.channel_fc1_bias.defined() || m.channel_fc2_bias.defined()) {
    detail::check_parameter("channel.fc1.bias", m.channel_fc1_bias, {rd}, r);
    detail::check_parameter("channel.fc2.bias", m.channel_fc2_bias, {c}, r);
  }
  detail::check_parameter("spatial.conv.conv.weight", m.spatial_conv_weight, {1, 2, k, k}, r);
  detail::check_parameter("spatial.conv.bn.weight", m.spatial_bn_weight, {1}, r);
  detail::check_parameter("spatial.conv.bn.bias", m.spatial_bn_bias, {1}, r);
  detail::check_parameter("spatial.conv.bn.running_mean", m.spatial_bn_running_mean, {1}, r);
  detail::check_parameter("spatial.conv.bn.running_var", m.spatial_bn_running_var, {1}, r);
}

}  // namespace

Tensor Cbam::forward(ConstTensorView x, ImageLayout layout) const {
  detail::Reasons r;
  const FeatureMap g = detail::feature_map("x", x, channels_, layout, r);
  const std::size_t before = r.size();
  check_cbam_parameters(*this, r);
  if (r.size() == before) check_running_var(*this, eps_, r);
  detail::throw_if(r);

  return detail::in_compute_dtype(
      x, {}, [&](const auto* xs, const auto*, auto* y) { cbam_forward(*this, eps_, g, xs, y); });
}

Tensor Cbam::backward(ConstTensorView x, ConstTensorView dy, ImageLayout layout) {
  detail::Reasons r;
  const FeatureMap g = detail::feature_map("x", x, channels_, layout, r);
  detail::check_same_sizes(x, dy, r);
  const std::size_t before = r.size();
  check_cbam_parameters(*this, r);
  if (r.size() == before) check_running_var(*this, eps_, r);
  // The gradients this backward adds to (the running statistics are
  // buffers, without gradients).
  NamedParameters learned = named_parameters();
  std::erase_if(learned, [&](const NamedParameter& p) {
    return p.parameter == &spatial_bn_running_mean || p.parameter == &spatial_bn_running_var;
  });
  const DType ct = detail::compute_dtype(x.dtype());
  if (x.defined()) detail::check_grads(learned, ct, r);
  detail::throw_if(r);

  // Every gradient buffer first (check_grads has ruled out a dtype clash).
  for (const NamedParameter& p : learned) detail::grad_of(*p.parameter, ct);
  return detail::in_compute_dtype(x, dy, [&](const auto* xs, const auto* dys, auto* dx) {
    cbam_backward(*this, eps_, g, xs, dys, dx);
  });
}

NamedParameters Cbam::named_parameters(std::string_view prefix) {
  const std::string p(prefix);
  NamedParameters list{{p + "channel.fc1.weight", &channel_fc1_weight}};
  if (channel_fc1_bias.defined()) list.push_back({p + "channel.fc1.bias", &channel_fc1_bias});
  list.push_back({p + "channel.fc2.weight", &channel_fc2_weight});
  if (channel_fc2_bias.defined()) list.push_back({p + "channel.fc2.bias", &channel_fc2_bias});
  list.push_back({p + "spatial.conv.conv.weight", &spatial_conv_weight});
  list.push_back({p + "spatial.conv.bn.weight", &spatial_bn_weight});
  list.push_back({p + "spatial.conv.bn.bias", &spatial_bn_bias});
  list.push_back({p + "spatial.conv.bn.running_mean", &spatial_bn_running_mean});
  list.push_back({p + "spatial.conv.bn.running_var", &spatial_bn_running_var});
  return list;
}

}  // namespace qkv::nn
