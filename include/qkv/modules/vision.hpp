// qkv/modules/vision.hpp — channel and spatial attention of CNN feature maps:
// squeeze-and-excitation (timm's SEModule) and CBAM (timm's CbamModule).
//
// Shapes, by the `layout` argument of each call:
//   ImageLayout::nchw   x, y, dx, dy  [B, C, H, W]
//   ImageLayout::nhwc   x, y, dx, dy  [B, H, W, C]
// B >= 0, H, W >= 1, C = the module's channels; f32, f64, bf16 or f16, any
// strides (a view that is not contiguous in its layout is copied once). The
// outputs are contiguous, of x's sizes and dtype; the parameters keep timm's
// 1x1-convolution layout [out, in, 1, 1] in either layout, so one state dict
// serves both.
//
// Threads: OpenMP over (batch, channel) rows or fixed blocks of pixels, with
// fixed summation orders, so results are bitwise identical for any thread
// count. NCHW and NHWC sum in different orders and agree to rounding.
#pragma once

#include <cstdint>
#include <string_view>

#include "qkv/modules/parameter.hpp"
#include "qkv/tensor.hpp"

namespace qkv::nn {

// Memory order of a feature map's dimensions.
enum class ImageLayout : std::uint8_t {
  nchw,  // [B, C, H, W] (PyTorch's default)
  nhwc,  // [B, H, W, C] (channels last)
};

// timm's make_divisible (timm/layers/helpers.py): the multiple of `divisor`
// nearest to `value` (halves round up), at least `min_value` (0 stands for
// `divisor`), plus one more `divisor` if that fell below round_limit * value:
//   max(min_value, int(value + divisor / 2) // divisor * divisor)
// Throws qkv::Error unless divisor >= 1 and value is finite.
std::int64_t make_divisible(double value, std::int64_t divisor = 8, std::int64_t min_value = 0,
                            double round_limit = 0.9);

struct SqueezeExcitationOptions {
  // Hidden width relative to the channels (timm's rd_ratio; 1/16 is SENet's
  // reduction 16). Default 1/16.
  double rd_ratio = 1.0 / 16;
  // Hidden width; 0 (default) derives it as timm does:
  // make_divisible(channels * rd_ratio, rd_divisor, round_limit = 0), so 8
  // for 64 channels.
  std::int64_t rd_channels = 0;
  // Divisor of the derived hidden width. Default 8 (timm's SEModule).
  std::int64_t rd_divisor = 8;
  // Whether fc1 and fc2 have biases. Default true (timm's bias).
  bool bias = true;
  // Storage dtype of the parameters. Default f32.
  DType dtype = DType::f32;
};

// Squeeze-and-excitation, timm's SEModule with its defaults (ReLU, sigmoid
// gate, no normalization: its `bn` is Identity, no max pooling):
//   g[b, c] = sigmoid(fc2(relu(fc1(mean over H, W of x[b, c]))))
//   y[b, c, h, w] = x[b, c, h, w] * g[b, c]
class SqueezeExcitation {
 public:
  // Zeroed parameters (fill them with init_uniform or load_parameters).
  // Throws qkv::Error unless channels >= 1, rd_ratio > 0 and finite,
  // rd_divisor >= 1, rd_channels >= 0 and dtype is floating.
  explicit SqueezeExcitation(std::int64_t channels, const SqueezeExcitationOptions& options = {});

  std::int64_t channels() const { return channels_; }
  std::int64_t rd_channels() const { return rd_; }

  // y = x * g. Throws qkv::Error for an input of the wrong rank, channel
  // count or dtype, or with H * W = 0.
  Tensor forward(ConstTensorView x, ImageLayout layout = ImageLayout::nchw) const;

  // Given the forward's input x and dy = dLoss/dy (x's sizes), returns dx
  // (x's dtype) and adds the gradients of fc1/fc2 weights and biases to
  // their Parameter::grad.
  Tensor backward(ConstTensorView x, ConstTensorView dy, ImageLayout layout = ImageLayout::nchw);

  // "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias" (biases only with
  // `bias`), each preceded by `prefix`: timm's state-dict names.
  NamedParameters named_parameters(std::string_view prefix = "");

  Parameter fc1_weight;  // [rd, C, 1, 1]
  Parameter fc1_bias;    // [rd]; undefined without bias
  Parameter fc2_weight;  // [C, rd, 1, 1]
  Parameter fc2_bias;    // [C]; undefined without bias

 private:
  std::int64_t channels_ = 0;
  std::int64_t rd_ = 0;
};

struct CbamOptions {
  // Hidden width of the channel MLP relative to the channels (timm's
  // rd_ratio). Default 1/16.
  double rd_ratio = 1.0 / 16;
  // Hidden width; 0 (default) derives it as timm does:
  // make_divisible(channels * rd_ratio, rd_divisor, round_limit = 0), so 4
  // for 64 channels.
  std::int64_t rd_channels = 0;
  // Divisor of the derived hidden width. Default 1 (timm's CbamModule).
  std::int64_t rd_divisor = 1;
  // Whether the channel MLP's fc1 and fc2 have biases. Default false
  // (timm's mlp_bias).
  bool mlp_bias = false;
  // Side of the square spatial convolution, odd; padded by
  // spatial_kernel_size / 2 on each side so H and W are kept. Default 7.
  std::int64_t spatial_kernel_size = 7;
  // BatchNorm's epsilon. Default 1e-5 (PyTorch's).
  double bn_eps = 1e-5;
  // Storage dtype of the parameters. Default f32.
  DType dtype = DType::f32;
};

// CBAM, timm's CbamModule with its defaults (ReLU, sigmoid gates):
//   channel attention (shared MLP on average and max pooling over H, W):
//     s[b, c] = sigmoid(mlp(mean_hw x[b, c]) + mlp(max_hw x[b, c])),
//     mlp = fc2(relu(fc1(.))), x1 = x * s[b, c]
//   spatial attention (ConvNormAct(2, 1, k, apply_act=False): a k x k
//   convolution without bias, zero padding k/2, then BatchNorm2d(1)):
//     a[b, h, w] = [mean over c of x1, max over c of x1]   (2 channels)
//     t = conv(a), z = (t - running_mean) / sqrt(running_var + eps) * bn.weight + bn.bias
//     y = x1 * sigmoid(z)[b, h, w]
// BatchNorm runs in inference form only: it applies the running statistics
// and never computes batch statistics (PyTorch's eval() mode); the backward
// differentiates that affine map. Where a maximum is attained more than once,
// its gradient goes to the first maximal element (lowest h * W + w over the
// plane, lowest channel over channels); PyTorch's amax spreads it evenly over
// ties instead, which only matters for exactly equal values.
class Cbam {
 public:
  // Zeroed MLP and convolution weights (fill them with init_uniform or
  // load_parameters) and PyTorch's fresh BatchNorm: weight 1, bias 0,
  // running_mean 0, running_var 1. Throws qkv::Error unless channels >= 1,
  // rd_ratio > 0 and finite, rd_divisor >= 1, rd_channels >= 0,
  // spatial_kernel_size is odd and >= 1, bn_eps >= 0 and dtype is floating.
  explicit Cbam(std::int64_t channels, const CbamOptions& options = {});

  std::int64_t channels() const { return channels_; }
  std::int64_t rd_channels() const { return rd_; }
  std::int64_t kernel_size() const { return kernel_; }

  // y as above. Throws qkv::Error for an input of the wrong rank, channel
  // count or dtype, with H * W = 0, or when running_var + eps is not positive
  // (init_uniform fills running_var with values of either sign: set it, e.g.
  // to 1, after init_uniform).
  Tensor forward(ConstTensorView x, ImageLayout layout = ImageLayout::nchw) const;

  // Given the forward's input x and dy = dLoss/dy (x's sizes), returns dx
  // (x's dtype) and adds the gradients of the MLP weights (and biases), the
  // convolution weight and BatchNorm's weight and bias to their
  // Parameter::grad. The running statistics are buffers, not learned: their
  // grad stays undefined.
  Tensor backward(ConstTensorView x, ConstTensorView dy, ImageLayout layout = ImageLayout::nchw);

  // timm's state-dict names, each preceded by `prefix`: "channel.fc1.weight",
  // "channel.fc1.bias", "channel.fc2.weight", "channel.fc2.bias" (biases only
  // with mlp_bias), "spatial.conv.conv.weight", "spatial.conv.bn.weight",
  // "spatial.conv.bn.bias", "spatial.conv.bn.running_mean",
  // "spatial.conv.bn.running_var". timm's int64 buffer
  // "spatial.conv.bn.num_batches_tracked" has no role in inference and is not
  // listed: drop it from a state dict before saving it for qkv.
  NamedParameters named_parameters(std::string_view prefix = "");

  Parameter channel_fc1_weight;       // [rd, C, 1, 1]
  Parameter channel_fc1_bias;         // [rd]; undefined without mlp_bias
  Parameter channel_fc2_weight;       // [C, rd, 1, 1]
  Parameter channel_fc2_bias;         // [C]; undefined without mlp_bias
  Parameter spatial_conv_weight;      // [1, 2, k, k]; input channel 0 is the
                                      // mean over channels, 1 the maximum
  Parameter spatial_bn_weight;        // [1]
  Parameter spatial_bn_bias;          // [1]
  Parameter spatial_bn_running_mean;  // [1]
  Parameter spatial_bn_running_var;   // [1]

 private:
  std::int64_t channels_ = 0;
  std::int64_t rd_ = 0;
  std::int64_t kernel_ = 0;
  double eps_ = 0.0;
};

}  // namespace qkv::nn
