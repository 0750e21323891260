// The key/value cache: storage, paging, appends (RoPE on the way in) and the
// validation of configs and appends. Every mutating call validates all of
// its input, the room needed in the cache included, before it writes
// anything, so a call that throws leaves the cache as it was. Stored rows are
// written as the storage traits say (cache/storage-inl.h, included here for
// the static Highway target: the writes are scalar), keys and values each in
// their own storage.
#include "qkv/kv_cache.hpp"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <functional>
#include <limits>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "cache/formats.hpp"
#include "core/checks.hpp"
#include "core/elements.hpp"
#include "core/hadamard.hpp"
#include "core/positional.hpp"
#include "core/rows.hpp"
// Highway before the traits, which are per target (here: the static one).
#include "hwy/highway.h"
// (the traits after highway.h)
#include "cache/storage-inl.h"

namespace qkv {
namespace cache {

// What a mutating call may touch, gathered so that the shared steps below can
// work on a KvCache's private state.
struct Pool {
  std::int64_t capacity;       // most tokens a sequence may hold (streaming: S + W + P - 1)
  std::int64_t page_size;      // tokens per page (contiguous: capacity)
  std::int64_t sinks, window;  // streaming's S and W (window 0: no streaming)
  std::int64_t kv_heads, head_dim, value_dim;
  std::vector<std::int64_t>& lengths;
  std::vector<std::int64_t>& positions;
  std::vector<std::vector<std::int64_t>>& tables;
  std::vector<std::int64_t>& free_list;  // min-heap: the lowest free page comes first
  KvStorage key_storage, value_storage;
  bool hadamard;                                // KvCacheConfig::rotate
  bool values_in_keys;                          // KvCacheConfig::values_in_keys: no value rows
  std::int64_t tail_dim;                        // KvCacheConfig::tail_dim: last key values
  KvStorage tail_storage;                       // stored in this (bf16, f16), past the blocks
  std::int64_t key_row_bytes, value_row_bytes;  // bytes of a token's [Hkv, D]
  std::byte* keys;
  std::byte* values;
};

}  // namespace cache

namespace {

using cache::Pool;

using cache::HWY_NAMESPACE::WithStorage;
using detail::at;
using detail::CopyRow;
using detail::load_row_for;
using detail::LoadRow;
using detail::Reasons;
using detail::Rotation;
using detail::throw_if;
using std::to_string;

std::string unknown_sequence(const char* op, std::int64_t b, std::int64_t batch) {
  return std::string(op) + ": unknown sequence " + to_string(b) + " (batch is " + to_string(batch) +
         ")";
}

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return a / b + (a % b != 0); }

// The stored bytes of a cache's keys or values (a Tensor of 1-byte elements).
std::byte* bytes_of(Tensor& t) { return static_cast<std::byte*>(t.view().data()); }
const std::byte* bytes_of(const Tensor& t) {
  return static_cast<const std::byte*>(t.view().data());
}

// The rows an append gives each sequence b: counts[b], or when counts is
// empty `rows` (to sequence `only` alone when it is >= 0, else to each).
struct Counts {
  std::span<const std::int64_t> counts = {};
  std::int64_t rows = 0;
  std::int64_t only = -1;

  std::int64_t operator[](std::size_t b) const {
    if (!counts.empty()) return counts[b];
    return only < 0 || static_cast<std::int64_t>(b) == only ? rows : 0;
  }
};

// Streaming: whether a sequence holding `held` tokens drops its oldest page
// after the sinks, which leaves window or more recent tokens.
bool drops(const Pool& pool, std::int64_t held) {
  return pool.window > 0 && held - pool.sinks - pool.page_size >= pool.window;
}

// Streaming: drops sequence b's oldest page after its sinks, back to the pool.
void drop_page(Pool& pool, std::size_t b) {
  std::vector<std::int64_t>& table = pool.tables[b];
  const auto oldest = table.begin() + pool.sinks / pool.page_size;
  pool.free_list.push_back(*oldest);  // within its reserved size: cannot throw
  std::push_heap(pool.free_list.begin(), pool.free_list.end(), std::greater<>());
  table.erase(oldest);
  pool.lengths[b] -= pool.page_size;
}

// Whether every sequence has room for counts[b] more tokens, and the pool
// enough free pages for all of them together. A streaming sequence holds at
// most `capacity` tokens at any time (drops come before the page they free
// is needed), so it needs at most the pages of min(length + count, capacity).
void check_room(const char* op, const Pool& pool, const Counts& counts, Reasons& r) {
  std::int64_t pages_needed = 0;
  for (std::size_t b = 0; b < pool.lengths.size(); ++b) {
    const std::int64_t length = pool.lengths[b];
    const std::int64_t count = counts[b];
    if (pool.window > 0) {
      const std::int64_t held = std::min(pool.capacity - length, count) + length;
      const auto pages = static_cast<std::int64_t>(pool.tables[b].size());
      pages_needed += std::max<std::int64_t>(0, ceil_div(held, pool.page_size) - pages);
      continue;
    }
    if (count > pool.capacity - length) {
      // Unsigned: both terms are below 2^63, their sum may not be.
      r.push_back(
          std::string(op) + ": sequence " + to_string(b) + " would hold " +
          to_string(static_cast<std::uint64_t>(length) + static_cast<std::uint64_t>(count)) +
          " tokens, more than capacity " + to_string(pool.capacity) + " (it holds " +
          to_string(length) + ", " + to_string(count) + " appended)");
      continue;
    }
    const auto held = static_cast<std::int64_t>(pool.tables[b].size());
    pages_needed += std::max<std::int64_t>(0, ceil_div(length + count, pool.page_size) - held);
  }
  const auto free_pages = static_cast<std::int64_t>(pool.free_list.size());
  if (pages_needed > free_pages) {
    r.push_back(std::string(op) + ": the pool has " + to_string(free_pages) + " free pages, " +
                to_string(pages_needed) +
                " needed (release finished sequences or configure more num_pages)");
  }
}

// The writer of `storage` for rows of `dtype` (f64 rows: also the writer of
// a key rotated in double), chosen once per call.
CopyRow writer_for(KvStorage storage, DType dtype) {
  return WithStorage(storage, [&](auto traits) {
    using Traits = decltype(traits);
    return detail::visit_floating(dtype, [](auto t) -> CopyRow {
      return &Traits::template Write<typename decltype(t)::type>;
    });
  });
}

// Appends rows [0, counts[b]) of k [B, n, Hkv, Dk] and v [B, n, Hkv, Dv] to
// each sequence b, taking pages as sequences cross page boundaries (and,
// streaming, dropping them: before a new page when the drop that follows the
// token would come anyway, so the pages held never exceed check_room's
// count), rows written in the storage of keys and of values. Runs only after check_room
// passed; it cannot fail (the tables have their capacity reserved), so a
// throwing call never gets here.
void write(Pool& pool, ConstTensorView k, ConstTensorView v, const Counts& counts,
           const RopeConfig* rope) {
  const CopyRow copy_key = writer_for(pool.key_storage, k.dtype());
  const CopyRow copy_value =
      pool.values_in_keys ? nullptr : writer_for(pool.value_storage, v.dtype());
  const LoadRow load_key = load_row_for(k.dtype());
  const LoadRow load_value = pool.values_in_keys ? nullptr : load_row_for(v.dtype());
  const CopyRow store_key = writer_for(pool.key_storage, DType::f64);
  const CopyRow store_value = writer_for(pool.value_storage, DType::f64);
  // A key row's values in key_storage, then its tail (tail_dim values in
  // tail_storage, from byte tail_at of the head's row). A row with a tail is
  // a latent one, appended without RoPE or the Hadamard rotation.
  const std::int64_t key_main = pool.head_dim - pool.tail_dim;
  const std::int64_t tail_at = stored_bytes(pool.key_storage, key_main);
  const bool tail = pool.tail_dim > 0;
  const CopyRow copy_tail = tail ? writer_for(pool.tail_storage, k.dtype()) : nullptr;
  std::optional<Rotation> rotation;
  if (rope != nullptr) rotation.emplace(*rope, pool.head_dim);
  // Rows rotated (RoPE, Hadamard) in double on the way in.
  std::vector<double> row(static_cast<std::size_t>(std::max(pool.head_dim, pool.value_dim)));
  const std::int64_t key_head = pool.key_row_bytes / pool.kv_heads;  // bytes per head's row
  const std::int64_t value_head = pool.value_row_bytes / pool.kv_heads;

  for (std::size_t b = 0; b < pool.lengths.size(); ++b) {
    std::vector<std::int64_t>& table = pool.tables[b];
    for (std::int64_t t = 0; t < counts[b]; ++t) {
      const std::int64_t position = pool.positions[b] + t;  // RoPE's
      if (pool.lengths[b] % pool.page_size == 0 && drops(pool, pool.lengths[b] + 1)) {
        drop_page(pool, b);
      }
      const std::int64_t held = pool.lengths[b];  // the token's row
      const std::int64_t index = held / pool.page_size;
      if (index == static_cast<std::int64_t>(table.size())) {
        assert(!pool.free_list.empty() && "check_room counted the pages");
        std::pop_heap(pool.free_list.begin(), pool.free_list.end(), std::greater<>());
        table.push_back(pool.free_list.back());
        pool.free_list.pop_back();
      }
      const std::int64_t slot = table[index] * pool.page_size + held % pool.page_size;
      std::byte* key_dst = pool.keys + slot * pool.key_row_bytes;
      std::byte* value_dst = pool.values + slot * pool.value_row_bytes;
      const auto bi = static_cast<std::int64_t>(b);
      if (rotation) rotation->set_position(position);
      for (std::int64_t h = 0; h < pool.kv_heads; ++h) {
        const std::byte* key_src =
            at(k.data(), k.dtype(), bi * k.stride(0) + t * k.stride(1) + h * k.stride(2));
        if (rotation || pool.hadamard) {
          load_key(key_src, k.stride(3), row.data(), pool.head_dim);
          if (rotation) rotation->rotate(row.data());
          if (pool.hadamard) detail::hadamard(row.data(), pool.head_dim);
          store_key(row.data(), 1, key_dst + h * key_head, pool.head_dim);
        } else {
          copy_key(key_src, k.stride(3), key_dst + h * key_head, key_main);
          if (tail) {
            copy_tail(at(key_src, k.dtype(), key_main * k.stride(3)), k.stride(3),
                      key_dst + h * key_head + tail_at, pool.tail_dim);
          }
        }
        if (pool.values_in_keys) continue;
        const std::byte* value_src =
            at(v.data(), v.dtype(), bi * v.stride(0) + t * v.stride(1) + h * v.stride(2));
        if (pool.hadamard) {
          load_value(value_src, v.stride(3), row.data(), pool.value_dim);
          detail::hadamard(row.data(), pool.value_dim);
          store_value(row.data(), 1, value_dst + h * value_head, pool.value_dim);
        } else {
          copy_value(value_src, v.stride(3), value_dst + h * value_head, pool.value_dim);
        }
      }
      pool.lengths[b] = held + 1;
      if (drops(pool, held + 1)) drop_page(pool, b);
    }
    pool.positions[b] += counts[b];
  }
}

std::string number(double x) {
  char text[32];
  std::snprintf(text, sizeof text, "%.9g", x);
  return text;
}

// Largest magnitude a quantized storage holds: its f16 scale is at most
// 65504, times 127 (q8_0) or 8 (q4_0).
double storage_limit(KvStorage storage) {
  return storage == KvStorage::q8_0 ? 65504.0 * 127 : 65504.0 * 8;
}

// The rows an append writes into a quantized storage are finite and within
// its range. Keys rotated by RoPE may grow by up to sqrt(2), so the limit of
// their inputs is the storage's divided by sqrt(2); a row rotated by the
// Hadamard transform (orthogonal) has no value above its Euclidean norm, to
// which the limit then applies. `name` is [B, n, Hkv, D].
void check_quantizable(const char* name, ConstTensorView t, KvStorage storage, const Counts& counts,
                       bool rope, bool hadamard, Reasons& r, std::int64_t tail = 0) {
  if (!cache::is_quantized(storage)) return;
  const double limit = storage_limit(storage);
  const double value_limit = hadamard ? HUGE_VAL : rope ? limit / std::sqrt(2.0) : limit;
  const LoadRow load = load_row_for(t.dtype());
  std::vector<double> row(static_cast<std::size_t>(t.size(3)));
  for (std::int64_t b = 0; b < t.size(0); ++b) {
    for (std::int64_t i = 0; i < counts[static_cast<std::size_t>(b)]; ++i) {
      for (std::int64_t h = 0; h < t.size(2); ++h) {
        const std::string at_row = to_string(b) + ", " + to_string(i) + ", " + to_string(h);
        load(at(t.data(), t.dtype(), b * t.stride(0) + i * t.stride(1) + h * t.stride(2)),
             t.stride(3), row.data(), t.size(3));
        double norm2 = 0.0;
        for (std::int64_t x = 0; x < t.size(3) - tail; ++x) {
          const double value = row[static_cast<std::size_t>(x)];
          norm2 += value * value;
          if (!(std::fabs(value) <= value_limit)) {
            r.push_back(std::string(name) + ": " + storage_name(storage) +
                        " storage holds finite values of magnitude <= " + number(limit) +
                        (rope && !hadamard ? " (before RoPE: " + number(value_limit) + ")" : "") +
                        ", got " + number(value) + " at [" + at_row + ", " + to_string(x) + "]");
            return;
          }
        }
        if (hadamard && !(std::sqrt(norm2) <= limit)) {
          r.push_back(std::string(name) + ": " + storage_name(storage) +
                      " storage holds finite values of magnitude <= " + number(limit) +
                      ", which a row rotated by the Hadamard transform reaches when its norm "
                      "does: got norm " +
                      number(std::sqrt(norm2)) + " for row [" + at_row + "]");
          return;
        }
      }
    }
  }
}

// The last checks of an append, on the values (r holds no reason yet):
// throws with every reason, or writes the rows.
void check_and_write(Pool& pool, ConstTensorView k, ConstTensorView v, const Counts& counts,
                     const RopeConfig* rope, Reasons& r) {
  check_quantizable("k_new", k, pool.key_storage, counts, rope != nullptr, pool.hadamard, r,
                    pool.tail_dim);
  if (!pool.values_in_keys) {
    check_quantizable("v_new", v, pool.value_storage, counts, false, pool.hadamard, r);
  }
  throw_if(r);
  write(pool, k, v, counts, rope);
}

// A storage's name for a message, or its value when it is no row.
std::string stored_as(KvStorage storage) {
  return is_storage(storage) ? std::string(storage_name(storage))
                             : "value " + std::to_string(static_cast<int>(storage));
}

}  // namespace

KvCache::KvCache(const KvCacheConfig& config) : config_(config) {
  Reasons r;
  const KvCacheConfig& c = config;
  auto at_least = [&](const char* field, std::int64_t value, std::int64_t low, const char* note) {
    if (value < low) {
      r.push_back(std::string("config.") + field + ": expected >= " + to_string(low) + note +
                  ", got " + to_string(value));
    }
  };
  at_least("batch", c.batch, 1, "");
  at_least("kv_heads", c.kv_heads, 1, "");
  at_least("head_dim", c.head_dim, 1, "");
  at_least("value_dim", c.value_dim, 0, " (0 = head_dim)");
  const bool streaming = c.window_tokens > 0;
  if (!streaming) at_least("capacity", c.capacity, 1, "");
  at_least("page_size", c.page_size, 0, " (0 = contiguous)");
  at_least("num_pages", c.num_pages, 0, " (0 = batch * the pages a sequence may hold)");
  if (c.page_size == 0 && c.num_pages != 0) {
    r.push_back("config.num_pages: only used by the paged layout (page_size > 0), got " +
                to_string(c.num_pages) + " with page_size 0 (contiguous)");
  }
  at_least("sink_tokens", c.sink_tokens, 0, "");
  at_least("window_tokens", c.window_tokens, 0, " (0 = no streaming)");
  if (!streaming) {
    if (c.sink_tokens > 0) {
      r.push_back("config.sink_tokens: only kept by streaming (window_tokens > 0), got " +
                  to_string(c.sink_tokens) + " with window_tokens 0");
    }
  } else {
    if (c.capacity != 0) {
      r.push_back(
          "config.capacity: expected 0 with window_tokens > 0 (a streaming sequence "
          "holds at most sink_tokens + window_tokens + page_size - 1 tokens), got " +
          to_string(c.capacity));
    }
    if (c.page_size == 0) {
      r.push_back(
          "config.window_tokens: streaming drops whole pages: expected page_size > 0 "
          "(paged), got 0 (contiguous)");
    } else if (c.page_size > 0 && c.sink_tokens >= 0 && c.sink_tokens % c.page_size != 0) {
      r.push_back("config.sink_tokens: expected a multiple of page_size " + to_string(c.page_size) +
                  " (the sinks fill whole pages), got " + to_string(c.sink_tokens));
    }
    constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
    if (c.page_size > 0 && c.sink_tokens >= 0 &&
        c.window_tokens > kMax - c.page_size - c.sink_tokens) {
      r.push_back(
          "config.window_tokens: sink_tokens + window_tokens + page_size overflows "
          "int64, got window_tokens " +
          to_string(c.window_tokens));
    }
  }
  if (c.values_in_keys) {
    if (c.kv_heads != 1) {
      r.push_back("config.values_in_keys: expected kv_heads 1 (one latent row per token), got " +
                  to_string(c.kv_heads));
    }
    if (c.value_dim > c.head_dim) {
      r.push_back(
          "config.values_in_keys: the values are the first value_dim of head_dim "
          "values: expected value_dim <= head_dim " +
          to_string(c.head_dim) + ", got " + to_string(c.value_dim));
    }
    if (c.value_storage != KvStorage::automatic && c.value_storage != c.key_storage) {
      r.push_back(std::string("config.value_storage: values_in_keys stores values in the keys' "
                              "storage: expected automatic or ") +
                  storage_name(c.key_storage) + ", got " + storage_name(c.value_storage));
    }
    if (cache::is_quantized(c.key_storage) && c.value_dim % cache::kQuantBlock != 0) {
      r.push_back(std::string("config.value_dim: the values of a latent row in ") +
                  storage_name(c.key_storage) + " are whole blocks: expected a multiple of " +
                  to_string(cache::kQuantBlock) + ", got " + to_string(c.value_dim));
    }
    if (c.rotate) {
      r.push_back(
          "config.rotate: not with values_in_keys (the Hadamard transform of the row "
          "would mix the values with the rest of the key)");
    }
  }
  if (c.tail_dim != 0) {
    const std::int64_t dv = c.value_dim == 0 ? c.head_dim : c.value_dim;
    if (!c.values_in_keys || !cache::is_quantized(c.key_storage)) {
      r.push_back(
          "config.tail_dim: an unquantized tail is for latent caches (values_in_keys) in a "
          "quantized key_storage (q8_0, q4_0): expected 0, got " +
          to_string(c.tail_dim));
    } else if (c.tail_dim < 0 || c.tail_dim > c.head_dim - dv) {
      r.push_back(
          "config.tail_dim: the tail lies past the value: expected 0 <= tail_dim <= "
          "head_dim - value_dim = " +
          to_string(c.head_dim - dv) + ", got " + to_string(c.tail_dim));
    }
    if (c.tail_storage != KvStorage::bf16 && c.tail_storage != KvStorage::f16) {
      r.push_back(std::string("config.tail_storage: expected bf16 or f16, got ") +
                  stored_as(c.tail_storage));
    }
  }
  const auto check_storage = [&](const char* field, KvStorage storage, std::int64_t dim,
                                 const char* dim_name) {
    if (!is_storage(storage)) {
      r.push_back(std::string("config.") + field + ": expected one of " + storage_names(false) +
                  ", got " + stored_as(storage));
    } else if (cache::is_quantized(storage) && dim >= 1 && dim % cache::kQuantBlock != 0) {
      r.push_back(std::string("config.") + field + ": " + storage_name(storage) +
                  " stores blocks of " + to_string(cache::kQuantBlock) + " values: expected " +
                  dim_name + " a multiple of " + to_string(cache::kQuantBlock) + ", got " +
                  to_string(dim));
    }
  };
  if (c.rotate) {
    for (const auto& [field, dim] :
         {std::pair{"head_dim", c.head_dim},
          std::pair{"value_dim", c.value_dim == 0 ? c.head_dim : c.value_dim}}) {
      if (dim >= 1 && !detail::is_power_of_two(dim)) {
        r.push_back(std::string("config.rotate: the Hadamard transform needs ") + field +
                    " a power of two, got " + to_string(dim));
      }
    }
  }
  // The blocks of a key row end where its tail starts (a tail out of range
  // was refused above).
  const bool tail = c.tail_dim > 0 && c.tail_dim <= c.head_dim;
  check_storage("key_storage", c.key_storage, tail ? c.head_dim - c.tail_dim : c.head_dim,
                tail ? "head_dim - tail_dim" : "head_dim");
  check_storage("value_storage", c.value_storage, c.value_dim == 0 ? c.head_dim : c.value_dim,
                c.value_dim == 0 ? "value_dim (0: head_dim)" : "value_dim");
  const bool dtype_used =
      c.key_storage == KvStorage::automatic || c.value_storage == KvStorage::automatic;
  switch (dtype_used ? c.dtype : DType::f32) {
    case DType::f32:
    case DType::bf16:
    case DType::f16:
      break;
    case DType::f64:
      r.push_back(
          "config.dtype: expected f32, bf16 or f16 storage, got f64 (the decode kernels compute "
          "in f32 and read f32, bf16 or f16 caches; append rounds f64 inputs to the storage)");
      break;
    case DType::boolean:
      r.push_back(
          "config.dtype: expected f32, bf16 or f16 storage, got bool (keys and values "
          "are floating-point)");
      break;
    default:
      r.push_back("config.dtype: expected f32, bf16 or f16 storage, got value " +
                  to_string(static_cast<int>(c.dtype)));
  }
  throw_if(r);

  const std::int64_t dv = value_dim();
  const std::int64_t tokens = page_size();
  held_max_ = streaming ? c.sink_tokens + c.window_tokens + c.page_size - 1 : c.capacity;
  // Pages one sequence may need at most; the pool size when not given.
  const std::int64_t per_sequence = ceil_div(held_max_, tokens);
  std::int64_t pages = paged() ? c.num_pages : c.batch;
  if (pages == 0 && !detail::checked_product({c.batch, per_sequence}, pages)) {
    r.push_back("config.num_pages: the default batch * (pages a sequence may hold) = " +
                to_string(c.batch) + " * " + to_string(per_sequence) + " overflows int64");
  }
  // At most 4 bytes per stored value.
  std::int64_t storage_bytes = 0;
  if (r.empty() && !detail::checked_product(
                       {pages, tokens, c.kv_heads, std::max(c.head_dim, dv), 4}, storage_bytes)) {
    const KvStorage widest = c.head_dim >= dv ? key_storage() : value_storage();
    r.push_back("config: storage of " + to_string(pages) + " pages of " + to_string(tokens) +
                " tokens x " + to_string(c.kv_heads) + " heads x " +
                to_string(std::max(c.head_dim, dv)) + " elements of " + storage_name(widest) +
                " exceeds 2^63 bytes");
  }
  throw_if(r);

  key_row_bytes_ = c.kv_heads * (stored_bytes(key_storage(), c.head_dim - c.tail_dim) +
                                 stored_bytes(c.tail_storage, c.tail_dim));
  // A latent cache's value rows are its key rows (no storage of their own).
  value_row_bytes_ =
      c.values_in_keys ? key_row_bytes_ : c.kv_heads * stored_bytes(value_storage(), dv);
  try {
    keys_ = Tensor(DType::boolean, {pages, tokens, key_row_bytes_});
    values_ = Tensor(DType::boolean, {pages, tokens, c.values_in_keys ? 0 : value_row_bytes_});
  } catch (const std::exception& e) {
    throw Error("config: cannot allocate the storage of keys [" + to_string(pages) + ", " +
                to_string(tokens) + ", " + to_string(c.kv_heads) + ", " + to_string(c.head_dim) +
                "] and values [" + to_string(pages) + ", " + to_string(tokens) + ", " +
                to_string(c.kv_heads) + ", " + to_string(dv) + "] (" +
                to_string(static_cast<std::uint64_t>(pages * tokens * key_row_bytes_) +
                          static_cast<std::uint64_t>(pages * tokens * value_row_bytes_)) +
                " bytes): " + e.what());
  }
  try {
    lengths_.assign(static_cast<std::size_t>(c.batch), 0);
    positions_.assign(static_cast<std::size_t>(c.batch), 0);
    tables_.resize(static_cast<std::size_t>(c.batch));
    if (paged()) {
      // Reserved now so that appending pages to a table never allocates (and
      // so never throws) once an append has passed its checks.
      for (auto& table : tables_) {
        table.reserve(static_cast<std::size_t>(std::min(per_sequence, pages)));
      }
      // Ascending order is already a min-heap.
      free_.resize(static_cast<std::size_t>(pages));
      for (std::int64_t p = 0; p < pages; ++p) free_[p] = p;
    } else {
      for (std::int64_t b = 0; b < c.batch; ++b) tables_[b] = {b};
    }
  } catch (const std::exception& e) {
    // std::bad_alloc, or std::length_error for more sequences or pages than
    // a std::vector can hold; nothing else is thrown here.
    throw Error("config: the block tables of " + to_string(c.batch) + " sequences and " +
                to_string(pages) + " pages do not fit in memory (" + e.what() + ")");
  }
}

std::int64_t KvCache::value_dim() const {
  return config_.value_dim == 0 ? config_.head_dim : config_.value_dim;
}

KvStorage KvCache::key_storage() const {
  return config_.key_storage == KvStorage::automatic ? cache::storage_of(config_.dtype)
                                                     : config_.key_storage;
}

KvStorage KvCache::value_storage() const {
  if (config_.values_in_keys) return key_storage();
  return config_.value_storage == KvStorage::automatic ? cache::storage_of(config_.dtype)
                                                       : config_.value_storage;
}

std::int64_t KvCache::page_size() const { return paged() ? config_.page_size : config_.capacity; }

std::int64_t KvCache::length(std::int64_t b) const {
  if (b < 0 || b >= config_.batch) throw Error(unknown_sequence("length", b, config_.batch));
  return lengths_[b];
}

std::int64_t KvCache::position(std::int64_t b) const {
  if (b < 0 || b >= config_.batch) throw Error(unknown_sequence("position", b, config_.batch));
  return positions_[b];
}

std::int64_t KvCache::free_pages() const { return static_cast<std::int64_t>(free_.size()); }

namespace {

// Checks the rows of an append, k_new [B, n, Hkv, Dk] and v_new [B, n, Hkv,
// Dv] (`batched`) or k_new [n, Hkv, Dk] and v_new [n, Hkv, Dv] (append_to),
// and the rope applied on the way in. n is k_new's (v_new's when k_new has
// the wrong rank); v_new is held to it. Returns n, or -1 when neither gives
// it.
std::int64_t check_rows(const KvCache& cache, bool batched, ConstTensorView k_new,
                        ConstTensorView v_new, const RopeConfig* rope, Reasons& r) {
  const KvCacheConfig& c = cache.config();
  const int rank = batched ? 4 : 3;
  const auto has_rank = [&](ConstTensorView t) { return t.defined() && t.rank() == rank; };
  const bool from_k = has_rank(k_new);
  const bool from_v = !from_k && has_rank(v_new);
  const std::int64_t n = from_k ? k_new.size(rank - 3) : from_v ? v_new.size(rank - 3) : -1;
  const std::string source =
      std::string(batched ? "batch, " : "") + "kv_heads and head dims of the cache";
  const auto check = [&](const char* name, ConstTensorView t, std::int64_t head_dim,
                         const std::string& from, const char* layout) {
    const std::int64_t sizes[] = {c.batch, n, c.kv_heads, head_dim};
    detail::check_view(name, t,
                       {.sizes = std::span(sizes).last(rank),
                        .sizes_source = from.c_str(),
                        .layout = layout,
                        .floating = true},
                       r);
  };
  check("k_new", k_new, c.head_dim, source, batched ? "[B, n, Hkv, Dk]" : "[n, Hkv, Dk]");
  if (c.values_in_keys) {
    // A latent row is its key and its value: nothing else to give.
    if (v_new.defined()) {
      r.push_back(
          "v_new: the cache takes its values from the keys (values_in_keys): expected "
          "an undefined view, got one of " +
          to_string(v_new.rank()) + " dimensions");
    }
    if (rope != nullptr) {
      r.push_back(
          "rope: not with values_in_keys (RoPE would rotate the row's first values, "
          "which are the values): rotate the row's RoPE part before appending");
    }
    return from_k ? n : -1;
  }
  check("v_new", v_new, cache.value_dim(), source + (from_k ? ", n of k_new" : ""),
        batched ? "[B, n, Hkv, Dv]" : "[n, Hkv, Dv]");
  if (rope != nullptr) detail::check_rope(*rope, c.head_dim, "Dk", r);
  return n;
}

}  // namespace

cache::Pool KvCache::pool_() {
  return Pool{.capacity = held_max_,
              .page_size = page_size(),
              .sinks = config_.sink_tokens,
              .window = config_.window_tokens,
              .kv_heads = config_.kv_heads,
              .head_dim = config_.head_dim,
              .value_dim = value_dim(),
              .lengths = lengths_,
              .positions = positions_,
              .tables = tables_,
              .free_list = free_,
              .key_storage = key_storage(),
              .value_storage = value_storage(),
              .hadamard = config_.rotate,
              .values_in_keys = config_.values_in_keys,
              .tail_dim = config_.tail_dim,
              .tail_storage = config_.tail_storage,
              .key_row_bytes = key_row_bytes_,
              .value_row_bytes = value_row_bytes_,
              .keys = bytes_of(keys_),
              .values = bytes_of(values_)};
}

void KvCache::append(ConstTensorView k_new, ConstTensorView v_new,
                     std::span<const std::int64_t> counts, const RopeConfig* rope) {
  Reasons r;
  const std::int64_t batch = config_.batch;
  const std::int64_t n = check_rows(*this, true, k_new, v_new, rope, r);
  bool counts_ok = n >= 0;
  if (!counts.empty() && static_cast<std::int64_t>(counts.size()) != batch) {
    r.push_back("counts: expected one count per sequence (B = " + to_string(batch) +
                ") or none (all n rows), got " + to_string(counts.size()));
    counts_ok = false;
  } else if (n >= 0) {
    for (std::size_t b = 0; b < counts.size(); ++b) {
      if (counts[b] < 0 || counts[b] > n) {
        r.push_back("counts[" + to_string(b) + "]: expected a count in [0, n = " + to_string(n) +
                    "] (the rows of the inputs), got " + to_string(counts[b]));
        counts_ok = false;
      }
    }
  }
  Pool pool = pool_();
  const Counts rows{.counts = counts, .rows = n};
  if (counts_ok) check_room("append", pool, rows, r);
  if (r.empty()) check_and_write(pool, k_new, v_new, rows, rope, r);
  throw_if(r);
}

void KvCache::append_to(std::int64_t b, ConstTensorView k_new, ConstTensorView v_new,
                        const RopeConfig* rope) {
  Reasons r;
  const std::int64_t batch = config_.batch;
  const std::int64_t hkv = config_.kv_heads;
  const bool b_ok = b >= 0 && b < batch;
  if (!b_ok) r.push_back(unknown_sequence("append_to", b, batch));
  const std::int64_t n = check_rows(*this, false, k_new, v_new, rope, r);
  // As a batch append in which only sequence b gets rows: the inputs repeat
  // over the batch (stride 0) and every other count is 0.
  Pool pool = pool_();
  const Counts rows{.rows = n, .only = b};
  if (b_ok && n >= 0) check_room("append_to", pool, rows, r);
  throw_if(r);
  const ConstTensorView k4(k_new.data(), k_new.dtype(), {batch, n, hkv, config_.head_dim},
                           {0, k_new.stride(0), k_new.stride(1), k_new.stride(2)});
  const ConstTensorView v4 =
      config_.values_in_keys
          ? ConstTensorView{}
          : ConstTensorView(v_new.data(), v_new.dtype(), {batch, n, hkv, value_dim()},
                            {0, v_new.stride(0), v_new.stride(1), v_new.stride(2)});
  check_and_write(pool, k4, v4, rows, rope, r);
}

void KvCache::release(std::int64_t b) {
  if (b < 0 || b >= config_.batch) throw Error(unknown_sequence("release", b, config_.batch));
  lengths_[b] = 0;
  positions_[b] = 0;
  if (!paged()) return;
  for (std::int64_t page : tables_[b]) {
    free_.push_back(page);
    std::push_heap(free_.begin(), free_.end(), std::greater<>());
  }
  tables_[b].clear();
}

namespace {

std::int64_t page_of(const char* op, std::span<const std::int64_t> table, std::int64_t b,
                     std::int64_t index) {
  if (index < 0 || index >= static_cast<std::int64_t>(table.size())) {
    throw Error(std::string(op) + ": page " + to_string(index) + " of sequence " + to_string(b) +
                " does not exist (its block table has " + to_string(table.size()) + " pages)");
  }
  return table[index];
}

}  // namespace

const void* KvCache::key_page(std::int64_t b, std::int64_t index) const {
  if (b < 0 || b >= config_.batch) throw Error(unknown_sequence("key_page", b, config_.batch));
  const std::int64_t page = page_of("key_page", tables_[b], b, index);
  return bytes_of(keys_) + page * page_size() * key_row_bytes_;
}

const void* KvCache::value_page(std::int64_t b, std::int64_t index) const {
  if (b < 0 || b >= config_.batch) throw Error(unknown_sequence("value_page", b, config_.batch));
  const std::int64_t page = page_of("value_page", tables_[b], b, index);
  if (config_.values_in_keys) return bytes_of(keys_) + page * page_size() * key_row_bytes_;
  return bytes_of(values_) + page * page_size() * value_row_bytes_;
}

std::span<const std::int64_t> KvCache::block_table(std::int64_t b) const {
  if (b < 0 || b >= config_.batch) throw Error(unknown_sequence("block_table", b, config_.batch));
  return tables_[b];
}

}  // namespace qkv
