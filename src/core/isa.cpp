#include "core/isa.hpp"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string>

#include "qkv/error.hpp"

namespace qkv::detail {
namespace {

// What the CPU supports (cpuid, with the OS's saving of the zmm state).
Isa cpu_isa() {
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512f") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")) {
    return Isa::avx512_bf16;
  }
#endif
  return Isa::avx512;
}

// -1: no test override; else an Isa.
std::atomic<int> test_limit{-1};

}  // namespace

Isa isa_limit() {
  static const Isa cpu = cpu_isa();
  const int forced = test_limit.load(std::memory_order_relaxed);
  if (forced >= 0) return std::min(cpu, static_cast<Isa>(forced));
  const char* text = std::getenv("QKV_ISA");
  if (text == nullptr || *text == '\0') return cpu;
  const std::string s = text;
  if (s == "avx512_bf16") return cpu;
  if (s == "avx512") return Isa::avx512;
  throw Error("QKV_ISA: expected 'avx512' or 'avx512_bf16' (or unset), got '" + s + "'");
}

bool has_bf16_dot() { return isa_limit() == Isa::avx512_bf16; }

void set_isa_limit_for_test(std::optional<Isa> limit) {
  test_limit.store(limit ? static_cast<int>(*limit) : -1, std::memory_order_relaxed);
}

}  // namespace qkv::detail
