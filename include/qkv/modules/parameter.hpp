// qkv/modules/parameter.hpp — learnable parameters of the modules (qkv::nn).
//
// Every module owns its parameters as `Parameter`s: the value in its storage
// dtype and, once a backward call reached it, the gradient. Modules list
// them under PyTorch's state-dict names ("in_proj_weight", "out_proj.bias",
// "fc1.weight", ...), so weights saved from PyTorch or timm load unchanged
// (see qkv/modules/safetensors.hpp).
//
// Compute precision: a module computes in f64 when its input is f64 (the
// precision the finite-difference tests need) and in f32 otherwise; bf16 and
// f16 inputs and weights are widened exactly and the outputs rounded once.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "qkv/tensor.hpp"

namespace qkv::nn {

// A learnable tensor and its gradient.
struct Parameter {
  Tensor value;  // the parameter, in its storage dtype (f32, f64, bf16 or f16)
  Tensor grad;   // same shape, f32 (f64 for an f64 backward); undefined until
                 // a backward call reaches it, then accumulated into by every
                 // later one, as PyTorch's `.grad`, until zero_grad()

  bool defined() const { return value.defined(); }
};

// A parameter under its state-dict name.
struct NamedParameter {
  std::string name;      // e.g. "out_proj.weight"
  Parameter* parameter;  // owned by the module
};
using NamedParameters = std::vector<NamedParameter>;

// Drops every gradient (the next backward call starts from zero).
void zero_grad(const NamedParameters& parameters);

// A parameter of the given shape and dtype (f32, f64, bf16 or f16), zeroed.
Parameter make_parameter(DType dtype, std::initializer_list<std::int64_t> sizes);

// Fills every parameter with a reproducible pseudo-random uniform value in
// [-bound, bound], bound = 1/sqrt(fan_in) where fan_in is the product of the
// parameter's dimensions after the first (a vector's length for vectors), as
// PyTorch initializes linear layers. The stream depends only on the seed and
// the parameter's position in the list. Meant for tests, examples and
// benchmarks; trained weights come from a file.
void init_uniform(const NamedParameters& parameters, std::uint64_t seed);

}  // namespace qkv::nn
