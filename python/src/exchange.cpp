#include "exchange.hpp"

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include "qkv/attention.hpp"
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

}  // namespace

nb::object attention_exchange(nb::handle q, nb::handle k, nb::handle v, const Options& options) {
  PyTypeObject* type = Py_TYPE(q.ptr());
  if (Py_TYPE(k.ptr()) != type || Py_TYPE(v.ptr()) != type) return nb::none();
  const DLPackExchangeAPI* api = api_of(type);
  if (api == nullptr) return nb::none();
  std::array<DLTensor, 3> t{};
  const std::array<nb::handle, 3> inputs{q, k, v};
  for (std::size_t i = 0; i < 3; ++i) {
    if (api->dltensor_from_py_object_no_sync(inputs[i].ptr(), &t[i]) != 0) {
      PyErr_Clear();  // the general path reports it
      return nb::none();
    }
  }
  const auto qv = exchange_view<ConstTensorView>(t[0]);
  const auto kv = exchange_view<ConstTensorView>(t[1]);
  const auto vv = exchange_view<ConstTensorView>(t[2]);
  if (!qv || !kv || !vv) return nb::none();

  std::array<std::int64_t, 4> shape{qv->size(0), qv->size(1), qv->size(2), vv->size(3)};
  DLTensor prototype{};
  prototype.device = t[0].device;
  prototype.ndim = 4;
  prototype.dtype = t[0].dtype;
  prototype.shape = shape.data();
  DLManagedTensorVersioned* managed = nullptr;
  if (api->managed_tensor_allocator(&prototype, &managed, nullptr, set_error) != 0) {
    throw nb::python_error();
  }
  void* created = nullptr;
  if (api->managed_tensor_to_py_object_no_sync(managed, &created) != 0) throw nb::python_error();
  nb::object out = nb::steal(static_cast<PyObject*>(created));  // owns `managed` now
  DLTensor out_tensor{};
  if (api->dltensor_from_py_object_no_sync(out.ptr(), &out_tensor) != 0) throw nb::python_error();
  const auto ov = exchange_view<TensorView>(out_tensor);
  if (!ov) throw Error("out: the allocated output is not a 4-D CPU tensor of q's dtype");
  const AttentionOptions o = options.to_cpp();
  {
    nb::gil_scoped_release release;
    attention_into(*qv, *kv, *vv, AttentionOutputs{*ov}, o);
  }
  return out;
}

}  // namespace qkv::python
