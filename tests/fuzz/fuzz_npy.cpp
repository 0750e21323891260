// Fuzzes the .npy reader: the input is the file. parse_npy reads it from
// memory and load_npy from a file with the same bytes; what they accept is
// written back with npy_bytes and read again.
//
// Checks: only qkv::Error escapes; the file and memory readers agree (both
// accept, with the same result, or both refuse); an accepted tensor has a
// rank of at most 4, a supported dtype and readable elements (ASan);
// writing it and reading that again gives the same dtype, shape and bits,
// and writing is canonical (the bytes written twice are equal).
#include "fuzz_common.hpp"
#include "qkv/npy.hpp"

using qkv::Tensor;
using qkv::fuzz::require;
using qkv::fuzz::same_bits;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Tensor t, from_file;
  const bool parsed = qkv::fuzz::accepted("parse_npy", [&] { t = qkv::parse_npy({data, size}); });
  static const qkv::fuzz::MemFile file("qkv-fuzz-npy");
  file.write(data, size);
  const bool loaded =
      qkv::fuzz::accepted("load_npy", [&] { from_file = qkv::load_npy(file.path()); });
  require(parsed == loaded, "parse_npy and load_npy disagree on whether the file is valid");
  if (!parsed) return 0;
  require(same_bits(t, from_file), "parse_npy and load_npy read different tensors");
  require(t.rank() <= 4, "a tensor of rank " + std::to_string(t.rank()));
  double sum = 0.0;  // read every element (ASan sees any read past the tensor)
  qkv::detail::for_each_index(t.sizes(), t.rank(), [&](const qkv::Shape& idx) {
    sum += qkv::detail::load(t.view().data(), t.dtype(),
                             qkv::detail::offset(idx, t.view().strides(), t.rank()));
  });
  (void)sum;
  const std::vector<std::uint8_t> written = qkv::npy_bytes(t);
  Tensor again;
  require(qkv::fuzz::accepted("parse_npy (written)", [&] { again = qkv::parse_npy(written); }),
          "parse_npy rejects what npy_bytes wrote");
  require(same_bits(t, again), "a tensor changed on the way through npy_bytes");
  require(qkv::npy_bytes(again) == written, "npy_bytes is not canonical");
  return 0;
}
