// What the decode kernel reads of a KV cache: a plain view of its pages,
// built by the entry point (api/decode.cpp) from qkv::KvCache for the length
// of one call, so that the kernel never sees the class. Keys and values are
// each in their storage; their layout and how they widen to f32 are the
// storage traits' (cache/storage-inl.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "qkv/kv_storage.hpp"

namespace qkv::cache {

struct KvView {
  KvStorage key_storage = KvStorage::f32;    // which StorageTraits reads the keys
  KvStorage value_storage = KvStorage::f32;  // and the values
  // Keys and values stored rotated by the Hadamard transform (core/hadamard.hpp):
  // the kernel rotates the queries and un-rotates the outputs.
  bool rotated = false;
  // A latent cache (KvCacheConfig::values_in_keys, one KV head): a token's
  // value row is the start of its key row, so values step by the key row.
  bool values_in_keys = false;
  // A latent cache's last tail_dim key values, stored past the row's blocks
  // in tail_storage (bf16 or f16; KvCacheConfig::tail_dim); 0: none.
  std::int64_t tail_dim = 0;
  KvStorage tail_storage = KvStorage::bf16;
  // Bytes of a token's keys [Hkv, Dk] and values [Hkv, Dv] as stored: the
  // token rows' stride in a page (a latent cache: both the key row's).
  std::int64_t key_token_bytes = 0, value_token_bytes = 0;
  std::int64_t batch = 0, kv_heads = 0, head_dim = 0, value_dim = 0;
  // Tokens per page (contiguous: capacity). A page holds page_size token
  // rows, keys [Hkv, Dk] and values [Hkv, Dv] each, contiguous.
  std::int64_t page_size = 0;
  std::span<const std::int64_t> lengths;  // [B]: tokens held by each sequence
  // Page i of sequence b (the i-th entry of its block table) starts at
  // key_pages[first_page[b] + i] and value_pages[first_page[b] + i];
  // first_page has B + 1 entries, the last one the number of pages.
  std::vector<const std::byte*> key_pages, value_pages;
  std::vector<std::int64_t> first_page;

  std::int64_t length(std::int64_t b) const { return lengths[static_cast<std::size_t>(b)]; }
  const std::byte* key_page(std::int64_t b, std::int64_t i) const {
    return key_pages[static_cast<std::size_t>(first_page[static_cast<std::size_t>(b)] + i)];
  }
  const std::byte* value_page(std::int64_t b, std::int64_t i) const {
    return value_pages[static_cast<std::size_t>(first_page[static_cast<std::size_t>(b)] + i)];
  }
};

}  // namespace qkv::cache
