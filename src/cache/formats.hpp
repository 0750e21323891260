// The stored formats of the KV cache (qkv::KvStorage), scalar: the quantized
// blocks (ggml's q8_0 and q4_0, bit for
// bit), the rounding of a row into its format on append, and the exact
// widening of a stored row back to f32. The reference decode reads the cache
// through dequantize_row; the decode kernel reads it through the per-target
// storage traits (cache/storage-inl.h), which are tested against it.
#pragma once

#include <cstddef>
#include <cstdint>

#include "qkv/dtype.hpp"
#include "qkv/kv_storage.hpp"

namespace qkv::cache {

// Values per quantized block.
inline constexpr std::int64_t kQuantBlock = 32;

// ggml's block_q8_0: x' = d * qs[i].
struct BlockQ8_0 {
  std::uint16_t d;  // f16 bits of the scale
  std::int8_t qs[kQuantBlock];
};
// ggml's block_q4_0: x'[i] = d * ((qs[i] & 15) - 8), x'[i + 16] = d * ((qs[i] >> 4) - 8).
struct BlockQ4_0 {
  std::uint16_t d;  // f16 bits of the scale
  std::uint8_t qs[kQuantBlock / 2];
};
static_assert(sizeof(BlockQ8_0) == 34 && sizeof(BlockQ4_0) == 18, "ggml's block sizes");

inline bool is_quantized(KvStorage s) { return s == KvStorage::q8_0 || s == KvStorage::q4_0; }

// The storage of dtype f32, bf16 or f16.
KvStorage storage_of(DType dtype);

// Quantizes n values (n % kQuantBlock == 0, all finite) into n / 32 blocks,
// as ggml's quantize_row_q8_0_ref and quantize_row_q4_0_ref do.
void quantize_q8_0(const float* x, std::int64_t n, BlockQ8_0* out);
void quantize_q4_0(const float* x, std::int64_t n, BlockQ4_0* out);

// The n values of a stored row, widened to f32 exactly.
void dequantize_row(KvStorage storage, const void* row, std::int64_t n, float* out);

}  // namespace qkv::cache
