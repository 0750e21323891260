// qkv/kv_cache.hpp — a key/value cache for autoregressive decoding.
//
// One cache per layer holds, for each of B sequences, the keys and values of
// its tokens so far: per token and KV head, Dk key and Dv value elements,
// stored in f32, bf16 or f16 (16-bit storage halves the bytes decoding
// reads; the kernels widen to f32 exactly), or quantized in ggml's block
// formats q8_0 and q4_0 (8.5 and 4.5 bits per value; see KvStorage), keys
// and values each in their own. Sequences grow independently.
//
// Two layouts:
//   contiguous (page_size == 0): each sequence owns `capacity` token slots,
//     K storage [B, capacity, Hkv, Dk] and V [B, capacity, Hkv, Dv];
//   paged (page_size > 0, as vLLM and FlashAttention's flash_attn_with_kvcache):
//     a pool of `num_pages` pages of page_size tokens ([page_size, Hkv, D]
//     each); a sequence's block table lists its pages in order, pages are
//     taken from the pool as it grows and returned by release().
// Token t of sequence b lives in page t / page_size of b's block table, row
// t % page_size (contiguous: one page of `capacity` tokens per sequence).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "qkv/kv_storage.hpp"  // KvStorage
#include "qkv/positional.hpp"  // RopeConfig
#include "qkv/tensor.hpp"

namespace qkv {

namespace cache {
struct Pool;  // what appends may change (src/cache/kv_cache.cpp)
}  // namespace cache

// Shape and storage of a KvCache.
struct KvCacheConfig {
  std::int64_t batch = 1;      // B: sequences
  std::int64_t kv_heads = 1;   // Hkv
  std::int64_t head_dim = 0;   // Dk (>= 1)
  std::int64_t value_dim = 0;  // Dv; 0 = head_dim
  std::int64_t capacity = 0;   // most tokens a sequence may hold (>= 1; streaming: 0)
  DType dtype = DType::f32;    // f32, bf16 or f16: the storage where *_storage is automatic
  std::int64_t page_size = 0;  // 0 = contiguous; else tokens per page (paged)
  std::int64_t num_pages = 0;  // paged: pages in the pool; 0 = B * pages a sequence may hold
  KvStorage key_storage = KvStorage::automatic;    // keys' storage; quantized: Dk % 32 == 0
  KvStorage value_storage = KvStorage::automatic;  // values'; quantized: Dv % 32 == 0
  // Store keys and values rotated by the normalized Walsh-Hadamard transform
  // of the head dim (after RoPE), which decoding undoes exactly in exact
  // arithmetic: spreads outlier channels before quantizing (llama.cpp's
  // rotation). Dk and Dv powers of two.
  bool rotate = false;
  // Streaming (StreamingLLM), paged only: with window_tokens > 0 a sequence
  // keeps its first sink_tokens tokens (whole pages: a multiple of page_size)
  // and its most recent ones; after each appended token, the oldest page
  // after the sinks is dropped (returned to the pool) while at least
  // window_tokens recent tokens remain without it. A sequence then holds its
  // sinks and between window_tokens and window_tokens + page_size - 1 recent
  // tokens (page_size 1: exactly window_tokens), in order. capacity must be 0
  // (the held tokens are bounded by the above). Keys keep the RoPE positions
  // they were appended at (position(b)), see docs/numerics.md.
  std::int64_t sink_tokens = 0;    // S: first tokens always kept
  std::int64_t window_tokens = 0;  // W: recent tokens kept at least; 0 = no streaming
  // A latent cache (multi-head latent attention, DeepSeek's MLA): one row of
  // head_dim values per token serves as its key, and its first value_dim
  // values as its value, stored once. kv_heads 1, value_dim <= head_dim, one
  // storage for the row (value_storage automatic or key_storage's); appends
  // take no values (v_new undefined) and no RoPE (rotate the row's RoPE part
  // before appending); no Hadamard rotation.
  bool values_in_keys = false;
  // A latent cache in a quantized key_storage (q8_0, q4_0) may keep the last
  // tail_dim values of each row, its RoPE part past the value (DeepSeek: 64
  // of 576), in tail_storage (bf16 or f16), not quantized, as FlashMLA's and
  // vLLM's quantized MLA caches do: a row is then (head_dim - tail_dim) / 32
  // blocks followed by tail_dim 16-bit values. Needs values_in_keys,
  // tail_dim <= head_dim - value_dim and head_dim - tail_dim a multiple of 32.
  // 0: the whole row in key_storage.
  std::int64_t tail_dim = 0;
  KvStorage tail_storage = KvStorage::bf16;  // the tail's storage: bf16 or f16
};

class KvCache {
 public:
  // Allocates the storage (zeroed); throws qkv::Error on a bad config.
  explicit KvCache(const KvCacheConfig& config);

  const KvCacheConfig& config() const { return config_; }
  bool paged() const { return config_.page_size > 0; }
  std::int64_t value_dim() const;
  // The storage of keys and of values (never automatic).
  KvStorage key_storage() const;
  KvStorage value_storage() const;
  // Tokens per page (contiguous: capacity).
  std::int64_t page_size() const;
  // Bytes of one token's keys [Hkv, Dk] and of its values [Hkv, Dv] as stored
  // (values_in_keys: both the row's, the values being its first Dv).
  std::int64_t key_token_bytes() const { return key_row_bytes_; }
  std::int64_t value_token_bytes() const { return value_row_bytes_; }
  // Tokens stored in sequence b, and all B lengths.
  std::int64_t length(std::int64_t b) const;
  std::span<const std::int64_t> lengths() const { return lengths_; }
  // Tokens ever appended to sequence b since it was last released: the
  // position of its next token (RoPE). length(b) unless streaming dropped some.
  std::int64_t position(std::int64_t b) const;
  // Pages not owned by any sequence (contiguous: 0).
  std::int64_t free_pages() const;

  // Appends tokens to every sequence: k_new [B, n, Hkv, Dk], v_new
  // [B, n, Hkv, Dv] (values_in_keys: undefined) in any floating dtype (rounded once to the
  // storage's), the first counts[b] rows to sequence b (counts empty: all n). With `rope`, keys are
  // rotated at their positions (position(b) + t) on the way in; the inputs are not modified. Throws
  // qkv::Error, changing nothing, if shapes or dtypes are wrong, a count is out of [0, n], a
  // sequence would exceed `capacity`, or the pool has too few free pages.
  void append(ConstTensorView k_new, ConstTensorView v_new,
              std::span<const std::int64_t> counts = {}, const RopeConfig* rope = nullptr);
  // Appends k_new [n, Hkv, Dk], v_new [n, Hkv, Dv] to sequence b alone;
  // throws qkv::Error, changing nothing, for an unknown b or as above.
  void append_to(std::int64_t b, ConstTensorView k_new, ConstTensorView v_new,
                 const RopeConfig* rope = nullptr);
  // Empties sequence b (the sequence ended); paged: returns its pages.
  void release(std::int64_t b);

  // Kernel access. Page `index` of sequence b's block table (index <
  // ceil(length(b) / page_size)): keys [page_size, Hkv, Dk] and values
  // [page_size, Hkv, Dv], contiguous, in their storage (quantized: a head's
  // row is D / 32 blocks).
  const void* key_page(std::int64_t b, std::int64_t index) const;
  const void* value_page(std::int64_t b, std::int64_t index) const;
  // Sequence b's block table: pool page of each of its pages (contiguous: {b}).
  std::span<const std::int64_t> block_table(std::int64_t b) const;

 private:
  cache::Pool pool_();  // the state appends change, gathered
  KvCacheConfig config_;
  std::int64_t held_max_ = 0;  // most tokens a sequence holds (capacity; streaming: S + W + P - 1)
  std::vector<std::int64_t> lengths_;              // [B] tokens held
  std::vector<std::int64_t> positions_;            // [B] tokens appended
  std::vector<std::vector<std::int64_t>> tables_;  // [B][pages of b]
  std::vector<std::int64_t> free_;                 // pool pages not in use
  std::int64_t key_row_bytes_ = 0;                 // bytes of one token's keys [Hkv, Dk]
  std::int64_t value_row_bytes_ = 0;               // and of its values [Hkv, Dv]
  // Stored bytes [pages, page_size, token bytes]: a Tensor for its 64-byte
  // alignment, huge pages and threaded zeroing, read as raw bytes.
  Tensor keys_;
  Tensor values_;
};

}  // namespace qkv
