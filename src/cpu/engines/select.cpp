#include "cpu/engines/select.hpp"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>

#include "core/isa.hpp"
#include "cpu/engines/probe.hpp"
#include "qkv/error.hpp"

namespace qkv::cpu::engines {
namespace {

// VDPBF16PS is taken only at this many times the 512-bit FMA's flops.
constexpr double kMinBf16DotGain = 1.5;
// Seconds each probe of the one-time check runs.
constexpr double kProbeSeconds = 0.004;

struct Choice {
  std::optional<Bf16Engine> engine;
  std::string reason;
};

// The choice for one QKV_ISA level (families allowed at it).
Choice choose() {
  using detail::Family;
  if (detail::family_allowed(Family::amx_bf16)) {
    return {Bf16Engine::amx_bf16, "AMX-BF16 usable"};
  }
  if (!detail::family_allowed(Family::avx512_bf16)) {
    return {std::nullopt, "no usable bf16 dot-product family: f32 FMAs"};
  }
  if (detail::cpu_vendor() != "AuthenticAMD") {
    return {std::nullopt, "AVX512-BF16 without AMX on " + detail::cpu_vendor() +
                              ": VDPBF16PS runs at half the f32 FMA rate there, f32 FMAs"};
  }
  const double fma = probe_avx512_fma_gflops(kProbeSeconds);
  const double dot = probe_family_gops(Family::avx512_bf16, kProbeSeconds);
  char text[160];
  std::snprintf(text, sizeof text, "AVX512-BF16 probe %.1f GFLOP/s against the FMA's %.1f (%.2fx)",
                dot, fma, fma > 0 ? dot / fma : 0.0);
  if (dot >= kMinBf16DotGain * fma) return {Bf16Engine::avx512_bf16, text};
  return {std::nullopt, std::string(text) + ": below 1.5x, f32 FMAs"};
}

// One choice per QKV_ISA level, made on first use (the probe runs once).
const Choice& choice_for(detail::Isa level) {
  static std::mutex mutex;
  static std::optional<Choice> choices[4];
  const std::lock_guard<std::mutex> lock(mutex);
  auto& c = choices[static_cast<int>(level)];
  if (!c) c = choose();
  return *c;
}

std::atomic<int> forced{-2};       // -2: none; -1: forced f32; else a Bf16Engine
std::atomic<int> forced_int8{-2};  // likewise, an Int8Engine

}  // namespace

// QKV_EMULATE_ENGINES: the engines' emulations in place of the CPU's
// choice, so that the whole test suite runs the engine paths on any CPU as
// a CPU with them would (slowly: the emulations are plain loops).
//   avx512_bf16  the AVX512-BF16 emulation for bf16 products (as Zen 4)
//   amx          the AMX-BF16 emulation and the int8 one (as Sapphire Rapids)
// Unset or empty: the CPU's choice. Read once; any other value is refused.
struct Emulation {
  std::optional<Bf16Engine> bf16;
  std::optional<Int8Engine> int8;
  bool set = false;
};

const Emulation& emulation() {
  static const Emulation e = [] {
    const char* text = std::getenv("QKV_EMULATE_ENGINES");
    if (text == nullptr || *text == '\0') return Emulation{};
    const std::string s = text;
    if (s == "avx512_bf16") return Emulation{Bf16Engine::emulate_avx512_bf16, std::nullopt, true};
    if (s == "amx") return Emulation{Bf16Engine::emulate_amx_bf16, Int8Engine::emulate, true};
    throw Error("QKV_EMULATE_ENGINES: expected 'avx512_bf16' or 'amx' (or unset), got '" + s + "'");
  }();
  return e;
}

std::optional<Bf16Engine> bf16_engine() {
  const int f = forced.load(std::memory_order_relaxed);
  if (f == -1) return std::nullopt;
  if (f >= 0) return static_cast<Bf16Engine>(f);
  if (emulation().set) return emulation().bf16;
  return choice_for(detail::isa_limit()).engine;
}

std::string bf16_engine_reason() {
  if (forced.load(std::memory_order_relaxed) != -2) return "set by a test";
  if (emulation().set) return "QKV_EMULATE_ENGINES: the emulation";
  return choice_for(detail::isa_limit()).reason;
}

std::optional<Int8Engine> int8_engine() {
  const int f = forced_int8.load(std::memory_order_relaxed);
  if (f == -1) return std::nullopt;
  if (f >= 0) return static_cast<Int8Engine>(f);
  if (emulation().set) return emulation().int8;
  if (detail::family_allowed(detail::Family::amx_int8)) return Int8Engine::amx_int8;
  if (detail::family_allowed(detail::Family::avx512_vnni)) return Int8Engine::avx512_vnni;
  return std::nullopt;
}

void set_int8_engine_for_test(std::optional<Int8Engine> engine) {
  forced_int8.store(engine ? static_cast<int>(*engine) : -1, std::memory_order_relaxed);
}

void set_bf16_engine_for_test(std::optional<Bf16Engine> engine) {
  forced.store(engine ? static_cast<int>(*engine) : -1, std::memory_order_relaxed);
}

void reset_bf16_engine_for_test() {
  forced.store(-2, std::memory_order_relaxed);
  forced_int8.store(-2, std::memory_order_relaxed);
}

}  // namespace qkv::cpu::engines
