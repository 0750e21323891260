// Fuzzes the safetensors reader: the input is the file. load_safetensors,
// load_safetensors_metadata and load_parameters (into a small Linear) read
// it; what they accept is written back with save_safetensors and read
// again.
//
// Checks: only qkv::Error escapes; a file load_safetensors accepts also
// passes load_safetensors_metadata; every tensor it returns has a rank of at
// most 4, a supported dtype and readable elements (ASan); saving what was
// loaded, with its metadata, and loading that again gives the same names,
// dtypes, shapes, bits and metadata; a rejected load_parameters leaves the
// parameters unchanged.
#include <unistd.h>

#include "fuzz_common.hpp"
#include "qkv/modules/linear.hpp"
#include "qkv/modules/safetensors.hpp"

namespace {

using qkv::DType;
using qkv::Tensor;
using qkv::fuzz::finding;
using qkv::fuzz::MemFile;
using qkv::fuzz::require;
using qkv::fuzz::same_bits;
namespace nn = qkv::nn;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const MemFile input("qkv-fuzz-input");
  // The writer renames a finished temporary file over its target, so the
  // copy is a real file (in /dev/shm: memory, no disk), removed at exit.
  struct CopyFile {
    std::string path = std::string(access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp") +
                       "/qkv-fuzz-copy-" + std::to_string(getpid()) + ".safetensors";
    ~CopyFile() { unlink(path.c_str()); }
  };
  static const CopyFile copy_file;
  const std::string& copy = copy_file.path;
  input.write(data, size);

  nn::TensorMap tensors;
  const bool loaded = qkv::fuzz::accepted("load_safetensors",
                                          [&] { tensors = nn::load_safetensors(input.path()); });
  std::map<std::string, std::string> metadata;
  const bool header_ok = qkv::fuzz::accepted(
      "load_safetensors_metadata", [&] { metadata = nn::load_safetensors_metadata(input.path()); });
  if (loaded) require(header_ok, "load_safetensors accepted a header the metadata reader rejects");

  // load_parameters into a Linear(2, 3): "weight" [3, 2], "bias" [3].
  nn::Linear linear(2, 3);
  const nn::NamedParameters params = linear.named_parameters();
  nn::init_uniform(params, 7);
  const Tensor weight_before = linear.weight.value, bias_before = linear.bias.value;
  if (loaded) {
    const bool strict = size % 2 == 0;
    if (!qkv::fuzz::accepted("load_parameters",
                             [&] { nn::load_parameters(params, tensors, strict); })) {
      require(same_bits(linear.weight.value, weight_before) &&
                  same_bits(linear.bias.value, bias_before),
              "a rejected load_parameters changed a parameter");
    }
  }
  if (!loaded) return 0;

  std::map<std::string, qkv::ConstTensorView> views;
  for (const auto& entry : tensors) {
    const std::string& name = entry.first;
    const Tensor& t = entry.second;
    require(t.rank() <= 4, "tensor " + name + " of rank " + std::to_string(t.rank()));
    require(t.dtype() == DType::f32 || t.dtype() == DType::f64 || t.dtype() == DType::f16 ||
                t.dtype() == DType::bf16 || t.dtype() == DType::boolean,
            "tensor " + name + " of an unsupported dtype");
    // Read every element (ASan sees any read past the tensor's memory).
    double sum = 0.0;
    qkv::detail::for_each_index(t.sizes(), t.rank(), [&](const qkv::Shape& idx) {
      sum += qkv::detail::load(t.view().data(), t.dtype(),
                               qkv::detail::offset(idx, t.view().strides(), t.rank()));
    });
    (void)sum;
    views.emplace(name, t.view());
  }
  // What was read is written back and read again unchanged.
  if (!qkv::fuzz::accepted("save_safetensors",
                           [&] { nn::save_safetensors(copy, views, metadata); })) {
    // Names or metadata that are not valid UTF-8 are the writer's to
    // refuse; the reader does not check the encoding of what it returns.
    return 0;
  }
  nn::TensorMap again;
  if (!qkv::fuzz::accepted("load_safetensors (copy)",
                           [&] { again = nn::load_safetensors(copy); })) {
    finding("load_safetensors rejects what save_safetensors wrote");
  }
  require(again.size() == tensors.size(), "the copy holds another number of tensors");
  for (const auto& [name, t] : tensors) {
    const auto it = again.find(name);
    require(it != again.end(), "the copy lacks tensor " + name);
    require(same_bits(t, it->second), "tensor " + name + " changed on the way through a file");
  }
  require(nn::load_safetensors_metadata(copy) == metadata, "the copy's metadata differs");
  return 0;
}
