// The fast backward of Score::additive (see additive_backward.hpp): GEMMs on
// OpenBLAS for the projections and the products with dO, and one Highway
// loop, compiled per target by re-including this file, for the tanh chain
// over every (query row, key) pair with a nonzero dS.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/additive_backward.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
// (foreach_target.h must come first: it re-includes this file per target.)
#include <cmath>
#include <cstdint>

#include "core/hwy_namespace.hpp"
#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"

QKV_HWY_NAMESPACE_BEGIN(cpu);

// One query row against `keys` keys (rows c * ld of uk and duk), for each
// key c with ds[c] != 0:
//   t = tanh(uq + uk[c]),  du = ds[c] v (1 - t^2)
//   duq += du,  duk[c] += du,  dv += ds[c] t
// Rows are [a_pad] floats (a multiple of every vector width), zero past A,
// where v is zero too, so the padding adds exact zeros.
void ChainRow(const float* HWY_RESTRICT uq, const float* HWY_RESTRICT uk, std::int64_t ld,
              std::int64_t keys, const float* HWY_RESTRICT ds, const float* HWY_RESTRICT v,
              std::int64_t a_pad, float* HWY_RESTRICT duq, float* HWY_RESTRICT duk,
              float* HWY_RESTRICT dv) {
  const hn::ScalableTag<float> d;
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(d));
  const auto one = hn::Set(d, 1.0f);
  for (std::int64_t c = 0; c < keys; ++c) {
    if (ds[c] == 0.0f) continue;
    const auto s = hn::Set(d, ds[c]);
    const float* ukc = uk + c * ld;
    float* dukc = duk + c * ld;
    for (std::int64_t a = 0; a < a_pad; a += lanes) {
      const auto t = hn::Tanh(d, hn::Add(hn::LoadU(d, uq + a), hn::LoadU(d, ukc + a)));
      const auto du = hn::Mul(hn::Mul(s, hn::LoadU(d, v + a)), hn::NegMulAdd(t, t, one));
      hn::StoreU(hn::Add(hn::LoadU(d, duq + a), du), d, duq + a);
      hn::StoreU(hn::Add(hn::LoadU(d, dukc + a), du), d, dukc + a);
      hn::StoreU(hn::MulAdd(s, t, hn::LoadU(d, dv + a)), d, dv + a);
    }
  }
}

// The scores of one query row against `keys` keys (rows c * ld of uk):
//   s[c] = v . tanh(uq + uk[c])
void ScoreRow(const float* HWY_RESTRICT uq, const float* HWY_RESTRICT uk, std::int64_t ld,
              std::int64_t keys, const float* HWY_RESTRICT v, std::int64_t a_pad,
              float* HWY_RESTRICT s) {
  const hn::ScalableTag<float> d;
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(d));
  for (std::int64_t c = 0; c < keys; ++c) {
    const float* ukc = uk + c * ld;
    auto acc = hn::Zero(d);
    for (std::int64_t a = 0; a < a_pad; a += lanes) {
      const auto t = hn::Tanh(d, hn::Add(hn::LoadU(d, uq + a), hn::LoadU(d, ukc + a)));
      acc = hn::MulAdd(hn::LoadU(d, v + a), t, acc);
    }
    s[c] = hn::GetLane(hn::SumOfLanes(d, acc));
  }
}

QKV_HWY_NAMESPACE_END(cpu);

#if HWY_ONCE

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/gemm.hpp"
#include "core/mask_gradient.hpp"
#include "core/softmax_epilogue.hpp"
#include "cpu/additive_backward.hpp"

namespace qkv::cpu {

HWY_EXPORT(ChainRow);
HWY_EXPORT(ScoreRow);

namespace {

// x as contiguous f32 values in x's own shape: x's memory when it already
// is, else a converted copy; null when x is undefined.
class Floats {
 public:
  explicit Floats(ConstTensorView x) {
    if (!x.defined()) return;
    if (x.dtype() == DType::f32 && x.is_contiguous()) {
      data_ = static_cast<const float*>(x.data());
      return;
    }
    copy_.resize(static_cast<std::size_t>(x.numel()));
    data_ = copy_.data();
    if (copy_.empty()) return;
    const std::vector<std::int64_t> sizes(x.size_span().begin(), x.size_span().end());
    copy(x, TensorView(copy_.data(), DType::f32, sizes));
  }
  const float* data() const { return data_; }

  // x with the rows [rows][cols] that `used` does not mark set to zero:
  // rows no gradient flows through, so that whatever they hold (padding,
  // NaN) never enters dW = dU^T x, where their dU row is zero.
  const float* with_unused_rows_zero(std::int64_t cols, const std::vector<unsigned char>& used) {
    if (std::all_of(used.begin(), used.end(), [](unsigned char u) { return u != 0; })) {
      return data_;
    }
    if (copy_.empty()) copy_.assign(data_, data_ + static_cast<std::int64_t>(used.size()) * cols);
    for (std::size_t r = 0; r < used.size(); ++r) {
      if (used[r] == 0)
        std::fill_n(copy_.begin() + static_cast<std::int64_t>(r) * cols, cols, 0.0f);
    }
    return data_ = copy_.data();
  }

 private:
  const float* data_ = nullptr;
  std::vector<float> copy_;
};

// An f32 result of dst's shape, zero to start with: dst's memory when dst is
// contiguous f32, else scratch that finish() converts into dst.
class Result {
 public:
  explicit Result(TensorView dst) : dst_(dst) {
    if (!dst.defined()) return;
    if (dst.dtype() == DType::f32 && dst.is_contiguous()) {
      data_ = static_cast<float*>(dst.data());
      std::fill_n(data_, dst.numel(), 0.0f);
    } else {
      scratch_.resize(static_cast<std::size_t>(dst.numel()));
      data_ = scratch_.data();
    }
  }
  float* data() { return data_; }

  // Stores the result into dst; returns whether every value is finite.
  bool finish() {
    if (!dst_.defined()) return true;
    const std::int64_t n = dst_.numel();
    const bool finite = std::all_of(data_, data_ + n, [](float x) { return std::isfinite(x); });
    if (!scratch_.empty()) {
      const std::vector<std::int64_t> sizes(dst_.size_span().begin(), dst_.size_span().end());
      copy(ConstTensorView(scratch_.data(), DType::f32, sizes), dst_);
    }
    return finite;
  }

 private:
  TensorView dst_;
  float* data_ = nullptr;
  std::vector<float> scratch_;
};

// Scores s [keys] (keys >= 1) into weights in place: p = exp(s - lse) with
// the row's own lse = m + log(sum_c exp(s_c - m)), m = max_c s_c, finished
// as the forward finishes its rows (core/softmax_epilogue.hpp). Not the
// forward's lse: these scores come from other GEMMs than the forward's (over
// all rows of Q and K, not one unit's), whose sums may round apart in the
// last bit, and against the forward's lse such scores give a row's only key
// a weight an ulp or more off 1. Against their own, it weighs exactly 1, and
// a row's weights sum to 1 but for rounding.
void WeightsFromScores(float* s, std::int64_t keys) {
  const float m = *std::max_element(s, s + keys);
  float sum = 0.0f;
  for (std::int64_t c = 0; c < keys; ++c) sum += std::exp(s[c] - m);
  const float row_lse = detail::finish_row(m, sum).lse;
  for (std::int64_t c = 0; c < keys; ++c) s[c] = detail::weight_from_lse(s[c], row_lse);
}

}  // namespace

bool additive_backward(const detail::AttentionProblem& p, const KernelParams& o, ConstTensorView q,
                       ConstTensorView k, ConstTensorView v, ConstTensorView out,
                       ConstTensorView dout, ConstTensorView probs, const GradientOutputs& grads) {
  const std::int64_t A = p.attention_size, a_pad = (A + 15) / 16 * 16;
  const std::int64_t rows_q = p.batch * p.nq * p.hq;             // rows of q, out, dout
  const std::int64_t rows_k = p.batch * p.nk * p.hkv;            // rows of k, v
  Floats qs(q), ks(k);                                           // [rows_q][Dq], [rows_k][Dk]
  const Floats vs(v), outs(out), douts(dout);                    // [rows_k][Dv], [rows_q][Dv] x 2
  const Floats ps(probs);                                        // [B][Hq][Nq][Nk], or null
  const Floats w_q(o.additive.w_q), w_k(o.additive.w_k);         // [A][Dq], [A][Dk]
  const Floats v_weight(o.additive.v);                           // [A]
  std::vector<float> v_a(v_weight.data(), v_weight.data() + A);  // [a_pad], zero past A
  v_a.resize(static_cast<std::size_t>(a_pad));
  const Floats bias(o.additive.bias);  // [A], or null
  const bool with_bias = bias.data() != nullptr;

  // UQ [rows_q][a_pad] = Q W_q^T, UK [rows_k][a_pad] = K W_k^T + bias: the
  // bias on the keys' side, where the forward adds it, so that tanh's
  // argument UQ + UK is formed as there.
  std::vector<float> uq(static_cast<std::size_t>(rows_q * a_pad));
  std::vector<float> uk(static_cast<std::size_t>(rows_k * a_pad));
  detail::gemm(DType::f32, false, true, rows_q, A, p.dq, 1.0, qs.data(), p.dq, w_q.data(), p.dq,
               0.0, uq.data(), a_pad);
  detail::gemm(DType::f32, false, true, rows_k, A, p.dk, 1.0, ks.data(), p.dk, w_k.data(), p.dk,
               0.0, uk.data(), a_pad, bias.data());

  // Gradients of UQ, UK and V, and which rows of Q and K they reach.
  std::vector<float> duq(uq.size()), duk(uk.size());
  Result dvs(grads.dv);  // [rows_k][Dv]
  std::vector<unsigned char> q_used(static_cast<std::size_t>(rows_q));
  std::vector<unsigned char> k_used(static_cast<std::size_t>(rows_k));
  // One work item per (sequence, KV head); each has its own d_v partial sum.
  const std::int64_t items = p.sequences * p.hkv;
  std::vector<float> dv_partial(static_cast<std::size_t>(items * a_pad));
  // dS at every (b, h, i, j), for d_mask (core/mask_gradient.hpp).
  Tensor ds_full = grads.d_mask.defined() ? detail::score_gradients(p, DType::f32) : Tensor();
  float* const ds_at = ds_full.defined() ? ds_full.data<float>() : nullptr;
  const std::int64_t ld_q = p.hq * p.dv, ld_k = p.hkv * p.dv;  // row strides of one head
#pragma omp parallel for schedule(dynamic) if (items > 1)
  for (std::int64_t item = 0; item < items; ++item) {
    const detail::SequenceExtent seq = p.sequence(item / p.hkv);
    const std::int64_t hk = item % p.hkv, nq = seq.nq, nk = seq.nk;
    if (nq == 0 || nk == 0) continue;
    const std::int64_t k_row = (seq.batch * p.nk + seq.k_begin) * p.hkv + hk;  // key 0's row
    std::vector<float> dp(static_cast<std::size_t>(nq * nk));                  // [nq][nk]
    std::vector<float> ds(static_cast<std::size_t>(nk));  // dS of one query row
    // Without `probs`, the weights of one head [nq][nk] from UQ and UK.
    std::vector<float> own(ps.data() ? 0 : static_cast<std::size_t>(nq * nk));
    for (std::int64_t h = hk * p.group(); h < (hk + 1) * p.group(); ++h) {
      const std::int64_t q_row = (seq.batch * p.nq + seq.q_begin) * p.hq + h;  // query 0's row
      const float* prob = own.data();  // [nq] rows of stride ld_p
      std::int64_t ld_p = nk;
      if (ps.data()) {
        prob = ps.data() + ((seq.batch * p.hq + h) * p.nq + seq.q_begin) * p.nk + seq.k_begin;
        ld_p = p.nk;
      } else {
        for (std::int64_t i = 0; i < nq; ++i) {
          float* row = own.data() + i * nk;
          HWY_DYNAMIC_DISPATCH(ScoreRow)
          (uq.data() + (q_row + i * p.hq) * a_pad, uk.data() + k_row * a_pad, p.hkv * a_pad, nk,
           v_a.data(), a_pad, row);
          WeightsFromScores(row, nk);
        }
      }
      const float* dout_h = douts.data() + q_row * p.dv;
      // dP = dO V^T [nq][nk]; dV += P^T dO [nk][Dv].
      detail::gemm(DType::f32, false, true, nq, nk, p.dv, 1.0, dout_h, ld_q,
                   vs.data() + k_row * p.dv, ld_k, 0.0, dp.data(), nk);
      detail::gemm(DType::f32, true, false, nk, p.dv, nq, 1.0, prob, ld_p, dout_h, ld_q, 1.0,
                   dvs.data() + k_row * p.dv, ld_k);
      for (std::int64_t i = 0; i < nq; ++i) {
        const std::int64_t row = q_row + i * p.hq;
        // D_i = <dO_i, O_i>, or without out its equal sum_j P_ij dP_ij.
        float d_i = 0.0f;
        if (outs.data() != nullptr) {
          d_i = detail::row_delta(douts.data() + row * p.dv, outs.data() + row * p.dv, p.dv);
        } else {
          for (std::int64_t j = 0; j < nk; ++j) d_i += prob[i * ld_p + j] * dp[i * nk + j];
        }
        bool any = false;
        for (std::int64_t j = 0; j < nk; ++j) {
          const float pij = prob[i * ld_p + j];
          // A weight of exactly 0 (a dropped key) cancels its terms, even a
          // NaN or inf from a value it never meets.
          ds[j] = pij == 0.0f ? 0.0f : pij * (dp[i * nk + j] - d_i);
          if (ds[j] == 0.0f) continue;
          k_used[static_cast<std::size_t>(k_row + j * p.hkv)] = 1;
          any = true;
        }
        if (ds_at != nullptr) {
          std::copy_n(
              ds.data(), nk,
              ds_at + ((seq.batch * p.hq + h) * p.nq + seq.q_begin + i) * p.nk + seq.k_begin);
        }
        if (!any) continue;
        q_used[static_cast<std::size_t>(row)] = 1;
        HWY_DYNAMIC_DISPATCH(ChainRow)
        (uq.data() + row * a_pad, uk.data() + k_row * a_pad, p.hkv * a_pad, nk, ds.data(),
         v_a.data(), a_pad, duq.data() + row * a_pad, duk.data() + k_row * a_pad,
         dv_partial.data() + item * a_pad);
      }
    }
  }

  // dq = dUQ W_q, dk = dUK W_k; dW_q = dUQ^T Q, dW_k = dUK^T K over the rows
  // a gradient reached (the others are zero in dU and made zero in Q, K).
  Result dq(grads.dq), dk(grads.dk), dw_q(grads.d_additive_w_q), dw_k(grads.d_additive_w_k);
  detail::gemm(DType::f32, false, false, rows_q, p.dq, A, 1.0, duq.data(), a_pad, w_q.data(), p.dq,
               0.0, dq.data(), p.dq);
  detail::gemm(DType::f32, false, false, rows_k, p.dk, A, 1.0, duk.data(), a_pad, w_k.data(), p.dk,
               0.0, dk.data(), p.dk);
  detail::gemm(DType::f32, true, false, A, p.dq, rows_q, 1.0, duq.data(), a_pad,
               qs.with_unused_rows_zero(p.dq, q_used), p.dq, 0.0, dw_q.data(), p.dq);
  detail::gemm(DType::f32, true, false, A, p.dk, rows_k, 1.0, duk.data(), a_pad,
               ks.with_unused_rows_zero(p.dk, k_used), p.dk, 0.0, dw_k.data(), p.dk);
  // d_bias = column sums of dUQ, d_v = the items' partial sums, in order.
  Result d_bias(with_bias ? grads.d_additive_bias : TensorView()), d_v(grads.d_additive_v);
  for (std::int64_t r = 0; with_bias && r < rows_q; ++r) {
    for (std::int64_t a = 0; a < A; ++a) d_bias.data()[a] += duq[r * a_pad + a];
  }
  for (std::int64_t item = 0; item < items; ++item) {
    for (std::int64_t a = 0; a < A; ++a) d_v.data()[a] += dv_partial[item * a_pad + a];
  }
  bool finite = true;
  for (Result* r : {&dq, &dk, &dvs, &dw_q, &dw_k, &d_v, &d_bias}) finite &= r->finish();
  if (ds_at != nullptr) finite = detail::sum_into_mask(ds_full, grads.d_mask) && finite;
  return finite;
}

}  // namespace qkv::cpu

#endif  // HWY_ONCE
