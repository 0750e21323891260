#include "core/mask_gradient.hpp"

#include <cmath>
#include <cstdint>
#include <vector>

#include "core/elements.hpp"

namespace qkv::detail {
namespace {

template <class Real>
void add_rows(const Real* ds, const std::int64_t (&sizes)[4], ConstTensorView d_mask,
              std::vector<double>& sums) {
  // The mask's dimensions right-aligned to [B, Hq, Nq, Nk], with the
  // stride of each in `sums` (row-major in the mask's shape); 0 where the
  // mask broadcasts.
  std::int64_t step[4] = {0, 0, 0, 0};
  std::int64_t stride = 1;
  for (int d = d_mask.rank() - 1; d >= 0; --d) {
    const int dim = 4 - d_mask.rank() + d;
    step[dim] = d_mask.size(d) == 1 ? 0 : stride;
    stride *= d_mask.size(d);
  }
  for (std::int64_t b = 0; b < sizes[0]; ++b) {
    for (std::int64_t h = 0; h < sizes[1]; ++h) {
      for (std::int64_t i = 0; i < sizes[2]; ++i) {
        double* row = sums.data() + b * step[0] + h * step[1] + i * step[2];
        const Real* src = ds + ((b * sizes[1] + h) * sizes[2] + i) * sizes[3];
        for (std::int64_t j = 0; j < sizes[3]; ++j) row[j * step[3]] += src[j];
      }
    }
  }
}

}  // namespace

Tensor score_gradients(const AttentionProblem& p, DType dtype) {
  return Tensor(dtype, {p.batch, p.hq, p.nq, p.nk});  // zeroed on construction
}

bool sum_into_mask(ConstTensorView ds, TensorView d_mask) {
  const std::int64_t sizes[4] = {ds.size(0), ds.size(1), ds.size(2), ds.size(3)};
  std::vector<double> sums(static_cast<std::size_t>(d_mask.numel()), 0.0);
  if (ds.dtype() == DType::f64) {
    add_rows(static_cast<const double*>(ds.data()), sizes, d_mask, sums);
  } else {
    add_rows(static_cast<const float*>(ds.data()), sizes, d_mask, sums);
  }
  bool finite = true;
  std::size_t m = 0;  // row-major, as `sums`
  for_each_index(d_mask.sizes(), d_mask.rank(), [&](const Shape& idx) {
    store(d_mask.data(), d_mask.dtype(), offset(idx, d_mask.strides(), d_mask.rank()), sums[m]);
    finite = finite && std::isfinite(sums[m]);
    ++m;
  });
  return finite;
}

}  // namespace qkv::detail
