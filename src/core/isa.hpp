// The instruction families beyond a Highway target that kernels may use,
// chosen at run time.
//
// A family is usable when the CPU lists it (cpuid), the OS saves its
// registers (XCR0, read with xgetbv) and, for AMX, Linux granted this
// process the tile data state (arch_prctl(ARCH_REQ_XCOMP_PERM), asked once).
// A VM may list amx_* flags that its OS does not enable: the family is then
// listed but not usable, with the reason, and no kernel takes it.
//
// The environment variable QKV_ISA caps the families, for benchmarks and
// tests of the lower paths (levels in this order, each allowing the ones
// before it):
//   QKV_ISA=f32           f32 FMAs only (also accepted: avx512, its old name)
//   QKV_ISA=avx512_vnni   + VPDPBUSD int8 dot products
//   QKV_ISA=avx512_bf16   + VDPBF16PS bf16 dot products
//   QKV_ISA=amx           + AMX tiles (or unset: everything usable)
// Highway 1.0.3 has no bf16 or int8 dot product and no AMX: such kernels
// are intrinsics in functions of their own target attribute (cpu/engines/),
// called only when the family is allowed here.
#pragma once

#include <array>
#include <optional>
#include <string>

namespace qkv::detail {

// Cap levels of QKV_ISA, each including the ones before it.
enum class Isa { f32, avx512_vnni, avx512_bf16, amx };

// Instruction families of products beyond the f32 FMA.
enum class Family { avx512_vnni, avx512_bf16, amx_int8, amx_bf16 };
inline constexpr std::array<Family, 4> kFamilies = {Family::avx512_vnni, Family::avx512_bf16,
                                                    Family::amx_int8, Family::amx_bf16};

// The family's name as `qkv info`, benchmarks and QKV_ISA's levels spell it
// ("avx512_bf16", "amx_bf16", ...).
const char* family_name(Family f);
// The QKV_ISA level that allows the family.
Isa family_level(Family f);

// What this process found out about one family.
struct FamilySupport {
  bool listed = false;  // cpuid lists every instruction set the family needs
  bool usable = false;  // listed, and the OS enabled its registers for this process
  std::string reason;   // why a listed family is not usable ("" when usable or not listed)
};

// The CPU's and OS's answer for the family, found once per process; QKV_ISA
// does not change it.
const FamilySupport& family_support(Family f);

// The highest level kernels may use: the usable families' highest, capped by
// QKV_ISA and by the test override. Throws qkv::Error for a QKV_ISA it does
// not know.
Isa isa_limit();

// Whether the family is usable and allowed by isa_limit().
bool family_allowed(Family f);

// Whether the CPU and the limit allow AVX512-BF16 dot products
// (VDPBF16PS, with AVX512F/BW/VL).
bool has_bf16_dot();

// The CPU's vendor and model name from cpuid ("" where there is none).
std::string cpu_vendor();
std::string cpu_model_name();
// The x86 family number (with the extended family added); 0 elsewhere.
int cpu_family_number();

// The family the last fused call's products ran on ("f32", "avx512_bf16",
// "amx_bf16", or an emulation's name), set by the kernels' entry points for
// the benchmarks' "isa" field.
void note_products_isa(const char* name);
const char* last_products_isa();

// Tests: caps the level as QKV_ISA would (nullopt: back to the environment).
void set_isa_limit_for_test(std::optional<Isa> limit);

}  // namespace qkv::detail
