// qkv/shard_layout.hpp — how one sequence is divided among the R ranks of a
// context-parallel call: the layouts that qkv::dist (qkv/distributed.hpp,
// over MPI) and qkv.context_parallel (over torch.distributed) both take.
// No MPI here, so code that only speaks of layouts needs none.
#pragma once

#include <cstdint>

namespace qkv::dist {

// How the whole sequence is divided among the R ranks.
enum class Layout : std::uint8_t {
  // Rank r holds rows [r * n, (r + 1) * n). With a causal mask rank r has
  // r + 1 shards of work, so the last rank sets the pace.
  contiguous,
  // The sequence in 2R chunks of n / 2 rows (n even); rank r holds chunks r
  // and 2R - 1 - r, back to back. Causal work is the same on every rank.
  zigzag,
};

}  // namespace qkv::dist
