// detail::KeyRule, the one formula of each query's admitted keys: range()
// against the definition key by key, reaches() against range() over every
// block of positions and keys, and windows as wide as int64 allows.
#include "core/key_range.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace qkv {
namespace {

constexpr std::int64_t kHuge = std::numeric_limits<std::int64_t>::max();

// The definition (docs/semantics.md): j < nk, j <= p (causal), p - j <= left,
// j - p <= right; a side of -1 is unbounded.
bool admits(const detail::KeyRule& r, std::int64_t p, std::int64_t j, std::int64_t nk) {
  return j >= 0 && j < nk && (!r.causal || j <= p) &&
         (r.window_left < 0 || p - j <= r.window_left) &&
         (r.window_right < 0 || j - p <= r.window_right);
}

std::vector<detail::KeyRule> rules() {
  std::vector<detail::KeyRule> out;
  for (const bool causal : {false, true}) {
    for (const std::int64_t left : {std::int64_t{-1}, std::int64_t{0}, std::int64_t{2}, kHuge}) {
      for (const std::int64_t right : {std::int64_t{-1}, std::int64_t{0}, std::int64_t{3}, kHuge}) {
        out.push_back({causal, left, right, Align::bottom_right, 0});
      }
    }
  }
  return out;
}

TEST(KeyRule, RangeIsTheDefinition) {
  constexpr std::int64_t nk = 9;
  for (const detail::KeyRule& r : rules()) {
    for (std::int64_t p = -4; p < nk + 4; ++p) {
      const detail::KeyRange kr = r.range(p, nk);
      ASSERT_LE(kr.lo, kr.hi);
      for (std::int64_t j = 0; j < nk; ++j) {
        ASSERT_EQ(kr.lo <= j && j < kr.hi, admits(r, p, j, nk))
            << "causal " << r.causal << " window " << r.window_left << "/" << r.window_right
            << " p " << p << " j " << j;
      }
    }
  }
}

TEST(KeyRule, OffsetPlacesRowZero) {
  detail::KeyRule r;
  EXPECT_EQ(r.offset(3, 10), 7);  // bottom-right: the last query sits on key 9
  r.align = Align::top_left;
  EXPECT_EQ(r.offset(3, 10), 0);
  r.shard_position = 5;
  EXPECT_EQ(r.offset(3, 10), 5);
}

TEST(KeyRule, ReachesIsAnyRowRange) {
  constexpr std::int64_t nk = 12;
  for (const detail::KeyRule& r : rules()) {
    for (std::int64_t p0 = -3; p0 < nk + 2; ++p0) {
      for (std::int64_t p1 = p0 - 1; p1 < p0 + 4; ++p1) {
        for (std::int64_t k0 = 0; k0 <= nk; ++k0) {
          for (std::int64_t k1 = k0; k1 <= nk; ++k1) {
            bool any = false;
            for (std::int64_t p = p0; p <= p1; ++p) {
              const detail::KeyRange kr = r.range(p, nk);
              any = any || (std::max(kr.lo, k0) < std::min(kr.hi, k1));
            }
            ASSERT_EQ(r.reaches(p0, p1, k0, k1), any)
                << "causal " << r.causal << " window " << r.window_left << "/" << r.window_right
                << " positions [" << p0 << ", " << p1 << "] keys [" << k0 << ", " << k1 << ")";
          }
        }
      }
    }
  }
}

TEST(KeyRule, WideWindowsAtFarPositions) {
  // Positions near the 2^60 limit of a call, windows up to int64's maximum:
  // no step may overflow.
  constexpr std::int64_t far = (std::int64_t{1} << 60) - 1;
  const detail::KeyRule r{true, kHuge, kHuge, Align::bottom_right, 0};
  const detail::KeyRange kr = r.range(far - 1, far);
  EXPECT_EQ(kr.lo, 0);
  EXPECT_EQ(kr.hi, far);
  EXPECT_TRUE(r.reaches(far - 1, far - 1, 0, 1));
  const detail::KeyRule narrow{false, 1, 1, Align::bottom_right, 0};
  EXPECT_FALSE(narrow.reaches(far - 1, far - 1, 0, far - 3));
  EXPECT_TRUE(narrow.reaches(far - 1, far - 1, 0, far - 1));
}

}  // namespace
}  // namespace qkv
