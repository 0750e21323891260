// Which path takes which attention option: one table for every path of the
// library, so that an option a path cannot honour is refused by name (or
// sends the call to a path that honours it), never ignored.
//
// A path is either an entry point, which refuses what it does not take
// with a qkv::Error naming the option, or a fast route inside one, which
// hands a call it does not take to the general route of the same entry
// point (the "falls back to" column of capabilities.cpp). The table speaks
// of options being on (core/options.hpp); conditions on values (Score::
// additive in decode, block layouts in decode's patterns) stay with the
// path's own checks.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "core/checks.hpp"
#include "core/options.hpp"

namespace qkv::detail {

enum class Path : std::uint8_t {
  forward,               // qkv::attention (fused kernels and reference)
  backward,              // qkv::attention_backward (every score; fused and reference)
  additive_backward,     // the fused backward of Score::additive (cpu/additive_backward)
  additive_own_weights,  // its route that computes P from its own projections
  dilated_split,         // a dilated pattern run as one dense call per residue class
  decode,                // qkv::decode_attention
  context_parallel,      // qkv::dist: ring attention and Ulysses
};
inline constexpr int kPathCount = 7;

// The path's name in messages ("decode_attention", ...).
const char* path_name(Path path);

// Whether `path` takes `option` when it is on.
bool supports(Path path, Option option);

// The options that `options` turns on and `path` does not take.
std::vector<Option> unsupported(Path path, const AttentionOptions& options);

// Whether `path` takes every option `options` turns on.
inline bool supports_all(Path path, const AttentionOptions& options) {
  return unsupported(path, options).empty();
}

// Appends "options.<name>: not supported by <by><why>" for each option that
// `options` turns on and `path` does not take.
void refuse_unsupported(Path path, const AttentionOptions& options, std::string_view by,
                        std::string_view why, Reasons& reasons);

}  // namespace qkv::detail
