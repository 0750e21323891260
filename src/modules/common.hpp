// Shared plumbing of the modules: compute precision, contiguous operands,
// GEMM on OpenBLAS, and gradient buffers.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "core/checks.hpp"
#include "core/gemm.hpp"
#include "qkv/modules/parameter.hpp"
#include "qkv/tensor.hpp"

namespace qkv::nn::detail {

// The library's checks (core/checks.hpp), so that modules word their
// messages as every other entry point does.
using qkv::detail::check_dim;
using qkv::detail::check_floating;
using qkv::detail::check_view;
using qkv::detail::num;
using qkv::detail::Reasons;
using qkv::detail::shape_of;
using qkv::detail::str;
using qkv::detail::throw_if;
using qkv::detail::ViewSpec;

// The dtype a module computes in for an input of dtype `input`: f64 for f64,
// f32 for everything else.
DType compute_dtype(DType input);

// x as contiguous elements of `dtype`: x's own memory when it already is,
// else a converted copy held in `storage`.
struct Dense {
  Tensor storage;
  const void* data = nullptr;
};
Dense dense(ConstTensorView x, DType dtype);

// GEMM on OpenBLAS (core/gemm.hpp): thread-count-independent blocks.
using qkv::detail::gemm;

// p.grad, allocated and zeroed in `dtype` on first use. Throws qkv::Error if
// it already holds gradients of another dtype (mixing f32 and f64 backward
// calls without zero_grad in between), which check_grads rules out first.
Tensor& grad_of(Parameter& p, DType dtype);

// Appends a reason for each parameter whose gradient holds another dtype
// than `dtype`, the one a backward accumulates in: run with the other checks
// so that no gradient is allocated or changed by a call that then throws.
void check_grads(const NamedParameters& parameters, DType dtype, Reasons& reasons);

// data[r * cols + c] += row[c] for every row r < rows (a bias broadcast).
void add_row(DType dtype, void* data, std::int64_t rows, std::int64_t cols, const void* row);
// out[c] += sum_r data[r * cols + c] (a bias gradient), rows in order.
void add_column_sums(DType dtype, const void* data, std::int64_t rows, std::int64_t cols,
                     void* out);

// A module's tensor input: check_view for a floating x of rank `rank` (-1:
// any) whose dimensions `layout` names ("[B, N, E]"); returns whether its
// sizes may be read.
bool check_input(const char* name, ConstTensorView x, int rank, const char* layout,
                 Reasons& reasons);

// t itself (moved, never copied) when it already has `dtype`, else a
// converted copy: a module's result in its input's dtype.
Tensor in_dtype(Tensor t, DType dtype);

// A module's pass in x's compute dtype: calls f(x, dy, out) with contiguous
// `const T*` x and dy (null when dy is undefined) and `T*` out shaped like
// x, T double for f64 inputs and float for the others; returns out in x's
// dtype.
template <class F>
Tensor in_compute_dtype(ConstTensorView x, ConstTensorView dy, F&& f) {
  const DType ct = compute_dtype(x.dtype());
  const Dense xs = dense(x, ct);
  const Dense dys = dy.defined() ? dense(dy, ct) : Dense{};
  Tensor out(ct, x.size_span());
  const auto run = [&]<class T>(T* o) {
    f(static_cast<const T*>(xs.data), static_cast<const T*>(dys.data), o);
  };
  if (ct == DType::f64) {
    run(out.data<double>());
  } else {
    run(out.data<float>());
  }
  return in_dtype(std::move(out), x.dtype());
}

// Appends a reason unless p's value has exactly `sizes` and a floating dtype,
// and its gradient, if any, the same sizes (parameters are public members: a
// caller may have replaced one). Returns whether p may be used.
bool check_parameter(const std::string& name, const Parameter& p,
                     std::initializer_list<std::int64_t> sizes, Reasons& reasons);

// The sizes of x with the last one replaced by `last`.
std::vector<std::int64_t> with_last(ConstTensorView x, std::int64_t last);

}  // namespace qkv::nn::detail
