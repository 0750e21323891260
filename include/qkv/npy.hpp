// qkv/npy.hpp — tensors in NumPy's .npy format.
//
// A .npy file is the magic "\x93NUMPY", a version byte pair (1.0, 2.0 or
// 3.0), the header's length (2 bytes little-endian in 1.0, 4 in 2.0 and
// 3.0), the header: a Python dict literal such as
//   {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }
// ending in a newline, then the elements, in C (row-major) or Fortran
// (column-major) order. qkv reads and writes:
//
//   descr          qkv dtype   notes
//   '<f4' '>f4'    f32         big-endian ('>') is byte-swapped on reading
//   '<f8' '>f8'    f64
//   '<f2' '>f2'    f16
//   '|b1'          boolean     any non-zero byte reads as 1
//   '<V2' '|V2'    bf16        how NumPy saves ml_dtypes.bfloat16 arrays (an
//                              opaque 2-byte type: np.load returns it as
//                              '|V2'; .view(ml_dtypes.bfloat16) restores it)
//
// and shapes of rank 0 to 4. Anything else (other dtypes, structured or
// object arrays, pickles) is refused with a qkv::Error naming the file.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "qkv/tensor.hpp"

namespace qkv {

// Reads a .npy file into a contiguous tensor of its dtype (Fortran-order
// files are transposed into row-major order). Before allocating anything
// it checks the whole header and the file's size, and throws qkv::Error
// naming the file and the problem for: a missing or unreadable file, a bad
// magic string or version, a header that is truncated, longer than 1 MiB,
// not ASCII (1.0, 2.0) or UTF-8 (3.0), not a dict with exactly the keys
// 'descr', 'fortran_order' and 'shape', or not ending in a newline; an
// unsupported dtype; a rank above 4; a shape whose byte count overflows; and
// data shorter or longer than the shape says.
Tensor load_npy(const std::string& path);

// The same, from the bytes of a .npy file in memory; `name` stands for the
// file in error messages.
Tensor parse_npy(std::span<const std::uint8_t> bytes, const std::string& name = "npy data");

// Writes `t` (any strides; its elements in row-major order, bit for bit) to
// `path` as version 1.0, C order, little-endian, the header padded so the
// data starts at a multiple of 64 bytes, as NumPy writes it. The file is
// written under a temporary name in the same folder and renamed over `path`
// only when complete, so an existing file is either replaced whole or left
// as it was. Throws qkv::Error for an undefined view, a view without memory
// or a file that cannot be written.
void save_npy(const std::string& path, ConstTensorView t);

// The bytes save_npy writes.
std::vector<std::uint8_t> npy_bytes(ConstTensorView t);

}  // namespace qkv
