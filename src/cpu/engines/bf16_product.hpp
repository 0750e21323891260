// The tile product on bf16 dot-product engines: C[m][n] (+)= A[m][k] B[k][n]
// with bf16 A and B and f32 C, the one seam through which the fused kernels
// use VDPBF16PS (AVX512-BF16) and TDPBF16PS (AMX-BF16).
//
// Layouts, what both instructions read without shuffles:
//   A  rows of bf16, a[i * lda + x] for x < k: a pair of consecutive x is
//      one 32-bit element (broadcast by VDPBF16PS, a tile column of AMX);
//   B  packed in pairs of rows, "VNNI" layout: element (x, j) at
//      b[(x / 2) * 2 * ldb + 2 * j + x % 2], so that a 32-bit element holds
//      B[2p][j] and B[2p + 1][j];
//   C  f32 rows, c[i * ldc + j].
// k is even (a caller pads an odd depth with a zero row of B and column of
// A), n a multiple of 16 (one vector, one tile's columns).
//
// Each engine's arithmetic, which its portable emulation reproduces bit for
// bit (tests/engines_test.cpp): for every C element the pairs are taken in
// order of x; each pair adds its two products, exact in f32 (8-bit
// significands), one at a time with one rounding each (an FMA), inputs
// that are subnormal read as zero (DAZ) and subnormal sums flushed to zero
// (FTZ), round to nearest even:
//   VDPBF16PS: the odd product first, then the even one (Intel SDM);
//   TDPBF16PS: the even product first, then the odd one (the SDM's
//   pseudo-code; the hardware's order is checked against it with the
//   bound of any order where a CPU has AMX).
#pragma once

#include <cstdint>

namespace qkv::cpu::engines {

// Operands of one product (see the header for the layouts).
struct Bf16Product {
  const std::uint16_t* a = nullptr;  // A, bf16 bits
  std::int64_t lda = 0;              // bf16 values from one A row to the next (even)
  const std::uint16_t* b = nullptr;  // B in pairs of rows
  std::int64_t ldb = 0;              // columns of a pair row of B (>= n, a multiple of 16)
  float* c = nullptr;                // C
  std::int64_t ldc = 0;              // floats from one C row to the next
  std::int64_t m = 0;                // rows of A and C
  std::int64_t n = 0;                // columns of B and C, a multiple of 16
  std::int64_t k = 0;                // columns of A, rows of B, even
  bool accumulate = false;           // C += A B (else C = A B)
};

// Who computes a product: an instruction, or its emulation in portable C++.
enum class Bf16Engine {
  avx512_bf16,          // VDPBF16PS (needs Family::avx512_bf16)
  amx_bf16,             // TDPBF16PS (needs Family::amx_bf16)
  emulate_avx512_bf16,  // VDPBF16PS's arithmetic, any CPU
  emulate_amx_bf16,     // TDPBF16PS's arithmetic, any CPU
};

const char* engine_name(Bf16Engine e);

// Whether this build and CPU can run the engine now (the emulations always;
// the instructions where core/isa.hpp allows their family).
bool engine_available(Bf16Engine e);

// The product on engine e, which must be available.
void bf16_product(Bf16Engine e, const Bf16Product& p);

// One pair step of each instruction: acc + a0 b0 + a1 b1 with the order,
// DAZ and FTZ of the header; a and b are the pair's bf16 bits.
float dpbf16_pair(float acc, std::uint16_t a0, std::uint16_t a1, std::uint16_t b0,
                  std::uint16_t b1);
float tdpbf16_pair(float acc, std::uint16_t a0, std::uint16_t a1, std::uint16_t b0,
                   std::uint16_t b1);

}  // namespace qkv::cpu::engines
