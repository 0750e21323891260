// `qkv demo`: built-in examples with their checks, then small transformers
// trained with the library's backward passes (see train.hpp), their learned
// attention drawn in the terminal and written as PNG and .npy files.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>

namespace qkv::tools {

struct DemoOptions {
  bool color = false;            // ANSI background shading in the heatmap
  bool train = true;             // false: only the fixed examples
  std::string out = "qkv-demo";  // folder for the pictures and .npy files
  std::int64_t steps = 0;        // step budget per task; 0 = the default
  std::uint64_t seed = 1;        // training seed
  std::int64_t threads = 1;      // OpenMP threads while training
  bool live = false;             // progress as one rewritten line (a terminal)
};

// Prints every example and its checks to `os`; returns true if all pass.
// Throws qkv::Error if a picture or .npy file cannot be written.
bool run_demo(std::ostream& os, const DemoOptions& options);

}  // namespace qkv::tools
