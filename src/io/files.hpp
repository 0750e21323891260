// Whole-file reads and all-or-nothing writes, for the file formats
// (npy, safetensors): a reader sees a file's size before it allocates, and a
// writer never leaves a half-written file where the caller asked for one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>

#include "qkv/tensor.hpp"

namespace qkv::io {

// A file opened for reading, with its size. Throws qkv::Error naming `path`
// when it cannot be opened or is not a regular file.
class InputFile {
 public:
  explicit InputFile(const std::string& path);
  ~InputFile();
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;

  std::uint64_t size() const { return size_; }
  // Reads `n` bytes at `offset` into `out`; throws qkv::Error naming the
  // file when fewer are there.
  void read(std::uint64_t offset, void* out, std::size_t n) const;

 private:
  std::string path_;
  std::FILE* file_ = nullptr;
  std::uint64_t size_ = 0;
};

// `view`'s elements in row-major order, bit for bit (any strides), into
// `out` (numel x element size bytes).
void gather_bytes(ConstTensorView view, std::byte* out);

// A file written under a temporary name in the target's folder and renamed
// over the target by commit(), so the target is either untouched or
// complete. Destroying it without commit() removes the temporary file.
// Throws qkv::Error naming `path` when the folder cannot be written.
class AtomicFile {
 public:
  explicit AtomicFile(const std::string& path);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  void write(const void* data, std::size_t n);
  // `view`'s elements in row-major order, bit for bit (any strides).
  void write(ConstTensorView view);
  // Flushes the data to the disk and renames the file over the target.
  void commit();

 private:
  std::string path_, temp_;
  std::FILE* file_ = nullptr;
};

}  // namespace qkv::io
