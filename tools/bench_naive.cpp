// The materialized baselines of `qkv bench`: what attention and its gradients
// cost without a fused kernel, built from a tuned sgemm (OpenBLAS) and a vectorized exp, so
// that the comparison measures the fusion and not a slow GEMM.
#include "bench_naive.hpp"

#include <cblas.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "qkv/internal/kernels.hpp"

namespace qkv::tools {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Row reductions keep kLanes partial results: one running value is a serial
// chain that IEEE order forbids the compiler to split, while independent
// partial results vectorize.
constexpr std::int64_t kLanes = 16;

float row_max(const float* x, std::int64_t n) {
  std::array<float, kLanes> part;
  part.fill(kNegInf);
  std::int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (std::int64_t l = 0; l < kLanes; ++l) part[l] = std::max(part[l], x[j + l]);
  }
  float result = *std::max_element(part.begin(), part.end());
  for (; j < n; ++j) result = std::max(result, x[j]);
  return result;
}

float row_sum(const float* x, std::int64_t n) {
  std::array<float, kLanes> part{};
  std::int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (std::int64_t l = 0; l < kLanes; ++l) part[l] += x[j + l];
  }
  float result = 0.0f;
  for (const float p : part) result += p;
  for (; j < n; ++j) result += x[j];
  return result;
}

// Masks the keys outside `keys` with -inf, then replaces the row by
// exp(row - max) and returns 1 / sum, the normalization (0 for a fully masked
// row, whose weights are then all 0, as qkv::attention specifies).
float softmax_row(float* row, std::int64_t n, KeyRange keys) {
  std::fill(row, row + keys.begin, kNegInf);
  std::fill(row + keys.end, row + n, kNegInf);
  const float max = row_max(row, n);
  if (max == kNegInf) {
    std::fill(row, row + n, 0.0f);
    return 0.0f;
  }
  for (std::int64_t j = 0; j < n; ++j) row[j] -= max;
  internal::exp_row(row, n, row);
  return 1.0f / row_sum(row, n);
}

template <class T>
void widen(const T* src, std::int64_t rows, std::int64_t ld, std::int64_t d, float* dst) {
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < d; ++c) dst[r * d + c] = to_float(src[r * ld + c]);
  }
}

// A row-major f32 matrix as sgemm takes it.
struct Matrix {
  const float* data = nullptr;
  std::int64_t ld = 0;  // leading dimension (elements between rows)
};

// Head h of batch entry b of t [B, N, H, D] as an [N, D] f32 matrix: t's own
// memory for f32, else widened into `buffer` [N * D].
Matrix head_f32(ConstTensorView t, std::int64_t b, std::int64_t h, float* buffer) {
  const std::int64_t offset = b * t.stride(0) + h * t.stride(2);
  const std::int64_t rows = t.size(1), d = t.size(3), ld = t.stride(1);
  switch (t.dtype()) {
    case DType::bf16:
      widen(static_cast<const bf16*>(t.data()) + offset, rows, ld, d, buffer);
      return {buffer, d};
    case DType::f16:
      widen(static_cast<const f16*>(t.data()) + offset, rows, ld, d, buffer);
      return {buffer, d};
    default:
      return {static_cast<const float*>(t.data()) + offset, ld};
  }
}

// Rounds the f32 matrix `src` [N, D] (leading dimension D) into head h of
// batch entry b of t [B, N, H, D].
void store_head(const float* src, TensorView t, std::int64_t b, std::int64_t h) {
  const auto bytes = static_cast<std::int64_t>(dtype_size(t.dtype()));
  auto* dst = static_cast<std::byte*>(t.data()) + (b * t.stride(0) + h * t.stride(2)) * bytes;
  const std::int64_t d = t.size(3);
  for (std::int64_t i = 0; i < t.size(1); ++i) {
    internal::store_row(src + i * d, d, dst + i * t.stride(1) * bytes, t.dtype());
  }
}

void check_dtype(const char* function, DType dtype) {
  if (dtype != DType::f32 && dtype != DType::bf16 && dtype != DType::f16) {
    throw Error(std::string(function) + ": dtype must be f32, bf16 or f16, got " +
                std::string(dtype_name(dtype)));
  }
}

float scale_of(const AttentionOptions& options, std::int64_t d) {
  return static_cast<float>(options.scale.value_or(1.0 / std::sqrt(static_cast<double>(d))));
}

}  // namespace

KeyRange keys_of_row(std::int64_t i, std::int64_t nq, std::int64_t nk,
                     const AttentionOptions& options) {
  const std::int64_t p = options.align == Align::bottom_right ? i + (nk - nq) : i;
  std::int64_t begin = 0, end = nk;
  if (options.causal) end = std::min(end, p + 1);
  if (options.window_right >= 0) end = std::min(end, p + options.window_right + 1);
  if (options.window_left >= 0) begin = std::clamp(p - options.window_left, std::int64_t{0}, nk);
  return {begin, std::max(begin, end)};
}

std::int64_t unmasked_pairs(std::int64_t nq, std::int64_t nk, const AttentionOptions& options) {
  std::int64_t pairs = 0;
  for (std::int64_t i = 0; i < nq; ++i) {
    const KeyRange keys = keys_of_row(i, nq, nk, options);
    pairs += keys.end - keys.begin;
  }
  return pairs;
}

void materialized_attention(ConstTensorView q, ConstTensorView k, ConstTensorView v, TensorView out,
                            const AttentionOptions& options, int threads) {
  const DType dtype = q.dtype();
  check_dtype("materialized_attention", dtype);
  const std::int64_t batch = q.size(0), nq = q.size(1), hq = q.size(2), d = q.size(3);
  const std::int64_t nk = k.size(1), group = hq / k.size(2);
  const float scale = scale_of(options, d);
  const bool in_place = dtype == DType::f32;  // f32 heads are read where they lie
#pragma omp parallel num_threads(threads)
  {
    // Per thread: S [nq, nk] (the memory a fused kernel avoids), O [nq, d],
    // 1 / row sums [nq], and the head's q, k, v widened to f32 unless f32.
    const auto s = std::make_unique_for_overwrite<float[]>(static_cast<std::size_t>(nq * nk));
    std::vector<float> o(static_cast<std::size_t>(nq * d)), inv_sum(static_cast<std::size_t>(nq));
    std::vector<float> q32(in_place ? 0 : static_cast<std::size_t>(nq * d));
    std::vector<float> k32(in_place ? 0 : static_cast<std::size_t>(nk * d));
    std::vector<float> v32(in_place ? 0 : static_cast<std::size_t>(nk * d));
#pragma omp for schedule(static)
    for (std::int64_t bh = 0; bh < batch * hq; ++bh) {
      const std::int64_t b = bh / hq, h = bh % hq;
      const Matrix qm = head_f32(q, b, h, q32.data());
      const Matrix km = head_f32(k, b, h / group, k32.data());
      const Matrix vm = head_f32(v, b, h / group, v32.data());
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nq, nk, d, scale, qm.data, qm.ld,
                  km.data, km.ld, 0.0f, s.get(), nk);
      for (std::int64_t i = 0; i < nq; ++i) {
        inv_sum[i] = softmax_row(s.get() + i * nk, nk, keys_of_row(i, nq, nk, options));
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nq, d, nk, 1.0f, s.get(), nk, vm.data,
                  vm.ld, 0.0f, o.data(), d);
      // Normalizing O's D columns rather than P's Nk columns: the usual
      // shortcut, equal up to rounding.
      for (std::int64_t i = 0; i < nq; ++i) {
        float* row = o.data() + i * d;
        for (std::int64_t c = 0; c < d; ++c) row[c] *= inv_sum[i];
      }
      store_head(o.data(), out, b, h);
    }
  }
}

void materialized_attention_backward(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                                     ConstTensorView out, ConstTensorView dout, ConstTensorView lse,
                                     TensorView dq, TensorView dk, TensorView dv,
                                     const AttentionOptions& options, int threads) {
  const DType dtype = q.dtype();
  check_dtype("materialized_attention_backward", dtype);
  const std::int64_t batch = q.size(0), nq = q.size(1), hq = q.size(2), d = q.size(3);
  const std::int64_t nk = k.size(1), hkv = k.size(2), group = hq / hkv;
  const float scale = scale_of(options, d);
  const bool in_place = dtype == DType::f32;  // f32 heads are read where they lie
  const auto* lse_data = static_cast<const float*>(lse.data());
  // One KV head per work item, so that dK and dV are summed over its query
  // heads by one thread, in head order.
#pragma omp parallel num_threads(threads)
  {
    // Per thread: P and dP (then dS) [nq, nk] (the memory a fused kernel
    // avoids), dQ [nq, d], the sums dK and dV [nk, d], rowsum(dO * O) [nq],
    // and the heads widened to f32 unless f32.
    const auto p = std::make_unique_for_overwrite<float[]>(static_cast<std::size_t>(nq * nk));
    const auto ds = std::make_unique_for_overwrite<float[]>(static_cast<std::size_t>(nq * nk));
    std::vector<float> dq32(static_cast<std::size_t>(nq * d)),
        row_dot(static_cast<std::size_t>(nq));
    std::vector<float> dk32(static_cast<std::size_t>(nk * d)),
        dv32(static_cast<std::size_t>(nk * d));
    const auto widened = [&](std::int64_t rows) {
      return std::vector<float>(in_place ? 0 : static_cast<std::size_t>(rows * d));
    };
    std::vector<float> q32 = widened(nq), o32 = widened(nq), do32 = widened(nq);
    std::vector<float> k32 = widened(nk), v32 = widened(nk);
#pragma omp for schedule(static)
    for (std::int64_t bh = 0; bh < batch * hkv; ++bh) {
      const std::int64_t b = bh / hkv, g = bh % hkv;
      const Matrix km = head_f32(k, b, g, k32.data());
      const Matrix vm = head_f32(v, b, g, v32.data());
      for (std::int64_t h = g * group; h < (g + 1) * group; ++h) {
        const Matrix qm = head_f32(q, b, h, q32.data());
        const Matrix om = head_f32(out, b, h, o32.data());
        const Matrix dom = head_f32(dout, b, h, do32.data());
        // The first query head of the KV head overwrites dK and dV, the
        // others add to them.
        const float beta = h == g * group ? 0.0f : 1.0f;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nq, nk, d, scale, qm.data, qm.ld,
                    km.data, km.ld, 0.0f, p.get(), nk);
        const float* lse_row = lse_data + b * lse.stride(0) + h * lse.stride(1);
        for (std::int64_t i = 0; i < nq; ++i) {
          float* row = p.get() + i * nk;
          const KeyRange keys = keys_of_row(i, nq, nk, options);
          const float lse_i = lse_row[i * lse.stride(2)];
          // A row with no admitted key (lse = -inf) has P = 0.
          if (lse_i == kNegInf || keys.begin >= keys.end) {
            std::fill(row, row + nk, 0.0f);
            continue;
          }
          std::fill(row, row + keys.begin, 0.0f);
          std::fill(row + keys.end, row + nk, 0.0f);
          for (std::int64_t j = keys.begin; j < keys.end; ++j) row[j] -= lse_i;
          internal::exp_row(row + keys.begin, keys.end - keys.begin, row + keys.begin);
        }
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, nk, d, nq, 1.0f, p.get(), nk, dom.data,
                    dom.ld, beta, dv32.data(), d);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nq, nk, d, 1.0f, dom.data, dom.ld,
                    vm.data, vm.ld, 0.0f, ds.get(), nk);
        for (std::int64_t i = 0; i < nq; ++i) {
          float dot = 0.0f;
          for (std::int64_t c = 0; c < d; ++c) {
            dot += dom.data[i * dom.ld + c] * om.data[i * om.ld + c];
          }
          row_dot[i] = dot;
        }
        for (std::int64_t i = 0; i < nq; ++i) {
          const float* p_row = p.get() + i * nk;
          float* ds_row = ds.get() + i * nk;
          for (std::int64_t j = 0; j < nk; ++j) ds_row[j] = p_row[j] * (ds_row[j] - row_dot[i]);
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nq, d, nk, scale, ds.get(), nk,
                    km.data, km.ld, 0.0f, dq32.data(), d);
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, nk, d, nq, scale, ds.get(), nk,
                    qm.data, qm.ld, beta, dk32.data(), d);
        store_head(dq32.data(), dq, b, h);
      }
      store_head(dk32.data(), dk, b, g);
      store_head(dv32.data(), dv, b, g);
    }
  }
}

}  // namespace qkv::tools
