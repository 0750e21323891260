// The fast backward of Score::additive. The softmax weights P come from the
// forward's probabilities pass (which applies every mask and bias), or,
// when key_lengths is a call's one mask, from this file's own projections
// as P_ij = exp(s_ij - lse_i), s_ij = v . tanh(UQ_i + UK_j), lse_i of the
// row's own s_ij; this file only differentiates the score itself. Computes
// in f32; per sequence b and KV head, over the query heads h of its group
// (shapes of one head):
//
//   UQ = Q W_q^T  [Nq, A],          UK = K W_k^T + bias  [Nk, A]  (GEMMs; the
//                                   bias where the forward adds it)
//   dP = dO V^T  [Nq, Nk],          dV += P^T dO  [Nk, Dv]      (GEMMs)
//   dS_ij = P_ij (dP_ij - D_i),     D_i = <dO_i, O_i>           (0 where P_ij = 0)
//                                   or sum_j P_ij dP_ij without O
//   t = tanh(UQ_i + UK_j),  du = dS_ij v (1 - t^2)              (Highway, per pair)
//   dUQ_i += du,  dUK_j += du,  d_v += dS_ij t
//   d_mask: dS itself, summed where the mask broadcasts (core/mask_gradient.hpp)
//
// then dq = dUQ W_q, dk = dUK W_k, dW_q = dUQ^T Q, dW_k = dUK^T K (GEMMs over
// all rows) and d_bias = the column sums of dUQ (equal to dUK's: each du
// enters both). The readable form is the reference backward
// (reference/backward.cpp).
#pragma once

#include "core/problem.hpp"
#include "cpu/params.hpp"
#include "qkv/backward.hpp"

namespace qkv::cpu {

// The gradients of a validated Score::additive call into `grads`. `probs`
// [B, Hq, Nq, Nk] (f32 or f64) are the forward's softmax weights of this
// call; undefined, they are computed here from the projections, each row
// normalized by the lse of its own scores (not the forward's: see
// WeightsFromScores), which only a call whose one mask is key_lengths may
// do (Path::additive_own_weights in core/capabilities.cpp). Such a call may also leave `out`
// undefined: then D_i = sum_j P_ij dP_ij replaces <dO_i, O_i> (equal, as
// sum_j P_ij = 1), so no forward pass is needed. Runs on OpenMP threads
// over (sequence, KV head) pairs, each written by one thread, with GEMMs
// cut into fixed blocks, so the result does not depend on the thread count.
// Returns whether every gradient is finite.
bool additive_backward(const detail::AttentionProblem& problem, const KernelParams& params,
                       ConstTensorView q, ConstTensorView k, ConstTensorView v, ConstTensorView out,
                       ConstTensorView dout, ConstTensorView probs, const GradientOutputs& grads);

}  // namespace qkv::cpu
