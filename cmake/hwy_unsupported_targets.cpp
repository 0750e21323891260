// Prints the Highway targets that a build compiles by default (HWY_TARGETS)
// and this CPU cannot run, as HWY_DISABLED_TARGETS spells them
// ("HWY_AVX3|HWY_AVX3_DL"); nothing where the CPU runs them all.
// cmake/hwy_this_cpu.cmake runs it at configure time.
#include <hwy/targets.h>

#include <cstdint>
#include <cstdio>

int main() {
  const std::int64_t supported = hwy::SupportedTargets();
  const char* separator = "";
  for (std::int64_t targets = HWY_TARGETS; targets != 0; targets &= targets - 1) {
    const std::int64_t target = targets & -targets;
    if ((supported & target) == 0) {
      std::printf("%sHWY_%s", separator, hwy::TargetName(target));
      separator = "|";
    }
  }
  return 0;
}
