// Entry points of qkv::decode_attention: validate, then run the decode
// kernels, or for the reference backend (and f64 queries) the reference
// attention on the cache gathered into dense tensors.
#include "qkv/decode.hpp"

#include <cstddef>
#include <string>
#include <vector>

#include "api/validate.hpp"
#include "cache/formats.hpp"
#include "cache/view.hpp"
#include "core/capabilities.hpp"
#include "core/elements.hpp"
#include "core/hadamard.hpp"
#include "core/query_maps.hpp"
#include "core/sparse.hpp"
#include "cpu/decode.hpp"

namespace qkv {
namespace {

using detail::Reasons;
using std::to_string;

// The longest query block decode handles; longer ones are a prefill, which
// qkv::attention runs on dense tensors.
constexpr std::int64_t kMaxNewTokens = 16;

// What decode does not take: the capability table's refusals, then the
// values it cannot honour.
void check_unsupported(const AttentionOptions& o, Reasons& r) {
  detail::refuse_unsupported(detail::Path::decode, o, "decode_attention", "", r);
  if (detail::uses_query_rows(o.sparse)) {
    r.push_back(
        "options.sparse: block layouts index query rows, which decode_attention does not have "
        "(patterns of positions, such as windows, global tokens and prefix_lm, are supported)");
  }
  if (o.score == Score::additive) {
    r.push_back("options.score: Score::additive is not supported by decode_attention");
  }
}

// The shape of a validated decode call.
struct DecodeShape {
  std::int64_t batch = 0, n = 0, hq = 0, dv = 0;
  DType dtype = DType::f32, stat_dtype = DType::f32;
  double scale = 1.0;  // multiplies <q, k>
};

// Checks q, the options and (when given) out and lse, before anything is
// allocated or written; throws qkv::Error listing every problem.
DecodeShape check_decode(ConstTensorView q, const KvCache& cache, const TensorView* out,
                         ConstTensorView lse, const AttentionOptions& o) {
  const KvCacheConfig& c = cache.config();
  Reasons r;
  detail::check_scalar_options(o, r);
  check_unsupported(o, r);
  DecodeShape shape;
  if (!detail::check_view("q", q, {.rank = 4, .layout = "[B, n, Hq, Dk]", .floating = true}, r)) {
    detail::throw_if(r);
  }
  shape = {q.size(0),         q.size(1), q.size(2),
           cache.value_dim(), q.dtype(), q.dtype() == DType::f64 ? DType::f64 : DType::f32};
  const std::int64_t dk = q.size(3);
  if (shape.batch != c.batch) {
    r.push_back("q: expected batch size (dim 0) " + to_string(c.batch) +
                " to match the cache, got " + to_string(shape.batch));
  }
  if (shape.n < 1 || shape.n > kMaxNewTokens) {
    r.push_back("q: expected 1 to " + to_string(kMaxNewTokens) + " new tokens (dim 1), got " +
                to_string(shape.n) + " (use qkv::attention for longer query blocks)");
  }
  if (shape.hq < 1 || shape.hq % c.kv_heads != 0) {
    r.push_back("q: expected query heads Hq (dim 2) a positive multiple of the cache's KV heads " +
                to_string(c.kv_heads) + ", got " + to_string(shape.hq));
  }
  if (dk != c.head_dim) {
    r.push_back("q: expected head dim (dim 3) " + to_string(c.head_dim) +
                " to match the cache, got " + to_string(dk));
  }
  for (std::int64_t s = 0; s < std::min(shape.batch, c.batch); ++s) {
    if (cache.length(s) < shape.n) {
      r.push_back("cache: sequence " + to_string(s) + " holds " + to_string(cache.length(s)) +
                  " tokens, fewer than the " + to_string(shape.n) +
                  " new queries (append their keys and values first)");
    }
  }
  shape.scale = detail::check_scale(o, dk, r);
  detail::check_alibi(o, shape.hq, shape.batch, false, r);
  detail::check_sinks(o, shape.hq, r);
  detail::check_query_maps(o, shape.hq, r);
  detail::check_fast_dtype(o.backend, shape.dtype, r);
  if (out != nullptr) {
    detail::Aliasing aliasing;
    aliasing.input("q", q);
    const std::int64_t out_sizes[] = {shape.batch, shape.n, shape.hq, shape.dv};
    const std::int64_t lse_sizes[] = {shape.batch, shape.hq, shape.n};
    detail::check_output("out", *out, {.sizes = out_sizes, .dtype = shape.dtype}, aliasing, r);
    if (lse.defined()) {
      detail::check_output("lse", lse, {.sizes = lse_sizes, .dtype = shape.stat_dtype}, aliasing,
                           r);
    }
  }
  detail::throw_if(r);
  return shape;
}

// The reference: the cache gathered into dense f32 [B, Lmax, Hkv, D] tensors
// (every storage widens to f32 exactly: cache/formats.hpp; a rotated cache's
// rows turned back by the Hadamard transform, in double) and
// qkv::attention with causal bottom-right alignment and the cache's lengths
// as key lengths, which is exactly decode's definition.
void reference_decode(ConstTensorView q, const KvCache& cache, TensorView out, TensorView lse,
                      const AttentionOptions& o) {
  const KvCacheConfig& c = cache.config();
  std::int64_t longest = 0;
  for (std::int64_t b = 0; b < c.batch; ++b) longest = std::max(longest, cache.length(b));
  const std::int64_t hkv = c.kv_heads, dk = c.head_dim, dv = cache.value_dim();
  Tensor k(DType::f32, {c.batch, longest, hkv, dk});
  Tensor v(DType::f32, {c.batch, longest, hkv, dv});
  const std::int64_t ps = cache.page_size();
  // Bytes of one head's stored key row and value row (a latent cache's: its
  // key row); a key row with a tail (KvCacheConfig::tail_dim) holds its last
  // values from byte k_main, past the blocks.
  const std::int64_t k_head = cache.key_token_bytes() / hkv;
  const std::int64_t v_stride = cache.value_token_bytes() / hkv;
  const std::int64_t tail = c.tail_dim, k_main = stored_bytes(cache.key_storage(), dk - tail);
  auto* kd = static_cast<float*>(k.view().data());
  auto* vd = static_cast<float*>(v.view().data());
  for (std::int64_t b = 0; b < c.batch; ++b) {
    for (std::int64_t j = 0; j < cache.length(b); ++j) {
      const auto* kp = static_cast<const std::byte*>(cache.key_page(b, j / ps));
      const auto* vp = static_cast<const std::byte*>(cache.value_page(b, j / ps));
      for (std::int64_t h = 0; h < hkv; ++h) {
        const std::byte* key_row = kp + ((j % ps) * hkv + h) * k_head;
        float* key_out = kd + ((b * longest + j) * hkv + h) * dk;
        cache::dequantize_row(cache.key_storage(), key_row, dk - tail, key_out);
        if (tail > 0) {
          cache::dequantize_row(c.tail_storage, key_row + k_main, tail, key_out + dk - tail);
        }
        cache::dequantize_row(cache.value_storage(), vp + ((j % ps) * hkv + h) * v_stride, dv,
                              vd + ((b * longest + j) * hkv + h) * dv);
      }
    }
  }
  Tensor k64 = to_dtype(k, DType::f64), v64 = to_dtype(v, DType::f64);
  if (c.rotate) {
    auto* k_rows = static_cast<double*>(k64.view().data());
    auto* v_rows = static_cast<double*>(v64.view().data());
    for (std::int64_t row = 0; row < c.batch * longest * hkv; ++row) {
      detail::hadamard(k_rows + row * dk, dk);
      detail::hadamard(v_rows + row * dv, dv);
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
  attention_into(to_dtype(q, DType::f64), k64, v64, {out64, lse64, {}}, opt);
  detail::for_each_index(out.sizes(), 4, [&](const Shape& i) {
    out.set({i[0], i[1], i[2], i[3]}, out64.get({i[0], i[1], i[2], i[3]}));
  });
  if (!lse.defined()) return;
  detail::for_each_index(lse.sizes(), 3, [&](const Shape& i) {
    lse.set({i[0], i[1], i[2]}, lse64.get({i[0], i[1], i[2]}));
  });
}

// The plain view the decode kernels read: the cache's shape and lengths, and
// the address of every page in each sequence's block table.
cache::KvView view_of(const KvCache& kv) {
  const KvCacheConfig& c = kv.config();
  cache::KvView view;
  view.key_storage = kv.key_storage();
  view.value_storage = kv.value_storage();
  view.rotated = c.rotate;
  view.values_in_keys = c.values_in_keys;
  view.tail_dim = c.tail_dim;
  view.tail_storage = c.tail_storage;
  view.key_token_bytes = kv.key_token_bytes();
  view.value_token_bytes = kv.value_token_bytes();
  view.batch = c.batch;
  view.kv_heads = c.kv_heads;
  view.head_dim = c.head_dim;
  view.value_dim = kv.value_dim();
  view.page_size = kv.page_size();
  view.lengths = kv.lengths();
  view.first_page.reserve(static_cast<std::size_t>(c.batch) + 1);
  for (std::int64_t b = 0; b < c.batch; ++b) {
    view.first_page.push_back(static_cast<std::int64_t>(view.key_pages.size()));
    const auto pages = static_cast<std::int64_t>(kv.block_table(b).size());
    for (std::int64_t i = 0; i < pages; ++i) {
      view.key_pages.push_back(static_cast<const std::byte*>(kv.key_page(b, i)));
      view.value_pages.push_back(static_cast<const std::byte*>(kv.value_page(b, i)));
    }
  }
  view.first_page.push_back(static_cast<std::int64_t>(view.key_pages.size()));
  return view;
}

// The queries through the options' maps (core/query_maps.hpp) for the
// decode kernels, which read no other trace of them, in f32: each row's keys
// are its sequence's cached tokens up to its own (causal, bottom-right), as
// reference_decode has them.
Tensor mapped_queries(ConstTensorView q, const KvCache& cache, const AttentionOptions& o) {
  detail::AttentionProblem p;
  p.batch = p.sequences = q.size(0);
  p.nq = q.size(1);
  p.hq = q.size(2);
  p.dq = q.size(3);
  p.key_lengths = cache.lengths();
  AttentionOptions rows = o;
  rows.causal = true;
  rows.align = Align::bottom_right;
  return detail::mapped_queries(p, q, rows, DType::f32);
}

// Runs a validated call. A fused result holding a NaN or an infinity is
// recomputed by the reference, which defines it (see docs/semantics.md).
void run(ConstTensorView q, const KvCache& cache, TensorView out, TensorView lse,
         const AttentionOptions& o, double scale) {
  if (o.backend != Backend::reference && q.dtype() != DType::f64) {
    const cache::KvView view = view_of(cache);
    cpu::KernelParams params = cpu::lower(o, scale);
    params.keys.causal = true;  // decoding's definition (reference_decode)
    params.keys.align = Align::bottom_right;
    const Tensor mapped = detail::maps_queries(o) ? mapped_queries(q, cache, o) : Tensor();
    cpu::DecodePlan plan =
        cpu::make_decode_plan(view, params, mapped.defined() ? mapped.view() : q, out, lse);
    cpu::decode(plan);
    if (detail::all_finite(out) && (!lse.defined() || detail::all_finite(lse, true))) return;
  }
  reference_decode(q, cache, out, lse, o);
}

}  // namespace

AttentionResult decode_attention(ConstTensorView q, const KvCache& cache,
                                 const AttentionOptions& options) {
  const DecodeShape s = check_decode(q, cache, nullptr, {}, options);
  AttentionResult result;
  result.out = Tensor(s.dtype, {s.batch, s.n, s.hq, s.dv});
  if (options.return_lse) result.lse = Tensor(s.stat_dtype, {s.batch, s.hq, s.n});
  run(q, cache, result.out, result.lse.view(), options, s.scale);
  return result;
}

void decode_attention_into(ConstTensorView q, const KvCache& cache, TensorView out, TensorView lse,
                           const AttentionOptions& options) {
  const DecodeShape s = check_decode(q, cache, &out, lse, options);
  run(q, cache, out, lse, options, s.scale);
}

}  // namespace qkv
