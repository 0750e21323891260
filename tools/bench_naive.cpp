// The materialized baseline of `qkv bench`: what attention costs without a
// fused kernel, built from a tuned sgemm (OpenBLAS) and a vectorized exp, so
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

#include "cpu/flash.hpp"

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
  cpu::exp_row(row, n, row);
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

void naive_attention(ConstTensorView q, ConstTensorView k, ConstTensorView v, TensorView out,
                     const AttentionOptions& options, int threads) {
  const DType dtype = q.dtype();
  if (dtype != DType::f32 && dtype != DType::bf16 && dtype != DType::f16) {
    throw Error("naive_attention: dtype must be f32, bf16 or f16, got " +
                std::string(dtype_name(dtype)));
  }
  const std::int64_t batch = q.size(0), nq = q.size(1), hq = q.size(2), d = q.size(3);
  const std::int64_t nk = k.size(1), group = hq / k.size(2);
  const auto scale = static_cast<float>(options.scale.value_or(1.0 / std::sqrt(double(d))));
  const bool in_place = dtype == DType::f32;  // f32 heads are read where they lie
  const std::int64_t out_bytes = static_cast<std::int64_t>(dtype_size(dtype));
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
      auto* dst =
          static_cast<std::byte*>(out.data()) + (b * out.stride(0) + h * out.stride(2)) * out_bytes;
      for (std::int64_t i = 0; i < nq; ++i) {
        float* row = o.data() + i * d;
        for (std::int64_t c = 0; c < d; ++c) row[c] *= inv_sum[i];
        cpu::store_row(row, d, dst + i * out.stride(1) * out_bytes, dtype);
      }
    }
  }
}

}  // namespace qkv::tools
