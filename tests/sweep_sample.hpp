// Sampling of the sweeps that take most of the sanitizer run's time.
//
// A sweep test runs its cases through a SweepSample. By default it runs all
// of them. With QKV_SWEEP_SHARE set to a share in (0, 1] (the `asan` test
// preset sets 0.25: the sanitizers slow the reference backend about tenfold),
// it runs that share of them, at least one, drawn by a seed: QKV_SWEEP_SEED
// (scripts/test.sh draws one per run and prints it), else the clock. Every
// failure's message names the seed; setting QKV_SWEEP_SEED to it replays the
// same cases. The cases skipped in one run are run in others, and all of them
// in every optimized run.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace qkv::test {

class SweepSample {
 public:
  // Draws which of `n` cases run. The draw depends on the seed and the test's
  // full name only, so each test of a run draws its own cases.
  explicit SweepSample(std::size_t n) : runs_(n, true) {
    const char* share_text = std::getenv("QKV_SWEEP_SHARE");
    if (share_text == nullptr || *share_text == '\0' || n == 0) {
      note_ = "all " + std::to_string(n) + " cases";
      return;
    }
    char* end = nullptr;
    const double share = std::strtod(share_text, &end);
    if (*end != '\0' || !(share > 0.0 && share <= 1.0)) {
      throw std::invalid_argument(
          std::string("QKV_SWEEP_SHARE: expected a share in (0, 1], got '") + share_text + "'");
    }
    std::uint64_t seed = 0;
    const char* seed_text = std::getenv("QKV_SWEEP_SEED");
    if (seed_text != nullptr && *seed_text != '\0') {
      seed = std::strtoull(seed_text, &end, 10);
      if (*end != '\0') {
        throw std::invalid_argument(
            std::string("QKV_SWEEP_SEED: expected a non-negative integer, got '") + seed_text +
            "'");
      }
    } else {
      seed =
          static_cast<std::uint64_t>(std::chrono::system_clock::now().time_since_epoch().count());
    }
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    const std::string name =
        info == nullptr ? "" : std::string(info->test_suite_name()) + "." + info->name();
    std::uint64_t key = 1469598103934665603ull ^ seed;  // FNV-1a over the name
    for (const char c : name) key = (key ^ static_cast<unsigned char>(c)) * 1099511628211ull;
    std::mt19937_64 gen(key);
    std::vector<std::size_t> order(n);
    std::iota(order.begin(), order.end(), std::size_t{0});
    std::shuffle(order.begin(), order.end(), gen);
    const auto keep = std::max<std::size_t>(
        1, static_cast<std::size_t>(std::ceil(share * static_cast<double>(n))));
    std::fill(runs_.begin(), runs_.end(), false);
    std::string chosen;
    std::sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(keep));
    for (std::size_t k = 0; k < keep; ++k) {
      runs_[order[k]] = true;
      if (k > 0) chosen += ',';
      chosen += std::to_string(order[k]);
    }
    note_ = "cases " + chosen + " of " + std::to_string(n) + " (QKV_SWEEP_SHARE=" + share_text +
            " QKV_SWEEP_SEED=" + std::to_string(seed) + " replays them)";
  }

  // Whether case i runs.
  bool runs(std::size_t i) const { return runs_.at(i); }

  // Which cases ran and how to replay them, for SCOPED_TRACE.
  const std::string& note() const { return note_; }

 private:
  std::vector<bool> runs_;
  std::string note_;
};

}  // namespace qkv::test
