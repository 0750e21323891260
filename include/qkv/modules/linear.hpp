// qkv/modules/linear.hpp — the linear projection y = x W^T + b (torch.nn.Linear).
//
// Shapes:
//   x       [..., in]    rank 1 to 4, any strides, f32, f64, bf16 or f16
//   weight  [out, in]    f32, f64, bf16 or f16 (bf16/f16 halve the bytes stored)
//   bias    [out]        same dtype as weight; absent when bias == false
//   y       [..., out]   dtype of x
// The product runs on OpenBLAS's GEMM (sgemm in f32, dgemm for f64 inputs),
// with 16-bit weights widened exactly to f32 once per call.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "qkv/modules/parameter.hpp"
#include "qkv/tensor.hpp"

namespace qkv::nn {

class Linear {
 public:
  // Zeroed parameters (fill them with init_uniform or load_parameters).
  // Throws qkv::Error unless in_features, out_features >= 1 and dtype is floating.
  Linear(std::int64_t in_features, std::int64_t out_features, bool with_bias = true,
         DType dtype = DType::f32);

  std::int64_t in_features() const { return in_; }
  std::int64_t out_features() const { return out_; }

  // y = x W^T + b. Throws qkv::Error if x's last dimension is not in_features.
  Tensor forward(ConstTensorView x) const;

  // Given the forward's input x and dy = dLoss/dy ([..., out]), returns
  // dx = dy W ([..., in], dtype of x) and adds dy^T x to weight.grad and the
  // sum of dy over rows to bias.grad.
  Tensor backward(ConstTensorView x, ConstTensorView dy);

  // "weight" and "bias" (if any), each preceded by `prefix`.
  NamedParameters named_parameters(std::string_view prefix = "");

  Parameter weight;  // [out, in]
  Parameter bias;    // [out]; undefined without bias

 private:
  // Reasons the parameters no longer have this layer's shapes (they are
  // public and may have been replaced).
  void check_parameters(std::vector<std::string>& reasons) const;

  std::int64_t in_ = 0;
  std::int64_t out_ = 0;
};

}  // namespace qkv::nn
