// qkv/modules/safetensors.hpp — parameters in the safetensors format.
//
// A safetensors file (Hugging Face's format, what `safetensors.torch.save_file`
// writes) is an 8-byte little-endian header length N, N bytes of UTF-8 JSON
// (padded with trailing spaces) mapping each tensor name to
// {"dtype", "shape", "data_offsets": [begin, end]} plus an optional
// "__metadata__" object of strings, and then the data buffer: each tensor's
// raw little-endian, row-major bytes at [begin, end) of it. qkv reads and
// writes F32, F64, F16, BF16 and BOOL tensors of rank 0 to 4.
#pragma once

#include <map>
#include <string>

#include "qkv/modules/parameter.hpp"
#include "qkv/tensor.hpp"

namespace qkv::nn {

using TensorMap = std::map<std::string, Tensor>;

// Reads every tensor of a file, each in its file dtype (BOOL as qkv's bool:
// any non-zero byte reads as 1). Throws qkv::Error naming the file, the tensor
// and every problem found, for an unreadable or truncated file, a header
// length past the end of the file, a header that is not a JSON object, an
// unsupported dtype, a rank above 4, or data offsets that are reversed, do
// not match shape x element size, overlap, leave gaps or unused trailing
// bytes, or reach past the end of the file (the reference implementation's
// rules for a valid file).
TensorMap load_safetensors(const std::string& path);

// The header's "__metadata__" (empty when absent), after the same checks of
// the header as load_safetensors; the tensor data is not read.
std::map<std::string, std::string> load_safetensors_metadata(const std::string& path);

// Writes `tensors` (any strides; written contiguous, in their own dtype, bit
// for bit) to `path`, with `metadata` as the header's "__metadata__" (omitted
// when empty). As the reference writer: tensors ordered by decreasing element
// size, then by name, data offsets increasing, the header padded with spaces
// to a multiple of 8 bytes (so each tensor starts at a multiple of its
// element size). Throws qkv::Error for an undefined view, the reserved name
// "__metadata__", names or metadata that are not valid UTF-8, or a file that
// cannot be written.
void save_safetensors(const std::string& path,
                      const std::map<std::string, ConstTensorView>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

// Copies tensors into the module's parameters by name, converting each to
// the parameter's dtype (RNE); gradients are left as they are. Throws
// qkv::Error, changing nothing, listing every parameter missing from
// `tensors`, every tensor of the wrong shape or a bool dtype, and (when
// strict) every tensor no parameter takes, as torch's load_state_dict.
void load_parameters(const NamedParameters& parameters, const TensorMap& tensors,
                     bool strict = true);
// load_safetensors(path), then load_parameters.
void load_parameters(const NamedParameters& parameters, const std::string& path,
                     bool strict = true);
// Writes every parameter's value under its name.
void save_parameters(const NamedParameters& parameters, const std::string& path);

}  // namespace qkv::nn
