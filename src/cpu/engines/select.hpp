// Which engine computes the fused kernels' bf16 products: chosen once per
// process by a table of what each CPU family is known to do, confirmed by
// a register probe, so that no path slower than the f32 FMAs is taken:
//   AMX-BF16 usable: amx_bf16 (on Sapphire Rapids-class CPUs TDPBF16PS
//     runs about 15x the f32 FMA rate);
//   AVX512-BF16 usable on AMD (Zen 4 and later): avx512_bf16, where the
//     probe finds VDPBF16PS at least 1.5x the 512-bit FMA's flops (Zen 4:
//     2x);
//   AVX512-BF16 on Intel without usable AMX (Cooper Lake, Sapphire Rapids
//     VMs whose OS keeps AMX off): none, VDPBF16PS measured at 0.5x the
//     f32 FMA rate there;
//   otherwise none: the kernels compute bf16 operands with f32 FMAs.
// QKV_ISA caps the families first (core/isa.hpp).
#pragma once

#include <optional>
#include <string>

#include "cpu/engines/bf16_product.hpp"
#include "cpu/engines/int8_product.hpp"

namespace qkv::cpu::engines {

// The engine for bf16 products, or nullopt for the f32 FMAs. The test
// override, when set, wins (an emulation runs the engine paths anywhere).
std::optional<Bf16Engine> bf16_engine();

// Why bf16_engine() chose what it did, for `qkv info`.
std::string bf16_engine_reason();

// The engine for int8 products (MatmulPrecision::int8's Q K^T), or nullopt:
// AMX-INT8 where usable (TDPBSSD), else AVX512-VNNI (VPDPBUSD, 3-4x the f32
// FMA's operations on Sapphire Rapids and Zen 4), else none.
std::optional<Int8Engine> int8_engine();

// Tests: force the engines (nullopt inside: none, the f32 FMAs); reset()
// returns to the CPU's choice.
void set_bf16_engine_for_test(std::optional<Bf16Engine> engine);
void set_int8_engine_for_test(std::optional<Int8Engine> engine);
void reset_bf16_engine_for_test();  // both engines

}  // namespace qkv::cpu::engines
