// qkv/kv_storage.hpp — how a KvCache (qkv/kv_cache.hpp) stores keys or
// values: the element types and ggml's quantized block formats.
#pragma once

#include <cstdint>

namespace qkv {

// How a KvCache stores its keys or its values. The quantized formats are
// ggml's, bit for bit (llama.cpp's --cache-type-k/-v): a head's row of D
// values (D a multiple of 32) is D / 32 blocks of 32 consecutive values, each
// an f16 scale d followed by the quantized values. Append rounds the inputs
// to f32, then quantizes each block as ggml's reference does:
//   q8_0 (34 bytes per block): d = max|x| / 127, q = round(x / d) (half away
//        from zero) in int8; x' = d * q. Error per value <= d / 2 (d before
//        its rounding to f16, which adds up to 2^-11 relative).
//   q4_0 (18 bytes per block): m = the x of largest magnitude, d = m / -8,
//        q = min(15, floor(x / d + 8.5)) in 4 bits (byte j holds values j
//        and j + 16, low nibble first); x' = d * (q - 8). Error per value
//        <= |d| / 2, except |d| for the values clipped at q = 15 (the
//        largest magnitude's opposite sign: x / d up to 8).
// A quantized storage holds the finite values its f16 scale reaches,
// |x| <= 65504 * 127 (q8_0) or 65504 * 8 (q4_0; keys rotated by RoPE: the
// input within that / sqrt(2)); an append of any other value throws,
// changing nothing.
enum class KvStorage : std::uint8_t {
  automatic,  // KvCacheConfig::dtype
  f32,
  bf16,
  f16,
  q8_0,
  q4_0,
};
// "auto", "f32", "bf16", "f16", "q8_0", "q4_0".
const char* storage_name(KvStorage storage);
// Bytes of n values in `storage` (not automatic; quantized: n % 32 == 0):
// 4n, 2n, 2n, 34n / 32, 18n / 32.
std::int64_t stored_bytes(KvStorage storage, std::int64_t n);

}  // namespace qkv
