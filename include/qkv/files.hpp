// qkv/files.hpp — writing a whole file, all or nothing.
#pragma once

#include <cstdint>
#include <span>
#include <string>

namespace qkv {

// Writes `bytes` to `path` under a temporary name in the same folder, then
// renames it over `path` (after flushing it to the disk): an existing file
// is either replaced whole or left as it was, and an interrupted run leaves
// no half-written file. The file readers and writers of qkv (npy,
// safetensors) write the same way. Throws qkv::Error naming `path` when the
// folder cannot be written or writing fails.
void write_file(const std::string& path, std::span<const std::uint8_t> bytes);

}  // namespace qkv
