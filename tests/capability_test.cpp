// The capability table (core/capabilities.cpp) against what the paths do:
// for every option and every path, a call with the option on either matches
// the reference (the path takes it, or hands the call to a route that does)
// or throws a qkv::Error naming "options.<name>" — never a result that
// ignores the option. The table says which of the two each pair must give.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "attention_checks.hpp"
#include "core/capabilities.hpp"
#include "core/options.hpp"
#include "test_util.hpp"

namespace {

using qkv::AttentionOptions;
using qkv::ConstTensorView;
using qkv::DType;
using qkv::Tensor;
using qkv::detail::Option;
using qkv::detail::Path;
using qkv::test::max_abs_diff;
using qkv::test::random_tensor;

constexpr std::int64_t kB = 2, kN = 9, kHq = 2, kHkv = 1, kD = 8, kA = 4;

// One call: inputs, options, and the arrays the options point into.
struct Case {
  Tensor q = random_tensor(DType::f32, {kB, kN, kHq, kD}, 1, -1.5, 1.5);
  Tensor k = random_tensor(DType::f32, {kB, kN, kHkv, kD}, 2, -1.5, 1.5);
  Tensor v = random_tensor(DType::f32, {kB, kN, kHkv, kD}, 3);
  Tensor w_q = random_tensor(DType::f32, {kA, kD}, 4);
  Tensor w_k = random_tensor(DType::f32, {kA, kD}, 5);
  Tensor w_v = random_tensor(DType::f32, {kA}, 6);
  Tensor w_b = random_tensor(DType::f32, {kA}, 7);
  Tensor mask = random_tensor(DType::f32, {1, 1, kN, kN}, 8);
  Tensor table = random_tensor(DType::f32, {kHq, 8}, 9);
  std::vector<std::int64_t> lengths = {kN, 5}, cu = {0, 4, kN};
  std::vector<float> slopes = {0.5f, 0.25f};
  std::vector<float> sinks = {0.3f, -1.2f};
  std::vector<float> scales = {0.8f, 1.3f};
  AttentionOptions o;
  bool packed = false;

  void additive() {
    o.score = qkv::Score::additive;
    o.additive = {w_q, w_k, w_v, w_b};
  }
  // Packs the two sequences' first rows into one batch entry (lengths 4, 5).
  void pack() {
    packed = true;
    q = qkv::to_dtype(q.view().slice(0, 0, 1), DType::f32);
    k = qkv::to_dtype(k.view().slice(0, 0, 1), DType::f32);
    v = qkv::to_dtype(v.view().slice(0, 0, 1), DType::f32);
    o.cu_seqlens_q = cu;
    o.cu_seqlens_k = cu;
    lengths = {4, 3};
    if (!o.key_lengths.empty()) o.key_lengths = lengths;
  }
};

// Turns `option` on with a value every path that takes it can run.
void turn_on(Option option, Case& c) {
  AttentionOptions& o = c.o;
  switch (option) {
    case Option::score:
      o.score = qkv::Score::dot;
      return;
    case Option::scale:
      o.scale = 0.7;
      return;
    case Option::additive:
      c.additive();
      return;
    case Option::causal:
      o.causal = true;
      return;
    case Option::align:
      o.align = qkv::Align::top_left;
      return;
    case Option::window_left:
      o.window_left = 3;
      return;
    case Option::window_right:
      o.window_right = 2;
      return;
    case Option::key_lengths:
      o.key_lengths = c.lengths;
      return;
    case Option::cu_seqlens_q:
    case Option::cu_seqlens_k:
      c.pack();
      return;
    case Option::mask:
      o.mask = c.mask;
      return;
    case Option::mask_requires_grad:
      o.mask = c.mask;
      o.mask_requires_grad = true;
      return;
    case Option::alibi_slopes:
      o.alibi_slopes = c.slopes;
      return;
    case Option::sinks:
      o.sinks = c.sinks;
      return;
    case Option::score_scale:
      o.score_scale = c.scales;
      return;
    case Option::score_scale_log_n:
      o.score_scale = c.scales;
      o.score_scale_log_n = true;
      return;
    case Option::relative_bias:
      o.relative_bias = {c.table, 16, true};
      return;
    case Option::softcap:
      o.softcap = 2.0;
      return;
    case Option::score_mod:
      o.score_mod = [](double s, std::int64_t, std::int64_t h, std::int64_t i, std::int64_t j) {
        return s + 0.1 * static_cast<double>(h + i - j);
      };
      return;
    case Option::mask_mod:
      o.mask_mod = [](std::int64_t, std::int64_t, std::int64_t i, std::int64_t j) {
        return (i + j) % 3 != 1;
      };
      return;
    case Option::sparse:
      o.sparse = qkv::SparsePattern::window(2, 1);
      return;
    case Option::dropout_p:
      o.dropout_p = 0.25;
      o.dropout_seed = 11;
      return;
    case Option::dropout_seed:
      o.dropout_seed = 11;
      return;
    case Option::dropout_offset:
      o.dropout_offset = 3;
      return;
    case Option::shard:
      if (o.sparse.defined()) {  // patterns take head offsets only (validate.cpp)
        o.shard.head = 1;
        o.shard.heads = 2 * kHq;
      } else {
        o.shard.position = 2;
      }
      return;
    case Option::backend:
      o.backend = qkv::Backend::fast;
      return;
    case Option::matmul_precision:
      o.matmul_precision = qkv::MatmulPrecision::medium;
      return;
    case Option::return_lse:
      o.return_lse = true;
      return;
    case Option::return_probs:
      o.return_probs = true;
      return;
  }
  ADD_FAILURE() << "no sample value for options." << qkv::detail::option_name(option);
}

// The call each path needs besides the option under test.
void prepare(Path path, Case& c) {
  switch (path) {
    case Path::additive_backward:
      c.additive();
      break;
    case Path::additive_own_weights:
      c.additive();
      c.o.key_lengths = c.lengths;
      break;
    case Path::dilated_split:
      c.o.sparse = qkv::SparsePattern::dilated_window(2, 2, 2);
      break;
    default:
      break;
  }
}

// Pairs that are not a combination of features: scale and score choose the
// score, which the additive paths have chosen already; score_scale (and its
// log_n form) scales dot-product scores, and validation refuses it with
// Score::additive (score_scale_test.cpp).
bool combines(Path path, Option option) {
  const bool additive_path = path == Path::additive_backward || path == Path::additive_own_weights;
  return !(additive_path && (option == Option::scale || option == Option::score ||
                             option == Option::score_scale || option == Option::score_scale_log_n));
}

void expect_names(const qkv::Error& e, Option option, const std::string& label) {
  const std::string want = std::string("options.") + qkv::detail::option_name(option) + ":";
  EXPECT_NE(std::string(e.what()).find(want), std::string::npos)
      << label << ": the error does not name " << want << "\n"
      << e.what();
}

// Decodes the last two rows of c.q against a cache of all of c.k, c.v and
// checks them against the causal forward's last two rows.
void run_decode(Case& c, bool supported, Option option, const std::string& label) {
  qkv::KvCacheConfig config;
  config.batch = c.q.size(0);
  config.kv_heads = kHkv;
  config.head_dim = kD;
  config.capacity = kN;
  qkv::KvCache cache(config);
  cache.append(c.k, c.v);
  const ConstTensorView q_new = c.q.view().slice(1, kN - 2, 2);
  if (!supported) {
    try {
      qkv::decode_attention(q_new, cache, c.o);
      ADD_FAILURE() << label << ": expected a qkv::Error";
    } catch (const qkv::Error& e) {
      expect_names(e, option, label);
    }
    return;
  }
  // Decoding is causal attention of the new rows against every cached key
  // (bottom-right by default; an option that moves them must show).
  qkv::test::expect_decode_matches_causal(q_new, c.k, c.v, cache, c.o, label);
}

// The backward on Backend::fast: matches the reference, or names the option.
void run_backward(Case& c, bool supported, Option option, const std::string& label) {
  if (supported) {
    qkv::test::expect_backward_matches(c.q, c.k, c.v, c.o, label);
    return;
  }
  AttentionOptions fast = c.o;
  fast.backend = qkv::Backend::fast;
  fast.return_lse = true;
  AttentionOptions forward = fast;
  forward.score_mod = nullptr;  // a forward the backward can be given
  const qkv::AttentionResult fwd = qkv::attention(c.q, c.k, c.v, forward);
  try {
    qkv::attention_backward(c.q, c.k, c.v, fwd.out, fwd.out, fwd.lse, fast);
    ADD_FAILURE() << label << ": expected a qkv::Error";
  } catch (const qkv::Error& e) {
    expect_names(e, option, label);
  }
}

// Backend::automatic's backward equals the reference backward's bit for bit.
void expect_automatic_is_reference(const Case& c, const std::string& label) {
  AttentionOptions automatic = c.o, reference = c.o;
  automatic.backend = qkv::Backend::automatic;
  reference.backend = qkv::Backend::reference;
  reference.return_lse = true;
  const qkv::AttentionResult r = qkv::attention(c.q, c.k, c.v, reference);
  const qkv::AttentionGradients want =
      qkv::attention_backward(c.q, c.k, c.v, r.out, r.out, r.lse, reference);
  const qkv::AttentionGradients got =
      qkv::attention_backward(c.q, c.k, c.v, r.out, r.out, r.lse, automatic);
  EXPECT_EQ(max_abs_diff(got.dq, want.dq), 0.0) << label;
  EXPECT_EQ(max_abs_diff(got.dk, want.dk), 0.0) << label;
  EXPECT_EQ(max_abs_diff(got.dv, want.dv), 0.0) << label;
}

void check(Path path, Option option) {
  const std::string label =
      std::string(qkv::detail::path_name(path)) + ", options." + qkv::detail::option_name(option);
  SCOPED_TRACE(label);
  Case c;
  prepare(path, c);
  if (!combines(path, option)) return;
  if (!qkv::detail::is_on(c.o, option)) turn_on(option, c);
  ASSERT_TRUE(qkv::detail::is_on(c.o, option)) << label << ": the sample value is the default";
  const bool supported = qkv::detail::supports(path, option);
  switch (path) {
    case Path::forward:
      ASSERT_TRUE(supported);
      qkv::test::expect_matches_reference(c.q, c.k, c.v, c.o, label);
      return;
    case Path::backward:
    case Path::additive_backward:
      run_backward(c, supported, option, label);
      if (!supported && path == Path::additive_backward &&
          qkv::detail::supports(Path::backward, option)) {
        // On Backend::automatic the reference backward runs instead.
        expect_automatic_is_reference(c, label);
      }
      return;
    case Path::additive_own_weights:
    case Path::dilated_split: {
      // Fast routes: a call they do not take runs on the general route, so
      // both must match the reference.
      qkv::test::expect_matches_reference(c.q, c.k, c.v, c.o, label);
      const Path backward = path == Path::dilated_split ? Path::backward : Path::additive_backward;
      if (qkv::detail::supports(backward, option)) {
        qkv::test::expect_backward_matches(c.q, c.k, c.v, c.o, label);
      }
      return;
    }
    case Path::decode:
      run_decode(c, supported, option, label);
      return;
    case Path::context_parallel:
      // qkv::dist's tests (tests/dist) run the pairs over MPI; here, the
      // refusals its validation gathers.
      {
        qkv::detail::Reasons reasons;
        qkv::detail::refuse_unsupported(path, c.o, "qkv::dist", "", reasons);
        EXPECT_EQ(reasons.empty(), supported) << label;
      }
      return;
  }
}

TEST(Capabilities, EveryOptionOnEveryPathMatchesTheReferenceOrIsRefusedByName) {
  for (int p = 0; p < qkv::detail::kPathCount; ++p) {
    for (std::size_t o = 0; o < qkv::detail::kOptionCount; ++o) {
      check(static_cast<Path>(p), static_cast<Option>(o));
    }
  }
}

TEST(Capabilities, EveryOptionHasANameADocAndADefaultThatIsOff) {
  const AttentionOptions defaults;
  for (std::size_t o = 0; o < qkv::detail::kOptionCount; ++o) {
    const Option option = static_cast<Option>(o);
    EXPECT_FALSE(qkv::detail::is_on(defaults, option)) << qkv::detail::option_name(option);
    EXPECT_GT(std::string(qkv::detail::option_doc(option)).size(), 5u);
  }
}

}  // namespace
