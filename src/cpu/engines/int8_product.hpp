// The int8 tile product: C[m][n] (+)= A[m][k] B[k][n] with signed 8-bit A
// and B and int32 C, exact (no product or sum of the sizes used here leaves
// int32: |C| <= 127^2 k < 2^31 for k < 133,000), so every engine and the
// emulation agree bit for bit, whatever their order.
//
// Layouts, what VPDPBUSD and TDPBSSD read without shuffles:
//   A  rows of int8, a[i * lda + x] for x < k: four consecutive x are one
//      32-bit element (broadcast by VPDPBUSD, a tile column of AMX);
//   B  packed in quads of rows: element (x, j) at
//      b[(x / 4) * 4 * ldb + 4 * j + x % 4];
//   C  int32 rows, c[i * ldc + j].
// k is a multiple of 4 (callers pad with zeros), n a multiple of 16.
// VPDPBUSD multiplies unsigned by signed bytes: its kernel adds 128 to B
// (a sign-bit flip) and subtracts 128 times each row's sum of A.
#pragma once

#include <cstdint>

namespace qkv::cpu::engines {

struct Int8Product {
  const std::int8_t* a = nullptr;  // A
  std::int64_t lda = 0;            // bytes from one A row to the next (a multiple of 4)
  const std::int8_t* b = nullptr;  // B in quads of rows
  std::int64_t ldb = 0;            // columns of a quad row of B (>= n, a multiple of 16)
  std::int32_t* c = nullptr;       // C
  std::int64_t ldc = 0;            // int32s from one C row to the next
  std::int64_t m = 0;              // rows of A and C
  std::int64_t n = 0;              // columns of B and C, a multiple of 16
  std::int64_t k = 0;              // columns of A, rows of B, a multiple of 4
  bool accumulate = false;         // C += A B (else C = A B)
};

enum class Int8Engine {
  avx512_vnni,  // VPDPBUSD (needs Family::avx512_vnni)
  amx_int8,     // TDPBSSD (needs Family::amx_int8)
  emulate,      // plain loops, any CPU: the same integers
};

const char* engine_name(Int8Engine e);
bool engine_available(Int8Engine e);
void int8_product(Int8Engine e, const Int8Product& p);

}  // namespace qkv::cpu::engines
