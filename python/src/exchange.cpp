#include "exchange.hpp"

#include <omp.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include "qkv/attention.hpp"
#include "qkv/backward.hpp"
#include "qkv/error.hpp"

namespace qkv::python {
namespace {

// The DLPack 1.x C ABI (dlpack.h), as far as this file uses it.
struct DLDevice {
  std::int32_t device_type;  // 1: CPU
  std::int32_t device_id;
};
struct DLDataType {
  std::uint8_t code;  // 2: float, 4: bfloat, 6: bool, ...
  std::uint8_t bits;
  std::uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  std::int32_t ndim;
  DLDataType dtype;
  std::int64_t* shape;
  std::int64_t* strides;  // in elements; null: compact row-major
  std::uint64_t byte_offset;
};
struct DLPackVersion {
  std::uint32_t major;
  std::uint32_t minor;
};
struct DLManagedTensorVersioned {
  DLPackVersion version;
  void* manager_ctx;
  void (*deleter)(DLManagedTensorVersioned* self);
  std::uint64_t flags;
  DLTensor dl_tensor;
};
struct DLPackExchangeAPIHeader {
  DLPackVersion version;
  DLPackExchangeAPIHeader* prev_api;
};
struct DLPackExchangeAPI {
  DLPackExchangeAPIHeader header;
  int (*managed_tensor_allocator)(DLTensor* prototype, DLManagedTensorVersioned** out,
                                  void* error_ctx,
                                  void (*set_error)(void* error_ctx, const char* kind,
                                                    const char* message));
  int (*managed_tensor_from_py_object_no_sync)(void* py_object, DLManagedTensorVersioned** out);
  int (*managed_tensor_to_py_object_no_sync)(DLManagedTensorVersioned* tensor,
                                             void** out_py_object);
  int (*dltensor_from_py_object_no_sync)(void* py_object, DLTensor* out);
  int (*current_work_stream)(std::int32_t device_type, std::int32_t device_id, void** out_stream);
};
constexpr std::int32_t kDLCPU = 1;
constexpr std::uint32_t kMajor = 1;
// The highest rank of a scaled_dot_product_attention input taken here.
constexpr int kMaxSdpaRank = 8;

// The exchange API of `type`, or null: looked up once per type (the last
// type seen is remembered; calls pass one tensor type over and over).
const DLPackExchangeAPI* api_of(PyTypeObject* type) {
  static PyTypeObject* cached_type = nullptr;
  static const DLPackExchangeAPI* cached_api = nullptr;
  if (type == cached_type) return cached_api;
  const DLPackExchangeAPI* api = nullptr;
  PyObject* capsule =
      PyObject_GetAttrString(reinterpret_cast<PyObject*>(type), "__dlpack_c_exchange_api__");
  if (capsule == nullptr) {
    PyErr_Clear();
  } else {
    if (PyCapsule_IsValid(capsule, "dlpack_exchange_api") != 0) {
      const auto* found = static_cast<const DLPackExchangeAPI*>(
          PyCapsule_GetPointer(capsule, "dlpack_exchange_api"));
      // The table must outlive the process (DLPack's rule), so the pointer
      // stays valid after the capsule's reference is dropped.
      if (found != nullptr && found->header.version.major == kMajor &&
          found->dltensor_from_py_object_no_sync != nullptr &&
          found->managed_tensor_allocator != nullptr &&
          found->managed_tensor_to_py_object_no_sync != nullptr) {
        api = found;
      }
    }
    Py_DECREF(capsule);
  }
  Py_INCREF(type);  // the cache keeps the type (and so its table) alive
  if (cached_type != nullptr) Py_DECREF(cached_type);
  cached_type = type;
  cached_api = api;
  return api;
}

// The qkv dtype of a floating DLPack dtype, or nothing.
std::optional<DType> float_dtype(DLDataType t) {
  if (t.lanes != 1) return std::nullopt;
  if (t.code == 2 && t.bits == 32) return DType::f32;
  if (t.code == 2 && t.bits == 64) return DType::f64;
  if (t.code == 2 && t.bits == 16) return DType::f16;
  if (t.code == 4 && t.bits == 16) return DType::bf16;
  return std::nullopt;
}

// The qkv dtype of an attention mask: a floating dtype or bool.
std::optional<DType> mask_dtype(DLDataType t) {
  if (t.lanes == 1 && t.code == 6 && t.bits == 8) return DType::boolean;
  return float_dtype(t);
}

// A view of a 4-D tensor in CPU memory with a dtype qkv takes, or nothing.
template <class View>
std::optional<View> exchange_view(const DLTensor& t) {
  const std::optional<DType> dtype = float_dtype(t.dtype);
  if (t.device.device_type != kDLCPU || t.ndim != 4 || !dtype) return std::nullopt;
  std::array<std::int64_t, 4> strides{};
  std::int64_t compact = 1;
  for (int d = 3; d >= 0; --d) {
    strides[d] = t.strides != nullptr ? t.strides[d] : compact;
    if (strides[d] < 0) return std::nullopt;
    compact *= t.shape[d];
  }
  auto* data = static_cast<std::uint8_t*>(t.data) + t.byte_offset;
  return View(data, *dtype, std::span<const std::int64_t>(t.shape, 4),
              std::span<const std::int64_t>(strides.data(), 4));
}

void set_error(void* /*ctx*/, const char* kind, const char* message) {
  PyObject* type = PyExc_RuntimeError;
  if (std::string(kind) == "MemoryError") type = PyExc_MemoryError;
  PyErr_SetString(type, message);
}

// Reads `objects` (all of one type that exports the exchange API) into
// DLTensors; false, with nothing raised, when that does not apply.
template <std::size_t N>
bool read_all(const DLPackExchangeAPI*& api, const std::array<nb::handle, N>& objects,
              std::array<DLTensor, N>& t) {
  PyTypeObject* type = Py_TYPE(objects[0].ptr());
  for (nb::handle o : objects) {
    if (Py_TYPE(o.ptr()) != type) return false;
  }
  api = api_of(type);
  if (api == nullptr) return false;
  for (std::size_t i = 0; i < N; ++i) {
    if (api->dltensor_from_py_object_no_sync(objects[i].ptr(), &t[i]) != 0) {
      PyErr_Clear();  // the general path reports it
      return false;
    }
  }
  return true;
}

// A new contiguous tensor of `shape` and `like`'s dtype and device,
// allocated by `api`'s library; its DLTensor goes to `view`.
nb::object allocate(const DLPackExchangeAPI* api, const DLTensor& like,
                    std::span<std::int64_t> shape, DLTensor& view) {
  DLTensor prototype{};
  prototype.device = like.device;
  prototype.ndim = static_cast<std::int32_t>(shape.size());
  prototype.dtype = like.dtype;
  prototype.shape = shape.data();
  DLManagedTensorVersioned* managed = nullptr;
  if (api->managed_tensor_allocator(&prototype, &managed, nullptr, set_error) != 0) {
    throw nb::python_error();
  }
  void* created = nullptr;
  if (api->managed_tensor_to_py_object_no_sync(managed, &created) != 0) throw nb::python_error();
  nb::object out = nb::steal(static_cast<PyObject*>(created));  // owns `managed` now
  if (api->dltensor_from_py_object_no_sync(out.ptr(), &view) != 0) throw nb::python_error();
  return out;
}

// The strides of `t` in elements (DLPack leaves them null for compact
// row-major tensors); false for a negative stride.
bool strides_of(const DLTensor& t, std::span<std::int64_t> strides) {
  std::int64_t compact = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    strides[d] = t.strides != nullptr ? t.strides[d] : compact;
    if (strides[d] < 0) return false;
    compact *= t.shape[d];
  }
  return true;
}

// Dimensions [0, n) of (sizes, strides) as one dimension: its size and
// stride, or nothing when no single stride walks them in order.
std::optional<std::array<std::int64_t, 2>> merge_leading(const std::int64_t* sizes,
                                                         const std::int64_t* strides, int n) {
  std::int64_t size = 1, stride = 0, inner = 0;  // inner: extent of the dims merged so far
  bool any = false;
  for (int d = n - 1; d >= 0; --d) {
    if (sizes[d] == 0) return std::array<std::int64_t, 2>{0, 0};
    if (sizes[d] == 1) continue;
    if (!any) {
      stride = strides[d];
      any = true;
    } else if (strides[d] != inner) {
      return std::nullopt;
    }
    inner = strides[d] * sizes[d];
    size *= sizes[d];
  }
  return std::array<std::int64_t, 2>{size, stride};
}

// PyTorch's SDPA layout [*batch, H, N, D] (or [N, D]: one head, no batch)
// as qkv's [B, N, H, D] view, the batch dimensions merged into B; nothing
// when they cannot merge without a copy, or for a dtype qkv does not take.
std::optional<ConstTensorView> sdpa_view(const DLTensor& t) {
  const std::optional<DType> dtype = float_dtype(t.dtype);
  if (t.device.device_type != kDLCPU || t.ndim < 2 || t.ndim > kMaxSdpaRank || !dtype) {
    return std::nullopt;
  }
  std::array<std::int64_t, kMaxSdpaRank> strides{};
  if (!strides_of(t, strides)) return std::nullopt;
  const int r = t.ndim;
  const int batch_dims = std::max(r - 3, 0);
  const auto b = merge_leading(t.shape, strides.data(), batch_dims);
  if (!b) return std::nullopt;
  const std::int64_t h = r >= 3 ? t.shape[r - 3] : 1, sh = r >= 3 ? strides[r - 3] : 0;
  const std::array<std::int64_t, 4> shape{(*b)[0], t.shape[r - 2], h, t.shape[r - 1]};
  const std::array<std::int64_t, 4> view_strides{(*b)[1], strides[r - 2], sh, strides[r - 1]};
  const auto* data = static_cast<const std::uint8_t*>(t.data) + t.byte_offset;
  return ConstTensorView(data, *dtype, shape, view_strides);
}

// attn_mask (rank <= the inputs' rank `r`, broadcasting to [*batch, H, L,
// S] by NumPy's rules) as a [B, H, L, S] view with zero strides where it
// broadcasts; nothing when it does not broadcast, or when its batch
// dimensions broadcast only in part (no single stride walks them).
std::optional<ConstTensorView> sdpa_mask_view(const DLTensor& m, const DLTensor& q,
                                              std::int64_t s) {
  const std::optional<DType> dtype = mask_dtype(m.dtype);
  const int r = q.ndim;
  if (m.device.device_type != kDLCPU || m.ndim > r || !dtype) return std::nullopt;
  std::array<std::int64_t, kMaxSdpaRank> mstrides{};
  if (!strides_of(m, mstrides)) return std::nullopt;
  // The target sizes, and the mask's sizes and strides aligned to them (size 1 in front).
  std::array<std::int64_t, kMaxSdpaRank> target{}, sizes{}, strides{};
  for (int d = 0; d < r; ++d) {
    target[d] = d == r - 1 ? s : q.shape[d];
    const int md = d - (r - m.ndim);
    sizes[d] = md >= 0 ? m.shape[md] : 1;
    strides[d] = md >= 0 ? mstrides[md] : 0;
    if (sizes[d] != target[d] && sizes[d] != 1) return std::nullopt;
    if (sizes[d] != target[d]) strides[d] = 0;
  }
  const int batch_dims = std::max(r - 3, 0);
  std::int64_t sb = 0;
  bool broadcast_batch = true;
  for (int d = 0; d < batch_dims; ++d) broadcast_batch = broadcast_batch && sizes[d] == 1;
  if (!broadcast_batch) {
    for (int d = 0; d < batch_dims; ++d) {
      if (sizes[d] != target[d]) return std::nullopt;
    }
    const auto b = merge_leading(sizes.data(), strides.data(), batch_dims);
    if (!b) return std::nullopt;
    sb = (*b)[1];
  }
  std::int64_t batch = 1;
  for (int d = 0; d < batch_dims; ++d) batch *= target[d];
  const std::int64_t h = r >= 3 ? target[r - 3] : 1, sh = r >= 3 ? strides[r - 3] : 0;
  const std::array<std::int64_t, 4> shape{batch, h, target[r - 2], s};
  const std::array<std::int64_t, 4> view_strides{sb, sh, strides[r - 2], strides[r - 1]};
  const auto* data = static_cast<const std::uint8_t*>(m.data) + m.byte_offset;
  return ConstTensorView(data, *dtype, shape, view_strides);
}

// Sets OpenMP's thread count for the lifetime of the object (0: leaves it).
class ThreadCount {
 public:
  explicit ThreadCount(int n) : saved_(omp_get_max_threads()) {
    if (n > 0 && n != saved_) omp_set_num_threads(n);
  }
  ~ThreadCount() {
    if (omp_get_max_threads() != saved_) omp_set_num_threads(saved_);
  }
  ThreadCount(const ThreadCount&) = delete;
  ThreadCount& operator=(const ThreadCount&) = delete;

 private:
  int saved_;
};

}  // namespace

nb::object attention_exchange(nb::handle q, nb::handle k, nb::handle v, const Options& options) {
  const DLPackExchangeAPI* api = nullptr;
  std::array<DLTensor, 3> t{};
  if (!read_all<3>(api, {q, k, v}, t)) return nb::none();
  const auto qv = exchange_view<ConstTensorView>(t[0]);
  const auto kv = exchange_view<ConstTensorView>(t[1]);
  const auto vv = exchange_view<ConstTensorView>(t[2]);
  if (!qv || !kv || !vv) return nb::none();

  std::array<std::int64_t, 4> shape{qv->size(0), qv->size(1), qv->size(2), vv->size(3)};
  DLTensor out_tensor{};
  nb::object out = allocate(api, t[0], shape, out_tensor);
  const auto ov = exchange_view<TensorView>(out_tensor);
  if (!ov) throw Error("out: the allocated output is not a 4-D CPU tensor of q's dtype");
  const AttentionOptions o = options.to_cpp();
  {
    nb::gil_scoped_release release;
    attention_into(*qv, *kv, *vv, AttentionOutputs{*ov}, o);
  }
  return out;
}

namespace {

// One scaled_dot_product_attention call read through the exchange API: the
// inputs as qkv views and the options (see sdpa_exchange).
struct SdpaCall {
  const DLPackExchangeAPI* api = nullptr;
  std::array<DLTensor, 3> t{};  // query, key, value
  ConstTensorView q, k, v;      // [B, L, Hq, E], [B, S, Hkv, E], [B, S, Hkv, Ev]
  AttentionOptions options;

  int rank() const { return t[0].ndim; }
};

// The call, or nothing when it breaks one of PyTorch's rules or needs a copy.
std::optional<SdpaCall> read_sdpa(nb::handle query, nb::handle key, nb::handle value,
                                  nb::handle attn_mask, std::optional<double> scale, bool is_causal,
                                  bool enable_gqa, double dropout_p, std::uint64_t dropout_seed) {
  SdpaCall c;
  if (!read_all<3>(c.api, {query, key, value}, c.t)) return std::nullopt;
  const DLTensor &tq = c.t[0], &tk = c.t[1], &tv = c.t[2];
  const int r = tq.ndim;
  if (tk.ndim != r || tv.ndim != r) return std::nullopt;
  for (int d = 0; d + 3 < r; ++d) {
    if (tk.shape[d] != tq.shape[d] || tv.shape[d] != tq.shape[d]) return std::nullopt;
  }
  const auto qv = sdpa_view(tq), kv = sdpa_view(tk), vv = sdpa_view(tv);
  if (!qv || !kv || !vv || kv->dtype() != qv->dtype() || vv->dtype() != qv->dtype()) {
    return std::nullopt;
  }
  const std::int64_t hq = qv->size(2), hkv = kv->size(2), s = kv->size(1);
  const bool heads_match = hq == hkv || (enable_gqa && hkv > 0 && hq % hkv == 0);
  if (!heads_match || vv->size(2) != hkv || vv->size(1) != s || kv->size(3) != qv->size(3) ||
      !(dropout_p >= 0.0 && dropout_p < 1.0)) {
    return std::nullopt;
  }
  c.q = *qv;
  c.k = *kv;
  c.v = *vv;
  AttentionOptions& o = c.options;
  // Without a head dimension every score is an empty sum, 0 for any scale
  // (PyTorch's result: the mean of the values), where qkv's default
  // 1/sqrt(E) is undefined.
  o.scale = !scale && qv->size(3) == 0 ? std::optional<double>(1.0) : scale;
  o.causal = is_causal;
  o.align = Align::top_left;
  o.dropout_p = dropout_p;
  o.dropout_seed = dropout_seed;
  if (!attn_mask.is_none()) {
    const DLPackExchangeAPI* mask_api = nullptr;
    std::array<DLTensor, 1> m{};
    if (is_causal || !read_all<1>(mask_api, {attn_mask}, m) || mask_api != c.api) {
      return std::nullopt;
    }
    const std::optional<DType> mdtype = mask_dtype(m[0].dtype);
    const bool mask_dtype_ok =
        mdtype && (*mdtype == DType::boolean || *mdtype == DType::f32 || *mdtype == qv->dtype());
    if (!mask_dtype_ok) return std::nullopt;
    const auto mv = sdpa_mask_view(m[0], tq, s);
    if (!mv) return std::nullopt;
    o.mask = *mv;
  }
  return c;
}

// A new contiguous tensor shaped like the input `like` (rank r, PyTorch's
// layout [*batch, H, N, D]) but with last dimension `last`, and its view in
// qkv's layout [B, N, H, D].
std::pair<nb::object, TensorView> allocate_sdpa(const SdpaCall& c, const DLTensor& like,
                                                std::int64_t last) {
  const int r = like.ndim;
  std::array<std::int64_t, kMaxSdpaRank> shape{};
  std::copy(like.shape, like.shape + r, shape.begin());
  shape[r - 1] = last;
  DLTensor t{};
  nb::object o = allocate(c.api, c.t[0], std::span(shape.data(), r), t);
  const std::int64_t n = shape[r - 2], h = r >= 3 ? shape[r - 3] : 1;
  std::int64_t b = 1;
  for (int d = 0; d + 3 < r; ++d) b *= shape[d];
  auto* data = static_cast<std::uint8_t*>(t.data) + t.byte_offset;
  // Row-major strides of [B, H, N, D] taken as if every size were at least 1
  // (as PyTorch's for an empty tensor): an empty result has distinct strides.
  const std::int64_t d1 = std::max<std::int64_t>(last, 1), n1 = std::max<std::int64_t>(n, 1);
  const std::int64_t h1 = std::max<std::int64_t>(h, 1);
  return {o, TensorView(data, c.q.dtype(), {b, n, h, last}, {h1 * n1 * d1, d1, n1 * d1, 1})};
}

// The statistics' DLPack dtype for inputs of qkv dtype `d`: float64 for
// float64, else float32.
DLDataType stat_dtype(DType d) {
  return DLDataType{2, static_cast<std::uint8_t>(d == DType::f64 ? 64 : 32), 1};
}

}  // namespace

nb::object sdpa_exchange(nb::handle query, nb::handle key, nb::handle value, nb::handle attn_mask,
                         std::optional<double> scale, bool is_causal, bool enable_gqa,
                         double dropout_p, std::uint64_t dropout_seed, int threads,
                         bool return_lse) {
  const std::optional<SdpaCall> c = read_sdpa(query, key, value, attn_mask, scale, is_causal,
                                              enable_gqa, dropout_p, dropout_seed);
  if (!c) return nb::none();
  auto [out, ov] = allocate_sdpa(*c, c->t[0], c->v.size(3));
  AttentionOutputs outputs{ov};
  nb::object lse;
  if (return_lse) {
    // [*batch, Hq, L] (or [L]), contiguous: qkv's [B, Hq, L].
    const int r = c->rank();
    DLTensor prototype = c->t[0];
    prototype.ndim = r - 1;
    prototype.dtype = stat_dtype(c->q.dtype());
    DLTensor t{};
    lse = allocate(c->api, prototype, std::span(c->t[0].shape, r - 1), t);
    const std::int64_t b = c->q.size(0), hq = c->q.size(2), l = c->q.size(1);
    auto* data = static_cast<std::uint8_t*>(t.data) + t.byte_offset;
    outputs.lse = TensorView(data, c->q.dtype() == DType::f64 ? DType::f64 : DType::f32, {b, hq, l},
                             {std::max<std::int64_t>(hq, 1) * std::max<std::int64_t>(l, 1),
                              std::max<std::int64_t>(l, 1), 1});
  }
  {
    nb::gil_scoped_release release;
    const ThreadCount count(threads);
    attention_into(c->q, c->k, c->v, outputs, c->options);
  }
  if (return_lse) return nb::make_tuple(out, lse);
  return out;
}

nb::object sdpa_backward_exchange(nb::handle grad_out, nb::handle query, nb::handle key,
                                  nb::handle value, nb::handle out, nb::handle lse,
                                  nb::handle attn_mask, std::optional<double> scale, bool is_causal,
                                  bool enable_gqa, double dropout_p, std::uint64_t dropout_seed,
                                  int threads) {
  const std::optional<SdpaCall> c = read_sdpa(query, key, value, attn_mask, scale, is_causal,
                                              enable_gqa, dropout_p, dropout_seed);
  if (!c) return nb::none();
  const DLPackExchangeAPI* api = nullptr;
  std::array<DLTensor, 3> t{};  // grad_out, out, lse
  if (!read_all<3>(api, {grad_out, out, lse}, t) || api != c->api) return nb::none();
  const auto dov = sdpa_view(t[0]), ov = sdpa_view(t[1]);
  if (!dov || !ov) return nb::none();
  // lse: [*batch, Hq, L] as [B, Hq, L], read with its strides.
  const DLTensor& tl = t[2];
  const int r = c->rank();
  std::array<std::int64_t, kMaxSdpaRank> ls{};
  if (tl.ndim != r - 1 || tl.device.device_type != kDLCPU || !strides_of(tl, ls)) {
    return nb::none();
  }
  const auto b = merge_leading(tl.shape, ls.data(), std::max(r - 3, 0));
  const std::optional<DType> ldtype = float_dtype(tl.dtype);
  if (!b || !ldtype) return nb::none();
  const std::int64_t hq = r >= 3 ? tl.shape[r - 3] : 1, sh = r >= 3 ? ls[r - 3] : 0;
  const auto* ldata = static_cast<const std::uint8_t*>(tl.data) + tl.byte_offset;
  const ConstTensorView lv(ldata, *ldtype, {(*b)[0], hq, tl.shape[r - 2]},
                           {(*b)[1], sh, ls[r - 2]});

  auto [dq, dqv] = allocate_sdpa(*c, c->t[0], c->q.size(3));
  auto [dk, dkv] = allocate_sdpa(*c, c->t[1], c->k.size(3));
  auto [dv, dvv] = allocate_sdpa(*c, c->t[2], c->v.size(3));
  {
    nb::gil_scoped_release release;
    const ThreadCount count(threads);
    attention_backward_into(c->q, c->k, c->v, *ov, *dov, lv, GradientOutputs{dqv, dkv, dvv},
                            c->options);
  }
  return nb::make_tuple(dq, dk, dv);
}

}  // namespace qkv::python
