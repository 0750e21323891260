// AMX: the tile configuration (LDTILECFG's 64-byte operand), and the one
// tile-product kernel behind both the bf16 and the int8 products. Both
// instructions read the same shapes in bytes: an A tile is 16 rows of 64
// bytes (32 bf16 or 64 int8 values of depth), a B tile 16 rows of 64 bytes
// (a row per 4 bytes of depth: a bf16 pair or an int8 quad, for each of 16
// columns), a C tile 16 x 16 four-byte sums (f32 or int32).
#pragma once

#include <cstdint>

namespace qkv::cpu::engines {

struct alignas(64) TileConfig {
  std::uint8_t palette = 1;    // palette 1: 8 tiles of up to 16 rows x 64 bytes
  std::uint8_t start_row = 0;  // restart row after an interrupted load (0)
  std::uint8_t reserved[14] = {};
  std::uint16_t colsb[16] = {};  // bytes per row of each tile
  std::uint8_t rows[16] = {};    // rows of each tile
};

// Operands of an AMX product in bytes (bf16_product.hpp's and
// int8_product.hpp's layouts): B row x / 4 holds depth bytes [x, x + 4) of
// every column.
struct AmxOperands {
  const std::uint8_t* a = nullptr;  // A rows
  std::int64_t a_stride = 0;        // bytes from one A row to the next
  const std::uint8_t* b = nullptr;  // B, a row per 4 bytes of depth
  std::int64_t b_stride = 0;        // bytes from one B row to the next
  void* c = nullptr;                // C, four-byte sums
  std::int64_t ldc = 0;             // sums from one C row to the next
  std::int64_t m = 0;               // rows of A and C
  std::int64_t n = 0;               // columns of B and C, a multiple of 16
  std::int64_t depth = 0;           // bytes of an A row in the product, a multiple of 4
  bool accumulate = false;          // C += A B (else C = A B)
};

enum class AmxOp {
  bf16,  // TDPBF16PS: bf16 pairs, f32 sums
  int8,  // TDPBSSD: signed int8 quads, int32 sums
};

// The product on AMX tiles: C in tmm0 and tmm1 (two column blocks of 16),
// A in tmm2, B in tmm3 and tmm4. Full tiles load in place; a block of fewer
// than 16 rows or a depth chunk of fewer than 64 bytes goes through
// zero-padded staging. Only on x86-64 where core/isa.hpp allows the family.
void amx_product(AmxOp op, const AmxOperands& p);

}  // namespace qkv::cpu::engines
