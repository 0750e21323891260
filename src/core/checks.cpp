#include "core/checks.hpp"

#include <algorithm>
#include <charconv>

#include "core/elements.hpp"

namespace qkv::detail {

void throw_if(const Reasons& reasons) {
  if (!reasons.empty()) throw Error(reasons);
}

std::string num(double x) {
  char text[32];
  return {text, std::to_chars(text, text + sizeof text, x).ptr};
}

std::string str(DType dtype) { return std::string(dtype_name(dtype)); }

std::string shape_of(ConstTensorView t) { return shape_string(t.size_span()); }

bool check_memory(const char* name, ConstTensorView t, Reasons& r) {
  if (!extent_fits(t)) {
    r.push_back(std::string(name) + ": sizes " + shape_of(t) + " with strides " +
                shape_string(t.stride_span()) +
                " overflow int64: the element count or the byte offset of the last element "
                "exceeds 2^63 - 1");
    return false;
  }
  if (t.data() == nullptr && t.numel() > 0) {
    r.push_back(std::string(name) + ": data is null but the tensor has " +
                std::to_string(t.numel()) + " elements (sizes " + shape_of(t) + ")");
    return false;
  }
  return true;
}

bool check_view(const char* name, ConstTensorView t, const ViewSpec& spec, Reasons& r) {
  if (!t.defined()) {
    r.push_back(std::string(name) + ": required tensor is undefined");
    return false;
  }
  const std::string layout = spec.layout != nullptr ? std::string(" ") + spec.layout : "";
  const int rank = spec.sizes.empty() ? spec.rank : static_cast<int>(spec.sizes.size());
  bool readable = true;
  if (rank >= 0 && t.rank() != rank) {
    r.push_back(std::string(name) + ": expected rank " + std::to_string(rank) + layout +
                ", got rank " + std::to_string(t.rank()) + " with sizes " + shape_of(t));
    readable = false;
  } else if (!spec.sizes.empty() &&
             !std::equal(spec.sizes.begin(), spec.sizes.end(), t.size_span().begin())) {
    r.push_back(std::string(name) + ": expected sizes" + (layout.empty() ? "" : layout + " =") +
                " " + shape_string(spec.sizes) + ", got " + shape_of(t));
  }
  if (spec.dtype && t.dtype() != *spec.dtype) {
    r.push_back(std::string(name) + ": expected dtype " + str(*spec.dtype) +
                (spec.dtype_source != nullptr ? std::string(" (") + spec.dtype_source + ")" : "") +
                ", got " + str(t.dtype()));
  } else if (spec.floating && !is_floating(t.dtype())) {
    r.push_back(std::string(name) + ": expected dtype f32, f64, f16 or bf16, got " +
                str(t.dtype()));
  }
  return check_memory(name, t, r) && readable;
}

void Aliasing::input(const char* name, ConstTensorView t) {
  if (t.defined()) views_.emplace_back(name, t);
}

void Aliasing::output(const char* name, ConstTensorView t, Reasons& r) {
  if (!t.defined()) return;
  if (const std::string reason = self_overlap_reason(t); !reason.empty()) {
    r.push_back(std::string(name) + ": " + reason);
  }
  const ByteRange range = byte_range(t);
  for (const auto& [other, view] : views_) {
    if (range.overlaps(byte_range(view))) {
      r.push_back(std::string(name) + ": memory overlaps " + other +
                  " (outputs must not alias an input or another output)");
    }
  }
  views_.emplace_back(name, t);
}

void check_output(const char* name, ConstTensorView t, const ViewSpec& spec, Aliasing& aliasing,
                  Reasons& r) {
  if (check_view(name, t, spec, r)) aliasing.output(name, t, r);
}

void check_fast_dtype(Backend backend, DType dtype, Reasons& r) {
  if (backend == Backend::fast && dtype == DType::f64) {
    r.push_back(
        "options.backend: Backend::fast computes in f32 and takes f32, f16 or bf16 inputs, got "
        "f64 (use Backend::reference or Backend::automatic)");
  }
}

bool checked_product(std::initializer_list<std::int64_t> factors, std::int64_t& out) {
  out = 1;
  for (const std::int64_t f : factors) {
    if (__builtin_mul_overflow(out, f, &out)) return false;
  }
  return true;
}

}  // namespace qkv::detail
