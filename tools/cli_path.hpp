// The path of the qkv binary that the tool's tests run. The value lives in a
// source file that CMake generates (tools/CMakeLists.txt) rather than in a
// compile definition, so that the other test sources compile to the same
// object in any checkout, and a compiler cache finds it.
#pragma once

namespace qkv::test {

extern const char* const kCli;

}  // namespace qkv::test
