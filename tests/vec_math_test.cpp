// The SIMD building blocks of the kernels, on every Highway target this CPU
// runs: output conversions are exactly the RNE conversions of qkv/dtype.hpp,
// and the softmax exp is accurate to a few ulps, exact 0 where e^x would be
// subnormal, and never subnormal.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu/flash.hpp"
#include "hwy/targets.h"

namespace {

// Float bit patterns spread over the whole range plus the edge cases.
std::vector<float> sample_floats() {
  std::vector<float> x;
  for (std::uint64_t bits = 0; bits < (1ull << 32); bits += 4093) {
    x.push_back(std::bit_cast<float>(static_cast<std::uint32_t>(bits)));
  }
  for (float f : {0.0f, -0.0f, 65504.0f, 65519.99f, 65520.0f, 1e-8f, 5.96e-8f, 2.98e-8f,
                  std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                  std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::max(),
                  std::bit_cast<float>(0x3f808000u), std::bit_cast<float>(0x3f818000u),
                  std::bit_cast<float>(0x387fc000u), std::bit_cast<float>(0x33000000u)}) {
    x.push_back(f);
  }
  return x;
}

class EveryTarget : public ::testing::Test {
 protected:
  template <class F>
  void for_each_target(F&& f) {
    for (const std::int64_t target : hwy::SupportedAndGeneratedTargets()) {
      hwy::SetSupportedTargetsForTest(target);
      SCOPED_TRACE(hwy::TargetName(target));
      f();
    }
    hwy::SetSupportedTargetsForTest(0);
  }
};

TEST_F(EveryTarget, OutputConversionsRoundToNearestEven) {
  const std::vector<float> x = sample_floats();
  std::vector<std::uint16_t> out(x.size());
  for_each_target([&] {
    for (qkv::DType dtype : {qkv::DType::f16, qkv::DType::bf16}) {
      qkv::cpu::store_row(x.data(), static_cast<std::int64_t>(x.size()), out.data(), dtype);
      int wrong = 0;
      for (std::size_t i = 0; i < x.size(); ++i) {
        const std::uint16_t want =
            dtype == qkv::DType::f16 ? qkv::to_f16(x[i]).bits : qkv::to_bf16(x[i]).bits;
        const bool both_nan =
            std::isnan(x[i]) &&
            (dtype == qkv::DType::f16 ? std::isnan(qkv::to_float(qkv::f16{out[i]}))
                                      : std::isnan(qkv::to_float(qkv::bf16{out[i]})));
        if (out[i] != want && !both_nan && ++wrong < 5) {
          ADD_FAILURE() << qkv::dtype_name(dtype) << " of " << x[i] << " (bits "
                        << std::bit_cast<std::uint32_t>(x[i]) << "): got " << out[i] << ", want "
                        << want;
        }
      }
      EXPECT_EQ(wrong, 0);
    }
  });
}

TEST_F(EveryTarget, ExpIsAccurateAndNeverSubnormal) {
  std::vector<float> x;
  for (float t = -104.0f; t <= 88.0f; t += 0.0037f) x.push_back(t);
  x.push_back(-std::numeric_limits<float>::infinity());
  x.push_back(-87.33654f);
  x.push_back(0.0f);
  std::vector<float> y(x.size());
  for_each_target([&] {
    qkv::cpu::exp_row(x.data(), static_cast<std::int64_t>(x.size()), y.data());
    double worst_ulps = 0.0;
    for (std::size_t i = 0; i < x.size(); ++i) {
      ASSERT_NE(std::fpclassify(y[i]), FP_SUBNORMAL) << "exp(" << x[i] << ")";
      const double exact = std::exp(static_cast<double>(x[i]));
      if (exact < std::numeric_limits<float>::min()) {
        // Below the normal range the kernel flushes to 0 (or keeps the
        // nearest normal at the boundary).
        EXPECT_TRUE(y[i] == 0.0f || y[i] == std::numeric_limits<float>::min()) << x[i];
        continue;
      }
      const double ulp = std::ldexp(1.0, std::ilogb(exact) - 23);
      worst_ulps = std::max(worst_ulps, std::fabs(y[i] - exact) / ulp);
    }
    EXPECT_LE(worst_ulps, 2.0);
    EXPECT_TRUE(std::isnan([] {
      const float nan = std::numeric_limits<float>::quiet_NaN();
      float r = 0.0f;
      qkv::cpu::exp_row(&nan, 1, &r);
      return r;
    }()));
  });
}

}  // namespace
