// qkv/modules/safetensors.hpp — parameters in the safetensors format.
//
// A safetensors file (Hugging Face's format, what `safetensors.torch.save_file`
// writes) is an 8-byte little-endian header length, a JSON header mapping each
// tensor name to {"dtype", "shape", "data_offsets": [begin, end]} (plus an
// optional "__metadata__" object of strings), and the raw little-endian tensor
// bytes. qkv reads and writes F32, F64, F16, BF16 and BOOL tensors of rank 0
// to 4.
#pragma once

#include <map>
#include <string>

#include "qkv/modules/parameter.hpp"
#include "qkv/tensor.hpp"

namespace qkv::nn {

using TensorMap = std::map<std::string, Tensor>;

// Reads every tensor of a file. Throws qkv::Error naming the file and the
// problem for an unreadable file, a malformed header, an unsupported dtype or
// rank, or data offsets that do not match the shapes or the file size.
TensorMap load_safetensors(const std::string& path);

// Writes `tensors` (any strides; written contiguous, in their own dtype) to
// `path`, with `metadata` as the header's "__metadata__". Throws qkv::Error if
// the file cannot be written.
void save_safetensors(const std::string& path,
                      const std::map<std::string, ConstTensorView>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

// Copies tensors into the module's parameters by name, converting each to
// the parameter's dtype (RNE). Throws qkv::Error, changing nothing, listing
// every parameter missing from `tensors`, every tensor of the wrong shape, and
// (when strict) every tensor no parameter takes.
void load_parameters(const NamedParameters& parameters, const TensorMap& tensors,
                     bool strict = true);
// load_safetensors(path), then load_parameters.
void load_parameters(const NamedParameters& parameters, const std::string& path,
                     bool strict = true);
// Writes every parameter's value under its name.
void save_parameters(const NamedParameters& parameters, const std::string& path);

}  // namespace qkv::nn
