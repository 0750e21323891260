#include "qkv/modules/linear.hpp"

#include <string>
#include <utility>
#include <vector>

#include "modules/common.hpp"
#include "qkv/error.hpp"

namespace qkv::nn {

namespace {

std::int64_t rows_of(ConstTensorView x) {
  const std::int64_t last = x.size(-1);
  return last == 0 ? 0 : x.numel() / last;
}

void check_features(const char* name, ConstTensorView x, std::int64_t features,
                    const char* feature_name, detail::Reasons& reasons) {
  if (!detail::check_input(name, x, -1, nullptr, reasons)) return;
  if (x.rank() < 1) {
    reasons.push_back(std::string(name) + ": expected rank 1 to 4 [..., " + feature_name +
                      "], got a scalar");
  } else if (x.size(-1) != features) {
    reasons.push_back(std::string(name) + ": expected last dimension " + feature_name + " = " +
                      std::to_string(features) + ", got " + shape_string(x.size_span()));
  }
}

}  // namespace

Linear::Linear(std::int64_t in_features, std::int64_t out_features, bool with_bias, DType dtype)
    : in_(in_features), out_(out_features) {
  detail::Reasons r;
  if (in_features < 1) {
    r.push_back("in_features: expected >= 1, got " + std::to_string(in_features));
  }
  if (out_features < 1) {
    r.push_back("out_features: expected >= 1, got " + std::to_string(out_features));
  }
  detail::check_floating("dtype", dtype, r);
  detail::throw_if(r);
  weight = make_parameter(dtype, {out_, in_});
  if (with_bias) bias = make_parameter(dtype, {out_});
}

void Linear::check_parameters(std::vector<std::string>& reasons) const {
  detail::check_parameter("weight", weight, {out_, in_}, reasons);
  if (bias.defined()) detail::check_parameter("bias", bias, {out_}, reasons);
}

Tensor Linear::forward(ConstTensorView x) const {
  detail::Reasons r;
  check_features("x", x, in_, "in_features", r);
  check_parameters(r);
  detail::throw_if(r);

  const DType ct = detail::compute_dtype(x.dtype());
  const std::int64_t rows = rows_of(x);
  const detail::Dense xs = detail::dense(x, ct);
  const detail::Dense w = detail::dense(weight.value, ct);
  Tensor y(ct, detail::with_last(x, out_));
  const detail::Dense b = bias.defined() ? detail::dense(bias.value, ct) : detail::Dense{};
  detail::gemm(ct, false, true, rows, out_, in_, 1.0, xs.data, in_, w.data, in_, 0.0,
               y.view().data(), out_, b.data);
  return detail::in_dtype(std::move(y), x.dtype());
}

Tensor Linear::backward(ConstTensorView x, ConstTensorView dy) {
  detail::Reasons r;
  check_features("x", x, in_, "in_features", r);
  check_features("dy", dy, out_, "out_features", r);
  if (r.empty() && detail::with_last(x, out_) != detail::with_last(dy, out_)) {
    r.push_back("dy: expected the leading dimensions of x " + shape_string(x.size_span()) +
                ", got " + shape_string(dy.size_span()));
  }
  check_parameters(r);
  const DType ct = detail::compute_dtype(x.dtype());
  if (x.defined()) detail::check_grads(named_parameters(), ct, r);
  detail::throw_if(r);

  // Every gradient buffer first (check_grads has ruled out a dtype clash).
  Tensor& gw = detail::grad_of(weight, ct);
  Tensor* gb = bias.defined() ? &detail::grad_of(bias, ct) : nullptr;
  const std::int64_t rows = rows_of(x);
  const detail::Dense xs = detail::dense(x, ct);
  const detail::Dense dys = detail::dense(dy, ct);
  const detail::Dense w = detail::dense(weight.value, ct);
  Tensor dx(ct, x.size_span());
  detail::gemm(ct, false, false, rows, in_, out_, 1.0, dys.data, out_, w.data, in_, 0.0,
               dx.view().data(), in_);
  detail::gemm(ct, true, false, out_, in_, rows, 1.0, dys.data, out_, xs.data, in_, 1.0,
               gw.view().data(), in_);
  if (gb != nullptr) detail::add_column_sums(ct, dys.data, rows, out_, gb->view().data());
  return detail::in_dtype(std::move(dx), x.dtype());
}

NamedParameters Linear::named_parameters(std::string_view prefix) {
  NamedParameters p{{std::string(prefix) + "weight", &weight}};
  if (bias.defined()) p.push_back({std::string(prefix) + "bias", &bias});
  return p;
}

}  // namespace qkv::nn
