// `qkv info`: what this CPU and process can run (the instruction families
// of core/isa.hpp, each with the reason when it is not usable), each one's
// register probe beside the f32 FMA's, and the engine the kernels chose for
// bf16 products.
#pragma once

#include <ostream>

namespace qkv::tools {

struct InfoOptions {
  bool json = false;  // one JSON object instead of the table
  bool probe = true;  // run the register probes (about 0.2 s each family)
};

// Prints the report; returns the exit status (0).
int run_info(std::ostream& out, const InfoOptions& options);

}  // namespace qkv::tools
