// How the qkv subcommands report an error: one line on stderr.
#pragma once

#include <ostream>
#include <string>

#include "qkv/error.hpp"

namespace qkv::tools {

// Writes "<command>: error: <reasons joined by '; '>" and returns the exit
// status of every error, 2.
inline int report_error(std::ostream& err, const std::string& command, const Error& e) {
  std::string line;
  for (const std::string& r : e.reasons()) line += (line.empty() ? "" : "; ") + r;
  err << command << ": error: " << line << "\n";
  return 2;
}

}  // namespace qkv::tools
