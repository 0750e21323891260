// qkv.context_parallel's native half (shards.cpp) and what qkv.distributed's
// (distributed.cpp) shares with it.
#pragma once

#include <nanobind/nanobind.h>

#include <string>

#include "qkv/shard_layout.hpp"

namespace qkv::python {

// "contiguous" or "zigzag"; throws qkv::Error naming `layout` otherwise.
dist::Layout parse_layout(const std::string& s);

// Binds the transport-free pieces of ring and all-to-all attention.
void bind_shards(nanobind::module_& m);

}  // namespace qkv::python
