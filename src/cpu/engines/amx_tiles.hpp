// AMX's tile configuration (LDTILECFG's 64-byte operand, palette 1): bytes
// per row and rows of each of the 16 tile registers.
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

}  // namespace qkv::cpu::engines
