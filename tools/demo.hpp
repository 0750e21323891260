// `qkv demo`: built-in examples with their checks.
#pragma once

#include <ostream>

namespace qkv::tools {

struct DemoOptions {
  bool color = false;  // ANSI background shading in the heatmap
};

// Prints every example and its checks to `os`; returns true if all pass.
bool run_demo(std::ostream& os, const DemoOptions& options);

}  // namespace qkv::tools
