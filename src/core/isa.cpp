#include "core/isa.hpp"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <string>

#include "qkv/error.hpp"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define QKV_X86_CPUID 1
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#else
#define QKV_X86_CPUID 0
#endif

namespace qkv::detail {
namespace {

constexpr std::size_t index_of(Family f) { return static_cast<std::size_t>(f); }

// Per family, in kFamilies' order: its name and the QKV_ISA level that
// allows it.
struct FamilyRow {
  const char* name;
  Isa level;
};
constexpr FamilyRow kFamilyRows[] = {{"avx512_vnni", Isa::avx512_vnni},
                                     {"avx512_bf16", Isa::avx512_bf16},
                                     {"amx_int8", Isa::amx},
                                     {"amx_bf16", Isa::amx}};
static_assert(std::size(kFamilyRows) == kFamilies.size());

#if QKV_X86_CPUID
struct Regs {
  unsigned a = 0, b = 0, c = 0, d = 0;
};

// cpuid(leaf, subleaf); zeros for a leaf beyond the CPU's highest.
Regs cpuid(unsigned leaf, unsigned subleaf) {
  Regs r;
  if (__get_cpuid_count(leaf, subleaf, &r.a, &r.b, &r.c, &r.d) == 0) return {};
  return r;
}

bool bit(unsigned word, int b) { return ((word >> b) & 1U) != 0; }

// XCR0, the state components the OS saves (xgetbv(0)); 0 without OSXSAVE.
std::uint64_t xcr0() {
  if (!bit(cpuid(1, 0).c, 27)) return 0;  // OSXSAVE
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<std::uint64_t>(hi) << 32) | lo;
}

// Asks Linux for the AMX tile data state (XTILEDATA, component 18) for this
// process; "" when granted, else why not.
std::string request_amx_permission() {
#if defined(__linux__)
  constexpr long kArchGetXcompPerm = 0x1022;
  constexpr long kArchReqXcompPerm = 0x1023;
  constexpr long kXfeatureXtiledata = 18;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) {
    return std::string("arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) failed: ") +
           std::strerror(errno);
  }
  std::uint64_t granted = 0;
  if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &granted) != 0 ||
      ((granted >> kXfeatureXtiledata) & 1U) == 0) {
    return "arch_prctl(ARCH_GET_XCOMP_PERM) does not list XTILEDATA";
  }
  return "";
#else
  return "AMX permission is asked only on Linux";
#endif
}
#endif

struct Detected {
  std::array<FamilySupport, kFamilies.size()> families;
  std::string vendor, model;
  int family_number = 0;
};

Detected detect() {
  Detected out;
#if QKV_X86_CPUID
  const Regs id0 = cpuid(0, 0);
  char vendor[13] = {};
  std::memcpy(vendor, &id0.b, 4);
  std::memcpy(vendor + 4, &id0.d, 4);
  std::memcpy(vendor + 8, &id0.c, 4);
  out.vendor = vendor;
  if (cpuid(0x80000000U, 0).a >= 0x80000004U) {
    char name[49] = {};
    for (unsigned i = 0; i < 3; ++i) {
      const Regs r = cpuid(0x80000002U + i, 0);
      std::memcpy(name + 16 * i, &r, 16);
    }
    out.model = name;
    const auto first = out.model.find_first_not_of(' ');
    out.model = first == std::string::npos ? "" : out.model.substr(first);
  }
  const unsigned signature = cpuid(1, 0).a;
  out.family_number = static_cast<int>((signature >> 8) & 0xF);
  if (out.family_number == 0xF) out.family_number += static_cast<int>((signature >> 20) & 0xFF);

  const Regs l7 = id0.a >= 7 ? cpuid(7, 0) : Regs{};
  const Regs l7s1 = l7.a >= 1 ? cpuid(7, 1) : Regs{};
  const std::uint64_t xcr = xcr0();
  const bool avx512 = bit(l7.b, 16) && bit(l7.b, 30) && bit(l7.b, 31);  // F, BW, VL
  // SSE, AVX, opmask, ZMM_Hi256, Hi16_ZMM state.
  const bool zmm_saved = (xcr & 0xE6U) == 0xE6U;
  const char* no_zmm = "the OS does not save the AVX-512 registers (XCR0 bits 5-7)";

  FamilySupport& vnni = out.families[index_of(Family::avx512_vnni)];
  vnni.listed = avx512 && bit(l7.c, 11);
  FamilySupport& bf16 = out.families[index_of(Family::avx512_bf16)];
  bf16.listed = avx512 && bit(l7s1.a, 5);
  for (FamilySupport* f : {&vnni, &bf16}) {
    f->usable = f->listed && zmm_saved;
    if (f->listed && !zmm_saved) f->reason = no_zmm;
  }

  FamilySupport& amx_int8 = out.families[index_of(Family::amx_int8)];
  FamilySupport& amx_bf16 = out.families[index_of(Family::amx_bf16)];
  const bool tile = bit(l7.d, 24);
  amx_int8.listed = tile && bit(l7.d, 25);
  amx_bf16.listed = tile && bit(l7.d, 22);
  if (amx_int8.listed || amx_bf16.listed) {
    std::string why;
    if ((xcr & (3U << 17)) != (3U << 17)) {
      why = "the OS does not enable the tile state (XCR0 bits 17-18)";
    } else {
      why = request_amx_permission();
    }
    for (FamilySupport* f : {&amx_int8, &amx_bf16}) {
      if (!f->listed) continue;
      f->usable = why.empty();
      f->reason = why;
    }
  }
#endif
  return out;
}

const Detected& detected() {
  static const Detected d = detect();
  return d;
}

// The highest level the usable families reach.
Isa cpu_isa() {
  Isa best = Isa::f32;
  for (const Family f : kFamilies) {
    if (family_support(f).usable) best = std::max(best, family_level(f));
  }
  return best;
}

// -1: no test override; else an Isa.
std::atomic<int> test_limit{-1};

}  // namespace

const char* family_name(Family f) { return kFamilyRows[index_of(f)].name; }

Isa family_level(Family f) { return kFamilyRows[index_of(f)].level; }

const FamilySupport& family_support(Family f) { return detected().families[index_of(f)]; }

Isa isa_limit() {
  static const Isa cpu = cpu_isa();
  const int forced = test_limit.load(std::memory_order_relaxed);
  if (forced >= 0) return std::min(cpu, static_cast<Isa>(forced));
  const char* text = std::getenv("QKV_ISA");
  if (text == nullptr || *text == '\0') return cpu;
  const std::string s = text;
  Isa cap = Isa::amx;
  if (s == "f32" || s == "avx512") {
    cap = Isa::f32;
  } else if (s == "avx512_vnni") {
    cap = Isa::avx512_vnni;
  } else if (s == "avx512_bf16") {
    cap = Isa::avx512_bf16;
  } else if (s != "amx") {
    throw Error("QKV_ISA: expected 'f32', 'avx512_vnni', 'avx512_bf16' or 'amx' (or unset), got '" +
                s + "'");
  }
  return std::min(cpu, cap);
}

bool family_allowed(Family f) { return family_support(f).usable && family_level(f) <= isa_limit(); }

bool has_bf16_dot() { return family_allowed(Family::avx512_bf16); }

std::string cpu_vendor() { return detected().vendor; }
std::string cpu_model_name() { return detected().model; }
int cpu_family_number() { return detected().family_number; }

namespace {
std::atomic<const char*> products_isa{"f32"};
}  // namespace

void note_products_isa(const char* name) { products_isa.store(name, std::memory_order_relaxed); }
const char* last_products_isa() { return products_isa.load(std::memory_order_relaxed); }

void set_isa_limit_for_test(std::optional<Isa> limit) {
  test_limit.store(limit ? static_cast<int>(*limit) : -1, std::memory_order_relaxed);
}

}  // namespace qkv::detail
