// Where the tests find the repository's files. The values live in a source
// file that CMake generates (tests/CMakeLists.txt) rather than in compile
// definitions, so that every other test source compiles to the same object
// in any checkout, and a compiler cache finds it.
#pragma once

namespace qkv::test {

extern const char* const kSourceDir;    // the repository's root
extern const char* const kTestDataDir;  // tests/data: the golden files

}  // namespace qkv::test
