// Bad input to the modules (qkv::nn): every row starts from a valid
// construction or call, breaks one thing, and checks that qkv::Error (not
// another exception, not a crash) names the argument, the expected and the
// actual value, and that the rejected call changed nothing: no parameter,
// no gradient (a rejected backward adds to none and allocates none), no
// input, no KV cache.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "bad_input.hpp"
#include "qkv/qkv.hpp"

namespace {

using qkv::ConstTensorView;
using qkv::DType;
using qkv::KvCache;
using qkv::Tensor;
using qkv::TensorView;
using qkv::nn::ImageLayout;
using qkv::nn::MultiHeadAttentionConfig;
using qkv::nn::NamedParameters;
using qkv::nn::Position;
using qkv::test::BadRow;
using qkv::test::Buffers;
using qkv::test::expect_rejected;
using qkv::test::expect_row;
using qkv::test::expect_valid;
using qkv::test::join;
using qkv::test::kInf;
using qkv::test::kMaxInt64;
using qkv::test::kNaN;
using qkv::test::row_name;
using qkv::test::view_rows;

// A dtype value outside the enum, as a cast in a binding may produce.
const DType kBadDType = static_cast<DType>(6);

// A parameter as a rejected call must leave it: its value and its gradient
// (whether there is one, its dtype, sizes and bytes).
struct ParameterState {
  std::string name;
  std::vector<std::byte> value;
  bool has_grad = false;
  DType grad_dtype = DType::f32;
  std::vector<std::int64_t> grad_sizes;
  std::vector<std::byte> grad;

  bool operator==(const ParameterState&) const = default;
};

std::vector<std::byte> bytes_of(const Tensor& t) {
  if (!t.defined()) return {};
  const auto* p = static_cast<const std::byte*>(t.view().data());
  return {p, p + static_cast<std::size_t>(t.numel()) * qkv::dtype_size(t.dtype())};
}

std::vector<ParameterState> state_of(const NamedParameters& parameters) {
  std::vector<ParameterState> out;
  for (const qkv::nn::NamedParameter& p : parameters) {
    ParameterState s;
    s.name = p.name;
    s.value = bytes_of(p.parameter->value);
    const Tensor& g = p.parameter->grad;
    if (g.defined()) {
      s.has_grad = true;
      s.grad_dtype = g.dtype();
      s.grad_sizes.assign(g.sizes().begin(), g.sizes().begin() + g.rank());
      s.grad = bytes_of(g);
    }
    out.push_back(std::move(s));
  }
  return out;
}

// What every module call below shares: its buffers, and its state, which a
// rejected call must leave alone: the parameters with their gradients, and
// what Call holds beyond them (a KV cache) as numbers.
template <class Call>
class ModuleCall : public Buffers {
 public:
  static constexpr const char* kState = "a parameter, a gradient or the KV cache";

  std::pair<std::vector<ParameterState>, std::vector<std::int64_t>> state() {
    Call& call = static_cast<Call&>(*this);
    return {state_of(call.parameters()), call.other_state()};
  }
  std::vector<std::int64_t> other_state() const { return {}; }
};

// ---- constructors ----------------------------------------------------------

class ConstructorCall : public ModuleCall<ConstructorCall> {
 public:
  void run() const { make(); }
  NamedParameters parameters() const { return {}; }

  std::function<void()> make;
};

// The config of a MultiHeadAttention of E = 8, H = 2 with `change` applied.
MultiHeadAttentionConfig mha_config(const std::function<void(MultiHeadAttentionConfig&)>& change) {
  MultiHeadAttentionConfig c;
  c.embed_dim = 8;
  c.num_heads = 2;
  change(c);
  return c;
}

// Constructs a MultiHeadAttention of mha_config(change).
std::function<void()> mha(const std::function<void(MultiHeadAttentionConfig&)>& change) {
  return [change] { qkv::nn::MultiHeadAttention m(mha_config(change)); };
}

const std::vector<BadRow<ConstructorCall>>& bad_constructors() {
  using C = ConstructorCall;
  using Config = MultiHeadAttentionConfig;
  static const std::vector<BadRow<C>> rows = {
      // MultiHeadAttention
      {"mha_embed_dim_zero",
       [](C& c) { c.make = mha([](Config& m) { m.embed_dim = 0; }); },
       {"embed_dim: expected >= 1, got 0"}},
      {"mha_num_heads_zero",
       [](C& c) { c.make = mha([](Config& m) { m.num_heads = 0; }); },
       {"num_heads: expected >= 1, got 0"}},
      {"mha_num_heads_not_dividing",
       [](C& c) { c.make = mha([](Config& m) { m.num_heads = 3; }); },
       {"num_heads: 3 does not divide embed_dim 8"}},
      {"mha_num_kv_heads_negative",
       [](C& c) { c.make = mha([](Config& m) { m.num_kv_heads = -1; }); },
       {"num_kv_heads: expected 0 (= num_heads) or a divisor of num_heads 2, got -1"}},
      {"mha_num_kv_heads_not_dividing",
       [](C& c) { c.make = mha([](Config& m) { m.num_kv_heads = 3; }); },
       {"num_kv_heads: expected 0 (= num_heads) or a divisor of num_heads 2, got 3"}},
      {"mha_kdim_negative",
       [](C& c) { c.make = mha([](Config& m) { m.kdim = -1; }); },
       {"kdim: expected >= 0 (0 = embed_dim), got -1"}},
      {"mha_vdim_negative",
       [](C& c) { c.make = mha([](Config& m) { m.vdim = -2; }); },
       {"vdim: expected >= 0 (0 = embed_dim), got -2"}},
      {"mha_dropout_one",
       [](C& c) { c.make = mha([](Config& m) { m.dropout = 1.0; }); },
       {"dropout: expected a probability in [0, 1), got 1"}},
      {"mha_dropout_nan",
       [](C& c) { c.make = mha([](Config& m) { m.dropout = kNaN; }); },
       {"dropout: expected a probability in [0, 1), got nan"}},
      {"mha_dropout_tiny_negative",
       [](C& c) { c.make = mha([](Config& m) { m.dropout = -1e-9; }); },
       {"dropout: expected a probability in [0, 1), got -1e-09"}},
      {"mha_position_out_of_range",
       [](C& c) { c.make = mha([](Config& m) { m.position = static_cast<Position>(9); }); },
       {"position: unknown value 9"}},
      {"mha_dtype_bool",
       [](C& c) { c.make = mha([](Config& m) { m.dtype = DType::boolean; }); },
       {"dtype: expected dtype f32, f64, f16 or bf16, got bool"}},
      {"mha_dtype_out_of_range",
       [](C& c) { c.make = mha([](Config& m) { m.dtype = kBadDType; }); },
       {"dtype: expected dtype f32, f64, f16 or bf16, got value 6"}},
      {"mha_rope_rotary_dim_odd",
       [](C& c) {
         c.make = mha([](Config& m) {
           m.position = Position::rope;
           m.rope.rotary_dim = 3;
         });
       },
       {"rope.rotary_dim: expected an even number in [0, Dh = 4] (0 = the whole head), got 3"}},
      {"mha_rope_base",
       [](C& c) {
         c.make = mha([](Config& m) {
           m.position = Position::rope;
           m.rope.base = 0.5;
         });
       },
       {"rope.base: expected a finite frequency base > 1, got 0.5"}},
      {"mha_rope_odd_head",
       [](C& c) {
         c.make = mha([](Config& m) {
           m.embed_dim = 6;
           m.position = Position::rope;
         });
       },
       {"rope.rotary_dim: 0 rotates the whole head, which needs an even head dim, got Dh = 3"}},
      {"mha_relative_bias_buckets",
       [](C& c) {
         c.make = mha([](Config& m) {
           m.position = Position::relative_bias;
           m.num_buckets = 3;
         });
       },
       {"num_buckets: expected >= 4 (bidirectional), got 3"}},
      {"mha_every_field",
       [](C& c) {
         c.make = mha([](Config& m) {
           m.embed_dim = 0;
           m.num_heads = 0;
           m.num_kv_heads = -1;
           m.kdim = -1;
           m.vdim = -1;
           m.dropout = 2.0;
           m.position = static_cast<Position>(4);
           m.dtype = DType::boolean;
         });
       },
       {"embed_dim", "num_heads", "num_kv_heads", "kdim", "vdim", "dropout", "position", "dtype"},
       8},
      // AdditiveAttention
      {"additive_hidden_size_zero",
       [](C& c) { c.make = [] { qkv::nn::AdditiveAttention(0); }; },
       {"hidden_size: expected >= 1 (and 2 * hidden_size within int64), got 0"}},
      {"additive_hidden_size_overflows",
       [](C& c) { c.make = [] { qkv::nn::AdditiveAttention(kMaxInt64 / 2 + 1); }; },
       {"hidden_size: expected >= 1 (and 2 * hidden_size within int64), got 4611686018427387904"}},
      {"additive_dtype_out_of_range",
       [](C& c) { c.make = [] { qkv::nn::AdditiveAttention(4, kBadDType); }; },
       {"dtype: expected dtype f32, f64, f16 or bf16, got value 6"}},
      // SqueezeExcitation
      {"se_channels_zero",
       [](C& c) { c.make = [] { qkv::nn::SqueezeExcitation(0); }; },
       {"channels: expected >= 1, got 0"}},
      {"se_rd_ratio_zero",
       [](C& c) { c.make = [] { qkv::nn::SqueezeExcitation(16, {.rd_ratio = 0.0}); }; },
       {"rd_ratio: expected a finite value > 0, got 0"}},
      {"se_rd_ratio_tiny_negative",
       [](C& c) { c.make = [] { qkv::nn::SqueezeExcitation(16, {.rd_ratio = -1e-9}); }; },
       {"rd_ratio: expected a finite value > 0, got -1e-09"}},
      {"se_rd_ratio_nan",
       [](C& c) { c.make = [] { qkv::nn::SqueezeExcitation(16, {.rd_ratio = kNaN}); }; },
       {"rd_ratio: expected a finite value > 0, got nan"}},
      {"se_rd_ratio_too_large",
       [](C& c) { c.make = [] { qkv::nn::SqueezeExcitation(16, {.rd_ratio = 1e300}); }; },
       {"rd_ratio: expected channels * rd_ratio below 2^52, got 16 * 1e+300 = 1.6e+301 (or give "
        "rd_channels)"}},
      {"se_rd_channels_negative",
       [](C& c) { c.make = [] { qkv::nn::SqueezeExcitation(16, {.rd_channels = -1}); }; },
       {"rd_channels: expected >= 0 (0 derives it from rd_ratio), got -1"}},
      {"se_rd_divisor_zero",
       [](C& c) { c.make = [] { qkv::nn::SqueezeExcitation(16, {.rd_divisor = 0}); }; },
       {"rd_divisor: expected >= 1, got 0"}},
      {"se_dtype_out_of_range",
       [](C& c) { c.make = [] { qkv::nn::SqueezeExcitation(16, {.dtype = kBadDType}); }; },
       {"dtype: expected dtype f32, f64, f16 or bf16, got value 6"}},
      {"se_every_field",
       [](C& c) {
         c.make = [] {
           qkv::nn::SqueezeExcitation(
               -1,
               {.rd_ratio = -kInf, .rd_channels = -1, .rd_divisor = -1, .dtype = DType::boolean});
         };
       },
       {"channels", "rd_ratio", "rd_channels", "rd_divisor", "dtype"},
       5},
      // Cbam
      {"cbam_kernel_even",
       [](C& c) { c.make = [] { qkv::nn::Cbam(16, {.spatial_kernel_size = 4}); }; },
       {"spatial_kernel_size: expected an odd size >= 1, got 4"}},
      {"cbam_kernel_negative",
       [](C& c) { c.make = [] { qkv::nn::Cbam(16, {.spatial_kernel_size = -1}); }; },
       {"spatial_kernel_size: expected an odd size >= 1, got -1"}},
      {"cbam_bn_eps_tiny_negative",
       [](C& c) { c.make = [] { qkv::nn::Cbam(16, {.bn_eps = -1e-9}); }; },
       {"bn_eps: expected a finite value >= 0, got -1e-09"}},
      {"cbam_bn_eps_infinite",
       [](C& c) { c.make = [] { qkv::nn::Cbam(16, {.bn_eps = kInf}); }; },
       {"bn_eps: expected a finite value >= 0, got inf"}},
      {"cbam_rd_ratio",
       [](C& c) { c.make = [] { qkv::nn::Cbam(16, {.rd_ratio = -2.0}); }; },
       {"rd_ratio: expected a finite value > 0, got -2"}},
      {"cbam_dtype_bool",
       [](C& c) { c.make = [] { qkv::nn::Cbam(16, {.dtype = DType::boolean}); }; },
       {"dtype: expected dtype f32, f64, f16 or bf16, got bool"}},
      {"cbam_channels_and_kernel",
       [](C& c) { c.make = [] { qkv::nn::Cbam(0, {.spatial_kernel_size = 0}); }; },
       {"channels: expected >= 1, got 0", "spatial_kernel_size: expected an odd size >= 1, got 0"},
       2},
      // Linear
      {"linear_in_features_zero",
       [](C& c) { c.make = [] { qkv::nn::Linear(0, 3); }; },
       {"in_features: expected >= 1, got 0"}},
      {"linear_out_features_negative",
       [](C& c) { c.make = [] { qkv::nn::Linear(4, -2); }; },
       {"out_features: expected >= 1, got -2"}},
      {"linear_dtype_out_of_range",
       [](C& c) { c.make = [] { qkv::nn::Linear(4, 3, true, kBadDType); }; },
       {"dtype: expected dtype f32, f64, f16 or bf16, got value 6"}},
      {"linear_every_argument",
       [](C& c) { c.make = [] { qkv::nn::Linear(-1, 0, false, DType::boolean); }; },
       {"in_features", "out_features", "dtype"},
       3},
      // LearnedPositionalEmbedding
      {"learned_max_positions_zero",
       [](C& c) { c.make = [] { qkv::nn::LearnedPositionalEmbedding(0, 4); }; },
       {"max_positions: expected >= 1, got 0"}},
      {"learned_dim_negative",
       [](C& c) { c.make = [] { qkv::nn::LearnedPositionalEmbedding(8, -4); }; },
       {"dim: expected >= 1, got -4"}},
      {"learned_dtype_out_of_range",
       [](C& c) { c.make = [] { qkv::nn::LearnedPositionalEmbedding(8, 4, kBadDType); }; },
       {"dtype: expected dtype f32, f64, f16 or bf16, got value 6"}},
      // RelativePositionBias
      {"relative_num_heads_zero",
       [](C& c) { c.make = [] { qkv::nn::RelativePositionBias(0); }; },
       {"num_heads: expected >= 1, got 0"}},
      {"relative_num_buckets_bidirectional",
       [](C& c) { c.make = [] { qkv::nn::RelativePositionBias(2, 3, 16, true); }; },
       {"num_buckets: expected >= 4 (bidirectional), got 3"}},
      {"relative_num_buckets_causal",
       [](C& c) { c.make = [] { qkv::nn::RelativePositionBias(2, 1, 16, false); }; },
       {"num_buckets: expected >= 2, got 1"}},
      {"relative_max_distance",
       [](C& c) { c.make = [] { qkv::nn::RelativePositionBias(2, 8, 2); }; },
       {"max_distance: expected more than the 2 exact buckets of num_buckets = 8, got 2"}},
      {"relative_dtype_out_of_range",
       [](C& c) { c.make = [] { qkv::nn::RelativePositionBias(2, 8, 16, true, kBadDType); }; },
       {"dtype: expected dtype f32, f64, f16 or bf16, got value 6"}},
      // make_parameter
      {"parameter_dtype_out_of_range",
       [](C& c) { c.make = [] { (void)qkv::nn::make_parameter(kBadDType, {2}); }; },
       {"parameter dtype: expected dtype f32, f64, f16 or bf16, got value 6"}},
  };
  return rows;
}

QKV_BAD_INPUT_TEST(ModuleValidation, ModuleBadConstructor, ConstructorCall, bad_constructors());

TEST(ModuleValidation, ConstructorVariantsAreValid) {
  using Config = MultiHeadAttentionConfig;
  expect_valid<ConstructorCall>({
      {"mha", [](ConstructorCall& c) { c.make = mha([](Config&) {}); }},
      {"mha rope on part of an odd head",
       [](ConstructorCall& c) {
         c.make = mha([](Config& m) {
           m.embed_dim = 6;
           m.position = Position::rope;
           m.rope.rotary_dim = 2;
         });
       }},
      {"mha dropout just below 1",
       [](ConstructorCall& c) { c.make = mha([](Config& m) { m.dropout = 0.999; }); }},
      {"se with rd_channels and any rd_ratio",
       [](ConstructorCall& c) {
         c.make = [] { qkv::nn::SqueezeExcitation(16, {.rd_ratio = 1e300, .rd_channels = 4}); };
       }},
      {"cbam with bn_eps 0 and a 1 x 1 kernel",
       [](ConstructorCall& c) {
         c.make = [] { qkv::nn::Cbam(16, {.spatial_kernel_size = 1, .bn_eps = 0.0}); };
       }},
  });
}

// ---- MultiHeadAttention ----------------------------------------------------

// Self-attention-shaped query [2, 3, 8] against key and value [2, 4, 8] in a
// module of E = 8, H = 2 and one K/V head, whose parameters already hold
// gradients (a valid backward ran); `saved` comes from a valid forward. The
// base call is a forward; rows switch to backward or forward_step.
class MhaCall : public ModuleCall<MhaCall> {
 public:
  enum class Mode { forward, backward, step };

  MhaCall() {
    query = tensor(DType::f32, {2, 3, 8});
    key = tensor(DType::f32, {2, 4, 8});
    value = tensor(DType::f32, {2, 4, 8});
    dout = tensor(DType::f32, {2, 3, 8});
    build(mha_config([](MultiHeadAttentionConfig& c) { c.num_kv_heads = 1; }));
  }

  // Replaces the module (its parameters initialized, gradients accumulated
  // once) and `saved`.
  void build(const MultiHeadAttentionConfig& config) {
    m.emplace(config);
    qkv::nn::init_uniform(m->named_parameters(), 3);
    qkv::nn::MultiHeadAttentionOptions save;
    save.save_for_backward = true;
    saved = m->forward(query, key, value, save).saved;
    m->backward(query, key, value, saved, dout, save);
  }
  void backward() { mode = Mode::backward; }
  // forward_step of x_new [2, 1, 8] against a cache of 2 sequences of 3
  // tokens (kv_heads 1, head_dim 4, capacity 8).
  void step() {
    mode = Mode::step;
    x_new = tensor(DType::f32, {2, 1, 8});
    cache.emplace(qkv::KvCacheConfig{.batch = 2, .kv_heads = 1, .head_dim = 4, .capacity = 8});
    cache->append(tensor(DType::f32, {2, 3, 1, 4}), tensor(DType::f32, {2, 3, 1, 4}));
  }

  void run() {
    switch (mode) {
      case Mode::forward:
        (void)m->forward(query, key, value, options);
        break;
      case Mode::backward:
        (void)m->backward(query, key, value, saved, dout, options);
        break;
      case Mode::step:
        (void)m->forward_step(x_new, *cache);
        break;
    }
  }
  NamedParameters parameters() { return m->named_parameters(); }
  std::vector<std::int64_t> other_state() const {
    if (!cache) return {};
    std::vector<std::int64_t> s(cache->lengths().begin(), cache->lengths().end());
    s.push_back(cache->free_pages());
    return s;
  }

  std::optional<qkv::nn::MultiHeadAttention> m;
  ConstTensorView query, key, value, dout, x_new;
  qkv::nn::MultiHeadAttentionOptions options;
  qkv::nn::MultiHeadAttentionSaved saved;
  std::optional<KvCache> cache;
  Mode mode = Mode::forward;
};

const std::vector<BadRow<MhaCall>>& bad_mha_calls() {
  static const std::vector<BadRow<MhaCall>> rows = join<MhaCall>({
      {
          // query, key, value
          {"query_rank",
           [](MhaCall& c) {
             c.query = c.tensor(DType::f32, {6, 8});
           },
           {"query: expected rank 3 [B, Nq, E], got rank 2 with sizes [6, 8]"}},
          {"key_dtype",
           [](MhaCall& c) {
             c.key = c.tensor(DType::f64, {2, 4, 8});
           },
           {"key, value: expected query's dtype f32, got f64 and f32"}},
          {"query_embed_dim",
           [](MhaCall& c) {
             c.query = c.tensor(DType::f32, {2, 3, 6});
           },
           {"query: expected embed dim E (dim 2) 8 to match the module's embed_dim, got 6 (sizes "
            "[2, "
            "3, 6])"}},
          {"key_value_batch",
           [](MhaCall& c) {
             c.key = c.tensor(DType::f32, {3, 4, 8});
             c.value = c.tensor(DType::f32, {3, 4, 8});
           },
           {"key: expected batch size (dim 0) 2 to match query's batch 2, got 3",
            "value: expected batch size (dim 0) 2 to match query's batch 2, got 3"},
           2},
          {"key_features",
           [](MhaCall& c) {
             c.key = c.tensor(DType::f32, {2, 4, 6});
           },
           {"key: expected features (dim 2) 8 to match the module's kdim, got 6"}},
          {"value_rows",
           [](MhaCall& c) {
             c.value = c.tensor(DType::f32, {2, 5, 8});
           },
           {"value: expected sequence length Nk (dim 1) 4 to match key's 4, got 5"}},
          {"value_features",
           [](MhaCall& c) {
             c.value = c.tensor(DType::f32, {2, 4, 5});
           },
           {"value: expected features (dim 2) 8 to match the module's vdim, got 5"}},
          // masks
          {"key_padding_mask_sizes",
           [](MhaCall& c) {
             c.options.key_padding_mask = c.tensor(DType::boolean, {2, 5});
           },
           {"key_padding_mask: expected sizes [B, Nk] = [2, 4], got [2, 5]"}},
          {"key_padding_mask_rank",
           [](MhaCall& c) {
             c.options.key_padding_mask = c.tensor(DType::f32, {2, 1, 4});
           },
           {"key_padding_mask: expected rank 2 [B, Nk], got rank 3 with sizes [2, 1, 4]"}},
          {"attn_mask_sizes",
           [](MhaCall& c) {
             c.options.attn_mask = c.tensor(DType::boolean, {3, 5});
           },
           {"attn_mask: expected [Nq, Nk] = [3, 4] or [B * H, Nq, Nk] = [2 * 2, 3, 4], got [3, "
            "5]"}},
          {"inputs_and_masks",
           [](MhaCall& c) {
             c.key = c.tensor(DType::f32, {2, 4, 7});
             c.options.key_padding_mask = c.tensor(DType::boolean, {2, 3});
             c.options.attn_mask = ConstTensorView(nullptr, DType::f32, {3, 4});
           },
           {"key: expected features", "key_padding_mask: expected sizes",
            "attn_mask: data is null"},
           3},
          // parameters replaced by ones of other shapes
          {"in_proj_weight_replaced",
           [](MhaCall& c) {
             c.m->in_proj_weight.value = Tensor(DType::f32, {24, 8});
           },
           {"in_proj_weight: expected a floating parameter of sizes [16, 8], got f32 [24, 8]"}},
          {"out_proj_weight_replaced",
           [](MhaCall& c) {
             c.m->out_proj.weight.value = Tensor(DType::bf16, {8, 4});
           },
           {"out_proj.weight: expected a floating parameter of sizes [8, 8], got bf16 [8, 4]"}},
          // backward
          {"backward_dout_rank",
           [](MhaCall& c) {
             c.backward();
             c.dout = c.tensor(DType::f32, {6, 8});
           },
           {"dout: expected rank 3 [B, Nq, E], got rank 2 with sizes [6, 8]"}},
          {"backward_dout_sizes",
           [](MhaCall& c) {
             c.backward();
             c.dout = c.tensor(DType::f32, {2, 3, 6});
           },
           {"dout: expected sizes [B, Nq, E] = [2, 3, 8], got [2, 3, 6]"}},
          {"backward_query_rank",
           [](MhaCall& c) {
             c.backward();
             c.query = c.tensor(DType::f32, {2, 3, 2, 4});
           },
           {"query: expected rank 3 [B, Nq, E], got rank 4"}},
          {"backward_key_padding_mask_null_data",
           [](MhaCall& c) {
             c.backward();
             c.options.key_padding_mask = ConstTensorView(nullptr, DType::boolean, {2, 4});
           },
           {"key_padding_mask: data is null"}},
          {"backward_without_saved",
           [](MhaCall& c) {
             c.backward();
             c.saved = {};
           },
           {"saved.q: expected [2, 3, 2, 4] in f32 from forward with save_for_backward and the "
            "same "
            "inputs, got none",
            "saved.k: expected [2, 4, 1, 4]", "saved.v", "saved.attn",
            "saved.lse: expected [2, 2, 3]"},
           5},
          {"backward_saved_lse_dtype",
           [](MhaCall& c) {
             c.backward();
             c.saved.lse = Tensor(DType::f64, {2, 2, 3});
           },
           {"saved.lse: expected [2, 2, 3] in f32 from forward with save_for_backward and the same "
            "inputs, got f64 [2, 2, 3]"}},
          {"backward_saved_for_other_inputs",
           [](MhaCall& c) {
             c.backward();
             c.query = c.tensor(DType::f32, {2, 5, 8});
             c.dout = c.tensor(DType::f32, {2, 5, 8});
           },
           {"saved.q: expected [2, 5, 2, 4] in f32", "got f32 [2, 3, 2, 4]", "saved.attn",
            "saved.lse"},
           3},
          // A gradient of another dtype: nothing may be allocated or added to
          // before the clash is found.
          {"backward_grad_dtype_clash",
           [](MhaCall& c) {
             c.backward();
             qkv::nn::zero_grad(c.m->named_parameters());
             c.m->out_proj.bias.grad = Tensor(DType::f64, {8});
           },
           {"out_proj.bias.grad: holds f64 gradients, this backward computes f32 (call zero_grad "
            "between f32 and f64 backward calls)"}},
          {"backward_out_proj_replaced_before_any_grad",
           [](MhaCall& c) {
             c.backward();
             qkv::nn::zero_grad(c.m->named_parameters());
             c.m->out_proj.weight.value = Tensor(DType::f32, {8, 4});
           },
           {"out_proj.weight: expected a floating parameter of sizes [8, 8], got f32 [8, 4]"}},
          {"backward_out_proj_bias_replaced",
           [](MhaCall& c) {
             c.backward();
             c.m->out_proj.bias.value = Tensor(DType::f32, {9});
           },
           {"out_proj.bias: expected a floating parameter of sizes [8], got f32 [9]"}},
          {"backward_relative_bias_replaced",
           [](MhaCall& c) {
             c.build(mha_config([](MultiHeadAttentionConfig& m) {
               m.position = Position::relative_bias;
               m.num_buckets = 8;
               m.max_distance = 16;
             }));
             c.backward();
             c.m->relative_bias->weight.value = Tensor(DType::f32, {3, 2});
           },
           {"relative_attention_bias.weight: expected a floating parameter of sizes [8, 2], got "
            "f32 "
            "[3, 2]"}},
          {"backward_grad_sizes",
           [](MhaCall& c) {
             c.backward();
             c.m->in_proj_bias.grad = Tensor(DType::f32, {8});
           },
           {"in_proj_bias.grad: expected sizes [16], got [8]"}},
          // forward_step
          {"step_rank",
           [](MhaCall& c) {
             c.step();
             c.x_new = c.tensor(DType::f32, {2, 8});
           },
           {"x_new: expected rank 3 [B, n, E], got rank 2 with sizes [2, 8]"}},
          {"step_no_tokens",
           [](MhaCall& c) {
             c.step();
             c.x_new = c.tensor(DType::f32, {2, 0, 8});
           },
           {"x_new: expected [B, n, E = 8] with 1 <= n <= 16, got [2, 0, 8]"}},
          {"step_too_many_tokens",
           [](MhaCall& c) {
             c.step();
             c.x_new = c.tensor(DType::f32, {2, 17, 8});
           },
           {"x_new: expected [B, n, E = 8] with 1 <= n <= 16, got [2, 17, 8]"}},
          {"step_embed_dim",
           [](MhaCall& c) {
             c.step();
             c.x_new = c.tensor(DType::f32, {2, 1, 6});
           },
           {"x_new: expected [B, n, E = 8] with 1 <= n <= 16, got [2, 1, 6]"}},
          {"step_batch",
           [](MhaCall& c) {
             c.step();
             c.x_new = c.tensor(DType::f32, {3, 1, 8});
           },
           {"cache: holds 2 sequences, x_new has B = 3"}},
          {"step_cache_heads",
           [](MhaCall& c) {
             c.step();
             c.cache.emplace(
                 qkv::KvCacheConfig{.batch = 2, .kv_heads = 2, .head_dim = 4, .capacity = 8});
           },
           {"cache: expected kv_heads = 1 and head_dim = value_dim = 4, got 2, 4 and 4"}},
          {"step_cache_full",
           [](MhaCall& c) {
             c.step();
             c.x_new = c.tensor(DType::f32, {2, 6, 8});
           },
           {"append: sequence 0 would hold 9 tokens, more than capacity 8 (it holds 3, 6 appended)",
            "append: sequence 1 would hold 9 tokens"},
           2},
          {"step_relative_bias",
           [](MhaCall& c) {
             c.build(mha_config([](MultiHeadAttentionConfig& m) {
               m.num_kv_heads = 1;
               m.position = Position::relative_bias;
             }));
             c.step();
           },
           {"forward_step: Position::relative_bias is not supported with a KV cache"}},
          {"step_cross_attention_module",
           [](MhaCall& c) {
             c.key = c.tensor(DType::f32, {2, 4, 6});
             c.build(mha_config([](MultiHeadAttentionConfig& m) {
               m.num_kv_heads = 1;
               m.kdim = 6;
             }));
             c.step();
           },
           {"forward_step: self-attention only (kdim == vdim == embed_dim)"}},
      },
      view_rows<MhaCall>({.name = "query", .sizes = {2, 3, 8}},
                         [](MhaCall& c, TensorView t) { c.query = t; }),
      view_rows<MhaCall>({.name = "key", .sizes = {2, 4, 8}},
                         [](MhaCall& c, TensorView t) { c.key = t; }),
      view_rows<MhaCall>({.name = "value", .sizes = {2, 4, 8}, .dtype = DType::f16},
                         [](MhaCall& c, TensorView t) { c.value = t; }),
      view_rows<MhaCall>({.name = "key_padding_mask",
                          .sizes = {2, 4},
                          .dtype = DType::boolean,
                          .optional = true,
                          .dtypes = ""},
                         [](MhaCall& c, TensorView t) { c.options.key_padding_mask = t; }),
      view_rows<MhaCall>({.name = "attn_mask",
                          .sizes = {3, 4},
                          .dtype = DType::boolean,
                          .optional = true,
                          .dtypes = ""},
                         [](MhaCall& c, TensorView t) { c.options.attn_mask = t; }),
      view_rows<MhaCall>({.name = "dout", .sizes = {2, 3, 8}},
                         [](MhaCall& c, TensorView t) {
                           c.backward();
                           c.dout = t;
                         }),
      view_rows<MhaCall>({.name = "x_new", .sizes = {2, 1, 8}},
                         [](MhaCall& c, TensorView t) {
                           c.step();
                           c.x_new = t;
                         }),
  });
  return rows;
}

QKV_BAD_INPUT_TEST(ModuleValidation, MultiHeadAttentionBadCall, MhaCall, bad_mha_calls());

TEST(ModuleValidation, MultiHeadAttentionVariantsAreValid) {
  expect_valid<MhaCall>({
      {"forward", [](MhaCall&) {}},
      {"backward", [](MhaCall& c) { c.backward(); }},
      {"forward_step", [](MhaCall& c) { c.step(); }},
      {"float masks, attn_mask per head",
       [](MhaCall& c) {
         c.options.key_padding_mask = c.tensor(DType::f16, {2, 4});
         c.options.attn_mask = c.tensor(DType::f32, {4, 3, 4});
       }},
      {"bool masks, backward",
       [](MhaCall& c) {
         c.backward();
         c.options.key_padding_mask = c.tensor(DType::boolean, {2, 4});
         c.options.attn_mask = c.tensor(DType::boolean, {3, 4});
       }},
      {"dout of another floating dtype",
       [](MhaCall& c) {
         c.backward();
         c.dout = c.tensor(DType::bf16, {2, 3, 8});
       }},
      {"step to the cache's capacity",
       [](MhaCall& c) {
         c.step();
         c.x_new = c.tensor(DType::f32, {2, 5, 8});
       }},
  });
}

// ---- AdditiveAttention -----------------------------------------------------

// decoder_hidden [2, 4] and encoder_outputs [2, 3, 4] in a module of H = 4
// whose parameters already hold gradients; backward's d_context [2, 4].
class AdditiveCall : public ModuleCall<AdditiveCall> {
 public:
  AdditiveCall() {
    qkv::nn::init_uniform(m.named_parameters(), 5);
    hidden = tensor(DType::f32, {2, 4});
    encoder = tensor(DType::f32, {2, 3, 4});
    d_context = tensor(DType::f32, {2, 4});
    (void)m.backward(hidden, encoder, {}, d_context, {});
  }
  void run() {
    if (backward) {
      (void)m.backward(hidden, encoder, lengths, d_context, d_weights);
    } else {
      (void)m.forward(hidden, encoder, lengths);
    }
  }
  NamedParameters parameters() { return m.named_parameters(); }

  qkv::nn::AdditiveAttention m{4};
  ConstTensorView hidden, encoder, d_context, d_weights;
  std::span<const std::int64_t> lengths;
  bool backward = false;
};

const std::vector<BadRow<AdditiveCall>>& bad_additive_calls() {
  static const std::vector<BadRow<AdditiveCall>> rows = join<AdditiveCall>({
      {
          {"hidden_rank",
           [](AdditiveCall& c) { c.hidden = c.tensor(DType::f32, {8}); },
           {"decoder_hidden: expected rank 2 [B, H], got rank 1 with sizes [8]"}},
          {"encoder_rank",
           [](AdditiveCall& c) {
             c.encoder = c.tensor(DType::f32, {6, 4});
           },
           {"encoder_outputs: expected rank 3 [B, S, H], got rank 2 with sizes [6, 4]"}},
          {"hidden_size",
           [](AdditiveCall& c) {
             c.hidden = c.tensor(DType::f32, {2, 5});
           },
           {"decoder_hidden: expected H = hidden_size = 4 in [B, H], got [2, 5]"}},
          {"encoder_size",
           [](AdditiveCall& c) {
             c.encoder = c.tensor(DType::f32, {2, 3, 5});
           },
           {"encoder_outputs: expected H = hidden_size = 4 in [B, S, H], got [2, 3, 5]"}},
          {"batch",
           [](AdditiveCall& c) {
             c.encoder = c.tensor(DType::f32, {3, 3, 4});
           },
           {"encoder_outputs: expected the batch size B = 2 of decoder_hidden, got [3, 3, 4]"}},
          {"dtypes_differ",
           [](AdditiveCall& c) {
             c.hidden = c.tensor(DType::f64, {2, 4});
           },
           {"decoder_hidden: expected the dtype of encoder_outputs (f32), got f64"}},
          {"lengths_count",
           [](AdditiveCall& c) { c.lengths = c.list<std::int64_t>({3}); },
           {"source_lengths: expected B = 2 entries (or none for all S), got 1"}},
          {"length_negative",
           [](AdditiveCall& c) {
             c.lengths = c.list<std::int64_t>({3, -1});
           },
           {"source_lengths[1]: expected 0 to S = 3, got -1"}},
          {"length_above_s",
           [](AdditiveCall& c) {
             c.lengths = c.list<std::int64_t>({4, 0});
           },
           {"source_lengths[0]: expected 0 to S = 3, got 4"}},
          {"attn_weight_replaced",
           [](AdditiveCall& c) {
             c.m.attn_weight.value = Tensor(DType::f32, {4, 4});
           },
           {"attn.weight: expected a floating parameter of sizes [4, 8], got f32 [4, 4]"}},
          {"v_weight_removed",
           [](AdditiveCall& c) { c.m.v_weight.value = Tensor(); },
           {"v.weight: expected a floating parameter of sizes [1, 4], got none"}},
          // backward
          {"backward_d_context_sizes",
           [](AdditiveCall& c) {
             c.backward = true;
             c.d_context = c.tensor(DType::f32, {2, 5});
           },
           {"d_context: expected [B, H] = [2, 4], got [2, 5]"}},
          {"backward_d_weights_sizes",
           [](AdditiveCall& c) {
             c.backward = true;
             c.d_weights = c.tensor(DType::f32, {2, 4});
           },
           {"d_weights: expected [B, S] = [2, 3], got [2, 4]"}},
          {"backward_lengths",
           [](AdditiveCall& c) {
             c.backward = true;
             c.lengths = c.list<std::int64_t>({1, 2, 3});
           },
           {"source_lengths: expected B = 2 entries (or none for all S), got 3"}},
          {"backward_grad_dtype_clash",
           [](AdditiveCall& c) {
             c.backward = true;
             qkv::nn::zero_grad(c.m.named_parameters());
             c.m.v_weight.grad = Tensor(DType::f64, {1, 4});
           },
           {"v.weight.grad: holds f64 gradients, this backward computes f32"}},
          {"backward_f64_after_f32",
           [](AdditiveCall& c) {
             c.backward = true;
             c.hidden = c.tensor(DType::f64, {2, 4});
             c.encoder = c.tensor(DType::f64, {2, 3, 4});
           },
           {"attn.weight.grad: holds f32 gradients, this backward computes f64", "attn.bias.grad",
            "v.weight.grad"},
           3},
      },
      view_rows<AdditiveCall>({.name = "decoder_hidden", .sizes = {2, 4}},
                              [](AdditiveCall& c, TensorView t) { c.hidden = t; }),
      view_rows<AdditiveCall>({.name = "encoder_outputs", .sizes = {2, 3, 4}},
                              [](AdditiveCall& c, TensorView t) { c.encoder = t; }),
      view_rows<AdditiveCall>({.name = "d_context", .sizes = {2, 4}},
                              [](AdditiveCall& c, TensorView t) {
                                c.backward = true;
                                c.d_context = t;
                              }),
      view_rows<AdditiveCall>({.name = "d_weights", .sizes = {2, 3}, .optional = true},
                              [](AdditiveCall& c, TensorView t) {
                                c.backward = true;
                                c.d_weights = t;
                              }),
  });
  return rows;
}

QKV_BAD_INPUT_TEST(ModuleValidation, AdditiveBadCall, AdditiveCall, bad_additive_calls());

TEST(ModuleValidation, AdditiveVariantsAreValid) {
  expect_valid<AdditiveCall>({
      {"forward", [](AdditiveCall&) {}},
      {"backward with d_weights",
       [](AdditiveCall& c) {
         c.backward = true;
         c.d_weights = c.tensor(DType::f16, {2, 3});
       }},
      {"lengths 0 and S",
       [](AdditiveCall& c) {
         c.lengths = c.list<std::int64_t>({0, 3});
       }},
  });
}

// ---- SqueezeExcitation and Cbam --------------------------------------------

// x and dy [2, 16, 3, 3] (NCHW) in a module of 16 channels whose parameters
// already hold gradients.
template <class Module>
class FeatureMapCall : public ModuleCall<FeatureMapCall<Module>> {
 public:
  static constexpr bool kCbam = std::is_same_v<Module, qkv::nn::Cbam>;
  using Options =
      std::conditional_t<kCbam, qkv::nn::CbamOptions, qkv::nn::SqueezeExcitationOptions>;

  FeatureMapCall() {
    x = this->tensor(DType::f32, {2, 16, 3, 3});
    dy = this->tensor(DType::f32, {2, 16, 3, 3});
    build({});
  }
  void build(const Options& options) {
    m.emplace(16, options);
    qkv::nn::init_uniform(m->named_parameters(), 9);
    if constexpr (kCbam) {
      // Its BatchNorm as PyTorch initializes it (init_uniform drew them).
      m->spatial_bn_running_mean.value.set({0}, 0.0);
      m->spatial_bn_running_var.value.set({0}, 1.0);
    }
    (void)m->backward(x, dy);
  }
  void run() {
    if (backward) {
      (void)m->backward(x, dy, layout);
    } else {
      (void)m->forward(x, layout);
    }
  }
  NamedParameters parameters() { return m->named_parameters(); }

  std::optional<Module> m;
  ConstTensorView x, dy;
  ImageLayout layout = ImageLayout::nchw;
  bool backward = false;
};

using SeCall = FeatureMapCall<qkv::nn::SqueezeExcitation>;
using CbamCall = FeatureMapCall<qkv::nn::Cbam>;

// The rows both modules share: x and dy.
template <class Call>
std::vector<BadRow<Call>> bad_feature_map_calls() {
  return join<Call>({
      {
          {"x_rank",
           [](Call& c) {
             c.x = c.tensor(DType::f32, {2, 16, 9});
           },
           {"x: expected rank 4 [B, C, H, W], got rank 3 with sizes [2, 16, 9]"}},
          {"x_channels",
           [](Call& c) {
             c.x = c.tensor(DType::f32, {2, 8, 3, 3});
           },
           {"x: expected C = 16 channels in [B, C, H, W], got [2, 8, 3, 3] (pass ImageLayout::nhwc "
            "for channels-last inputs)"}},
          {"x_channels_nhwc",
           [](Call& c) { c.layout = ImageLayout::nhwc; },
           {"x: expected C = 16 channels in [B, H, W, C], got [2, 16, 3, 3]"}},
          {"x_no_pixels",
           [](Call& c) {
             c.x = c.tensor(DType::f32, {2, 16, 0, 3});
           },
           {"x: expected H, W >= 1 in [B, C, H, W], got [2, 16, 0, 3]"}},
          {"backward_dy_sizes",
           [](Call& c) {
             c.backward = true;
             c.dy = c.tensor(DType::f32, {2, 16, 3, 2});
           },
           {"dy: expected the sizes of x [2, 16, 3, 3], got [2, 16, 3, 2]"}},
          {"backward_dy_rank",
           [](Call& c) {
             c.backward = true;
             c.dy = c.tensor(DType::f32, {2, 16, 9});
           },
           {"dy: expected rank 4 (the sizes of x), got rank 3 with sizes [2, 16, 9]"}},
          {"backward_f64_after_f32",
           [](Call& c) {
             c.backward = true;
             c.x = c.tensor(DType::f64, {2, 16, 3, 3});
             c.dy = c.tensor(DType::f64, {2, 16, 3, 3});
           },
           {"fc1.weight.grad: holds f32 gradients, this backward computes f64", "fc1.bias.grad",
            "fc2.weight.grad", "fc2.bias.grad"},
           4},
      },
      view_rows<Call>({.name = "x", .sizes = {2, 16, 3, 3}},
                      [](Call& c, TensorView t) { c.x = t; }),
      view_rows<Call>({.name = "dy", .sizes = {2, 16, 3, 3}},
                      [](Call& c, TensorView t) {
                        c.backward = true;
                        c.dy = t;
                      }),
  });
}

std::vector<BadRow<SeCall>> bad_se_calls() {
  std::vector<BadRow<SeCall>> rows = bad_feature_map_calls<SeCall>();
  const std::vector<BadRow<SeCall>> more = {
      {"fc1_weight_replaced",
       [](SeCall& c) {
         c.m->fc1_weight.value = Tensor(DType::f32, {8, 16});
       },
       {"fc1.weight: expected a floating parameter of sizes [8, 16, 1, 1], got f32 [8, 16]"}},
      {"fc2_bias_removed",
       [](SeCall& c) { c.m->fc2_bias.value = Tensor(); },
       {"fc2.bias: expected a floating parameter of sizes [16], got none"}},
      {"backward_grad_dtype_clash",
       [](SeCall& c) {
         c.backward = true;
         qkv::nn::zero_grad(c.m->named_parameters());
         c.m->fc2_weight.grad = Tensor(DType::f64, {16, 8, 1, 1});
       },
       {"fc2.weight.grad: holds f64 gradients, this backward computes f32"}},
  };
  rows.insert(rows.end(), more.begin(), more.end());
  return rows;
}

QKV_BAD_INPUT_TEST(ModuleValidation, SqueezeExcitationBadCall, SeCall, bad_se_calls());

std::vector<BadRow<CbamCall>> bad_cbam_calls() {
  std::vector<BadRow<CbamCall>> rows = bad_feature_map_calls<CbamCall>();
  // Cbam's MLP has no biases: its f64-after-f32 row names its own parameters.
  for (BadRow<CbamCall>& row : rows) {
    if (row.name != "backward_f64_after_f32") continue;
    row.message = {"channel.fc1.weight.grad: holds f32 gradients, this backward computes f64",
                   "spatial.conv.conv.weight.grad", "spatial.conv.bn.bias.grad"};
    row.reasons = 5;
  }
  const std::vector<BadRow<CbamCall>> more = {
      {"running_var_negative",
       [](CbamCall& c) { c.m->spatial_bn_running_var.value.set({0}, -1.0); },
       {"spatial.conv.bn.running_var: expected running_var + eps > 0 (eps = 1e-05), got "
        "running_var = -1"}},
      {"running_var_tiny_negative_without_eps",
       [](CbamCall& c) {
         c.build(qkv::nn::CbamOptions{.bn_eps = 0.0});
         c.m->spatial_bn_running_var.value.set({0}, -0x1p-20);
       },
       {"spatial.conv.bn.running_var: expected running_var + eps > 0 (eps = 0), got "
        "running_var = -9.5367431640625e-07"}},
      {"conv_weight_replaced",
       [](CbamCall& c) {
         c.m->spatial_conv_weight.value = Tensor(DType::f32, {1, 2, 3, 3});
       },
       {"spatial.conv.conv.weight: expected a floating parameter of sizes [1, 2, 7, 7], got f32 "
        "[1, 2, 3, 3]"}},
      {"backward_running_var",
       [](CbamCall& c) {
         c.backward = true;
         c.m->spatial_bn_running_var.value.set({0}, -2.0);
       },
       {"spatial.conv.bn.running_var: expected running_var + eps > 0", "got running_var = -2"}},
      {"backward_grad_dtype_clash",
       [](CbamCall& c) {
         c.backward = true;
         qkv::nn::zero_grad(c.m->named_parameters());
         c.m->spatial_bn_bias.grad = Tensor(DType::f64, {1});
       },
       {"spatial.conv.bn.bias.grad: holds f64 gradients, this backward computes f32"}},
  };
  rows.insert(rows.end(), more.begin(), more.end());
  return rows;
}

QKV_BAD_INPUT_TEST(ModuleValidation, CbamBadCall, CbamCall, bad_cbam_calls());

TEST(ModuleValidation, FeatureMapVariantsAreValid) {
  const auto nhwc = [](auto& c) {
    c.layout = ImageLayout::nhwc;
    c.x = c.tensor(DType::bf16, {2, 3, 3, 16});
    c.dy = c.tensor(DType::f32, {2, 3, 3, 16});
  };
  expect_valid<SeCall>({{"forward", [](SeCall&) {}},
                        {"backward", [](SeCall& c) { c.backward = true; }},
                        {"nhwc backward",
                         [&](SeCall& c) {
                           nhwc(c);
                           c.backward = true;
                         }},
                        {"empty batch", [](SeCall& c) {
                           c.x = c.tensor(DType::f32, {0, 16, 3, 3});
                         }}});
  expect_valid<CbamCall>({{"forward", [](CbamCall&) {}},
                          {"backward", [](CbamCall& c) { c.backward = true; }},
                          {"nhwc", [&](CbamCall& c) { nhwc(c); }}});
}

// ---- Linear ----------------------------------------------------------------

// x [2, 4] and dy [2, 3] through Linear(4, 3) whose parameters already hold
// gradients.
class LinearCall : public ModuleCall<LinearCall> {
 public:
  LinearCall() {
    qkv::nn::init_uniform(m.named_parameters(), 11);
    x = tensor(DType::f32, {2, 4});
    dy = tensor(DType::f32, {2, 3});
    (void)m.backward(x, dy);
  }
  void run() {
    if (backward) {
      (void)m.backward(x, dy);
    } else {
      (void)m.forward(x);
    }
  }
  NamedParameters parameters() { return m.named_parameters(); }

  qkv::nn::Linear m{4, 3};
  ConstTensorView x, dy;
  bool backward = false;
};

const std::vector<BadRow<LinearCall>>& bad_linear_calls() {
  static const std::vector<BadRow<LinearCall>> rows = join<LinearCall>({
      {
          {"x_scalar",
           [](LinearCall& c) { c.x = c.tensor(DType::f32, {}); },
           {"x: expected rank 1 to 4 [..., in_features], got a scalar"}},
          {"x_features",
           [](LinearCall& c) {
             c.x = c.tensor(DType::f32, {2, 5});
           },
           {"x: expected last dimension in_features = 4, got [2, 5]"}},
          {"weight_replaced",
           [](LinearCall& c) {
             c.m.weight.value = Tensor(DType::f32, {4, 3});
           },
           {"weight: expected a floating parameter of sizes [3, 4], got f32 [4, 3]"}},
          {"bias_replaced",
           [](LinearCall& c) { c.m.bias.value = Tensor(DType::f64, {4}); },
           {"bias: expected a floating parameter of sizes [3], got f64 [4]"}},
          {"weight_grad_sizes",
           [](LinearCall& c) { c.m.weight.grad = Tensor(DType::f32, {12}); },
           {"weight.grad: expected sizes [3, 4], got [12]"}},
          {"backward_dy_features",
           [](LinearCall& c) {
             c.backward = true;
             c.dy = c.tensor(DType::f32, {2, 4});
           },
           {"dy: expected last dimension out_features = 3, got [2, 4]"}},
          {"backward_dy_rows",
           [](LinearCall& c) {
             c.backward = true;
             c.dy = c.tensor(DType::f32, {5, 3});
           },
           {"dy: expected the leading dimensions of x [2, 4], got [5, 3]"}},
          {"backward_grad_dtype_clash",
           [](LinearCall& c) {
             c.backward = true;
             qkv::nn::zero_grad(c.m.named_parameters());
             c.m.bias.grad = Tensor(DType::f64, {3});
           },
           {"bias.grad: holds f64 gradients, this backward computes f32 (call zero_grad between "
            "f32 "
            "and f64 backward calls)"}},
          {"backward_f64_after_f32",
           [](LinearCall& c) {
             c.backward = true;
             c.x = c.tensor(DType::f64, {2, 4});
             c.dy = c.tensor(DType::f64, {2, 3});
           },
           {"weight.grad: holds f32 gradients, this backward computes f64", "bias.grad"},
           2},
      },
      view_rows<LinearCall>({.name = "x", .sizes = {2, 4}},
                            [](LinearCall& c, TensorView t) { c.x = t; }),
      view_rows<LinearCall>({.name = "dy", .sizes = {2, 3}},
                            [](LinearCall& c, TensorView t) {
                              c.backward = true;
                              c.dy = t;
                            }),
  });
  return rows;
}

QKV_BAD_INPUT_TEST(ModuleValidation, LinearBadCall, LinearCall, bad_linear_calls());

TEST(ModuleValidation, LinearVariantsAreValid) {
  expect_valid<LinearCall>({
      {"forward", [](LinearCall&) {}},
      {"backward", [](LinearCall& c) { c.backward = true; }},
      {"rank 1", [](LinearCall& c) { c.x = c.tensor(DType::f16, {4}); }},
      {"rank 4 backward",
       [](LinearCall& c) {
         c.backward = true;
         c.x = c.tensor(DType::f32, {2, 1, 2, 4});
         c.dy = c.tensor(DType::bf16, {2, 1, 2, 3});
       }},
  });
}

// ---- LearnedPositionalEmbedding and RelativePositionBias --------------------

// x and dy [2, 3, 4] through LearnedPositionalEmbedding(8, 4) from `start`,
// whose weight already holds gradients.
class LearnedCall : public ModuleCall<LearnedCall> {
 public:
  LearnedCall() {
    qkv::nn::init_uniform(m.named_parameters(), 13);
    x = tensor(DType::f32, {2, 3, 4});
    dy = tensor(DType::f32, {2, 3, 4});
    (void)m.backward(x, dy);
  }
  void run() {
    if (backward) {
      (void)m.backward(x, dy, start);
    } else {
      (void)m.forward(x, start);
    }
  }
  NamedParameters parameters() { return m.named_parameters(); }

  qkv::nn::LearnedPositionalEmbedding m{8, 4};
  ConstTensorView x, dy;
  std::int64_t start = 0;
  bool backward = false;
};

const std::vector<BadRow<LearnedCall>>& bad_learned_calls() {
  static const std::vector<BadRow<LearnedCall>> rows = join<LearnedCall>({
      {
          {"x_rank",
           [](LearnedCall& c) {
             c.x = c.tensor(DType::f32, {3, 4});
           },
           {"x: expected rank 3 [B, N, dim], got rank 2 with sizes [3, 4]"}},
          {"x_dim",
           [](LearnedCall& c) {
             c.x = c.tensor(DType::f32, {2, 3, 5});
           },
           {"x: expected last dimension dim = 4, got [2, 3, 5]"}},
          {"start_negative",
           [](LearnedCall& c) { c.start = -1; },
           {"start: expected a position >= 0, got -1"}},
          {"start_past_the_table",
           [](LearnedCall& c) { c.start = 6; },
           {"start: positions start + N = 6 + 3 exceed max_positions = 8"}},
          {"start_max",
           [](LearnedCall& c) { c.start = kMaxInt64; },
           {"start: positions start + N = 9223372036854775807 + 3 exceed max_positions = 8"}},
          {"weight_replaced",
           [](LearnedCall& c) {
             c.m.weight.value = Tensor(DType::f32, {4, 8});
           },
           {"weight: expected a floating parameter of sizes [8, 4], got f32 [4, 8]"}},
          {"backward_dy_sizes",
           [](LearnedCall& c) {
             c.backward = true;
             c.dy = c.tensor(DType::f32, {2, 2, 4});
           },
           {"dy: expected the sizes of x [2, 3, 4], got [2, 2, 4]"}},
          {"backward_dy_dim",
           [](LearnedCall& c) {
             c.backward = true;
             c.dy = c.tensor(DType::f32, {2, 3, 5});
           },
           {"dy: expected last dimension dim = 4, got [2, 3, 5]"}},
          {"backward_start",
           [](LearnedCall& c) {
             c.backward = true;
             c.start = 7;
           },
           {"start: positions start + N = 7 + 3 exceed max_positions = 8"}},
          {"backward_f64_after_f32",
           [](LearnedCall& c) {
             c.backward = true;
             c.x = c.tensor(DType::f64, {2, 3, 4});
             c.dy = c.tensor(DType::f64, {2, 3, 4});
           },
           {"weight.grad: holds f32 gradients, this backward computes f64"}},
      },
      view_rows<LearnedCall>({.name = "x", .sizes = {2, 3, 4}, .dtype = DType::bf16},
                             [](LearnedCall& c, TensorView t) { c.x = t; }),
      view_rows<LearnedCall>({.name = "dy", .sizes = {2, 3, 4}},
                             [](LearnedCall& c, TensorView t) {
                               c.backward = true;
                               c.dy = t;
                             }),
  });
  return rows;
}

QKV_BAD_INPUT_TEST(ModuleValidation, LearnedPositionalEmbeddingBadCall, LearnedCall,
                   bad_learned_calls());

// d_table [2, 8] into RelativePositionBias(2, 8, 16), whose weight already
// holds gradients; or bias(nq, nk).
class RelativeCall : public ModuleCall<RelativeCall> {
 public:
  RelativeCall() {
    qkv::nn::init_uniform(m.named_parameters(), 17);
    d_table = tensor(DType::f32, {2, 8});
    m.backward(d_table);
  }
  void run() {
    if (dense) {
      (void)m.bias(nq, nk);
    } else {
      m.backward(d_table);
    }
  }
  NamedParameters parameters() { return m.named_parameters(); }

  qkv::nn::RelativePositionBias m{2, 8, 16};
  ConstTensorView d_table;
  bool dense = false;  // bias(nq, nk) instead of backward
  std::int64_t nq = 3, nk = 3;
};

const std::vector<BadRow<RelativeCall>>& bad_relative_calls() {
  static const std::vector<BadRow<RelativeCall>> rows = join<RelativeCall>({
      {
          {"d_table_transposed",
           [](RelativeCall& c) {
             c.d_table = c.tensor(DType::f32, {8, 2});
           },
           {"d_table: expected [H, num_buckets] = [2, 8], got [8, 2]"}},
          {"d_table_rank",
           [](RelativeCall& c) { c.d_table = c.tensor(DType::f32, {16}); },
           {"d_table: expected rank 2 [H, num_buckets], got rank 1 with sizes [16]"}},
          {"weight_replaced",
           [](RelativeCall& c) {
             c.m.weight.value = Tensor(DType::f32, {2, 8});
           },
           {"relative_attention_bias.weight: expected a floating parameter of sizes [8, 2], got "
            "f32 "
            "[2, 8]"}},
          {"f64_after_f32",
           [](RelativeCall& c) {
             c.d_table = c.tensor(DType::f64, {2, 8});
           },
           {"relative_attention_bias.weight.grad: holds f32 gradients, this backward computes "
            "f64"}},
          {"bias_nq_negative",
           [](RelativeCall& c) {
             c.dense = true;
             c.nq = -1;
           },
           {"nq: expected >= 0, got -1"}},
          {"bias_nk_negative",
           [](RelativeCall& c) {
             c.dense = true;
             c.nk = -3;
           },
           {"nk: expected >= 0, got -3"}},
          {"bias_too_large",
           [](RelativeCall& c) {
             c.dense = true;
             c.nq = c.nk = std::int64_t{1} << 40;
           },
           {"nq, nk: the bias [H, nq, nk] = [2, 1099511627776, 1099511627776] has more than 2^63 - "
            "1 "
            "elements"}},
      },
      view_rows<RelativeCall>({.name = "d_table", .sizes = {2, 8}},
                              [](RelativeCall& c, TensorView t) { c.d_table = t; }),
  });
  return rows;
}

QKV_BAD_INPUT_TEST(ModuleValidation, RelativePositionBiasBadCall, RelativeCall,
                   bad_relative_calls());

TEST(ModuleValidation, PositionalVariantsAreValid) {
  expect_valid<LearnedCall>({
      {"forward", [](LearnedCall&) {}},
      {"last positions", [](LearnedCall& c) { c.start = 5; }},
      {"backward, no rows",
       [](LearnedCall& c) {
         c.backward = true;
         c.start = 8;
         c.x = c.tensor(DType::f32, {2, 0, 4});
         c.dy = c.tensor(DType::f32, {2, 0, 4});
       }},
  });
  expect_valid<RelativeCall>({
      {"backward", [](RelativeCall&) {}},
      {"transposed view",
       [](RelativeCall& c) {
         c.d_table = ConstTensorView(c.d_table.data(), DType::f32, {2, 8}, {1, 2});
       }},
      {"empty bias",
       [](RelativeCall& c) {
         c.dense = true;
         c.nq = 0;
         c.nk = 5;
       }},
  });
}

}  // namespace
