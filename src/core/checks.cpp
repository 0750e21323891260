#include "core/checks.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>

#include "core/elements.hpp"

namespace qkv::detail {

void throw_if(const Reasons& reasons) {
  if (!reasons.empty()) throw Error(reasons);
}

std::string num(double x) {
  char text[32];
  return {text, std::to_chars(text, text + sizeof text, x).ptr};
}

std::string str(DType dtype) {
  if (dtype_size(dtype) == 0) return "value " + std::to_string(static_cast<int>(dtype));
  return std::string(dtype_name(dtype));
}

std::string shape_of(ConstTensorView t) { return shape_string(t.size_span()); }

bool check_floating(const char* name, DType dtype, Reasons& r) {
  if (is_floating(dtype)) return true;
  r.push_back(std::string(name) + ": expected dtype f32, f64, f16 or bf16, got " + str(dtype));
  return false;
}

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
                " " + shape_string(spec.sizes) +
                (spec.sizes_source != nullptr ? std::string(" (") + spec.sizes_source + ")" : "") +
                ", got " + shape_of(t));
  }
  if (spec.dtype && t.dtype() != *spec.dtype) {
    r.push_back(std::string(name) + ": expected dtype " + str(*spec.dtype) +
                (spec.dtype_source != nullptr ? std::string(" (") + spec.dtype_source + ")" : "") +
                ", got " + str(t.dtype()));
  } else if (spec.floating) {
    check_floating(name, t.dtype(), r);
  }
  return check_memory(name, t, r) && readable;
}

void check_dim(const char* name, ConstTensorView t, int d, const char* what, std::int64_t expected,
               const std::string& source, Reasons& r) {
  if (t.size(d) != expected) {
    r.push_back(std::string(name) + ": expected " + what + " (dim " + std::to_string(d) + ") " +
                std::to_string(expected) + " to match " + source + ", got " +
                std::to_string(t.size(d)) + " (sizes " + shape_of(t) + ")");
  }
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

bool check_output(const char* name, ConstTensorView t, const ViewSpec& spec, Aliasing& aliasing,
                  Reasons& r) {
  if (!check_view(name, t, spec, r)) return false;
  aliasing.output(name, t, r);
  return true;
}

void check_fast_dtype(Backend backend, DType dtype, Reasons& r) {
  if (backend == Backend::fast && dtype == DType::f64) {
    r.push_back(
        "options.backend: Backend::fast computes in f32 and takes f32, f16 or bf16 inputs, got "
        "f64 (use Backend::reference or Backend::automatic)");
  }
}

void check_rope(const RopeConfig& rope, std::int64_t head_dim, const char* dim, Reasons& r) {
  using std::to_string;
  if (!(rope.base > 1.0) || !std::isfinite(rope.base)) {
    r.push_back("rope.base: expected a finite frequency base > 1, got " + num(rope.base));
  }
  if (head_dim < 0) {
    if (rope.rotary_dim < 0 || rope.rotary_dim % 2 != 0) {
      r.push_back("rope.rotary_dim: expected an even number >= 0 (0 = the whole head), got " +
                  to_string(rope.rotary_dim));
    }
    return;
  }
  const std::string d = std::string(dim) + " = " + to_string(head_dim);
  if (rope.rotary_dim < 0 || rope.rotary_dim > head_dim || rope.rotary_dim % 2 != 0) {
    r.push_back("rope.rotary_dim: expected an even number in [0, " + d +
                "] (0 = the whole head), got " + to_string(rope.rotary_dim));
  } else if (rope.rotary_dim == 0 && head_dim % 2 != 0) {
    r.push_back("rope.rotary_dim: 0 rotates the whole head, which needs an even head dim, got " +
                d + " (rotate an even number of leading elements instead)");
  }
}

bool checked_product(std::initializer_list<std::int64_t> factors, std::int64_t& out) {
  // A factor of 0 makes the product 0 however large the others are.
  if (std::find(factors.begin(), factors.end(), 0) != factors.end()) {
    out = 0;
    return true;
  }
  out = 1;
  for (const std::int64_t f : factors) {
    if (__builtin_mul_overflow(out, f, &out)) return false;
  }
  return true;
}

}  // namespace qkv::detail
