// Bad input to qkv::attention and qkv::attention_into: every row starts from a
// valid call, breaks one thing, and checks that qkv::Error (not another
// exception, not a crash) names the argument, the expected and the actual value.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <limits>
#include <memory>
#include <optional>
#include <ostream>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "bad_input.hpp"
#include "qkv/qkv.hpp"

namespace {

using qkv::ConstTensorView;
using qkv::DType;
using qkv::TensorView;
using qkv::test::error_of;
using qkv::test::expect_contains;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// One attention call under construction: the valid base case q [2, 5, 4, 8],
// k and v [2, 7, 2, 8] (f32, GQA with 2 query heads per KV head), which a row
// then breaks. Views and spans point into buffers owned here, so a Call is
// never copied or moved.
class Call {
 public:
  Call() {
    q = tensor(DType::f32, {2, 5, 4, 8});
    k = tensor(DType::f32, {2, 7, 2, 8});
    v = tensor(DType::f32, {2, 7, 2, 8});
  }
  Call(const Call&) = delete;
  Call& operator=(const Call&) = delete;

  // A zeroed contiguous tensor that lives as long as the call. Buffers hold at
  // least kMinElements so that a row may alias a larger view onto any of them
  // without the view leaving the allocation.
  qkv::TensorView tensor(DType dtype, std::initializer_list<std::int64_t> sizes) {
    std::int64_t n = 1;
    for (std::int64_t s : sizes) n *= s;
    const auto count = static_cast<std::size_t>(std::max(n, kMinElements));
    switch (dtype) {
      case DType::f32:
        return {alloc<float>(count), dtype, sizes};
      case DType::f64:
        return {alloc<double>(count), dtype, sizes};
      case DType::f16:
        return {alloc<qkv::f16>(count), dtype, sizes};
      case DType::bf16:
        return {alloc<qkv::bf16>(count), dtype, sizes};
      case DType::boolean:
        return {alloc<std::uint8_t>(count), dtype, sizes};
    }
    return {};
  }
  // A span over a copy of `values` that lives as long as the call.
  template <class T>
  std::span<const T> list(std::initializer_list<T> values) {
    T* p = alloc<T>(values.size());
    std::copy(values.begin(), values.end(), p);
    return {p, values.size()};
  }

  // Switches to attention_into with valid out [2, 5, 4, 8], lse [2, 4, 5] and
  // probs [2, 4, 5, 7], each in its own buffer.
  void use_outputs() {
    into = true;
    outputs.out = tensor(DType::f32, {2, 5, 4, 8});
    outputs.lse = tensor(DType::f32, {2, 4, 5});
    outputs.probs = tensor(DType::f32, {2, 4, 5, 7});
  }
  // Score::additive with valid parameters of attention size A = 3.
  void use_additive() {
    options.score = qkv::Score::additive;
    options.additive.w_q = tensor(DType::f32, {3, 8});
    options.additive.w_k = tensor(DType::f32, {3, 8});
    options.additive.v = tensor(DType::f32, {3});
    options.additive.bias = tensor(DType::f32, {3});
  }
  // Two packed sequences (2 + 3 query rows, 3 + 4 key rows) in batch 1.
  void use_packed() {
    q = tensor(DType::f32, {1, 5, 4, 8});
    k = tensor(DType::f32, {1, 7, 2, 8});
    v = tensor(DType::f32, {1, 7, 2, 8});
    options.cu_seqlens_q = list<std::int64_t>({0, 2, 5});
    options.cu_seqlens_k = list<std::int64_t>({0, 3, 7});
  }

  void run() const {
    if (into) {
      qkv::attention_into(q, k, v, outputs, options);
    } else {
      (void)qkv::attention(q, k, v, options);
    }
  }

  qkv::TensorView q, k, v;  // mutable so that rows can alias outputs onto them
  qkv::AttentionOptions options;
  qkv::AttentionOutputs outputs;
  bool into = false;  // false: qkv::attention; true: qkv::attention_into

 private:
  static constexpr std::int64_t kMinElements = 1024;

  template <class T>
  T* alloc(std::size_t n) {
    auto block = std::make_shared<std::vector<T>>(n);
    T* p = block->data();
    blocks_.push_back(std::move(block));
    return p;
  }

  std::vector<std::shared_ptr<void>> blocks_;
};

struct BadCase {
  std::string name;                   // gtest parameter name
  std::function<void(Call&)> breaks;  // turns the valid base call into a bad one
  std::vector<std::string> message;   // substrings that what() must contain
  std::size_t reasons = 1;            // problems the error lists (one per broken thing)
};

void PrintTo(const BadCase& c, std::ostream* os) { *os << c.name; }

// 2^40: with a stride of 2^40, its last row sits 2^80 elements in.
constexpr std::int64_t kHuge = std::int64_t{1} << 40;

const std::vector<BadCase>& bad_cases() {
  static const std::vector<BadCase> cases = {
      // q, k, v
      {"q_rank_3",
       [](Call& c) {
         c.q = c.tensor(DType::f32, {2, 5, 32});
       },
       {"q: expected rank 4, got rank 3", "[2, 5, 32]"}},
      {"k_rank_2",
       [](Call& c) {
         c.k = c.tensor(DType::f32, {14, 16});
       },
       {"k: expected rank 4, got rank 2"}},
      {"v_rank_0",
       [](Call& c) { c.v = c.tensor(DType::f32, {}); },
       {"v: expected rank 4, got rank 0"}},
      {"q_undefined", [](Call& c) { c.q = {}; }, {"q: required tensor is undefined"}},
      {"q_null_data",
       [](Call& c) {
         c.q = TensorView(nullptr, DType::f32, {2, 5, 4, 8});
       },
       {"q: data is null", "320 elements", "[2, 5, 4, 8]"}},
      {"q_extent_overflows",
       [](Call& c) {
         c.q = TensorView(c.q.data(), DType::f32, {2, kHuge, 4, 8}, {0, kHuge, 8, 1});
       },
       {"q: sizes [2, 1099511627776, 4, 8] with strides [0, 1099511627776, 8, 1]", "int64"}},
      {"v_element_count_overflows",  // broadcast (stride 0), so only the count overflows
       [](Call& c) {
         c.v = TensorView(c.v.data(), DType::f32, {2, std::int64_t{1} << 62, 2, 8}, {0, 0, 0, 0});
       },
       {"v: sizes [2, 4611686018427387904, 2, 8] with strides [0, 0, 0, 0]", "element count"}},
      // The last element sits at offset 2^63 - 1, so its end does not fit
      // in int64 even for 1-byte bool elements.
      {"mask_ends_past_int64",
       [](Call& c) {
         const std::int64_t last_at_max = std::numeric_limits<std::int64_t>::max() - 139;
         c.options.mask =
             TensorView(c.q.data(), DType::boolean, {2, 4, 5, 7}, {last_at_max, 35, 7, 1});
       },
       {"options.mask: sizes [2, 4, 5, 7] with strides [9223372036854775668, 35, 7, 1] overflow "
        "int64"}},
      {"k_batch",
       [](Call& c) {
         c.k = c.tensor(DType::f32, {3, 7, 2, 8});
       },
       {"k: expected batch size (dim 0) 2", "got 3"}},
      {"v_batch",
       [](Call& c) {
         c.v = c.tensor(DType::f32, {1, 7, 2, 8});
       },
       {"v: expected batch size (dim 0) 2", "got 1"}},
      {"v_sequence",
       [](Call& c) {
         c.v = c.tensor(DType::f32, {2, 6, 2, 8});
       },
       {"v: expected sequence length (dim 1) 7", "got 6"}},
      {"v_kv_heads",
       [](Call& c) {
         c.v = c.tensor(DType::f32, {2, 7, 1, 8});
       },
       {"v: expected KV heads (dim 2) 2", "got 1"}},
      {"k_head_dim_dot",
       [](Call& c) {
         c.k = c.tensor(DType::f32, {2, 7, 2, 6});
       },
       {"k: expected head dim (dim 3) 8", "got 6", "Score::additive"}},
      {"hq_not_multiple_of_hkv",
       [](Call& c) {
         c.k = c.tensor(DType::f32, {2, 7, 3, 8});
         c.v = c.tensor(DType::f32, {2, 7, 3, 8});
       },
       {"Hq = 4", "multiple of the KV heads Hkv = 3"}},
      {"hkv_zero",
       [](Call& c) {
         c.k = c.tensor(DType::f32, {2, 7, 0, 8});
         c.v = c.tensor(DType::f32, {2, 7, 0, 8});
       },
       {"k: expected at least 1 KV head for 4 query heads, got 0"}},
      {"k_dtype",
       [](Call& c) {
         c.k = c.tensor(DType::f64, {2, 7, 2, 8});
       },
       {"k: expected dtype f32 (the dtype of q), got f64"}},
      {"v_dtype",
       [](Call& c) {
         c.v = c.tensor(DType::bf16, {2, 7, 2, 8});
       },
       {"v: expected dtype f32 (the dtype of q), got bf16"}},
      {"k_bool",
       [](Call& c) {
         c.k = c.tensor(DType::boolean, {2, 7, 2, 8});
       },
       {"k: expected dtype f32 (the dtype of q), got bool"}},
      // k and v are fine (f32); they must not be asked to match a bool q.
      {"q_bool",
       [](Call& c) {
         c.q = c.tensor(DType::boolean, {2, 5, 4, 8});
       },
       {"q: expected dtype f32, f64, f16 or bf16, got bool"}},

      // score
      {"scale_with_dot",
       [](Call& c) {
         c.options.score = qkv::Score::dot;
         c.options.scale = 0.5;
       },
       {"options.scale: only used by Score::scaled_dot", "Score::dot"}},
      {"scale_with_additive",
       [](Call& c) {
         c.use_additive();
         c.options.scale = 0.5;
       },
       {"options.scale: only used by Score::scaled_dot", "Score::additive"}},
      {"scale_infinite",
       [](Call& c) { c.options.scale = kInf; },
       {"options.scale: expected a finite number within the f32 range", "got inf"}},
      {"scale_nan",
       [](Call& c) { c.options.scale = kNaN; },
       {"options.scale: expected a finite number within the f32 range", "got nan"}},
      // The fast kernels fold the scale into Q in f32, where this is inf.
      {"scale_beyond_f32",
       [](Call& c) { c.options.scale = -1e39; },
       {"options.scale: expected a finite number within the f32 range", "got -1e+39"}},
      {"score_out_of_range",
       [](Call& c) { c.options.score = static_cast<qkv::Score>(7); },
       {"options.score: expected Score::scaled_dot, Score::dot or Score::additive", "got value 7"}},
      {"additive_missing_w_q",
       [](Call& c) {
         c.use_additive();
         c.options.additive.w_q = {};
       },
       {"options.additive.w_q: required tensor is undefined"}},
      {"additive_w_q_rank",
       [](Call& c) {
         c.use_additive();
         c.options.additive.w_q = c.tensor(DType::f32, {3, 8, 1});
       },
       {"options.additive.w_q: expected rank 2, got rank 3"}},
      {"additive_w_k_input_size",
       [](Call& c) {
         c.use_additive();
         c.options.additive.w_k = c.tensor(DType::f32, {3, 6});
       },
       {"options.additive.w_k: expected input size (dim 1) 8", "k's head dim", "got 6"}},
      {"additive_w_k_attention_size",
       [](Call& c) {
         c.use_additive();
         c.options.additive.w_k = c.tensor(DType::f32, {2, 8});
       },
       {"options.additive.w_k: expected attention size (dim 0) 3", "got 2"}},
      {"additive_v_size",
       [](Call& c) {
         c.use_additive();
         c.options.additive.v = c.tensor(DType::f32, {4});
       },
       {"options.additive.v: expected attention size (dim 0) 3", "got 4"}},
      {"additive_bias_size",
       [](Call& c) {
         c.use_additive();
         c.options.additive.bias = c.tensor(DType::f32, {1});
       },
       {"options.additive.bias: expected attention size (dim 0) 3", "got 1"}},
      {"additive_dtype",
       [](Call& c) {
         c.use_additive();
         c.options.additive.w_k = c.tensor(DType::boolean, {3, 8});
       },
       {"options.additive.w_k: expected dtype f32, f64, f16 or bf16, got bool"}},
      {"additive_params_with_scaled_dot",
       [](Call& c) {
         c.use_additive();
         c.options.score = qkv::Score::scaled_dot;
       },
       {"options.additive: parameters given but score is not Score::additive"}},

      // windows, softcap, align, backend
      {"window_left_minus_2",
       [](Call& c) { c.options.window_left = -2; },
       {"options.window_left: expected -1 (unbounded) or a size >= 0, got -2"}},
      {"window_right_minus_5",
       [](Call& c) { c.options.window_right = -5; },
       {"options.window_right: expected -1 (unbounded) or a size >= 0, got -5"}},
      {"softcap_negative",
       [](Call& c) { c.options.softcap = -1.5; },
       {"options.softcap: expected 0 (off) or a value in [2^-126, 2^126]", "got -1.5"}},
      // c or 1 / c would be inf or subnormal in the kernels' f32.
      {"softcap_beyond_f32",
       [](Call& c) { c.options.softcap = 1e38; },
       {"options.softcap: expected 0 (off) or a value in [2^-126, 2^126]", "got 1e+38"}},
      {"softcap_subnormal_in_f32",
       [](Call& c) { c.options.softcap = 1e-40; },
       {"options.softcap", "got 1e-40"}},
      // A fixed six-decimal format would print this as "-0.000000".
      {"softcap_tiny_negative",
       [](Call& c) { c.options.softcap = -1e-9; },
       {"options.softcap", "got -1e-09"}},
      {"softcap_nan", [](Call& c) { c.options.softcap = kNaN; }, {"options.softcap", "got nan"}},
      {"softcap_infinite",
       [](Call& c) { c.options.softcap = kInf; },
       {"options.softcap", "got inf"}},
      {"align_out_of_range",
       [](Call& c) { c.options.align = static_cast<qkv::Align>(9); },
       {"options.align", "got value 9"}},
      {"backend_fast_with_f64",
       [](Call& c) {
         c.q = c.tensor(DType::f64, {2, 5, 4, 8});
         c.k = c.tensor(DType::f64, {2, 7, 2, 8});
         c.v = c.tensor(DType::f64, {2, 7, 2, 8});
         c.options.backend = qkv::Backend::fast;
       },
       {"options.backend: Backend::fast computes in f32", "got f64", "Backend::reference"}},
      {"backend_out_of_range",
       [](Call& c) { c.options.backend = static_cast<qkv::Backend>(5); },
       {"options.backend", "got value 5"}},
      {"matmul_precision_out_of_range",
       [](Call& c) { c.options.matmul_precision = static_cast<qkv::MatmulPrecision>(3); },
       {"options.matmul_precision: expected MatmulPrecision::highest, MatmulPrecision::medium or "
        "MatmulPrecision::int8",
        "got value 3"}},

      // key lengths and packed sequences
      {"key_lengths_count",
       [](Call& c) { c.options.key_lengths = c.list<std::int64_t>({7}); },
       {"options.key_lengths: expected one length per sequence (2), got 1"}},
      {"key_length_beyond_sequence",
       [](Call& c) {
         c.options.key_lengths = c.list<std::int64_t>({7, 8});
       },
       {"options.key_lengths[1]: expected a length in [0, 7]", "got 8"}},
      {"key_length_negative",
       [](Call& c) {
         c.options.key_lengths = c.list<std::int64_t>({-1, 3});
       },
       {"options.key_lengths[0]: expected a length in [0, 7]", "got -1"}},
      {"packed_key_length_beyond_its_sequence",
       [](Call& c) {
         c.use_packed();
         c.options.key_lengths = c.list<std::int64_t>({3, 5});
       },
       {"options.key_lengths[1]: expected a length in [0, 4]", "got 5"}},
      {"cu_seqlens_q_without_k",
       [](Call& c) {
         c.use_packed();
         c.options.cu_seqlens_k = {};
       },
       {"options.cu_seqlens_k: expected together with cu_seqlens_q", "got none"}},
      {"cu_seqlens_k_without_q",
       [](Call& c) {
         c.use_packed();
         c.options.cu_seqlens_q = {};
       },
       {"options.cu_seqlens_q: expected together with cu_seqlens_k", "got none"}},
      {"cu_seqlens_with_batch_2",
       [](Call& c) {
         c.options.cu_seqlens_q = c.list<std::int64_t>({0, 2, 5});
         c.options.cu_seqlens_k = c.list<std::int64_t>({0, 3, 7});
       },
       {"q: packed sequences (cu_seqlens) expect batch size 1, got 2"}},
      {"cu_seqlens_not_monotonic",
       [](Call& c) {
         c.use_packed();
         c.options.cu_seqlens_q = c.list<std::int64_t>({0, 3, 2, 5});
         c.options.cu_seqlens_k = c.list<std::int64_t>({0, 3, 5, 7});
       },
       {"options.cu_seqlens_q: expected non-decreasing offsets, but [2] = 2 < [1] = 3"}},
      {"cu_seqlens_first_not_zero",
       [](Call& c) {
         c.use_packed();
         c.options.cu_seqlens_k = c.list<std::int64_t>({1, 3, 7});
       },
       {"options.cu_seqlens_k[0]: expected 0, got 1"}},
      {"cu_seqlens_last_not_total",
       [](Call& c) {
         c.use_packed();
         c.options.cu_seqlens_q = c.list<std::int64_t>({0, 2, 4});
       },
       {"options.cu_seqlens_q: expected the last offset to equal q's packed length 5, got 4"}},
      // With valid key lengths for the 2 sequences of cu_seqlens_q, the shorter
      // cu_seqlens_k must not be read past its end.
      {"cu_seqlens_sizes_differ",
       [](Call& c) {
         c.use_packed();
         c.options.cu_seqlens_k = c.list<std::int64_t>({0, 7});
         c.options.key_lengths = c.list<std::int64_t>({3, 4});
       },
       {"options.cu_seqlens_k: expected 3 offsets like cu_seqlens_q, got 2"}},
      {"cu_seqlens_too_short",
       [](Call& c) {
         c.use_packed();
         c.options.cu_seqlens_q = c.list<std::int64_t>({0});
         c.options.cu_seqlens_k = c.list<std::int64_t>({0});
       },
       {"options.cu_seqlens_q: expected at least 2 offsets (S + 1 for S sequences), got 1",
        "options.cu_seqlens_k: expected at least 2 offsets"},
       2},

      // mask
      {"mask_does_not_broadcast",
       [](Call& c) {
         c.options.mask = c.tensor(DType::boolean, {2, 3, 5, 7});
       },
       {"options.mask: sizes [2, 3, 5, 7] do not broadcast to [B, Hq, Nq, Nk] = [2, 4, 5, 7]",
        "dim 1 is 3, expected 4 or 1"}},
      {"mask_trailing_dim",
       [](Call& c) {
         c.options.mask = c.tensor(DType::f32, {5, 6});
       },
       {"options.mask: sizes [5, 6] do not broadcast", "dim 1 is 6, expected 7 or 1"}},
      {"mask_null_data",
       [](Call& c) {
         c.options.mask = ConstTensorView(nullptr, DType::boolean, {5, 7});
       },
       {"options.mask: data is null but the tensor has 35 elements"}},

      // ALiBi
      {"alibi_count",
       [](Call& c) {
         c.options.alibi_slopes = c.list<float>({1, 1, 1});
       },
       {"options.alibi_slopes: expected Hq = 4 or B * Hq = 2 * 4 slopes, got 3"}},
      {"alibi_count_packed",
       [](Call& c) {
         c.use_packed();
         c.options.alibi_slopes = c.list<float>({1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1});
       },
       {"options.alibi_slopes: expected Hq = 4 or S * Hq = 2 * 4 slopes, got 12"}},
      {"alibi_slope_infinite",
       [](Call& c) {
         c.options.alibi_slopes = c.list<float>({1, std::numeric_limits<float>::infinity(), 1, 1});
       },
       {"options.alibi_slopes[1]: expected a finite slope, got inf"}},
      {"alibi_slope_nan",
       [](Call& c) {
         c.options.alibi_slopes = c.list<float>({1, 1, 1, std::numeric_limits<float>::quiet_NaN()});
       },
       {"options.alibi_slopes[3]: expected a finite slope, got nan"}},

      // attention sinks
      {"sinks_count",
       [](Call& c) {
         c.options.sinks = c.list<float>({0, 0, 0});
       },
       {"options.sinks: expected Hq = 4 logits, got 3"}},
      {"sinks_nan",
       [](Call& c) {
         c.options.sinks = c.list<float>({0, std::numeric_limits<float>::quiet_NaN(), 0, 0});
       },
       {"options.sinks[1]: expected a finite logit or -inf, got nan"}},
      {"sinks_positive_infinity",
       [](Call& c) {
         c.options.sinks = c.list<float>({0, 0, 0, std::numeric_limits<float>::infinity()});
       },
       {"options.sinks[3]: expected a finite logit or -inf, got inf"}},

      // relative position bias
      {"relative_bias_heads",
       [](Call& c) {
         c.options.relative_bias.table = c.tensor(DType::f32, {3, 32});
       },
       {"options.relative_bias.table: expected heads (dim 0) 4", "got 3"}},
      {"relative_bias_too_few_buckets",
       [](Call& c) {
         c.options.relative_bias.table = c.tensor(DType::f32, {4, 3});
       },
       {"options.relative_bias.table: expected at least 4 buckets (dim 1), got 3"}},
      {"relative_bias_too_few_causal_buckets",
       [](Call& c) {
         c.options.relative_bias.table = c.tensor(DType::f32, {4, 1});
         c.options.relative_bias.bidirectional = false;
       },
       {"options.relative_bias.table: expected at least 2 buckets (dim 1), got 1"}},
      {"relative_bias_max_distance",
       [](Call& c) {
         c.options.relative_bias.table = c.tensor(DType::f32, {4, 32});
         c.options.relative_bias.max_distance = 8;  // 16 buckets a side, 8 of them exact
       },
       {"options.relative_bias.max_distance: expected more than 8", "got 8"}},
      {"relative_bias_dtype",
       [](Call& c) {
         c.options.relative_bias.table = c.tensor(DType::boolean, {4, 32});
       },
       {"options.relative_bias.table: expected dtype f32, f64, f16 or bf16, got bool"}},
      {"relative_bias_rank",
       [](Call& c) { c.options.relative_bias.table = c.tensor(DType::f32, {128}); },
       {"options.relative_bias.table: expected rank 2, got rank 1"}},

      // outputs of attention_into
      {"out_undefined",
       [](Call& c) {
         c.use_outputs();
         c.outputs.out = {};
       },
       {"out: required tensor is undefined"}},
      {"out_sizes",
       [](Call& c) {
         c.use_outputs();
         c.outputs.out = c.tensor(DType::f32, {2, 5, 4, 7});
       },
       {"out: expected sizes [2, 5, 4, 8], got [2, 5, 4, 7]"}},
      {"out_rank",
       [](Call& c) {
         c.use_outputs();
         c.outputs.out = c.tensor(DType::f32, {10, 4, 8});
       },
       {"out: expected rank 4, got rank 3"}},
      {"out_dtype",
       [](Call& c) {
         c.use_outputs();
         c.outputs.out = c.tensor(DType::f64, {2, 5, 4, 8});
       },
       {"out: expected dtype f32", "got f64"}},
      {"out_null_data",
       [](Call& c) {
         c.use_outputs();
         c.outputs.out = TensorView(nullptr, DType::f32, {2, 5, 4, 8});
       },
       {"out: data is null but the tensor has 320 elements"}},
      {"out_overlaps_q",
       [](Call& c) {
         c.use_outputs();
         c.outputs.out = TensorView(c.q.data(), DType::f32, {2, 5, 4, 8});
       },
       {"out: memory overlaps q"}},
      {"out_overlaps_mask",
       [](Call& c) {
         c.use_outputs();
         c.options.mask = ConstTensorView(c.outputs.out.data(), DType::f32, {5, 7});
       },
       {"out: memory overlaps options.mask"}},
      {"out_stride_0",
       [](Call& c) {
         c.use_outputs();
         c.outputs.out =
             TensorView(c.outputs.out.data(), DType::f32, {2, 5, 4, 8}, {160, 32, 8, 0});
       },
       {"out: has overlapping elements: dimension 3 (size 8) has stride 0"}},
      {"lse_overlaps_out",
       [](Call& c) {
         c.use_outputs();
         c.outputs.lse = TensorView(c.outputs.out.data(), DType::f32, {2, 4, 5});
       },
       {"lse: memory overlaps out"}},
      {"probs_overlaps_lse",
       [](Call& c) {
         c.use_outputs();
         c.outputs.probs = TensorView(c.outputs.lse.data(), DType::f32, {2, 4, 5, 7});
       },
       {"probs: memory overlaps lse"}},
      {"probs_sizes",
       [](Call& c) {
         c.use_outputs();
         c.outputs.probs = c.tensor(DType::f32, {2, 4, 5, 6});
       },
       {"probs: expected sizes [2, 4, 5, 7], got [2, 4, 5, 6]"}},
      {"lse_dtype",
       [](Call& c) {
         c.use_outputs();
         c.outputs.lse = c.tensor(DType::f64, {2, 4, 5});
       },
       {"lse: expected dtype f32", "got f64"}},
      {"lse_f32_for_f64_inputs",
       [](Call& c) {
         c.use_outputs();
         c.q = c.tensor(DType::f64, {2, 5, 4, 8});
         c.k = c.tensor(DType::f64, {2, 7, 2, 8});
         c.v = c.tensor(DType::f64, {2, 7, 2, 8});
         c.outputs.out = c.tensor(DType::f64, {2, 5, 4, 8});
         c.outputs.probs = c.tensor(DType::f64, {2, 4, 5, 7});
       },
       {"lse: expected dtype f64", "got f32"}},
  };
  return cases;
}

class ValidationBadInput : public testing::TestWithParam<BadCase> {};

TEST_P(ValidationBadInput, ThrowsErrorNamingTheProblem) {
  const BadCase& bad = GetParam();
  Call call;
  bad.breaks(call);
  const std::optional<qkv::Error> error = error_of([&] { call.run(); });
  if (!error) return;
  expect_contains(error->what(), bad.message);
  EXPECT_EQ(error->reasons().size(), bad.reasons) << error->what();
}

std::string case_name(const testing::TestParamInfo<BadCase>& param) { return param.param.name; }

INSTANTIATE_TEST_SUITE_P(Validation, ValidationBadInput, testing::ValuesIn(bad_cases()), case_name);

// The base that every row breaks is itself valid, with either entry point.
TEST(ValidationTest, BaseCaseIsValid) {
  Call call;
  EXPECT_NO_THROW(call.run());
  call.use_outputs();
  EXPECT_NO_THROW(call.run());
}

// Variants next to the bad rows that must stay accepted, so that no check is
// stricter than the documented contract.
TEST(ValidationTest, ValidVariantsAreAccepted) {
  const std::vector<std::pair<std::string, std::function<void(Call&)>>> variants = {
      {"additive with Dq != Dk",
       [](Call& c) {
         c.use_additive();
         c.q = c.tensor(DType::f32, {2, 5, 4, 6});
         c.options.additive.w_q = c.tensor(DType::f32, {3, 6});
       }},
      {"packed with key lengths",
       [](Call& c) {
         c.use_packed();
         c.options.key_lengths = c.list<std::int64_t>({0, 4});
       }},
      {"packed with per-sequence ALiBi slopes [S * Hq]",
       [](Call& c) {
         c.use_packed();
         c.options.alibi_slopes = c.list<float>({1, 1, 1, 1, 2, 2, 2, 2});
       }},
      {"per-batch ALiBi slopes [B * Hq]",
       [](Call& c) {
         c.options.alibi_slopes = c.list<float>({1, 1, 1, 1, 2, 2, 2, 2});
       }},
      {"mask broadcast from [B, 1, 1, Nk]",
       [](Call& c) {
         c.options.mask = c.tensor(DType::boolean, {2, 1, 1, 7});
       }},
      {"windows of 0 and unbounded", [](Call& c) { c.options.window_left = 0; }},
      {"relative bias, causal buckets",
       [](Call& c) {
         c.options.relative_bias.table = c.tensor(DType::f32, {4, 2});
         c.options.relative_bias.max_distance = 2;
         c.options.relative_bias.bidirectional = false;
       }},
      {"explicit scale and softcap",
       [](Call& c) {
         c.options.scale = 0.25;
         c.options.softcap = 30.0;
       }},
      {"broadcast (stride 0) inputs",
       [](Call& c) {
         c.k = TensorView(c.k.data(), DType::f32, {2, 7, 2, 8}, {0, 0, 0, 1});
       }},
      {"outputs in one buffer, disjoint",
       [](Call& c) {
         c.use_outputs();
         TensorView all = c.tensor(DType::f32, {320 + 40});
         c.outputs.out = TensorView(all.data(), DType::f32, {2, 5, 4, 8});
         c.outputs.lse = TensorView(static_cast<float*>(all.data()) + 320, DType::f32, {2, 4, 5});
       }},
  };
  for (const auto& [name, make] : variants) {
    Call call;
    make(call);
    EXPECT_NO_THROW(call.run()) << name;
  }
}

// Checks that every reason of `e` is in what() and that what() lists them.
void expect_listed(const qkv::Error& e, std::size_t count) {
  const std::string what = e.what();
  ASSERT_EQ(e.reasons().size(), count) << what;
  EXPECT_EQ(what.rfind("qkv: " + std::to_string(count) + " problems:", 0), 0u) << what;
  for (const std::string& reason : e.reasons()) {
    EXPECT_NE(what.find("\n  - " + reason), std::string::npos) << reason << "\nin:\n" << what;
  }
}

TEST(ValidationTest, ListsEveryOptionProblemInOneError) {
  Call call;
  call.options.window_left = -2;
  call.options.softcap = -1.0;
  call.options.key_lengths = call.list<std::int64_t>({9, 9});
  call.options.alibi_slopes = call.list<float>({1, 1, 1});
  call.options.align = static_cast<qkv::Align>(9);
  const std::optional<qkv::Error> error = error_of([&] { call.run(); });
  ASSERT_TRUE(error);
  expect_listed(*error, 6);  // two key lengths are out of range
  expect_contains(error->what(),
                  {"options.window_left", "options.softcap", "options.key_lengths[0]",
                   "options.key_lengths[1]", "options.alibi_slopes", "options.align"});
}

// Options that need no shape are reported together with shape problems.
TEST(ValidationTest, ListsShapeAndOptionProblemsInOneError) {
  Call call;
  call.k = call.tensor(DType::f32, {3, 7, 2, 8});
  call.v = call.tensor(DType::f64, {2, 7, 2, 8});
  call.options.window_right = -5;
  const std::optional<qkv::Error> error = error_of([&] { call.run(); });
  ASSERT_TRUE(error);
  expect_listed(*error, 3);
  expect_contains(error->what(), {"k: expected batch size (dim 0) 2", "v: expected dtype f32",
                                  "options.window_right"});
}

TEST(ValidationTest, ListsEveryOutputProblemInOneError) {
  Call call;
  call.use_outputs();
  call.outputs.out = call.tensor(DType::f16, {2, 5, 4, 8});
  call.outputs.lse = TensorView(call.outputs.out.data(), DType::f32, {2, 4, 5});
  call.outputs.probs = call.tensor(DType::f32, {2, 4, 5, 6});
  const std::optional<qkv::Error> error = error_of([&] { call.run(); });
  ASSERT_TRUE(error);
  expect_listed(*error, 3);
  expect_contains(error->what(),
                  {"out: expected dtype f32", "lse: memory overlaps out", "probs: expected sizes"});
}

}  // namespace
