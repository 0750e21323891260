// qkv/kv_storage.hpp — how a KvCache (qkv/kv_cache.hpp) stores keys or
// values: the element types and ggml's quantized block formats.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

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
// The storages, one row each: X(enumerator, name, dtype_name, doc). `name`
// is qkv's short name (messages, `qkv bench`), `dtype_name` PyTorch's
// spelling that the Python API takes ("" for automatic).
#define QKV_KV_STORAGES(X)                                    \
  X(automatic, "auto", "", "KvCacheConfig::dtype")            \
  X(f32, "f32", "float32", "IEEE single")                     \
  X(bf16, "bf16", "bfloat16", "bfloat16 (round to nearest)")  \
  X(f16, "f16", "float16", "IEEE half (round to nearest)")    \
  X(q8_0, "q8_0", "q8_0", "ggml's 8-bit blocks of 32 values") \
  X(q4_0, "q4_0", "q4_0", "ggml's 4-bit blocks of 32 values")

enum class KvStorage : std::uint8_t {
#define QKV_KV_STORAGE_ENUMERATOR(enumerator, name, dtype_name, doc) enumerator,
  QKV_KV_STORAGES(QKV_KV_STORAGE_ENUMERATOR)
#undef QKV_KV_STORAGE_ENUMERATOR
};
// Whether `storage` is one of the rows (a KvStorage may hold any byte).
bool is_storage(KvStorage storage);
// The row's name: "auto", "f32", "bf16", "f16", "q8_0", "q4_0" ("?" for a
// value that is no row).
const char* storage_name(KvStorage storage);
// The row's dtype_name ("" for automatic); nullptr for a value that is no row.
const char* storage_dtype_name(KvStorage storage);
// The storage whose dtype_name is `dtype_name` (not ""); nullopt if none.
std::optional<KvStorage> storage_of_dtype_name(std::string_view dtype_name);
// Every row's `name`, or `dtype_name` (skipping automatic's ""), joined by
// ", ": for messages that list what is accepted.
std::string storage_names(bool dtype_names);
// Bytes of n values in `storage` (not automatic; quantized: n % 32 == 0):
// 4n, 2n, 2n, 34n / 32, 18n / 32.
std::int64_t stored_bytes(KvStorage storage, std::int64_t n);

}  // namespace qkv
