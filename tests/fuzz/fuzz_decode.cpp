// Fuzzes the KV cache and decoding: KvCache construction (contiguous and
// paged, extreme configurations), sequences of append, append_to (with and
// without RoPE) and release, decode_attention and decode_attention_into over
// their options (scale, softcap, ALiBi, score_scale, window, backends, matmul_precision, and
// options decode must refuse), apply_rope and apply_rope_backward, with strided and bad views; keys
// and values stored in f32, bf16, f16 or quantized (q8_0, q4_0), plain or rotated by the Hadamard
// transform; streaming caches (sinks and window); latent caches (MLA: values a prefix of the keys).
//
// Checks: only qkv::Error escapes; a rejected append or release leaves every
// length, block table, free page count and stored row as it was; a
// rejected decode leaves its outputs bitwise unchanged, and one that must be
// rejected is (a sequence shorter than n, n > 16, options that do not apply
// to decoding); an append moves each position by its count, and a streaming
// sequence holds no more than its sinks and window allow and no fewer than
// its sinks and window; an append without RoPE stores its rows rounded once to the
// storage dtype (quantized: ggml's quantizer on the rows rounded to f32);
// finite caches and queries give finite outputs; decode meets
// the tolerance policy against the reference forward over each sequence's
// cached keys (computed in double), and is bitwise the same for another
// thread count and for the allocating call; apply_rope_backward undoes
// apply_rope.
#include <cmath>
#include <tuple>

#include "api/validate.hpp"
#include "cache/formats.hpp"
#include "fuzz_common.hpp"
#include "reference/attention.hpp"

namespace {

using qkv::AttentionOptions;
using qkv::ConstTensorView;
using qkv::DType;
using qkv::KvCache;
using qkv::KvCacheConfig;
using qkv::KvStorage;
using qkv::Tensor;
using qkv::fuzz::Arg;
using qkv::fuzz::finding;
using qkv::fuzz::Input;
using qkv::fuzz::require;

constexpr std::int64_t kMaxDecodeRows = 16;

// The rows a sequence holds, read out of its pages and widened to f32
// (exact for every storage): [1, L, Hkv, D].
Tensor gather(const KvCache& cache, std::int64_t b, bool keys) {
  const KvCacheConfig& cfg = cache.config();
  const std::int64_t d = keys ? cfg.head_dim : cache.value_dim();
  const KvStorage storage = keys ? cache.key_storage() : cache.value_storage();
  const std::int64_t length = cache.length(b);
  const std::int64_t sizes[] = {1, length, cfg.kv_heads, d};
  Tensor t(DType::f32, sizes);
  // A head's row stride (a latent cache's values: the key row).
  const std::int64_t head =
      (keys ? cache.key_token_bytes() : cache.value_token_bytes()) / cfg.kv_heads;
  auto* dst = static_cast<float*>(t.view().data());
  for (std::int64_t i = 0; i < length; ++i) {
    const auto* page =
        static_cast<const std::byte*>(keys ? cache.key_page(b, i / cache.page_size())
                                           : cache.value_page(b, i / cache.page_size()));
    for (std::int64_t h = 0; h < cfg.kv_heads; ++h) {
      // A key row with a tail: its last tail_dim values past the blocks.
      const std::int64_t tail = keys ? cfg.tail_dim : 0;
      const std::byte* row = page + ((i % cache.page_size()) * cfg.kv_heads + h) * head;
      float* out = dst + (i * cfg.kv_heads + h) * d;
      qkv::cache::dequantize_row(storage, row, d - tail, out);
      if (tail > 0) {
        qkv::cache::dequantize_row(cfg.tail_storage, row + qkv::stored_bytes(storage, d - tail),
                                   tail, out + d - tail);
      }
    }
  }
  return t;
}

// What a storage holds of rows [.., D] (any floating dtype): rounded once to
// f32, bf16 or f16, or rounded to f32 and quantized per row of D; in f64.
Tensor stored_as(ConstTensorView rows, KvStorage storage) {
  if (!qkv::cache::is_quantized(storage)) {
    const DType dtype = storage == KvStorage::bf16  ? DType::bf16
                        : storage == KvStorage::f16 ? DType::f16
                                                    : DType::f32;
    return qkv::to_dtype(qkv::to_dtype(rows, dtype), DType::f64);
  }
  Tensor f = qkv::to_dtype(rows, DType::f32);
  const std::int64_t d = rows.size(rows.rank() - 1);
  std::vector<std::byte> blocks(static_cast<std::size_t>(qkv::stored_bytes(storage, d)));
  auto* x = static_cast<float*>(f.view().data());
  for (std::int64_t r = 0; r < f.view().numel() / d; ++r) {
    if (storage == KvStorage::q8_0) {
      qkv::cache::quantize_q8_0(x + r * d, d,
                                reinterpret_cast<qkv::cache::BlockQ8_0*>(blocks.data()));
    } else {
      qkv::cache::quantize_q4_0(x + r * d, d,
                                reinterpret_cast<qkv::cache::BlockQ4_0*>(blocks.data()));
    }
    qkv::cache::dequantize_row(storage, blocks.data(), d, x + r * d);
  }
  return qkv::to_dtype(f, DType::f64);
}

// Everything observable about a cache, to compare before and after a
// rejected call.
struct CacheState {
  std::vector<std::int64_t> lengths, positions;
  std::vector<std::vector<std::int64_t>> tables;
  std::int64_t free_pages = 0;
  std::vector<Tensor> keys, values;

  explicit CacheState(const KvCache& cache) : free_pages(cache.free_pages()) {
    for (std::int64_t b = 0; b < cache.config().batch; ++b) {
      lengths.push_back(cache.length(b));
      positions.push_back(cache.position(b));
      const auto t = cache.block_table(b);
      tables.emplace_back(t.begin(), t.end());
      keys.push_back(gather(cache, b, true));
      values.push_back(gather(cache, b, false));
    }
  }
  bool operator==(const CacheState& o) const {
    if (lengths != o.lengths || positions != o.positions || tables != o.tables ||
        free_pages != o.free_pages) {
      return false;
    }
    for (std::size_t b = 0; b < keys.size(); ++b) {
      if (!qkv::fuzz::same_values(keys[b], o.keys[b]) ||
          !qkv::fuzz::same_values(values[b], o.values[b])) {
        return false;
      }
    }
    return true;
  }
};

// A cache configuration: mostly small and valid, sometimes extreme (then
// only those whose byte count overflows or that are invalid, so that
// nothing huge is allocated).
bool fuzz_config(Input& in, KvCacheConfig& c) {
  static constexpr DType kStorage[] = {DType::f32, DType::f32, DType::bf16, DType::f16};
  c.batch = in.range(1, 3);
  c.kv_heads = in.range(1, 2);
  c.head_dim = in.size(16, 40);
  c.value_dim = in.coin() ? 0 : in.size(16, 40);
  c.capacity = in.range(1, 40);
  c.dtype = in.pick(kStorage);
  c.page_size = in.coin() ? 0 : in.range(1, 8);
  c.num_pages = in.coin() ? 0 : in.range(0, 20);
  if (in.one_in(10)) {
    std::int64_t* const fields[] = {&c.batch,    &c.kv_heads,  &c.head_dim, &c.value_dim,
                                    &c.capacity, &c.page_size, &c.num_pages};
    *fields[in.range(0, 6)] = in.extreme_int();
  }
  if (in.one_in(20)) c.dtype = qkv::fuzz::any_dtype(in);
  // Keys and values in their own storage, quantized ones mostly with dims
  // they accept; sometimes a value outside the enum.
  static constexpr KvStorage kOwn[] = {KvStorage::automatic, KvStorage::f32,  KvStorage::bf16,
                                       KvStorage::f16,       KvStorage::q8_0, KvStorage::q4_0};
  static constexpr std::int64_t kBlockDims[] = {32, 64};
  if (in.coin()) {
    c.key_storage = in.pick(kOwn);
    c.value_storage = in.pick(kOwn);
    if (qkv::cache::is_quantized(c.key_storage) && !in.one_in(8)) c.head_dim = in.pick(kBlockDims);
    if (qkv::cache::is_quantized(c.value_storage) && !in.one_in(8)) {
      c.value_dim = in.coin() ? 0 : in.pick(kBlockDims);
    }
    if (in.one_in(20)) c.value_storage = static_cast<KvStorage>(in.range(6, 255));
  }
  // The Hadamard rotation, mostly with the powers of two it needs.
  if (in.one_in(4)) {
    c.rotate = true;
    if (!in.one_in(8)) {
      c.head_dim = in.pick(kBlockDims);
      c.value_dim = in.coin() ? 0 : in.pick(kBlockDims);
    }
  }
  // A latent cache (MLA), mostly valid: one head, values a prefix of the keys.
  if (in.one_in(5)) {
    c.values_in_keys = true;
    if (!in.one_in(8)) {
      c.kv_heads = 1;
      c.rotate = false;
      c.value_storage = KvStorage::automatic;
      c.value_dim = in.coin() ? 0 : std::min(c.head_dim, in.pick(kBlockDims));
      if (qkv::cache::is_quantized(c.key_storage)) c.value_dim = c.head_dim == 64 ? 32 : 0;
    }
    // Its RoPE part unquantized, mostly where it may be.
    if (in.coin()) {
      c.tail_dim = in.one_in(8) ? in.extreme_int() : in.pick(kBlockDims) / 2;
      c.tail_storage = in.one_in(8) ? static_cast<KvStorage>(in.range(0, 255))
                                    : (in.coin() ? KvStorage::bf16 : KvStorage::f16);
    }
  }
  // Streaming, mostly valid: paged, capacity 0, sinks in whole pages.
  if (in.one_in(4)) {
    c.page_size = in.one_in(10) ? 0 : in.range(1, 6);
    c.capacity = in.one_in(10) ? in.range(1, 8) : 0;
    c.window_tokens = in.one_in(10) ? in.extreme_int() : in.range(1, 12);
    c.sink_tokens = in.one_in(10) ? in.extreme_int() : in.range(0, 2) * c.page_size;
  }
  // Bytes the storage would take, in long double (several fields may be
  // extreme at once); valid configurations above 64 MiB are skipped (they
  // are not errors, only slow).
  const auto positive = [](std::int64_t x) {
    return static_cast<long double>(std::max<std::int64_t>(x, 1));
  };
  const std::int64_t dv = c.value_dim == 0 ? c.head_dim : c.value_dim;
  const long double held =
      c.window_tokens > 0
          ? positive(c.sink_tokens) + positive(c.window_tokens) + positive(c.page_size)
          : positive(c.capacity);
  long double tokens = positive(c.batch) * held;
  if (c.page_size > 0) {
    const long double pages = c.num_pages > 0
                                  ? positive(c.num_pages)
                                  : positive(c.batch) * std::ceil(held / positive(c.page_size));
    tokens = pages * positive(c.page_size);
  }
  // Plus a length and a block table (a std::vector) per sequence.
  const long double bytes =
      tokens * positive(c.kv_heads) * (positive(c.head_dim) + positive(dv)) * 4 +
      positive(c.batch) * 32;
  return !(bytes > 0x1p26L && bytes < 0x1p63L);
}

// Appends fuzzed rows to every sequence (or to one); checks the outcome.
void fuzz_append(Input& in, KvCache& cache) {
  const KvCacheConfig& cfg = cache.config();
  const bool one = in.coin();
  // Sometimes more rows than any capacity here; but the inputs stay within
  // 2^24 values (a cache of 64 MiB can have a million one-row sequences,
  // and filling 64 rows each took minutes: slow, not wrong).
  std::int64_t rows = in.one_in(10) ? 64 : in.range(0, 6);
  if (!qkv::fuzz::small_enough({cfg.batch, rows, cfg.kv_heads, cfg.head_dim + cache.value_dim()},
                               std::int64_t{1} << 24)) {
    rows = std::min<std::int64_t>(rows, 1);
  }
  std::vector<std::int64_t> k_sizes{cfg.batch, rows, cfg.kv_heads, cfg.head_dim};
  std::vector<std::int64_t> v_sizes{cfg.batch, rows, cfg.kv_heads, cache.value_dim()};
  if (one) {
    k_sizes.erase(k_sizes.begin());
    v_sizes.erase(v_sizes.begin());
  }
  bool must_reject = false;
  // A latent cache takes no values (mostly none given).
  const bool no_values = cfg.values_in_keys && !in.one_in(8);
  if (cfg.values_in_keys && !no_values) must_reject = true;
  if (in.one_in(16)) {
    if (no_values) {
      k_sizes.back() += 1;  // alone, the keys' row count is theirs to choose
    } else {
      auto& sizes = in.coin() ? k_sizes : v_sizes;
      sizes[static_cast<std::size_t>(in.range(0, static_cast<std::int64_t>(sizes.size()) - 1))] +=
          1;
    }
    must_reject = true;
  }
  const DType dtype = qkv::fuzz::floating_dtype(in);
  qkv::fuzz::Values vals = qkv::fuzz::values(in, true);
  vals.infinities = true;
  Arg k = qkv::fuzz::make_input(in, k_sizes, dtype, vals);
  Arg v = no_values ? Arg{} : qkv::fuzz::make_input(in, v_sizes, dtype, vals);
  if (in.one_in(20)) {
    Arg& victim = in.coin() || cfg.values_in_keys ? k : v;
    const qkv::fuzz::BadView bad = qkv::fuzz::bad_view(in);
    const bool empty = victim.view.numel() == 0;
    qkv::fuzz::make_bad(in, victim, bad);
    must_reject = must_reject || bad == qkv::fuzz::BadView::undefined ||
                  bad == qkv::fuzz::BadView::overflow ||
                  (bad == qkv::fuzz::BadView::null_data && !empty);
  }
  qkv::RopeConfig rope;
  const bool with_rope = in.one_in(4);
  if (with_rope && cfg.values_in_keys) must_reject = true;
  if (with_rope) {
    rope.base = in.one_in(8) ? in.extreme_real() : 10000.0;
    rope.interleaved = in.coin();
    rope.rotary_dim = in.coin() ? 0 : in.param(0, cfg.head_dim);
  }
  std::vector<std::int64_t> counts;
  std::int64_t target = 0;
  if (one) {
    target = in.one_in(10) ? in.extreme_int() : in.range(0, cfg.batch - 1);
    must_reject = must_reject || target < 0 || target >= cfg.batch;
  } else if (in.coin()) {
    for (std::int64_t b = 0; b < cfg.batch; ++b) counts.push_back(in.range(0, rows));
    if (in.one_in(10)) {
      counts[static_cast<std::size_t>(in.range(0, cfg.batch - 1))] = in.extreme_int();
    }
    if (in.one_in(12)) counts.push_back(0);
  }
  for (std::size_t b = 0; b < counts.size(); ++b) {
    if (counts[b] < 0 || counts[b] > rows) must_reject = true;
  }
  if (!counts.empty() && counts.size() != static_cast<std::size_t>(cfg.batch)) must_reject = true;

  const CacheState before(cache);
  const qkv::fuzz::Snapshot inputs{&k, &v};
  const bool ok = qkv::fuzz::accepted("KvCache::append", [&] {
    if (one) {
      cache.append_to(target, k, v, with_rope ? &rope : nullptr);
    } else {
      cache.append(k, v, counts, with_rope ? &rope : nullptr);
    }
  });
  inputs.require_unchanged("KvCache::append (inputs)");
  if (!ok) {
    require(CacheState(cache) == before, "a rejected append changed the cache");
    return;
  }
  require(!must_reject, "KvCache::append accepted a call it must reject");
  const CacheState after(cache);
  for (std::int64_t b = 0; b < cfg.batch; ++b) {
    const auto i = static_cast<std::size_t>(b);
    const std::int64_t given = one ? (b == target ? rows : 0) : (counts.empty() ? rows : counts[i]);
    require(after.positions[i] == before.positions[i] + given,
            "append moved the position of sequence " + std::to_string(b) + " by " +
                std::to_string(after.positions[i] - before.positions[i]) + ", expected " +
                std::to_string(given));
    if (cfg.window_tokens > 0) {
      require(after.lengths[i] <= cfg.sink_tokens + cfg.window_tokens + cfg.page_size - 1,
              "a streaming sequence holds more than its sinks and window allow");
      require(after.lengths[i] >= std::min(after.positions[i], cfg.sink_tokens + cfg.window_tokens),
              "a streaming sequence dropped tokens of its window");
    }
  }
  // Streaming drops rows (tests/streaming_cache_test.cpp checks which).
  if (with_rope || cfg.rotate || cfg.window_tokens > 0) return;  // rows rotated on the way in
  // Each appended row is the input's row rounded once to the storage dtype.
  for (std::int64_t b = 0; b < cfg.batch; ++b) {
    const std::int64_t added =
        after.lengths[static_cast<std::size_t>(b)] - before.lengths[static_cast<std::size_t>(b)];
    const std::int64_t expected =
        one ? (b == target ? rows : 0)
            : (counts.empty() ? rows : counts[static_cast<std::size_t>(b)]);
    require(added == expected, "append added " + std::to_string(added) + " rows to sequence " +
                                   std::to_string(b) + ", expected " + std::to_string(expected));
    if (added == 0) continue;
    const std::int64_t start = before.lengths[static_cast<std::size_t>(b)];
    const ConstTensorView k_rows = one ? k.cview() : k.cview().slice(0, b, 1);
    // A latent cache's values are its keys' first value_dim.
    const ConstTensorView v_src = cfg.values_in_keys ? k.cview() : v.cview();
    const ConstTensorView v_rows = one ? v_src : v_src.slice(0, b, 1);
    const ConstTensorView k_in = one ? k_rows.slice(0, 0, added) : k_rows.slice(1, 0, added);
    ConstTensorView v_in = one ? v_rows.slice(0, 0, added) : v_rows.slice(1, 0, added);
    if (cfg.values_in_keys) v_in = v_in.slice(v_in.rank() - 1, 0, cache.value_dim());
    const Tensor k_stored = qkv::to_dtype(
        after.keys[static_cast<std::size_t>(b)].view().slice(1, start, added), DType::f64);
    const Tensor v_stored = qkv::to_dtype(
        after.values[static_cast<std::size_t>(b)].view().slice(1, start, added), DType::f64);
    const Tensor v_want = stored_as(v_in, cache.value_storage());
    // A key row's values before its tail in the key storage, the tail's in
    // its own.
    const std::int64_t tail = cfg.tail_dim, lead = cfg.head_dim - tail;
    const auto part = [&](ConstTensorView t, std::int64_t start, std::int64_t n) {
      return qkv::to_dtype(t.slice(t.rank() - 1, start, n), DType::f64);
    };
    for (const auto& [from, n, storage] : {std::tuple{std::int64_t{0}, lead, cache.key_storage()},
                                           std::tuple{lead, tail, cfg.tail_storage}}) {
      if (n == 0) continue;
      const Tensor got = part(k_stored.view(), from, n);
      const Tensor want = stored_as(part(k_in, from, n).view(), storage);
      const double* x = static_cast<const double*>(got.view().data());
      const double* y = static_cast<const double*>(want.view().data());
      for (std::int64_t i = 0; i < added * cfg.kv_heads * n; ++i) {
        require(x[i] == y[i] || (std::isnan(x[i]) && std::isnan(y[i])),
                "an appended key is not its input rounded once");
      }
    }
    for (std::int64_t i = 0; i < added * cfg.kv_heads * cache.value_dim(); ++i) {
      const double* x = static_cast<const double*>(v_stored.view().data());
      const double* y = static_cast<const double*>(v_want.view().data());
      require(x[i] == y[i] || (std::isnan(x[i]) && std::isnan(y[i])),
              "an appended value is not its input rounded once");
    }
  }
}

void fuzz_release(Input& in, KvCache& cache) {
  const std::int64_t b = in.one_in(6) ? in.extreme_int() : in.range(0, cache.config().batch - 1);
  const CacheState before(cache);
  const bool ok = qkv::fuzz::accepted("KvCache::release", [&] { cache.release(b); });
  const bool valid = b >= 0 && b < cache.config().batch;
  require(ok == valid, "KvCache::release(" + std::to_string(b) +
                           ") accepted=" + std::to_string(ok) + " for batch " +
                           std::to_string(cache.config().batch));
  if (!ok) {
    require(CacheState(cache) == before, "a rejected release changed the cache");
    return;
  }
  require(cache.length(b) == 0, "release left rows in the sequence");
}

// Whether every stored key and value is finite.
bool cache_finite(const CacheState& s) {
  for (std::size_t b = 0; b < s.keys.size(); ++b) {
    if (!qkv::fuzz::all_finite(s.keys[b]) || !qkv::fuzz::all_finite(s.values[b])) return false;
  }
  return true;
}

// The reference for sequence b: the causal forward (bottom-right) of its
// queries over its cached rows, in double, and the naive computation in f32.
struct SequenceCheck {
  double err_fast = 0, err_naive = 0, max_ref = 0, lse_fast = 0, lse_naive = 0;
  int mismatches = 0;        // decode's non-finite values that are not the reference's
  int naive_mismatches = 0;  // the naive computation's
};

void check_sequence(const KvCache& cache, const CacheState& state, std::int64_t b,
                    ConstTensorView q, ConstTensorView out, ConstTensorView lse,
                    const AttentionOptions& decode_opt, SequenceCheck& acc) {
  const std::int64_t n = q.size(1), hq = q.size(2);
  AttentionOptions opt = decode_opt;
  opt.causal = true;
  opt.align = qkv::Align::bottom_right;
  opt.return_lse = true;
  if (decode_opt.alibi_slopes.size() == static_cast<std::size_t>(cache.config().batch * hq)) {
    opt.alibi_slopes = decode_opt.alibi_slopes.subspan(static_cast<std::size_t>(b * hq),
                                                       static_cast<std::size_t>(hq));
  }
  const Tensor q32 = qkv::to_dtype(q.slice(0, b, 1), DType::f32);
  const Tensor k32 = qkv::to_dtype(state.keys[static_cast<std::size_t>(b)], DType::f32);
  const Tensor v32 = qkv::to_dtype(state.values[static_cast<std::size_t>(b)], DType::f32);
  AttentionOptions ref_opt = opt;
  ref_opt.backend = qkv::Backend::reference;
  const qkv::AttentionResult ref =
      qkv::attention(qkv::test::f64(q32), qkv::test::f64(k32), qkv::test::f64(v32), ref_opt);
  const qkv::detail::AttentionProblem problem =
      qkv::detail::check_attention_inputs(q32, k32, v32, opt);
  const std::int64_t out_sizes[] = {1, n, hq, v32.size(3)};
  const std::int64_t lse_sizes[] = {1, hq, n};
  Tensor naive(DType::f32, out_sizes), naive_lse(DType::f32, lse_sizes);
  qkv::reference::naive_attention(problem, q32, k32, v32, {naive, naive_lse, {}}, ref_opt,
                                  DType::f32);
  const ConstTensorView out_b = out.slice(0, b, 1);
  acc.err_fast = std::max(acc.err_fast, qkv::test::finite_diff(out_b, ref.out, &acc.mismatches));
  acc.err_naive =
      std::max(acc.err_naive, qkv::test::finite_diff(naive, ref.out, &acc.naive_mismatches));
  acc.max_ref = std::max(acc.max_ref, qkv::test::max_abs([&] {
                           Tensor t = ref.out;
                           qkv::detail::for_each_index(t.sizes(), 4, [&](const qkv::Shape& i) {
                             if (!std::isfinite(t.get({i[0], i[1], i[2], i[3]}))) {
                               t.set({i[0], i[1], i[2], i[3]}, 0);
                             }
                           });
                           return t;
                         }()));
  if (lse.defined()) {
    acc.lse_fast = std::max(acc.lse_fast,
                            qkv::test::finite_diff(lse.slice(0, b, 1), ref.lse, &acc.mismatches));
    acc.lse_naive =
        std::max(acc.lse_naive, qkv::test::finite_diff(naive_lse, ref.lse, &acc.naive_mismatches));
  }
}

// Decodes n rows per sequence with fuzzed options and outputs.
void fuzz_decode(Input& in, KvCache& cache) {
  const KvCacheConfig& cfg = cache.config();
  const std::int64_t group = in.range(1, 3);
  const std::int64_t hq = in.one_in(16) ? cfg.kv_heads * group + 1 : cfg.kv_heads * group;
  std::int64_t shortest = qkv::fuzz::kMax64;
  for (std::int64_t b = 0; b < cfg.batch; ++b) shortest = std::min(shortest, cache.length(b));
  const std::int64_t n =
      in.one_in(10) ? in.range(0, 20)
                    : in.range(1, std::max<std::int64_t>(std::min(shortest, kMaxDecodeRows), 1));
  std::string must_reject;
  if (hq % cfg.kv_heads != 0) must_reject = "Hq not a multiple of Hkv";
  if (n < 1 || n > kMaxDecodeRows) must_reject = "n = " + std::to_string(n);
  if (n > shortest) must_reject = "a sequence shorter than n";

  static constexpr DType kTypes[] = {DType::f32, DType::f32, DType::bf16, DType::f16, DType::f64};
  const DType dtype = in.pick(kTypes);
  std::int64_t dk = cfg.head_dim;
  if (in.one_in(20)) {
    dk += 1;
    must_reject = "Dk that is not the cache's";
  }
  const qkv::fuzz::Values vq = qkv::fuzz::values(in, true, dtype == DType::f16 ? 8.0 : 1e4);
  Arg q = qkv::fuzz::make_input(in, {cfg.batch, n, hq, dk}, dtype, vq);

  AttentionOptions opt;
  std::vector<float> slopes, sinks, scales;
  static constexpr qkv::Backend kBackends[] = {qkv::Backend::automatic, qkv::Backend::fast,
                                               qkv::Backend::reference};
  opt.backend = in.pick(kBackends);
  if (opt.backend == qkv::Backend::fast && dtype == DType::f64) must_reject = "fast with f64";
  bool comparable = true;
  if (in.one_in(3)) {
    static constexpr double kScales[] = {1.0, 0.5, 0.0, -1.0, 2.0, 0.01};
    const double s = in.one_in(6) ? in.extreme_real() : in.pick(kScales);
    opt.scale = s;
    if (!std::isfinite(s)) must_reject = "scale " + std::to_string(s);
    if (std::fabs(s) > 1e3) comparable = false;
  }
  if (in.one_in(4)) {
    static constexpr double kCaps[] = {1.0, 5.0, 30.0, 0.5};
    const double cap = in.one_in(4) ? in.extreme_real() : in.pick(kCaps);
    opt.softcap = cap;
    if (!(cap >= 0.0) || !std::isfinite(cap)) must_reject = "softcap " + std::to_string(cap);
    if (cap != 0.0 && (cap < 1e-30 || cap > 1e30)) comparable = false;
  }
  if (in.one_in(4)) {
    const std::int64_t count = in.coin() ? hq : cfg.batch * hq;
    qkv::fuzz::SplitMix gen(in.u64());
    for (std::int64_t h = 0; h < count; ++h) slopes.push_back(static_cast<float>(gen.symmetric()));
    if (in.one_in(6) && !slopes.empty()) {
      const double x = in.extreme_real();
      slopes[static_cast<std::size_t>(in.range(0, count - 1))] = static_cast<float>(x);
      if (!std::isfinite(static_cast<float>(x))) must_reject = "non-finite ALiBi slope";
      if (std::fabs(x) > 1e3) comparable = false;
    }
    if (in.one_in(12)) {
      // Neither Hq nor B * Hq slopes.
      slopes.resize(static_cast<std::size_t>(hq + cfg.batch * hq + 1), 0.5f);
      must_reject = "ALiBi slope count";
    }
    opt.alibi_slopes = slopes;
  }
  if (in.one_in(5)) {
    qkv::fuzz::SplitMix gen(in.u64());
    for (std::int64_t h = 0; h < hq; ++h) {
      sinks.push_back(in.one_in(5) ? -std::numeric_limits<float>::infinity()
                                   : static_cast<float>(4 * gen.symmetric()));
    }
    if (in.one_in(10)) {
      sinks.push_back(0.0f);
      must_reject = "sink count";
    }
    opt.sinks = sinks;
  }
  if (in.one_in(6)) {
    qkv::fuzz::SplitMix gen(in.u64());
    for (std::int64_t h = 0; h < hq; ++h) scales.push_back(static_cast<float>(2 * gen.symmetric()));
    if (in.one_in(10)) {
      scales.push_back(1.0f);
      must_reject = "score_scale count";
    }
    opt.score_scale = scales;
    opt.score_scale_log_n = in.coin();
  }
  if (in.one_in(4)) {
    opt.window_left = in.param(-1, 20);
    if (opt.window_left < -1) must_reject = "window_left below -1";
  }
  if (in.one_in(5)) {
    // Patterns of positions; block layouts read query rows, which decode
    // rejects. Factories that reject their parameters leave the pattern off.
    const std::int64_t kind = in.range(0, 3);
    qkv::fuzz::accepted("sparse pattern factory", [&] {
      switch (kind) {
        case 0:
          opt.sparse = qkv::SparsePattern::window(in.param(-1, 12), 0) |
                       qkv::SparsePattern::global_tokens({in.param(0, 8)});
          break;
        case 1:
          opt.sparse = qkv::SparsePattern::prefix_lm(in.param(0, 40));
          break;
        case 2:
          opt.sparse = qkv::SparsePattern::strided(in.param(1, 6));
          break;
        default:
          opt.sparse = qkv::SparsePattern::block_sparse({1, 1, 1, 64, {1}});
          must_reject = "a block layout";
          break;
      }
    });
  }
  // Options that do not apply to decoding.
  Arg mask;
  std::vector<std::int64_t> lengths;
  if (in.one_in(16)) {
    switch (in.range(0, 5)) {
      case 0:
        mask = qkv::fuzz::make_input(in, {1}, DType::boolean, {});
        opt.mask = mask.view;
        break;
      case 1:
        opt.dropout_p = 0.5;
        break;
      case 2:
        lengths.assign(static_cast<std::size_t>(cfg.batch), 1);
        opt.key_lengths = lengths;
        break;
      case 3:
        opt.score = qkv::Score::additive;
        break;
      case 4:
        opt.score_mod = [](double s, std::int64_t, std::int64_t, std::int64_t, std::int64_t) {
          return s;
        };
        break;
      default:
        opt.score = static_cast<qkv::Score>(in.range(3, 255));
        break;
    }
    must_reject = "an option decoding does not take";
  }
  if (in.one_in(24)) {
    opt.backend = static_cast<qkv::Backend>(in.range(3, 255));
    must_reject = "out-of-range backend";
  }
  if (in.one_in(3)) opt.matmul_precision = qkv::MatmulPrecision::medium;
  if (in.one_in(24)) {
    opt.matmul_precision = static_cast<qkv::MatmulPrecision>(in.range(3, 255));
    must_reject = "out-of-range matmul_precision";
  }
  if (opt.score == qkv::Score::dot && opt.scale.has_value()) must_reject = "dot with a scale";

  const bool into = in.coin();
  Arg out, lse;
  if (into) {
    const std::int64_t dv = cache.value_dim();
    out = qkv::fuzz::make_output(in, {cfg.batch, n, hq, dv}, dtype);
    if (in.coin()) {
      lse = qkv::fuzz::make_output(in, {cfg.batch, hq, n},
                                   dtype == DType::f64 ? DType::f64 : DType::f32);
    }
    if (in.one_in(10)) {
      Arg& victim = lse.view.defined() && in.coin() ? lse : out;
      switch (in.range(0, 2)) {
        case 0: {
          const bool empty = victim.view.numel() == 0;
          const qkv::fuzz::BadView bad = qkv::fuzz::bad_view(in);
          qkv::fuzz::make_bad(in, victim, bad);
          if (bad == qkv::fuzz::BadView::overflow || victim.aliased ||
              (bad == qkv::fuzz::BadView::undefined && &victim == &out) ||
              (bad == qkv::fuzz::BadView::null_data && !empty)) {
            must_reject = "bad output view";
          }
          break;
        }
        case 1:
          qkv::fuzz::alias_into(victim, &victim == &out ? q : out);
          if (victim.aliased) must_reject = "output aliasing";
          break;
        default: {
          std::vector<std::int64_t> sizes(victim.view.size_span().begin(),
                                          victim.view.size_span().end());
          sizes.back() += 1;
          victim = qkv::fuzz::make_output(in, sizes, victim.view.dtype());
          must_reject = "output of the wrong sizes";
          break;
        }
      }
    }
  } else {
    opt.return_lse = in.coin();
  }

  const CacheState state(cache);
  const qkv::fuzz::Snapshot inputs{&q, &mask};
  const qkv::fuzz::Snapshot outputs{&out, &lse};
  qkv::AttentionResult r;
  const bool ok = qkv::fuzz::accepted("decode_attention", [&] {
    if (into) {
      qkv::decode_attention_into(q, cache, out, lse, opt);
    } else {
      r = qkv::decode_attention(q, cache, opt);
    }
  });
  inputs.require_unchanged("decode_attention (inputs)");
  require(CacheState(cache) == state, "decode_attention changed the cache");
  if (!ok) {
    outputs.require_unchanged("decode_attention that threw (outputs)");
    return;
  }
  require(must_reject.empty(), "decode_attention accepted " + must_reject);
  require(qkv::fuzz::gaps_untouched(out) && qkv::fuzz::gaps_untouched(lse),
          "decode_attention wrote outside an output view");
  const ConstTensorView o = into ? out.cview() : ConstTensorView(r.out);
  const ConstTensorView l = into ? lse.cview() : ConstTensorView(r.lse);
  const bool finite = q.finite && cache_finite(state) && comparable;
  if (finite) {
    qkv::fuzz::require_finite(o, "decode out");
    qkv::fuzz::require_finite(l, "decode lse", true);
  }
  if (!qkv::fuzz::small_enough({cfg.batch, hq, n, cfg.capacity, cfg.head_dim + cache.value_dim()},
                               200000)) {
    return;
  }
  // The same call on another thread count, allocating: bitwise equal.
  qkv::fuzz::fuzz_threads(in);
  AttentionOptions again = opt;
  again.return_lse = l.defined();
  const qkv::AttentionResult r2 = qkv::decode_attention(q, cache, again);
  require(qkv::fuzz::same_values(o, r2.out) && (!l.defined() || qkv::fuzz::same_values(l, r2.lse)),
          "decode differs for another thread count or the allocating call");
  // A rotated cache's rows are what the kernel reads after rotating the
  // queries, not the keys the reference would take (the unit tests compare
  // those through the reference decode, which un-rotates in double).
  if (!comparable || dtype == DType::f64 || cfg.rotate) return;
  SequenceCheck acc;
  for (std::int64_t b = 0; b < cfg.batch; ++b) {
    check_sequence(cache, state, b, q, o, l, opt, acc);
  }
  // Non-finite inputs too: a non-finite decode result is the reference's own
  // (the call is recomputed by it), and a finite one must not hide a NaN row.
  require(acc.mismatches == 0, "decode: infinities or NaNs differ from the reference");
  if (!finite) return;
  require(acc.naive_mismatches == 0, "naive decode: infinities or NaNs differ from the reference");
  // medium may round the queries and weights to bf16: its error model is
  // tests/bf16_dot_test.cpp's, not the f32 policy below.
  if (opt.matmul_precision == qkv::MatmulPrecision::medium &&
      (cache.key_storage() == qkv::KvStorage::bf16 ||
       cache.value_storage() == qkv::KvStorage::bf16)) {
    return;
  }
  // The tolerance policy holds statistically: enough outputs and keys, and
  // scores of moderate size (as in fuzz_attention).
  double max_k = 0.0;
  for (const Tensor& k : state.keys) max_k = std::max(max_k, qkv::test::max_abs(k));
  const double scale = opt.scale.value_or(1.0 / std::sqrt(static_cast<double>(cfg.head_dim)));
  const double scores =
      std::fabs(scale) * static_cast<double>(cfg.head_dim) * qkv::test::max_abs(q.cview()) * max_k;
  if (cfg.batch * n * hq * cache.value_dim() < 512 || shortest < 16 || scores > 32.0) return;
  const double floor = qkv::test::unit_roundoff(dtype) * acc.max_ref;
  require(acc.err_fast <= 2 * acc.err_naive + floor,
          "decode error " + std::to_string(acc.err_fast) + " above 2 x naive " +
              std::to_string(acc.err_naive) + " + " + std::to_string(floor));
}

// apply_rope then apply_rope_backward gives back x (both rotate by the same
// angles computed in double; f64 views, so rounding is at the level of ulps).
void fuzz_rope(Input& in) {
  const std::int64_t b = in.range(1, 2), n = in.range(0, 5), h = in.range(1, 2),
                     d = in.range(1, 12);
  const DType dtype = in.coin() ? DType::f64 : qkv::fuzz::floating_dtype(in);
  Arg x = qkv::fuzz::make_input(in, {b, n, h, d}, dtype, qkv::fuzz::values(in, false));
  if (x.aliased || in.one_in(3))
    x = [&] {
      Arg y = qkv::fuzz::make_output(in, {b, n, h, d}, dtype);
      qkv::fuzz::fill_values(in, y, qkv::fuzz::values(in, false));
      return y;
    }();
  std::vector<std::int64_t> starts;
  for (std::int64_t i = 0; i < b; ++i)
    starts.push_back(in.one_in(6) ? in.extreme_int() : in.range(0, 100000));
  if (in.one_in(12)) starts.push_back(0);
  qkv::RopeConfig rope;
  rope.base = in.one_in(8) ? in.extreme_real() : 10000.0;
  rope.interleaved = in.coin();
  rope.rotary_dim = in.coin() ? 0 : in.param(0, d);
  const Tensor before = qkv::to_dtype(x.cview(), DType::f64);
  const qkv::fuzz::Snapshot snap{&x};
  const bool ok = qkv::fuzz::accepted("apply_rope", [&] { qkv::apply_rope(x, starts, rope); });
  if (!ok) {
    snap.require_unchanged("apply_rope that threw");
    return;
  }
  require(qkv::fuzz::gaps_untouched(x), "apply_rope wrote outside its view");
  if (x.aliased) return;
  require(qkv::fuzz::all_finite(x), "apply_rope made a finite input non-finite");
  if (dtype != DType::f64) return;
  const bool back = qkv::fuzz::accepted("apply_rope_backward",
                                        [&] { qkv::apply_rope_backward(x, starts, rope); });
  require(back, "apply_rope_backward rejected what apply_rope accepted");
  const double tol = 16 * 0x1p-53 * std::max(qkv::test::max_abs(before), 1e-300);
  require(qkv::test::max_abs_diff(x.cview(), before) <= tol,
          "apply_rope_backward does not undo apply_rope");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Input in(data, size);
  qkv::fuzz::fuzz_threads(in);
  if (in.one_in(6)) {
    fuzz_rope(in);
    return 0;
  }
  KvCacheConfig cfg;
  if (!fuzz_config(in, cfg)) return 0;
  std::unique_ptr<KvCache> cache;
  if (!qkv::fuzz::accepted("KvCache", [&] { cache = std::make_unique<KvCache>(cfg); })) return 0;
  for (int step = 0; step < 8 && in.fdp().remaining_bytes() > 0; ++step) {
    switch (in.range(0, 5)) {
      case 0:
      case 1:
      case 2:
        fuzz_append(in, *cache);
        break;
      case 3:
        fuzz_release(in, *cache);
        break;
      default:
        fuzz_decode(in, *cache);
        break;
    }
  }
  return 0;
}
