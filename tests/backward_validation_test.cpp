// Bad input to qkv::attention_backward and attention_backward_into: each row
// starts from a valid call, breaks one thing, and checks that qkv::Error names
// the argument and the problem. (The checks shared with the forward, on q, k,
// v and the options, are covered by validation_test.cpp.)
#include <gtest/gtest.h>

#include <cctype>
#include <functional>
#include <string>
#include <vector>

#include "qkv/qkv.hpp"

namespace {

using qkv::DType;
using qkv::Tensor;

// The valid base case: q [2, 5, 4, 8], k and v [2, 7, 2, 8] (GQA), out and
// dout [2, 5, 4, 8], lse [2, 4, 5], gradients in their own buffers.
struct Call {
  Tensor q{DType::f32, {2, 5, 4, 8}}, k{DType::f32, {2, 7, 2, 8}}, v{DType::f32, {2, 7, 2, 8}};
  Tensor out{DType::f32, {2, 5, 4, 8}}, dout{DType::f32, {2, 5, 4, 8}};
  Tensor lse{DType::f32, {2, 4, 5}};
  Tensor dq{DType::f32, {2, 5, 4, 8}}, dk{DType::f32, {2, 7, 2, 8}}, dv{DType::f32, {2, 7, 2, 8}};
  Tensor table{DType::f32, {4, 8}}, d_table{DType::f32, {4, 8}};
  qkv::GradientOutputs grads() { return {dq, dk, dv}; }
  qkv::AttentionOptions options;
  bool into = true;
  qkv::GradientOutputs custom;
  bool use_custom = false;

  void run() {
    if (!into) {
      qkv::attention_backward(q, k, v, out, dout, lse, options);
      return;
    }
    qkv::attention_backward_into(q, k, v, out, dout, lse, use_custom ? custom : grads(), options);
  }
};

struct Row {
  std::string name;
  std::function<void(Call&)> breaks;
  std::vector<std::string> message;  // substrings the error must contain
};

std::string error_of(Call& c) {
  try {
    c.run();
  } catch (const qkv::Error& e) {
    return e.what();
  }
  return "";
}

const std::vector<Row>& rows() {
  static const std::vector<Row> table = {
      {"out shape",
       [](Call& c) {
         c.out = Tensor(DType::f32, {2, 5, 4, 9});
       },
       {"out: expected sizes [2, 5, 4, 8], got [2, 5, 4, 9]"}},
      {"dout dtype",
       [](Call& c) {
         c.dout = Tensor(DType::bf16, {2, 5, 4, 8});
       },
       {"dout: expected dtype f32, got bf16"}},
      {"lse shape",
       [](Call& c) {
         c.lse = Tensor(DType::f32, {2, 5, 4});
       },
       {"lse: expected sizes [2, 4, 5], got [2, 5, 4]"}},
      {"lse missing", [](Call& c) { c.lse = Tensor(); }, {"lse: required tensor is undefined"}},
      {"out missing", [](Call& c) { c.out = Tensor(); }, {"out: required tensor is undefined"}},
      {"out and lse missing for a piece of a larger call",
       [](Call& c) {
         c.out = Tensor();
         c.lse = Tensor();
         c.options.shard.partial_keys = true;
       },
       {"out, lse: required with options.shard.partial_keys"}},
      {"score_mod",
       [](Call& c) {
         c.options.score_mod = [](double s, std::int64_t, std::int64_t, std::int64_t,
                                  std::int64_t) { return s; };
       },
       {"options.score_mod", "cannot differentiate"}},
      {"dropout_p",
       [](Call& c) { c.options.dropout_p = 1.0; },
       {"options.dropout_p: expected a probability in [0, 1), got 1"}},
      {"dq shape",
       [](Call& c) {
         c.use_custom = true;
         c.custom = {c.dk, c.dk, c.dv};
       },
       {"dq: expected sizes [2, 5, 4, 8], got [2, 7, 2, 8]"}},
      {"dv missing",
       [](Call& c) {
         c.use_custom = true;
         c.custom = {c.dq, c.dk, {}};
       },
       {"dv: required because the options use v"}},
      {"dk overlaps dq",
       [](Call& c) {
         c.use_custom = true;
         // [2, 7, 2, 8] over dq's 320 floats.
         c.custom = {c.dq, qkv::TensorView(c.dq.data<float>(), {2, 7, 2, 8}), c.dv};
       },
       {"dk: memory overlaps dq"}},
      {"dq overlaps q",
       [](Call& c) {
         c.use_custom = true;
         c.custom = {c.q, c.dk, c.dv};
       },
       {"dq: memory overlaps q"}},
      {"relative bias gradient missing",
       [](Call& c) { c.options.relative_bias.table = c.table; },
       {"d_relative_bias: required because the options use relative_bias.table"}},
      {"relative bias gradient not used",
       [](Call& c) {
         c.use_custom = true;
         c.custom = {c.dq, c.dk, c.dv, c.d_table};
       },
       {"d_relative_bias: given, but the options have no relative_bias.table"}},
      {"mask gradient without a mask",
       [](Call& c) {
         c.options.mask_requires_grad = true;
         c.into = false;
       },
       {"options.mask_requires_grad: expected a float options.mask, got none"}},
      {"mask gradient of a bool mask",
       [](Call& c) {
         static Tensor mask{DType::boolean, {5, 7}};
         c.options.mask = mask;
         c.options.mask_requires_grad = true;
         c.into = false;
       },
       {"options.mask_requires_grad: expected a float options.mask, got a bool mask"}},
      {"mask gradient missing",
       [](Call& c) {
         static Tensor mask{DType::f32, {5, 7}};
         c.options.mask = mask;
         c.options.mask_requires_grad = true;
       },
       {"d_mask: required because the options use mask_requires_grad"}},
      {"mask gradient of the wrong shape",
       [](Call& c) {
         static Tensor mask{DType::f32, {5, 7}}, d_mask{DType::f32, {1, 5, 7}};
         c.options.mask = mask;
         c.options.mask_requires_grad = true;
         c.use_custom = true;
         c.custom = {.dq = c.dq, .dk = c.dk, .dv = c.dv, .d_mask = d_mask};
       },
       {"d_mask: expected rank 2, got rank 3 with sizes [1, 5, 7]"}},
      {"fast additive with softcap",
       [](Call& c) {
         static Tensor w{DType::f32, {3, 8}}, va{DType::f32, {3}};
         c.options.score = qkv::Score::additive;
         c.options.additive = {w, w, va, {}};
         c.options.softcap = 2.0;
         c.options.backend = qkv::Backend::fast;
         c.into = false;
       },
       {"options.softcap: not supported by Backend::fast's backward of Score::additive"}},
  };
  return table;
}

class BackwardValidation : public ::testing::TestWithParam<std::size_t> {};

TEST_P(BackwardValidation, ThrowsErrorNamingTheProblem) {
  const Row& row = rows()[GetParam()];
  Call c;
  row.breaks(c);
  const std::string message = error_of(c);
  ASSERT_FALSE(message.empty()) << row.name << ": no qkv::Error";
  for (const std::string& part : row.message) {
    EXPECT_NE(message.find(part), std::string::npos)
        << row.name << ": expected \"" << part << "\" in\n"
        << message;
  }
}

INSTANTIATE_TEST_SUITE_P(Rows, BackwardValidation, ::testing::Range<std::size_t>(0, rows().size()),
                         [](const auto& row_info) {
                           std::string name = rows()[row_info.param].name;
                           for (char& ch : name)
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return name;
                         });

TEST(BackwardValidation, BaseCaseIsValid) {
  Call c;
  EXPECT_EQ(error_of(c), "");
  c.into = false;
  EXPECT_EQ(error_of(c), "");
}

// The parameter rows decide what a call's backward computes: the used
// parameters' gradients, in the rows' order, with the shapes the allocating
// overload returns and the _into overload requires.
TEST(BackwardValidation, ParameterGradientsFollowTheRows) {
  Call c;
  EXPECT_TRUE(qkv::parameter_gradients(c.q, c.k, c.v, c.options).empty());
  const std::vector<float> sinks = {0.5f, -1.0f, 0.0f, 2.0f};
  c.options.sinks = sinks;
  c.options.relative_bias.table = c.table;
  const std::vector<qkv::ParameterGradient> used =
      qkv::parameter_gradients(c.q, c.k, c.v, c.options);
  ASSERT_EQ(used.size(), 2u);
  EXPECT_STREQ(used[0].name, "d_relative_bias");
  EXPECT_EQ(used[0].sizes, (std::vector<std::int64_t>{4, 8}));
  EXPECT_STREQ(used[1].name, "d_sinks");
  EXPECT_EQ(used[1].sizes, (std::vector<std::int64_t>{4}));
  EXPECT_EQ(used[1].dtype, DType::f32);
  const qkv::AttentionGradients g =
      qkv::attention_backward(c.q, c.k, c.v, {}, c.dout, {}, c.options);
  EXPECT_EQ(g.d_relative_bias.size(0), 4);
  EXPECT_EQ(g.d_relative_bias.size(1), 8);
  EXPECT_EQ(g.d_sinks.size(0), 4);
  EXPECT_FALSE(g.d_additive_w_q.defined());
  EXPECT_THROW(qkv::parameter_gradients(c.q, c.k, c.dout, c.options), qkv::Error);
}

}  // namespace
