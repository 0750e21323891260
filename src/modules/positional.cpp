#include "qkv/modules/positional.hpp"

#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "core/elements.hpp"
#include "modules/common.hpp"
#include "qkv/error.hpp"
#include "qkv/positional.hpp"

namespace qkv::nn {

namespace {

using detail::Reasons;
using std::to_string;

// v as a contiguous tensor of `dtype` that the caller may modify.
Tensor contiguous_copy(ConstTensorView v, DType dtype) {
  detail::Dense d = detail::dense(v, dtype);
  if (d.storage.defined()) return std::move(d.storage);
  Tensor t(dtype, v.size_span());
  if (v.numel() > 0) {
    std::memcpy(t.view().data(), d.data, static_cast<std::size_t>(v.numel()) * dtype_size(dtype));
  }
  return t;
}

}  // namespace

// ---- LearnedPositionalEmbedding -------------------------------------------

namespace {

// Checks a [B, N, dim] argument; returns whether its sizes may be used.
bool check_sequence(const char* name, ConstTensorView x, std::int64_t dim, Reasons& r) {
  if (!detail::check_input(name, x, 3, "[B, N, dim]", r)) return false;
  if (x.size(2) != dim) {
    r.push_back(std::string(name) + ": expected last dimension dim = " + to_string(dim) + ", got " +
                shape_string(x.size_span()));
    return false;
  }
  return true;
}

void check_start(std::int64_t start, std::int64_t n, std::int64_t max_positions, Reasons& r) {
  if (start < 0) {
    r.push_back("start: expected a position >= 0, got " + to_string(start));
  } else if (start > max_positions - n) {
    r.push_back("start: positions start + N = " + to_string(start) + " + " + to_string(n) +
                " exceed max_positions = " + to_string(max_positions));
  }
}

}  // namespace

LearnedPositionalEmbedding::LearnedPositionalEmbedding(std::int64_t max_positions, std::int64_t dim,
                                                       DType dtype)
    : max_positions_(max_positions), dim_(dim) {
  Reasons r;
  if (max_positions < 1) {
    r.push_back("max_positions: expected >= 1, got " + to_string(max_positions));
  }
  if (dim < 1) r.push_back("dim: expected >= 1, got " + to_string(dim));
  detail::check_floating("dtype", dtype, r);
  detail::throw_if(r);
  weight = make_parameter(dtype, {max_positions_, dim_});
}

Tensor LearnedPositionalEmbedding::forward(ConstTensorView x, std::int64_t start) const {
  Reasons r;
  if (check_sequence("x", x, dim_, r)) check_start(start, x.size(1), max_positions_, r);
  detail::check_parameter("weight", weight, {max_positions_, dim_}, r);
  detail::throw_if(r);

  const DType ct = detail::compute_dtype(x.dtype());
  const std::int64_t n = x.size(1);
  // Rows [start, start + N) of the table, [N, dim], added to each sequence
  // as one row of N * dim elements.
  const detail::Dense rows = detail::dense(weight.value.view().slice(0, start, n), ct);
  Tensor y = contiguous_copy(x, ct);
  detail::add_row(ct, y.view().data(), x.size(0), n * dim_, rows.data);
  return detail::in_dtype(std::move(y), x.dtype());
}

Tensor LearnedPositionalEmbedding::backward(ConstTensorView x, ConstTensorView dy,
                                            std::int64_t start) {
  Reasons r;
  const bool x_ok = check_sequence("x", x, dim_, r);
  const bool dy_ok = check_sequence("dy", dy, dim_, r);
  if (x_ok) check_start(start, x.size(1), max_positions_, r);
  if (x_ok && dy_ok && x.sizes() != dy.sizes()) {
    r.push_back("dy: expected the sizes of x " + shape_string(x.size_span()) + ", got " +
                shape_string(dy.size_span()));
  }
  detail::check_parameter("weight", weight, {max_positions_, dim_}, r);
  if (x_ok) detail::check_grads(named_parameters(), detail::compute_dtype(x.dtype()), r);
  detail::throw_if(r);

  const DType ct = detail::compute_dtype(x.dtype());
  const std::int64_t n = x.size(1);
  const detail::Dense dys = detail::dense(dy, ct);
  Tensor& grad = detail::grad_of(weight, ct);
  auto* rows = static_cast<std::byte*>(grad.view().data()) +
               start * dim_ * static_cast<std::int64_t>(dtype_size(ct));
  // Sums over the batch in order, one row of N * dim elements per sequence.
  detail::add_column_sums(ct, dys.data, x.size(0), n * dim_, rows);
  return contiguous_copy(dy, x.dtype());
}

NamedParameters LearnedPositionalEmbedding::named_parameters(std::string_view prefix) {
  return {{std::string(prefix) + "weight", &weight}};
}

// ---- RelativePositionBias -------------------------------------------------

RelativePositionBias::RelativePositionBias(std::int64_t num_heads, std::int64_t num_buckets,
                                           std::int64_t max_distance, bool bidirectional,
                                           DType dtype)
    : heads_(num_heads),
      buckets_(num_buckets),
      max_distance_(max_distance),
      bidirectional_(bidirectional) {
  Reasons r;
  if (num_heads < 1) r.push_back("num_heads: expected >= 1, got " + to_string(num_heads));
  // Checked here, not on first use, with the conditions of t5_relative_bucket.
  const std::int64_t min_buckets = bidirectional ? 4 : 2;
  if (num_buckets < min_buckets) {
    r.push_back("num_buckets: expected >= " + to_string(min_buckets) +
                (bidirectional ? " (bidirectional)" : "") + ", got " + to_string(num_buckets));
  } else {
    const std::int64_t exact = (bidirectional ? num_buckets / 2 : num_buckets) / 2;
    if (max_distance <= exact) {
      r.push_back("max_distance: expected more than the " + to_string(exact) +
                  " exact buckets of num_buckets = " + to_string(num_buckets) + ", got " +
                  to_string(max_distance));
    }
  }
  detail::check_floating("dtype", dtype, r);
  detail::throw_if(r);
  weight = make_parameter(dtype, {buckets_, heads_});
}

qkv::RelativePositionBias RelativePositionBias::options() const {
  return {weight.value.view().transpose(0, 1), max_distance_, bidirectional_};
}

void RelativePositionBias::backward(ConstTensorView d_table) {
  Reasons r;
  if (detail::check_input("d_table", d_table, 2, "[H, num_buckets]", r) &&
      (d_table.size(0) != heads_ || d_table.size(1) != buckets_)) {
    r.push_back("d_table: expected [H, num_buckets] = [" + to_string(heads_) + ", " +
                to_string(buckets_) + "], got " + shape_string(d_table.size_span()));
  }
  detail::check_parameter("relative_attention_bias.weight", weight, {buckets_, heads_}, r);
  if (d_table.defined()) {
    detail::check_grads(named_parameters(), detail::compute_dtype(d_table.dtype()), r);
  }
  detail::throw_if(r);

  const DType ct = detail::compute_dtype(d_table.dtype());
  void* grad = detail::grad_of(weight, ct).view().data();
  for (std::int64_t k = 0; k < buckets_; ++k) {
    for (std::int64_t h = 0; h < heads_; ++h) {
      const double d = qkv::detail::load(d_table.data(), d_table.dtype(),
                                         h * d_table.stride(0) + k * d_table.stride(1));
      // One rounding to ct, as ct's own addition.
      qkv::detail::store(grad, ct, k * heads_ + h, qkv::detail::load(grad, ct, k * heads_ + h) + d);
    }
  }
}

Tensor RelativePositionBias::bias(std::int64_t nq, std::int64_t nk) const {
  Reasons r;
  if (nq < 0) r.push_back("nq: expected >= 0, got " + to_string(nq));
  if (nk < 0) r.push_back("nk: expected >= 0, got " + to_string(nk));
  std::int64_t elements = 0;
  if (r.empty() && !qkv::detail::checked_product({heads_, nq, nk}, elements)) {
    r.push_back("nq, nk: the bias [H, nq, nk] = [" + to_string(heads_) + ", " + to_string(nq) +
                ", " + to_string(nk) + "] has more than 2^63 - 1 elements");
  }
  detail::check_parameter("relative_attention_bias.weight", weight, {buckets_, heads_}, r);
  detail::throw_if(r);

  const ConstTensorView w = weight.value;
  Tensor out(w.dtype(), {heads_, nq, nk});
  // An empty bias (nk = 0 with nq up to 2^63 - 1) has no rows to visit.
  if (elements == 0) return out;
  void* o = out.view().data();
  for (std::int64_t i = 0; i < nq; ++i) {
    for (std::int64_t j = 0; j < nk; ++j) {
      const std::int64_t bucket =
          t5_relative_bucket(j - i, buckets_, max_distance_, bidirectional_);
      for (std::int64_t h = 0; h < heads_; ++h) {
        // Same dtype in and out: the value is copied exactly.
        qkv::detail::store(o, w.dtype(), (h * nq + i) * nk + j,
                           qkv::detail::load(w.data(), w.dtype(), bucket * heads_ + h));
      }
    }
  }
  return out;
}

NamedParameters RelativePositionBias::named_parameters(std::string_view prefix) {
  return {{std::string(prefix) + "relative_attention_bias.weight", &weight}};
}

}  // namespace qkv::nn
