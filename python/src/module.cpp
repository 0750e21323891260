// qkv._qkv: the native half of the Python package. Every function writes
// into arrays the caller allocated (the `_into` entry points of the C++ API),
// so nothing is copied in either direction; the Python layer (python/qkv)
// allocates outputs of the caller's array type and maps foreign
// conventions. The one exception, attention_exchange (exchange.hpp), has
// PyTorch allocate the output from C. The GIL is released while a kernel runs. qkv::Error becomes
// ValueError (nanobind's translation of std::invalid_argument).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>
#include <omp.h>

#include <string>
#include <utility>
#include <vector>

#include "arrays.hpp"
#include "exchange.hpp"
#include "gradients.hpp"
#include "options.hpp"
#include "qkv/qkv.hpp"
#include "shards.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace qkv::python {
namespace {

void attention_into_py(const In& q, const In& k, const In& v, const Out& out,
                       const std::optional<Out>& lse, const std::optional<Out>& probs,
                       const Options& options) {
  const ConstTensorView qv = view_of(q, "q"), kv = view_of(k, "k"), vv = view_of(v, "v");
  const AttentionOptions o = options.to_cpp();
  const AttentionOutputs outputs{view_of(out, "out"), view_of(lse, "lse"), view_of(probs, "probs")};
  nb::gil_scoped_release release;
  attention_into(qv, kv, vv, outputs, o);
}

// (name, shape) of each parameter gradient the call computes.
std::vector<std::pair<std::string, std::vector<std::int64_t>>> parameter_gradients_py(
    const In& q, const In& k, const In& v, const Options& options) {
  const ConstTensorView qv = view_of(q, "q"), kv = view_of(k, "k"), vv = view_of(v, "v");
  std::vector<std::pair<std::string, std::vector<std::int64_t>>> result;
  for (const ParameterGradient& g : parameter_gradients(qv, kv, vv, options.to_cpp())) {
    result.emplace_back(g.name, g.sizes);
  }
  return result;
}

void attention_backward_into_py(const In& q, const In& k, const In& v, const std::optional<In>& out,
                                const In& dout, const std::optional<In>& lse, const Out& dq,
                                const Out& dk, const Out& dv, const nb::dict& parameter_grads,
                                const Options& options) {
  const ConstTensorView qv = view_of(q, "q"), kv = view_of(k, "k"), vv = view_of(v, "v"),
                        ov = view_of(out, "out"), dov = view_of(dout, "dout"),
                        lv = view_of(lse, "lse");
  const AttentionOptions o = options.to_cpp();
  GradientOutputs grads{.dq = view_of(dq, "dq"), .dk = view_of(dk, "dk"), .dv = view_of(dv, "dv")};
  take_parameter_gradients(parameter_grads, grads);
  nb::gil_scoped_release release;
  attention_backward_into(qv, kv, vv, ov, dov, lv, grads, o);
}

RopeConfig rope_config(double base, bool interleaved, std::int64_t rotary_dim) {
  RopeConfig r;
  r.base = base;
  r.interleaved = interleaved;
  r.rotary_dim = rotary_dim;
  return r;
}

DType storage_dtype(const std::string& s) {
  if (s == "float32") return DType::f32;
  if (s == "bfloat16") return DType::bf16;
  if (s == "float16") return DType::f16;
  throw Error("dtype: expected 'float32', 'bfloat16' or 'float16', got '" + s + "'");
}

// A KvCache's key or value storage by its dtype name; None: the cache's dtype.
KvStorage kv_storage(const std::optional<std::string>& s, const char* name) {
  if (!s) return KvStorage::automatic;
  if (const std::optional<KvStorage> storage = storage_of_dtype_name(*s)) return *storage;
  throw Error(std::string(name) + ": expected one of " + storage_names(true) +
              " or None (dtype), got '" + *s + "'");
}

// The dtype name of a storage the cache resolved (never automatic).
const char* kv_storage_name(KvStorage s) { return storage_dtype_name(s); }

FeatureMap parse_feature_map(const std::string& s) {
  if (s == "elu_plus_one") return FeatureMap::elu_plus_one;
  if (s == "relu") return FeatureMap::relu;
  throw Error("feature_map: expected 'elu_plus_one' or 'relu', got '" + s + "'");
}

LinearAttentionOptions linear_options(const std::string& feature_map, bool causal, bool normalize,
                                      double eps, std::int64_t chunk, const std::string& backend) {
  LinearAttentionOptions o;
  o.feature_map = parse_feature_map(feature_map);
  o.causal = causal;
  o.normalize = normalize;
  o.eps = eps;
  o.chunk = chunk;
  o.backend = parse_backend(backend);
  return o;
}

}  // namespace

// The modules (modules.cpp).
void bind_modules(nb::module_& m);

#ifdef QKV_WITH_MPI
// qkv::dist's functions (distributed.cpp), when the build has MPI.
void bind_distributed(nb::module_& m);
#endif

}  // namespace qkv::python

NB_MODULE(_qkv, m) {
  using namespace qkv;
  using namespace qkv::python;
  m.doc() = "qkv's native functions; use the `qkv` package, which wraps them.";

  nb::class_<SparsePattern>(m, "SparsePattern",
                            "An attention pattern (qkv/sparse.hpp): one more mask, run by the "
                            "fused kernels without visiting the tiles it leaves empty.")
      .def(nb::init<>())
      .def_static("window", &SparsePattern::window, "left"_a, "right"_a)
      .def_static("dilated_window", &SparsePattern::dilated_window, "left"_a, "right"_a,
                  "dilation"_a)
      .def_static("strided", &SparsePattern::strided, "stride"_a)
      .def_static("fixed", &SparsePattern::fixed, "block"_a, "summary"_a)
      .def_static("global_tokens", &SparsePattern::global_tokens, "tokens"_a)
      .def_static("prefix", &SparsePattern::prefix, "length"_a)
      .def_static("prefix_lm", &SparsePattern::prefix_lm, "prefix_length"_a)
      .def_static(
          "block_sparse",
          [](nb::ndarray<nb::ro, const std::uint8_t, nb::ndim<3>, nb::c_contig, nb::device::cpu>
                 layout,
             std::int64_t block_size) {
            BlockLayout l;
            l.heads = static_cast<std::int64_t>(layout.shape(0));
            l.q_blocks = static_cast<std::int64_t>(layout.shape(1));
            l.k_blocks = static_cast<std::int64_t>(layout.shape(2));
            l.block_size = block_size;
            l.bits.assign(layout.data(), layout.data() + layout.size());
            return SparsePattern::block_sparse(std::move(l));
          },
          "layout"_a, "block_size"_a)
      .def_static(
          "bigbird",
          [](std::int64_t heads, std::int64_t nq, std::int64_t nk, std::int64_t block_size,
             std::int64_t window_blocks, std::int64_t global_blocks, std::int64_t random_blocks,
             std::uint64_t seed) {
            BigBirdConfig c;
            c.heads = heads;
            c.nq = nq;
            c.nk = nk;
            c.block_size = block_size;
            c.window_blocks = window_blocks;
            c.global_blocks = global_blocks;
            c.random_blocks = random_blocks;
            c.seed = seed;
            return SparsePattern::block_sparse(bigbird_layout(c));
          },
          "heads"_a, "nq"_a, "nk"_a, "block_size"_a = 64, "window_blocks"_a = 1,
          "global_blocks"_a = 1, "random_blocks"_a = 2, "seed"_a = 0)
      .def("__or__", [](const SparsePattern& a, const SparsePattern& b) { return a | b; })
      .def("__and__", [](const SparsePattern& a, const SparsePattern& b) { return a & b; })
      .def("defined", &SparsePattern::defined)
      .def("admits", &SparsePattern::admits, "h"_a, "i"_a, "p"_a, "j"_a)
      .def("__repr__", [](const SparsePattern& p) {
        return "SparsePattern(" + (p.defined() ? p.describe() : std::string("off")) + ")";
      });

  bind_options(m);

  m.def("attention_into", &attention_into_py, "q"_a, "k"_a, "v"_a, "out"_a, "lse"_a.none(),
        "probs"_a.none(), "options"_a,
        "Attention of q [B, Nq, Hq, Dk], k [B, Nk, Hkv, Dk], v [B, Nk, Hkv, Dv] into out "
        "[B, Nq, Hq, Dv] (dtype of q), lse [B, Hq, Nq] and probs [B, Hq, Nq, Nk] (float32; "
        "float64 for float64 inputs) when given.");
  m.def("attention_exchange", &attention_exchange, "q"_a, "k"_a, "v"_a, "options"_a,
        "attention(q, k, v) for tensors that export DLPack's C exchange API (PyTorch's): "
        "returns out, allocated by their library, or None when that path does not apply.");
  m.def("sdpa_exchange", &sdpa_exchange, "query"_a, "key"_a, "value"_a, "attn_mask"_a.none(),
        "scale"_a.none(), "is_causal"_a, "enable_gqa"_a, "dropout_p"_a, "dropout_seed"_a,
        "threads"_a, "return_lse"_a,
        "scaled_dot_product_attention's forward on tensors in its layout that export DLPack's C "
        "exchange API: returns out [..., Hq, L, Ev], contiguous (with return_lse, (out, lse)), "
        "or None when that path does not apply (see exchange.hpp).");
  m.def("sdpa_backward_exchange", &sdpa_backward_exchange, "grad_out"_a, "query"_a, "key"_a,
        "value"_a, "out"_a, "lse"_a, "attn_mask"_a.none(), "scale"_a.none(), "is_causal"_a,
        "enable_gqa"_a, "dropout_p"_a, "dropout_seed"_a, "threads"_a,
        "The backward of sdpa_exchange: (dq, dk, dv) in the inputs' layouts, or None when that "
        "path does not apply.");
  m.def("attention_backward_into", &attention_backward_into_py, "q"_a, "k"_a, "v"_a, "out"_a.none(),
        "dout"_a, "lse"_a.none(), "dq"_a, "dk"_a, "dv"_a, "parameter_grads"_a, "options"_a,
        "Gradients of attention into dq, dk, dv (dtype of q) and, from parameter_grads (a dict "
        "by the names of parameter_gradient_names), the parameter gradients the options use.");
  m.def("parameter_gradients", &parameter_gradients_py, "q"_a, "k"_a, "v"_a, "options"_a,
        "[(name, shape)] of the parameter gradients attention_backward computes for these "
        "inputs and options (float32, float64 for float64 inputs), in the rows' order.");
  m.attr("parameter_gradient_names") = nb::tuple(nb::cast(parameter_gradient_names()));

  nb::class_<KvCache>(m, "KvCache",
                      "A key/value cache for decoding (qkv/kv_cache.hpp): contiguous "
                      "(page_size = 0) or paged.")
      .def(
          "__init__",
          [](KvCache* self, std::int64_t batch, std::int64_t kv_heads, std::int64_t head_dim,
             std::int64_t value_dim, std::int64_t capacity, const std::string& dtype,
             std::int64_t page_size, std::int64_t num_pages,
             const std::optional<std::string>& k_dtype, const std::optional<std::string>& v_dtype,
             bool rotate, std::int64_t sink_tokens, std::int64_t window_tokens, bool values_in_keys,
             std::int64_t tail_dim, const std::string& tail_dtype) {
            if (tail_dtype != "bfloat16" && tail_dtype != "float16") {
              throw Error("tail_dtype: expected 'bfloat16' or 'float16', got '" + tail_dtype + "'");
            }
            KvCacheConfig c;
            c.batch = batch;
            c.kv_heads = kv_heads;
            c.head_dim = head_dim;
            c.value_dim = value_dim;
            c.capacity = capacity;
            c.dtype = storage_dtype(dtype);
            c.page_size = page_size;
            c.num_pages = num_pages;
            c.key_storage = kv_storage(k_dtype, "k_dtype");
            c.value_storage = kv_storage(v_dtype, "v_dtype");
            c.rotate = rotate;
            c.sink_tokens = sink_tokens;
            c.window_tokens = window_tokens;
            c.values_in_keys = values_in_keys;
            c.tail_dim = tail_dim;
            c.tail_storage = tail_dtype == "float16" ? KvStorage::f16 : KvStorage::bf16;
            new (self) KvCache(c);
          },
          "batch"_a, "kv_heads"_a, "head_dim"_a, nb::kw_only(), "value_dim"_a = 0, "capacity"_a = 0,
          "dtype"_a = "float32", "page_size"_a = 0, "num_pages"_a = 0,
          "k_dtype"_a.none() = nb::none(), "v_dtype"_a.none() = nb::none(), "rotate"_a = false,
          "sink_tokens"_a = 0, "window_tokens"_a = 0, "values_in_keys"_a = false, "tail_dim"_a = 0,
          "tail_dtype"_a = "bfloat16")
      .def_prop_ro("paged", &KvCache::paged)
      .def_prop_ro("batch", [](const KvCache& c) { return c.config().batch; })
      .def_prop_ro("kv_heads", [](const KvCache& c) { return c.config().kv_heads; })
      .def_prop_ro("head_dim", [](const KvCache& c) { return c.config().head_dim; })
      .def_prop_ro("value_dim", &KvCache::value_dim)
      .def_prop_ro("capacity", [](const KvCache& c) { return c.config().capacity; })
      .def_prop_ro("page_size", &KvCache::page_size)
      .def_prop_ro("free_pages", &KvCache::free_pages)
      .def_prop_ro("k_dtype", [](const KvCache& c) { return kv_storage_name(c.key_storage()); })
      .def_prop_ro("rotate", [](const KvCache& c) { return c.config().rotate; })
      .def_prop_ro("v_dtype", [](const KvCache& c) { return kv_storage_name(c.value_storage()); })
      .def_prop_ro("values_in_keys", [](const KvCache& c) { return c.config().values_in_keys; })
      .def_prop_ro("tail_dim", [](const KvCache& c) { return c.config().tail_dim; })
      .def_prop_ro("tail_dtype",
                   [](const KvCache& c) { return kv_storage_name(c.config().tail_storage); })
      .def_prop_ro("sink_tokens", [](const KvCache& c) { return c.config().sink_tokens; })
      .def_prop_ro("window_tokens", [](const KvCache& c) { return c.config().window_tokens; })
      .def_prop_ro("key_token_bytes", &KvCache::key_token_bytes)
      .def_prop_ro("value_token_bytes", &KvCache::value_token_bytes)
      .def(
          "key_page",
          [](const KvCache& c, std::int64_t b, std::int64_t index) {
            const auto* p = static_cast<const char*>(c.key_page(b, index));
            return nb::bytes(p, static_cast<std::size_t>(c.page_size() * c.key_token_bytes()));
          },
          "b"_a, "index"_a)
      .def(
          "value_page",
          [](const KvCache& c, std::int64_t b, std::int64_t index) {
            const auto* p = static_cast<const char*>(c.value_page(b, index));
            return nb::bytes(p, static_cast<std::size_t>(c.page_size() * c.value_token_bytes()));
          },
          "b"_a, "index"_a)
      .def("length", &KvCache::length, "b"_a)
      .def("position", &KvCache::position, "b"_a)
      .def("lengths",
           [](const KvCache& c) {
             return std::vector<std::int64_t>(c.lengths().begin(), c.lengths().end());
           })
      .def(
          "append",
          [](KvCache& c, const In& k, const std::optional<In>& v, const std::optional<Ints>& counts,
             bool rope, double rope_base, bool rope_interleaved, std::int64_t rotary_dim) {
            const RopeConfig r = rope_config(rope_base, rope_interleaved, rotary_dim);
            const ConstTensorView kv = view_of(k, "k"), vv = view_of(v, "v");
            nb::gil_scoped_release release;
            c.append(kv, vv, span_of(counts), rope ? &r : nullptr);
          },
          "k"_a, "v"_a.none(), "counts"_a.none() = nb::none(), "rope"_a = false,
          "rope_base"_a = 10000.0, "rope_interleaved"_a = false, "rotary_dim"_a = 0)
      .def(
          "append_to",
          [](KvCache& c, std::int64_t b, const In& k, const std::optional<In>& v, bool rope,
             double rope_base, bool rope_interleaved, std::int64_t rotary_dim) {
            const RopeConfig r = rope_config(rope_base, rope_interleaved, rotary_dim);
            const ConstTensorView kv = view_of(k, "k"), vv = view_of(v, "v");
            nb::gil_scoped_release release;
            c.append_to(b, kv, vv, rope ? &r : nullptr);
          },
          "b"_a, "k"_a, "v"_a.none(), "rope"_a = false, "rope_base"_a = 10000.0,
          "rope_interleaved"_a = false, "rotary_dim"_a = 0)
      .def("release", &KvCache::release, "b"_a);

  m.def(
      "decode_attention_into",
      [](const In& q, const KvCache& cache, const Out& out, const std::optional<Out>& lse,
         const Options& options) {
        const AttentionOptions o = options.to_cpp();
        const ConstTensorView qv = view_of(q, "q");
        const TensorView ov = view_of(out, "out"), lv = view_of(lse, "lse");
        nb::gil_scoped_release release;
        decode_attention_into(qv, cache, ov, lv, o);
      },
      "q"_a, "cache"_a, "out"_a, "lse"_a.none(), "options"_a,
      "Attention of q [B, n, Hq, Dk] against everything `cache` holds, into out [B, n, Hq, Dv] "
      "(and lse [B, Hq, n]).");

  const auto rope = [](bool backward) {
    return [backward](const Out& x, const Ints& start_positions, double base, bool interleaved,
                      std::int64_t rotary_dim) {
      const RopeConfig r = rope_config(base, interleaved, rotary_dim);
      const TensorView xv = view_of(x, backward ? "grad" : "x");
      const std::span<const std::int64_t> starts(start_positions.data(), start_positions.shape(0));
      nb::gil_scoped_release release;
      if (backward) {
        apply_rope_backward(xv, starts, r);
      } else {
        apply_rope(xv, starts, r);
      }
    };
  };
  m.def("apply_rope", rope(false), "x"_a, "start_positions"_a, "base"_a = 10000.0,
        "interleaved"_a = false, "rotary_dim"_a = 0,
        "Rotates x [B, n, H, D] in place; row t of sequence b at position start_positions[b] + t.");
  m.def("apply_rope_backward", rope(true), "grad"_a, "start_positions"_a, "base"_a = 10000.0,
        "interleaved"_a = false, "rotary_dim"_a = 0, "The gradient of apply_rope, in place.");

  nb::class_<LinearAttentionState>(m, "LinearAttentionState",
                                   "A causal linear attention's state: s [B, Hkv, M, Dv] = sum_j "
                                   "phi(k_j) v_j^T and z [B, Hkv, M] = sum_j phi(k_j).")
      .def(
          "__init__",
          [](LinearAttentionState* self, std::int64_t batch, std::int64_t kv_heads,
             std::int64_t features, std::int64_t value_dim, const std::string& dtype) {
            if (dtype != "float32" && dtype != "float64") {
              throw Error("dtype: expected 'float32' or 'float64', got '" + dtype + "'");
            }
            new (self) LinearAttentionState(
                linear_attention_state(batch, kv_heads, features, value_dim,
                                       dtype == "float64" ? DType::f64 : DType::f32));
          },
          "batch"_a, "kv_heads"_a, "features"_a, "value_dim"_a, "dtype"_a = "float32")
      .def_prop_ro("s",
                   [](nb::handle self) {
                     return array_of(nb::cast<LinearAttentionState&>(self).s.view(), self);
                   })
      .def_prop_ro("z", [](nb::handle self) {
        return array_of(nb::cast<LinearAttentionState&>(self).z.view(), self);
      });

  m.def(
      "linear_attention_into",
      [](const In& q, const In& k, const In& v, const Out& out, const std::string& feature_map,
         bool causal, bool normalize, double eps, std::int64_t chunk, const std::string& backend,
         LinearAttentionState* final_state) {
        const ConstTensorView qv = view_of(q, "q"), kv = view_of(k, "k"), vv = view_of(v, "v");
        const LinearAttentionOptions o =
            linear_options(feature_map, causal, normalize, eps, chunk, backend);
        const TensorView ov = view_of(out, "out");
        nb::gil_scoped_release release;
        linear_attention_into(qv, kv, vv, ov, o, final_state);
      },
      "q"_a, "k"_a, "v"_a, "out"_a, "feature_map"_a, "causal"_a, "normalize"_a, "eps"_a, "chunk"_a,
      "backend"_a, "final_state"_a.none() = nb::none());
  m.def(
      "linear_attention_step_into",
      [](const In& q, const In& k, const In& v, LinearAttentionState& state, const Out& out,
         const std::string& feature_map, bool normalize, double eps, std::int64_t chunk,
         const std::string& backend) {
        const ConstTensorView qv = view_of(q, "q"), kv = view_of(k, "k"), vv = view_of(v, "v");
        const LinearAttentionOptions o =
            linear_options(feature_map, true, normalize, eps, chunk, backend);
        const TensorView ov = view_of(out, "out");
        nb::gil_scoped_release release;
        linear_attention_step_into(qv, kv, vv, state, ov, o);
      },
      "q"_a, "k"_a, "v"_a, "state"_a, "out"_a, "feature_map"_a, "normalize"_a, "eps"_a, "chunk"_a,
      "backend"_a);
  m.def(
      "linear_attention_backward_into",
      [](const In& q, const In& k, const In& v, const In& dout, const Out& dq, const Out& dk,
         const Out& dv, const std::string& feature_map, bool causal, bool normalize, double eps,
         std::int64_t chunk, const std::string& backend) {
        const LinearAttentionOptions o =
            linear_options(feature_map, causal, normalize, eps, chunk, backend);
        const ConstTensorView qv = view_of(q, "q"), kv = view_of(k, "k"), vv = view_of(v, "v"),
                              dov = view_of(dout, "dout");
        const LinearAttentionGradientOutputs g{view_of(dq, "dq"), view_of(dk, "dk"),
                                               view_of(dv, "dv")};
        nb::gil_scoped_release release;
        linear_attention_backward_into(qv, kv, vv, dov, g, o);
      },
      "q"_a, "k"_a, "v"_a, "dout"_a, "dq"_a, "dk"_a, "dv"_a, "feature_map"_a, "causal"_a,
      "normalize"_a, "eps"_a, "chunk"_a, "backend"_a);

  m.def(
      "dropout_keep_into",
      [](const Out& keep, std::uint64_t seed, std::uint32_t offset, double p) {
        const TensorView kv = view_of(keep, "keep");
        if (kv.dtype() != DType::boolean || kv.rank() != 4 || !kv.is_contiguous()) {
          throw Error("keep: expected a contiguous 4-D bool array [B, Hq, Nq, Nk], got " +
                      std::string(dtype_name(kv.dtype())) + " " + shape_string(kv.size_span()));
        }
        if (!(p >= 0.0 && p < 1.0)) {
          throw Error("p: expected a probability in [0, 1), got " + std::to_string(p));
        }
        nb::gil_scoped_release release;
        auto* out = static_cast<bool*>(kv.data());
        const std::int64_t hq = kv.size(1), nq = kv.size(2), nk = kv.size(3);
        for (std::int64_t b = 0; b < kv.size(0); ++b) {
          for (std::int64_t h = 0; h < hq; ++h) {
            for (std::int64_t i = 0; i < nq; ++i) {
              for (std::int64_t j = 0; j < nk; ++j) {
                *out++ = dropout_keep(seed, offset, p, hq, b, h, i, j);
              }
            }
          }
        }
      },
      "keep"_a, "seed"_a, "offset"_a, "p"_a,
      "Writes dropout's pattern into keep [B, Hq, Nq, Nk] (bool, contiguous): keep[b, h, i, "
      "j] = qkv::dropout_keep(seed, offset, p, Hq, b, h, i, j), whether attention's dropout "
      "keeps that weight.");
  m.def("alibi_slopes", &alibi_slopes, "num_heads"_a,
        "ALiBi's slopes for num_heads heads (Press et al. 2022), as a list of floats.");
  m.def(
      "set_num_threads",
      [](int n) {
        if (n < 1) throw Error("n: expected a thread count >= 1, got " + std::to_string(n));
        omp_set_num_threads(n);
      },
      "n"_a, "Threads of the next calls (OpenMP).");
  m.def("get_num_threads", &omp_get_max_threads, "Threads the next call uses.");

  bind_modules(m);
  bind_shards(m);
#ifdef QKV_WITH_MPI
  bind_distributed(m);
#endif
}
