// Instruction families beyond a Highway target that kernels may use, chosen
// at run time: what the CPU reports (cpuid, read once), limited by the
// environment variable QKV_ISA for benchmarks and tests of the lower paths:
//   QKV_ISA=avx512_bf16  (or unset) everything the CPU has
//   QKV_ISA=avx512       no AVX512-BF16 products (the f32 products instead)
// Highway 1.0.3 has no bf16 dot product and no target for it, so such
// kernels are intrinsics in functions of their own target attribute
// (cpu/bf16_dot-inl.h), called only when the family is allowed here.
#pragma once

#include <optional>

namespace qkv::detail {

// Instruction families, each including the ones before it.
enum class Isa { avx512, avx512_bf16 };

// The highest family kernels may use: the CPU's, capped by QKV_ISA and by
// the test override. Throws qkv::Error for a QKV_ISA it does not know.
Isa isa_limit();

// Whether the CPU and the limit allow AVX512-BF16 dot products
// (VDPBF16PS, with AVX512F/BW/VL).
bool has_bf16_dot();

// Tests: caps the family as QKV_ISA would (nullopt: back to the environment).
void set_isa_limit_for_test(std::optional<Isa> limit);

}  // namespace qkv::detail
