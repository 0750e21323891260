// Philox4x32-10, the counter-based generator of dropout (see dropout_keep in
// qkv/backward.hpp): a pure function of a 128-bit counter and a 64-bit key,
// so any thread can regenerate any element's random bits.
#pragma once

#include <array>
#include <cstdint>

#include "qkv/attention.hpp"

namespace qkv::detail {

using PhiloxCounter = std::array<std::uint32_t, 4>;

// Ten rounds of Philox4x32 on `counter` under `key` (Random123's reference
// algorithm and constants).
inline PhiloxCounter philox4x32_10(PhiloxCounter c, std::uint32_t k0, std::uint32_t k1) {
  constexpr std::uint64_t kM0 = 0xD2511F53u;
  constexpr std::uint64_t kM1 = 0xCD9E8D57u;
  constexpr std::uint32_t kW0 = 0x9E3779B9u;
  constexpr std::uint32_t kW1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += kW0;
      k1 += kW1;
    }
    const std::uint64_t p0 = kM0 * c[0];
    const std::uint64_t p1 = kM1 * c[2];
    c = {static_cast<std::uint32_t>(p1 >> 32) ^ c[1] ^ k0, static_cast<std::uint32_t>(p1),
         static_cast<std::uint32_t>(p0 >> 32) ^ c[3] ^ k1, static_cast<std::uint32_t>(p0)};
  }
  return c;
}

// The dropout threshold: a word w keeps its weight iff (w >> 8) >= threshold,
// i.e. u = (w >> 8) * 2^-24 >= p, with p rounded up to a multiple of 2^-24.
inline std::uint32_t dropout_threshold(double p) {
  const double t = p * 16777216.0;
  const auto floor_t = static_cast<std::uint32_t>(t);
  return static_cast<double>(floor_t) == t ? floor_t : floor_t + 1;
}

// The dropout stream (b * Hq + h of qkv::dropout_keep) of query head h of
// sequence s in a call with hq heads, in the coordinates of the whole
// problem when the call is a shard of one (AttentionOptions::shard).
inline std::int64_t dropout_stream(const ShardOffsets& shard, std::int64_t hq, std::int64_t s,
                                   std::int64_t h) {
  return s * (shard.heads > 0 ? shard.heads : hq) + shard.head + h;
}

// The four dropout words of keys [4 * (j / 4), 4 * (j / 4) + 4) of row i of
// head `bh` (= b * Hq + h).
inline PhiloxCounter dropout_words(std::uint64_t seed, std::uint32_t offset, std::int64_t bh,
                                   std::int64_t i, std::int64_t j) {
  return philox4x32_10({static_cast<std::uint32_t>(j / 4), static_cast<std::uint32_t>(i),
                        static_cast<std::uint32_t>(bh), offset},
                       static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32));
}

}  // namespace qkv::detail
