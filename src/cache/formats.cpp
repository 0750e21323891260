#include "cache/formats.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

namespace qkv {

bool is_storage(KvStorage storage) {
  switch (storage) {
#define QKV_KV_STORAGE_CASE(enumerator, name, dtype_name, doc) case KvStorage::enumerator:
    QKV_KV_STORAGES(QKV_KV_STORAGE_CASE)
#undef QKV_KV_STORAGE_CASE
    return true;
  }
  return false;
}

const char* storage_name(KvStorage storage) {
#define QKV_KV_STORAGE_NAME(enumerator, name, dtype_name, doc) \
  if (storage == KvStorage::enumerator) return name;
  QKV_KV_STORAGES(QKV_KV_STORAGE_NAME)
#undef QKV_KV_STORAGE_NAME
  return "?";
}

const char* storage_dtype_name(KvStorage storage) {
#define QKV_KV_STORAGE_DTYPE_NAME(enumerator, name, dtype_name, doc) \
  if (storage == KvStorage::enumerator) return dtype_name;
  QKV_KV_STORAGES(QKV_KV_STORAGE_DTYPE_NAME)
#undef QKV_KV_STORAGE_DTYPE_NAME
  return nullptr;
}

std::optional<KvStorage> storage_of_dtype_name(std::string_view wanted) {
#define QKV_KV_STORAGE_OF(enumerator, name, dtype_name, doc) \
  if (!wanted.empty() && wanted == dtype_name) return KvStorage::enumerator;
  QKV_KV_STORAGES(QKV_KV_STORAGE_OF)
#undef QKV_KV_STORAGE_OF
  return std::nullopt;
}

std::string storage_names(bool dtype_names) {
  std::string joined;
  const auto add = [&](const char* name) {
    if (*name == '\0') return;
    if (!joined.empty()) joined += ", ";
    joined += name;
  };
#define QKV_KV_STORAGE_LIST(enumerator, name, dtype_name, doc) add(dtype_names ? dtype_name : name);
  QKV_KV_STORAGES(QKV_KV_STORAGE_LIST)
#undef QKV_KV_STORAGE_LIST
  return joined;
}

std::int64_t stored_bytes(KvStorage storage, std::int64_t n) {
  switch (storage) {
    case KvStorage::q8_0:
      return n / cache::kQuantBlock * static_cast<std::int64_t>(sizeof(cache::BlockQ8_0));
    case KvStorage::q4_0:
      return n / cache::kQuantBlock * static_cast<std::int64_t>(sizeof(cache::BlockQ4_0));
    case KvStorage::bf16:
    case KvStorage::f16:
      return n * 2;
    default:
      return n * 4;
  }
}

namespace cache {

KvStorage storage_of(DType dtype) {
  switch (dtype) {
    case DType::bf16:
      return KvStorage::bf16;
    case DType::f16:
      return KvStorage::f16;
    default:
      return KvStorage::f32;
  }
}

void quantize_q8_0(const float* x, std::int64_t n, BlockQ8_0* out) {
  for (std::int64_t b = 0; b < n / kQuantBlock; ++b, x += kQuantBlock) {
    float amax = 0.0f;
    for (std::int64_t i = 0; i < kQuantBlock; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    out[b].d = to_f16(d).bits;
    for (std::int64_t i = 0; i < kQuantBlock; ++i) {
      out[b].qs[i] = static_cast<std::int8_t>(std::round(x[i] * id));
    }
  }
}

void quantize_q4_0(const float* x, std::int64_t n, BlockQ4_0* out) {
  constexpr std::int64_t kHalf = kQuantBlock / 2;
  for (std::int64_t b = 0; b < n / kQuantBlock; ++b, x += kQuantBlock) {
    // The value of largest magnitude, the first one on ties.
    float amax = 0.0f, max = 0.0f;
    for (std::int64_t i = 0; i < kQuantBlock; ++i) {
      if (amax < std::fabs(x[i])) {
        amax = std::fabs(x[i]);
        max = x[i];
      }
    }
    const float d = max / -8.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    out[b].d = to_f16(d).bits;
    for (std::int64_t i = 0; i < kHalf; ++i) {
      // x * id is in [-8, 8] (up to rounding): + 8.5 truncates to [0, 16].
      const auto lo = std::min<std::uint8_t>(15, static_cast<std::uint8_t>(x[i] * id + 8.5f));
      const auto hi =
          std::min<std::uint8_t>(15, static_cast<std::uint8_t>(x[i + kHalf] * id + 8.5f));
      out[b].qs[i] = static_cast<std::uint8_t>(lo | (hi << 4));
    }
  }
}

void dequantize_row(KvStorage storage, const void* row, std::int64_t n, float* out) {
  switch (storage) {
    case KvStorage::q8_0: {
      const auto* blocks = static_cast<const BlockQ8_0*>(row);
      for (std::int64_t b = 0; b < n / kQuantBlock; ++b) {
        const float d = to_float(f16{blocks[b].d});
        for (std::int64_t i = 0; i < kQuantBlock; ++i) {
          out[b * kQuantBlock + i] = d * static_cast<float>(blocks[b].qs[i]);
        }
      }
      return;
    }
    case KvStorage::q4_0: {
      const auto* blocks = static_cast<const BlockQ4_0*>(row);
      constexpr std::int64_t kHalf = kQuantBlock / 2;
      for (std::int64_t b = 0; b < n / kQuantBlock; ++b) {
        const float d = to_float(f16{blocks[b].d});
        float* o = out + b * kQuantBlock;
        for (std::int64_t i = 0; i < kHalf; ++i) {
          o[i] = d * static_cast<float>((blocks[b].qs[i] & 15) - 8);
          o[i + kHalf] = d * static_cast<float>((blocks[b].qs[i] >> 4) - 8);
        }
      }
      return;
    }
    case KvStorage::bf16:
    case KvStorage::f16: {
      const auto* bits = static_cast<const std::uint16_t*>(row);
      for (std::int64_t i = 0; i < n; ++i) {
        out[i] = storage == KvStorage::bf16 ? to_float(bf16{bits[i]}) : to_float(f16{bits[i]});
      }
      return;
    }
    default:
      std::memcpy(out, row, static_cast<std::size_t>(n) * sizeof(float));
  }
}

}  // namespace cache
}  // namespace qkv
