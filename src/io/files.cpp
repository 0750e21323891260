#include "io/files.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "core/elements.hpp"
#include "qkv/error.hpp"
#include "qkv/files.hpp"

namespace qkv::io {

namespace {

std::string system_error() { return std::strerror(errno); }

}  // namespace

void gather_bytes(ConstTensorView view, std::byte* out) {
  const std::size_t element = dtype_size(view.dtype());
  const auto* base = static_cast<const std::byte*>(view.data());
  detail::for_each_index(view.sizes(), view.rank(), [&](const Shape& idx) {
    const std::int64_t at = detail::offset(idx, view.strides(), view.rank());
    std::memcpy(out, base + at * static_cast<std::int64_t>(element), element);
    out += element;
  });
}

InputFile::InputFile(const std::string& path) : path_(path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    throw Error(path + ": cannot open the file for reading (" + system_error() + ")");
  }
  if (!S_ISREG(st.st_mode)) throw Error(path + ": expected a regular file");
  file_ = std::fopen(path.c_str(), "rb");
  if (file_ == nullptr) {
    throw Error(path + ": cannot open the file for reading (" + system_error() + ")");
  }
  size_ = static_cast<std::uint64_t>(st.st_size);
}

InputFile::~InputFile() {
  if (file_ != nullptr) std::fclose(file_);
}

void InputFile::read(std::uint64_t offset, void* out, std::size_t n) const {
  if (offset > size_ || n > size_ - offset) {
    throw Error(path_ + ": truncated: expected " + std::to_string(n) + " bytes at offset " +
                std::to_string(offset) + ", the file has " + std::to_string(size_) + " bytes");
  }
  if (n == 0) return;
  if (::fseeko(file_, static_cast<off_t>(offset), SEEK_SET) != 0 ||
      std::fread(out, 1, n, file_) != n) {
    throw Error(path_ + ": reading the file failed (" + system_error() + ")");
  }
}

AtomicFile::AtomicFile(const std::string& path) : path_(path) {
  const std::size_t slash = path.find_last_of('/');
  const std::string folder = slash == std::string::npos ? "." : path.substr(0, slash + 1);
  if (path.empty() || slash + 1 == path.size()) {
    throw Error("'" + path + "': expected a file name, got a folder");
  }
  // A fresh name beside the target (so rename stays within one file
  // system), created exclusively with the usual mode (0666 less the umask).
  static std::atomic<std::uint64_t> counter{0};
  int fd = -1;
  for (int attempt = 0; fd < 0 && attempt < 100; ++attempt) {
    temp_ = path + ".tmp-" + std::to_string(::getpid()) + "-" + std::to_string(counter++);
    fd = ::open(temp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd < 0) {
    const std::string reason = system_error();
    temp_.clear();
    throw Error(path + ": cannot create a file in folder '" + folder + "' (" + reason + ")");
  }
  file_ = ::fdopen(fd, "wb");
  if (file_ == nullptr) {
    const std::string reason = system_error();
    ::close(fd);
    ::unlink(temp_.c_str());
    temp_.clear();
    throw Error(path + ": cannot open the file for writing (" + reason + ")");
  }
}

AtomicFile::~AtomicFile() {
  if (file_ != nullptr) std::fclose(file_);
  if (!temp_.empty()) ::unlink(temp_.c_str());
}

void AtomicFile::write(const void* data, std::size_t n) {
  if (n != 0 && std::fwrite(data, 1, n, file_) != n) {
    throw Error(path_ + ": writing the file failed (" + system_error() + ")");
  }
}

void AtomicFile::write(ConstTensorView view) {
  const std::size_t bytes = static_cast<std::size_t>(view.numel()) * dtype_size(view.dtype());
  if (bytes == 0) return;
  if (view.is_contiguous()) {
    write(view.data(), bytes);
    return;
  }
  std::vector<std::byte> staging(bytes);
  gather_bytes(view, staging.data());
  write(staging.data(), bytes);
}

void AtomicFile::commit() {
  std::FILE* f = file_;
  file_ = nullptr;
  const bool flushed = std::fflush(f) == 0 && ::fsync(::fileno(f)) == 0;
  if (std::fclose(f) != 0 || !flushed) {
    throw Error(path_ + ": writing the file failed (" + system_error() + ")");
  }
  if (std::rename(temp_.c_str(), path_.c_str()) != 0) {
    throw Error(path_ + ": cannot replace the file (" + system_error() + ")");
  }
  temp_.clear();
}

}  // namespace qkv::io

namespace qkv {

void write_file(const std::string& path, std::span<const std::uint8_t> bytes) {
  io::AtomicFile file(path);
  file.write(bytes.data(), bytes.size());
  file.commit();
}

}  // namespace qkv
