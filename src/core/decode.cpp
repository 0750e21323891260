// Entry points of qkv::decode_attention: validate, then run the decode
// kernels, or for the reference backend (and f64 queries) the reference
// attention on the cache gathered into dense tensors.
#include "qkv/decode.hpp"

#include <cstring>
#include <string>
#include <vector>

#include "core/elements.hpp"
#include "cpu/decode.hpp"

namespace qkv {
namespace {

using Reasons = std::vector<std::string>;
using std::to_string;

// The longest query block decode handles; longer ones are a prefill, which
// qkv::attention runs on dense tensors.
constexpr std::int64_t kMaxNewTokens = 16;

void check_decode(ConstTensorView q, const KvCache& cache, ConstTensorView out, ConstTensorView lse,
                  const AttentionOptions& o, Reasons& r) {
  const KvCacheConfig& c = cache.config();
  if (!q.defined() || q.rank() != 4) {
    r.push_back("q: expected a rank-4 tensor [B, n, Hq, Dk]");
    return;
  }
  if (!is_floating(q.dtype())) r.push_back("q: expected dtype f32, f64, f16 or bf16");
  const std::int64_t b = q.size(0), n = q.size(1), hq = q.size(2), dk = q.size(3);
  if (b != c.batch) {
    r.push_back("q: expected batch size (dim 0) " + to_string(c.batch) +
                " to match the cache, got " + to_string(b));
  }
  if (n < 1 || n > kMaxNewTokens) {
    r.push_back("q: expected 1 to " + to_string(kMaxNewTokens) + " new tokens (dim 1), got " +
                to_string(n) + " (use qkv::attention for longer query blocks)");
  }
  if (hq < 1 || hq % c.kv_heads != 0) {
    r.push_back("q: query heads Hq = " + to_string(hq) +
                " must be a positive multiple of the cache's KV heads " + to_string(c.kv_heads));
  }
  if (dk != c.head_dim) {
    r.push_back("q: expected head dim (dim 3) " + to_string(c.head_dim) +
                " to match the cache, got " + to_string(dk));
  }
  for (std::int64_t s = 0; s < std::min(b, c.batch); ++s) {
    if (cache.length(s) < n) {
      r.push_back("cache: sequence " + to_string(s) + " holds " + to_string(cache.length(s)) +
                  " tokens, fewer than the " + to_string(n) +
                  " new queries (append their keys and values first)");
    }
  }
  const auto check_view = [&](const char* name, ConstTensorView t, std::vector<std::int64_t> sizes,
                              DType dtype) {
    if (!t.defined()) return;
    bool ok = t.rank() == static_cast<int>(sizes.size());
    for (std::size_t d = 0; ok && d < sizes.size(); ++d)
      ok = t.size(static_cast<int>(d)) == sizes[d];
    if (!ok) r.push_back(std::string(name) + ": expected sizes " + shape_string(sizes));
    if (t.dtype() != dtype) {
      r.push_back(std::string(name) + ": expected dtype " + std::string(dtype_name(dtype)));
    }
  };
  const DType stat = q.dtype() == DType::f64 ? DType::f64 : DType::f32;
  check_view("out", out, {b, n, hq, cache.value_dim()}, q.dtype());
  check_view("lse", lse, {b, hq, n}, stat);
  // What decode does not take.
  if (o.mask.defined()) r.push_back("options.mask: not supported by decode_attention");
  if (!o.key_lengths.empty()) {
    r.push_back(
        "options.key_lengths: not supported by decode_attention (the cache's lengths apply)");
  }
  if (!o.cu_seqlens_q.empty() || !o.cu_seqlens_k.empty()) {
    r.push_back("options.cu_seqlens_q/k: not supported by decode_attention");
  }
  if (o.relative_bias.table.defined()) {
    r.push_back("options.relative_bias: not supported by decode_attention");
  }
  if (o.score_mod || o.mask_mod) {
    r.push_back("options.score_mod/mask_mod: not supported by decode_attention");
  }
  if (o.sparse.defined()) {
    r.push_back("options.sparse: not supported by decode_attention");
  }
  if (o.score == Score::additive)
    r.push_back("options.score: Score::additive is not supported by decode_attention");
  if (o.dropout_p != 0.0) r.push_back("options.dropout_p: decoding has no dropout");
  if (o.window_right >= 0) {
    r.push_back("options.window_right: decode queries see no keys after them (causal)");
  }
  if (o.window_left < -1) r.push_back("options.window_left: expected -1 or a size >= 0");
  if (!(o.softcap >= 0.0)) r.push_back("options.softcap: expected 0 (off) or > 0");
  if (!o.alibi_slopes.empty() && static_cast<std::int64_t>(o.alibi_slopes.size()) != hq &&
      static_cast<std::int64_t>(o.alibi_slopes.size()) != b * hq) {
    r.push_back("options.alibi_slopes: expected Hq or B * Hq slopes");
  }
  if (o.backend == Backend::fast && q.dtype() == DType::f64) {
    r.push_back("options.backend: Backend::fast takes f32, f16 or bf16 queries, got f64");
  }
}

// The reference: the cache gathered into dense [B, Lmax, Hkv, D] tensors and
// qkv::attention with causal bottom-right alignment and the cache's lengths
// as key lengths, which is exactly decode's definition.
void reference_decode(ConstTensorView q, const KvCache& cache, TensorView out, TensorView lse,
                      const AttentionOptions& o) {
  const KvCacheConfig& c = cache.config();
  std::int64_t longest = 0;
  for (std::int64_t b = 0; b < c.batch; ++b) longest = std::max(longest, cache.length(b));
  Tensor k(c.dtype, {c.batch, longest, c.kv_heads, c.head_dim});
  Tensor v(c.dtype, {c.batch, longest, c.kv_heads, cache.value_dim()});
  const std::int64_t ps = cache.page_size();
  const std::size_t elem = c.dtype == DType::f32 ? 4 : 2;
  const std::size_t k_row = static_cast<std::size_t>(c.kv_heads * c.head_dim) * elem;
  const std::size_t v_row = static_cast<std::size_t>(c.kv_heads * cache.value_dim()) * elem;
  for (std::int64_t b = 0; b < c.batch; ++b) {
    for (std::int64_t j = 0; j < cache.length(b); ++j) {
      const auto* kp = static_cast<const std::uint8_t*>(cache.key_page(b, j / ps));
      const auto* vp = static_cast<const std::uint8_t*>(cache.value_page(b, j / ps));
      std::memcpy(static_cast<std::uint8_t*>(k.view().data()) + (b * longest + j) * k_row,
                  kp + (j % ps) * k_row, k_row);
      std::memcpy(static_cast<std::uint8_t*>(v.view().data()) + (b * longest + j) * v_row,
                  vp + (j % ps) * v_row, v_row);
    }
  }
  AttentionOptions opt = o;
  opt.causal = true;
  opt.align = Align::bottom_right;
  opt.key_lengths = cache.lengths();
  opt.backend = Backend::reference;
  // In f64 (the reference reads everything as double anyway), rounded once
  // into out.
  Tensor out64(DType::f64, out.size_span());
  Tensor lse64(DType::f64, {q.size(0), q.size(2), q.size(1)});
  attention_into(to_dtype(q, DType::f64), to_dtype(k, DType::f64), to_dtype(v, DType::f64),
                 {out64, lse64, {}}, opt);
  detail::for_each_index(out.sizes(), 4, [&](const Shape& i) {
    out.set({i[0], i[1], i[2], i[3]}, out64.get({i[0], i[1], i[2], i[3]}));
  });
  if (!lse.defined()) return;
  detail::for_each_index(lse.sizes(), 3, [&](const Shape& i) {
    lse.set({i[0], i[1], i[2]}, lse64.get({i[0], i[1], i[2]}));
  });
}

void run(ConstTensorView q, const KvCache& cache, TensorView out, TensorView lse,
         const AttentionOptions& o) {
  Reasons r;
  check_decode(q, cache, out, lse, o, r);
  if (!r.empty()) throw Error(r);
  if (o.backend == Backend::reference || q.dtype() == DType::f64) {
    reference_decode(q, cache, out, lse, o);
    return;
  }
  cpu::DecodePlan plan = cpu::make_decode_plan(cache, o, q, out, lse);
  cpu::decode(plan);
}

}  // namespace

AttentionResult decode_attention(ConstTensorView q, const KvCache& cache,
                                 const AttentionOptions& options) {
  AttentionResult result;
  if (q.defined() && q.rank() == 4) {
    result.out = Tensor(q.dtype(), {q.size(0), q.size(1), q.size(2), cache.value_dim()});
    if (options.return_lse) {
      result.lse = Tensor(q.dtype() == DType::f64 ? DType::f64 : DType::f32,
                          {q.size(0), q.size(2), q.size(1)});
    }
  }
  run(q, cache, result.out, result.lse.view(), options);
  return result;
}

void decode_attention_into(ConstTensorView q, const KvCache& cache, TensorView out, TensorView lse,
                           const AttentionOptions& options) {
  if (!out.defined()) throw Error(std::string("out: required tensor is undefined"));
  run(q, cache, out, lse, options);
}

}  // namespace qkv
