#include "demo.hpp"

namespace qkv::tools {

bool run_demo(std::ostream& os, const DemoOptions&) {
  os << "TODO\n";
  return false;
}

}  // namespace qkv::tools
