// core/mask_gradient.hpp — d_mask, the float mask's gradient
// (options.mask_requires_grad). The mask is added to the score s_ij, so its
// gradient at (b, h, i, j) is dS_ij, the score's gradient (before softcap's
// chain, which comes before the mask); a mask that broadcasts along a
// dimension gets dS summed over it. Every backend writes dS at each
// (b, h, i, j) of [B, Hq, Nq, Nk] into a buffer from score_gradients (zero
// where no key is admitted; packed sequences at their packed rows and keys,
// zero between them), each element by one thread, and sum_into_mask reduces
// it in a fixed order: the result never depends on the thread count.
#pragma once

#include "core/problem.hpp"
#include "qkv/tensor.hpp"

namespace qkv::detail {

// A zeroed contiguous [B, Hq, Nq, Nk] buffer of `dtype` for dS.
Tensor score_gradients(const AttentionProblem& p, DType dtype);

// d_mask[m] = the sum of ds over the (b, h, i, j) that broadcast onto m
// (right-aligned, size-1 dimensions repeat), in double in index order,
// stored once. ds is score_gradients' buffer, d_mask shaped like the mask.
// Returns whether every sum is finite.
bool sum_into_mask(ConstTensorView ds, TensorView d_mask);

}  // namespace qkv::detail
