// AttentionOptions::shard: one call computes a piece of a larger problem (a
// block of query rows against a block of keys, or a subset of the heads),
// and the pieces of a problem give the whole call back.
//   Forward: pieces merged row by row by their lse (merge_softmax_parts, the
//     merge of split-KV decoding and of ring attention) equal the whole call
//     within the worst-case error bounds of error_bound.hpp, under every
//     option that moves with the query position, and with dropout.
//   Heads: calls on subsets of the heads equal the whole call bitwise.
//   Backward: the pieces' gradients (given the whole call's out and lse, as
//     ring attention's backward is) sum to the whole call's.
//   Validation: bad offsets throw qkv::Error naming the field; decoding
//     rejects shards.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "api/validate.hpp"
#include "core/elements.hpp"
#include "core/softmax_epilogue.hpp"
#include "qkv/qkv.hpp"

// bad_input.hpp and attention_checks.hpp both define qkv::test::kInf: the
// former's is renamed here so that this file can use both.
#define kInf kInfOfBadInput
#include "bad_input.hpp"
#undef kInf
#include "attention_checks.hpp"
#include "error_bound.hpp"
#include "test_util.hpp"

namespace {

using qkv::AttentionOptions;
using qkv::AttentionResult;
using qkv::Backend;
using qkv::ConstTensorView;
using qkv::DType;
using qkv::Tensor;
using qkv::TensorView;
using qkv::detail::kMaxSequence;
using qkv::test::finite_diff;
using qkv::test::Inputs;
using qkv::test::make_inputs;
using qkv::test::max_abs;
using qkv::test::max_abs_diff;

constexpr double kNegInf = -std::numeric_limits<double>::infinity();
constexpr std::uint64_t kSeed = 0x5eed0123456789abULL;
constexpr std::int64_t kB = 2, kHq = 4, kHkv = 2, kD = 16;

const char* backend_name(Backend b) { return b == Backend::fast ? "fast" : "reference"; }

struct Block {
  std::int64_t begin = 0, size = 0;
};

// Consecutive blocks of the given sizes.
std::vector<Block> blocks_of(std::initializer_list<std::int64_t> sizes) {
  std::vector<Block> blocks;
  std::int64_t begin = 0;
  for (const std::int64_t s : sizes) {
    blocks.push_back({begin, s});
    begin += s;
  }
  return blocks;
}

// A whole problem and how it is cut: query rows into `rows`, keys into `keys`.
struct Split {
  std::int64_t nq, nk;
  std::vector<Block> rows, keys;
};

std::vector<Split> splits() {
  return {{24, 24, blocks_of({11, 13}), blocks_of({7, 9, 8})},
          {16, 24, blocks_of({7, 9}), blocks_of({7, 9, 8})},
          // More rows than keys: bottom_right causal rows before the keys are empty.
          {24, 16, blocks_of({11, 13}), blocks_of({5, 6, 5})}};
}

std::string split_name(const Split& s, qkv::Align align) {
  return "Nq " + std::to_string(s.nq) + " Nk " + std::to_string(s.nk) +
         (align == qkv::Align::bottom_right ? " bottom_right" : " top_left");
}

// The options of the piece of rows `r` against keys `c` of a call with
// `whole` options: positions in the piece's key coordinates (the whole
// call's p_i = i + delta moved by the piece's first row and first key),
// dropout in the whole call's rows and keys.
AttentionOptions piece_options(const AttentionOptions& whole, std::int64_t nq, std::int64_t nk,
                               const Block& r, const Block& c) {
  const std::int64_t delta = whole.align == qkv::Align::bottom_right ? nk - nq : 0;
  AttentionOptions o = whole;
  o.align = qkv::Align::top_left;
  o.shard.position = r.begin + delta - c.begin;
  o.shard.row = r.begin;
  o.shard.key = c.begin;
  o.shard.partial_keys = true;  // the backward's weights come from the whole row's lse
  o.return_lse = true;
  return o;
}

struct Merged {
  Tensor out;  // [B, Nq, Hq, Dv] f32
  Tensor lse;  // [B, Hq, Nq] f32
};

// Runs every piece of `split` and merges each row's pieces (normalized parts:
// m = lse, l = 1) in f32, in key order, as a ring of f32 calls would.
Merged merge_pieces(const Inputs& in, const Split& split, const AttentionOptions& whole) {
  const std::int64_t b_n = in.q.size(0), hq = in.q.size(2), dv = in.v.size(3);
  Merged m{Tensor(DType::f32, {b_n, split.nq, hq, dv}), Tensor(DType::f32, {b_n, hq, split.nq})};
  std::vector<float> row(static_cast<std::size_t>(dv));
  for (const Block& r : split.rows) {
    std::vector<AttentionResult> parts;
    for (const Block& c : split.keys) {
      parts.push_back(qkv::attention(
          in.q.view().slice(1, r.begin, r.size), in.k.view().slice(1, c.begin, c.size),
          in.v.view().slice(1, c.begin, c.size), piece_options(whole, split.nq, split.nk, r, c)));
    }
    for (std::int64_t b = 0; b < b_n; ++b)
      for (std::int64_t h = 0; h < hq; ++h)
        for (std::int64_t i = 0; i < r.size; ++i) {
          const float lse = qkv::detail::merge_softmax_parts<float>(
              static_cast<std::int64_t>(parts.size()), dv,
              [&](std::int64_t s) {
                const AttentionResult& p = parts[static_cast<std::size_t>(s)];
                return qkv::detail::SoftmaxPart<float>{
                    p.lse.data<float>()[(b * hq + h) * r.size + i], 1.0f,
                    p.out.data<float>() + ((b * r.size + i) * hq + h) * dv};
              },
              row.data(), -std::numeric_limits<float>::infinity());
          for (std::int64_t c = 0; c < dv; ++c) {
            m.out.set({b, r.begin + i, h, c}, row[static_cast<std::size_t>(c)]);
          }
          m.lse.set({b, h, r.begin + i}, lse);
        }
  }
  return m;
}

struct Tolerance {
  double out = 0.0, lse = 0.0;
};

// How far the merged pieces may lie from the whole call, both computed in
// f32 in different orders. Each is compared with the exact result:
//  * The whole call is within forward_error_bound (error_bound.hpp) of it.
//    So is every piece of its own exact result: a piece is a sub-problem of
//    the whole (fewer keys, a subset of q, k and v, and the same |p_i - j|
//    for ALiBi, since that is what the shift preserves), and the bound only
//    grows with the keys and the magnitudes. |exact out| <= r max|v| (r =
//    1 / (1 - dropout_p)) for the whole and every piece: a convex
//    combination of values, each scaled by at most r.
//  * Exactly, the pieces merge to the whole: out = sum_s pi_s o_s with pi_s
//    = e^(lse_s) / sum_t e^(lse_t) (dropout included: each o_s is linear in
//    the weights, and lse_s is taken before dropout). With computed lse_s
//    off by at most E_l each, and the merge's w_s = fl(exp(fl(lse_s - M)))
//    off by u |lse_s - M| <= u (2 M_s + log(Nk + 1) + 2 E_l) (M_s bounds
//    |score|) and the exponential's 2 ulp, every weight is off by a factor
//    within 1 + eta, and sum_s |pi_s' - pi_s| <= 2 eta / (1 - eta). Then
//    |merged - exact| <= E_o + quotient(eta) r max|v| (the parts' own error
//    through a convex combination, and the moved weights), plus the merge's
//    f32 arithmetic: the sums over the parts (n products and additions, n
//    parts), 1 / sum and the product by it, weights flushed below 2^-126
//    (sum >= 1, the largest weight being e^0).
//  * The merged lse = M + log(sum) is a logsumexp of the parts' lse, which
//    is 1-Lipschitz in them (E_l), plus the relative error of the sum
//    through the log (-log(1 - e)), log's ulp on log(sum) <= log(n), and the
//    last addition's ulp on |lse| <= M_s + log(Nk + 1) + E_l.
// The tolerance is the sum of the two distances to the exact result.
Tolerance merge_tolerance(const Inputs& in, const AttentionOptions& opt, std::int64_t parts) {
  using qkv::test::gamma_n;
  using qkv::test::grow;
  using qkv::test::quotient;
  const double u = qkv::test::kU32;
  const double o_max = max_abs(in.v) / (1.0 - opt.dropout_p);
  const qkv::test::ForwardErrorBound e =
      qkv::test::forward_error_bound(in.q, in.k, in.v, opt, o_max);
  const double magnitude = qkv::test::score_error_bound(in.q, in.k, opt).magnitude;
  const double log_n = std::log(static_cast<double>(in.k.size(1)) + 1);
  const double n = static_cast<double>(parts);
  const double flushed = n * 0x1p-125;
  const double rounding = (1 + grow(u * (2 * magnitude + log_n + 2 * e.lse))) * (1 + 4 * u) - 1;
  const double eta = (1 + grow(e.lse)) * (1 + rounding) - 1;
  const double arithmetic = (quotient(gamma_n(n + 1)) + 2 * u + flushed) * (o_max + e.out) +
                            qkv::test::kTiny32 * (2 * n + 2);
  Tolerance t;
  t.out = (e.out + quotient(eta) * o_max + arithmetic) + e.out;
  const double sum_error = (1 + rounding) * (1 + gamma_n(n)) - 1 + flushed;
  const double through_log =
      sum_error < 1 ? -std::log1p(-sum_error) : std::numeric_limits<double>::infinity();
  t.lse = (e.lse + through_log + 2 * u * std::log(n) + u * (magnitude + log_n + e.lse)) + e.lse;
  return t;
}

// Rows of the whole problem that no key is admitted to by the causal and
// window masks alone (sequence positions p_i = i + delta), times B * Hq.
std::int64_t expected_empty_rows(const AttentionOptions& o, std::int64_t nq, std::int64_t nk) {
  const std::int64_t delta = o.align == qkv::Align::bottom_right ? nk - nq : 0;
  std::int64_t empty = 0;
  for (std::int64_t i = 0; i < nq; ++i) {
    const std::int64_t p = i + delta;
    std::int64_t lo = 0, hi = nk - 1;
    if (o.window_left >= 0) lo = std::max(lo, p - o.window_left);
    if (o.causal) hi = std::min(hi, p);
    if (o.window_right >= 0) hi = std::min(hi, p + o.window_right);
    empty += lo > hi;
  }
  return empty * kB * kHq;
}

// Elements whose bits differ (NaN matches NaN; -0 does not match +0).
std::int64_t bit_differences(ConstTensorView a, ConstTensorView b) {
  std::int64_t n = 0;
  qkv::detail::for_each_index(a.sizes(), a.rank(), [&](const qkv::Shape& idx) {
    const double x =
        qkv::detail::load(a.data(), a.dtype(), qkv::detail::offset(idx, a.strides(), a.rank()));
    const double y =
        qkv::detail::load(b.data(), b.dtype(), qkv::detail::offset(idx, b.strides(), b.rank()));
    const bool same = std::bit_cast<std::uint64_t>(x) == std::bit_cast<std::uint64_t>(y) ||
                      (std::isnan(x) && std::isnan(y));
    n += same ? 0 : 1;
  });
  return n;
}

// dst += src, element by element (same sizes).
void add_into(TensorView dst, ConstTensorView src) {
  qkv::detail::for_each_index(src.sizes(), src.rank(), [&](const qkv::Shape& idx) {
    const std::int64_t d = qkv::detail::offset(idx, dst.strides(), dst.rank());
    const double x = qkv::detail::load(src.data(), src.dtype(),
                                       qkv::detail::offset(idx, src.strides(), src.rank()));
    qkv::detail::store(dst.data(), dst.dtype(), d,
                       qkv::detail::load(dst.data(), dst.dtype(), d) + x);
  });
}

// The option sets of the forward check. `slopes` must outlive the result
// (the options point into it).
std::vector<std::pair<std::string, AttentionOptions>> forward_cases(
    const std::vector<float>& slopes) {
  std::vector<std::pair<std::string, AttentionOptions>> cases;
  cases.emplace_back("no mask", AttentionOptions{});
  AttentionOptions causal;
  causal.causal = true;
  cases.emplace_back("causal", causal);
  AttentionOptions causal_window = causal;
  causal_window.window_left = 5;
  cases.emplace_back("causal, window_left 5", causal_window);
  AttentionOptions window;
  window.window_left = 3;
  window.window_right = 2;
  cases.emplace_back("window 3 / 2", window);
  AttentionOptions alibi;
  alibi.alibi_slopes = slopes;
  cases.emplace_back("ALiBi", alibi);
  AttentionOptions softcap;
  softcap.softcap = 5.0;
  cases.emplace_back("softcap 5", softcap);
  AttentionOptions dropout;
  dropout.dropout_p = 0.3;
  dropout.dropout_seed = kSeed;
  dropout.dropout_offset = 7;
  cases.emplace_back("dropout 0.3", dropout);
  // Everything that reads p_i at once.
  AttentionOptions all = causal_window;
  all.alibi_slopes = slopes;
  all.softcap = 5.0;
  all.dropout_p = 0.3;
  all.dropout_seed = kSeed + 1;
  cases.emplace_back("causal, window_left 5, ALiBi, softcap, dropout", all);
  return cases;
}

void check_forward(Backend backend) {
  const std::vector<float> slopes = qkv::alibi_slopes(kHq);
  std::int64_t empty_rows = 0;
  std::uint32_t seed = 100;
  for (const Split& split : splits()) {
    const Inputs in = make_inputs(kB, split.nq, split.nk, kHq, kHkv, kD, kD, DType::f32, seed += 3);
    for (const qkv::Align align : {qkv::Align::top_left, qkv::Align::bottom_right}) {
      for (auto [name, opt] : forward_cases(slopes)) {
        const std::string label =
            std::string(backend_name(backend)) + ", " + split_name(split, align) + ", " + name;
        SCOPED_TRACE(label);
        opt.align = align;
        opt.backend = backend;
        opt.return_lse = true;
        const AttentionResult whole = qkv::attention(in.q, in.k, in.v, opt);
        const Merged merged = merge_pieces(in, split, opt);
        const Tolerance tol =
            merge_tolerance(in, opt, static_cast<std::int64_t>(split.keys.size()));
        int mismatches = 0;
        const double out_err = finite_diff(merged.out, whole.out, &mismatches);
        const double lse_err = finite_diff(merged.lse, whole.lse, &mismatches);
        EXPECT_EQ(mismatches, 0) << "infinities or NaNs differ";
        EXPECT_LE(out_err, tol.out) << "out";
        EXPECT_LE(lse_err, tol.lse) << "lse";
        // Rows that see no key: out 0 and lse -inf, in the whole call and merged.
        std::int64_t empty = 0;
        for (std::int64_t b = 0; b < kB; ++b)
          for (std::int64_t h = 0; h < kHq; ++h)
            for (std::int64_t i = 0; i < split.nq; ++i) {
              if (whole.lse.get({b, h, i}) != kNegInf) continue;
              ++empty;
              EXPECT_EQ(merged.lse.get({b, h, i}), kNegInf);
              for (std::int64_t c = 0; c < kD; ++c) {
                EXPECT_EQ(whole.out.get({b, i, h, c}), 0.0) << "row " << i;
                EXPECT_EQ(merged.out.get({b, i, h, c}), 0.0) << "row " << i;
              }
            }
        if (!opt.sparse.defined()) {
          EXPECT_EQ(empty, expected_empty_rows(opt, split.nq, split.nk));
        }
        empty_rows += empty;
      }
    }
  }
  EXPECT_GT(empty_rows, 0) << "no case had a row without keys";
}

TEST(ShardForward, ReferencePiecesMergeToTheWholeCall) { check_forward(Backend::reference); }

TEST(ShardForward, FastPiecesMergeToTheWholeCall) { check_forward(Backend::fast); }

// The check has teeth: pieces whose dropout forgets the global row and key
// (the right positions, shard.row = shard.key = 0) merge to something else.
TEST(ShardForward, DropoutOfLocalIndicesDoesNotMerge) {
  const Split split = splits()[1];
  const Inputs in = make_inputs(kB, split.nq, split.nk, kHq, kHkv, kD, kD, DType::f32, 120);
  for (const Backend backend : {Backend::reference, Backend::fast}) {
    SCOPED_TRACE(backend_name(backend));
    AttentionOptions opt;
    opt.causal = true;
    opt.dropout_p = 0.3;
    opt.dropout_seed = kSeed;
    opt.backend = backend;
    opt.return_lse = true;
    const Tolerance tol = merge_tolerance(in, opt, static_cast<std::int64_t>(split.keys.size()));
    const Block& r = split.rows[1];
    const Block& c = split.keys[1];
    AttentionOptions local = piece_options(opt, split.nq, split.nk, r, c);
    const AttentionResult right =
        qkv::attention(in.q.view().slice(1, r.begin, r.size), in.k.view().slice(1, c.begin, c.size),
                       in.v.view().slice(1, c.begin, c.size), local);
    local.shard.row = 0;
    local.shard.key = 0;
    const AttentionResult wrong =
        qkv::attention(in.q.view().slice(1, r.begin, r.size), in.k.view().slice(1, c.begin, c.size),
                       in.v.view().slice(1, c.begin, c.size), local);
    EXPECT_GT(max_abs_diff(right.out, wrong.out), 100 * tol.out);
    EXPECT_EQ(bit_differences(right.lse, wrong.lse), 0) << "lse is taken before dropout";
  }
}

// Query heads [2g, 2g + 2) with KV head g (the GQA group of 2 kept): the
// same math in the same order per head, so the same bits, dropout included
// (shard.head / shard.heads give the whole call's head streams). The
// backward of the half (given the whole call's out, dout and lse) gives
// the whole's dq of those heads and dk, dv of that KV head, bitwise too.
TEST(ShardHeads, HalvesOfTheHeadsEqualTheWholeCallBitwise) {
  for (const Split& split : splits()) {
    const Inputs in = make_inputs(kB, split.nq, split.nk, kHq, kHkv, kD, kD, DType::f32, 130);
    const Tensor dout = qkv::test::random_tensor(DType::f32, {kB, split.nq, kHq, kD}, 131);
    for (const Backend backend : {Backend::reference, Backend::fast}) {
      const std::string label =
          std::string(backend_name(backend)) + ", " + split_name(split, qkv::Align::bottom_right);
      SCOPED_TRACE(label);
      AttentionOptions opt;
      opt.causal = true;
      opt.dropout_p = 0.3;
      opt.dropout_seed = kSeed;
      opt.dropout_offset = 3;
      opt.backend = backend;
      opt.return_lse = true;
      const AttentionResult whole = qkv::attention(in.q, in.k, in.v, opt);
      const qkv::AttentionGradients whole_grad =
          qkv::attention_backward(in.q, in.k, in.v, whole.out, dout, whole.lse, opt);
      for (std::int64_t g = 0; g < kHkv; ++g) {
        const std::int64_t h0 = 2 * g;
        AttentionOptions half = opt;
        half.shard.head = h0;
        half.shard.heads = kHq;
        const ConstTensorView q = in.q.view().slice(2, h0, 2);
        const ConstTensorView k = in.k.view().slice(2, g, 1);
        const ConstTensorView v = in.v.view().slice(2, g, 1);
        const AttentionResult part = qkv::attention(q, k, v, half);
        EXPECT_EQ(bit_differences(part.out, whole.out.view().slice(2, h0, 2)), 0) << "out " << g;
        EXPECT_EQ(bit_differences(part.lse, whole.lse.view().slice(1, h0, 2)), 0) << "lse " << g;
        const qkv::AttentionGradients grad = qkv::attention_backward(
            q, k, v, whole.out.view().slice(2, h0, 2), dout.view().slice(2, h0, 2),
            whole.lse.view().slice(1, h0, 2), half);
        EXPECT_EQ(bit_differences(grad.dq, whole_grad.dq.view().slice(2, h0, 2)), 0) << "dq " << g;
        EXPECT_EQ(bit_differences(grad.dk, whole_grad.dk.view().slice(2, g, 1)), 0) << "dk " << g;
        EXPECT_EQ(bit_differences(grad.dv, whole_grad.dv.view().slice(2, g, 1)), 0) << "dv " << g;
        if (g == 1) {
          // Without the offsets the second half draws the first half's streams.
          EXPECT_GT(
              max_abs_diff(qkv::attention(q, k, v, opt).out, whole.out.view().slice(2, h0, 2)),
              0.01);
        }
      }
    }
  }
}

// Ring attention's backward: each piece gets the whole call's out, dout and
// lse of its rows; dq of a row block sums over key blocks, dk and dv of a
// key block over row blocks. Exactly, the pieces' dS_ij (from the whole
// lse and D_i) are the whole's, so the sums are the whole gradients; in f32
// each piece and the whole call lie within backward_error_bound
// (error_bound.hpp) of their exact gradients. As in merge_tolerance, the
// whole problem's bound covers every piece (fewer keys and rows, the same
// out and lse given with the same errors, a key mass sum_i P_ij over fewer
// rows); the exact gradients of a piece may exceed the whole's, so their
// magnitudes (which only size the output rounding) are bounded from the
// inputs: |dq| <= scale max|k| g, |dk| <= scale max|q| mass g, |dv| <= r
// max|dout| mass, with g = max |r dP - D| <= Dv max|dout| (r max|v| +
// max|out|). The partial sums add exactly enough in double to neglect.
// Sum of n pieces against the whole: (n + 1) bounds.
void check_backward(Backend backend) {
  std::uint32_t seed = 140;
  for (const Split& split : splits()) {
    for (const qkv::Align align : {qkv::Align::top_left, qkv::Align::bottom_right}) {
      const std::string label =
          std::string(backend_name(backend)) + ", " + split_name(split, align);
      SCOPED_TRACE(label);
      const Inputs in =
          make_inputs(kB, split.nq, split.nk, kHq, kHkv, kD, kD, DType::f32, seed += 3);
      const Tensor dout = qkv::test::random_tensor(DType::f32, {kB, split.nq, kHq, kD}, seed + 100);
      AttentionOptions opt;
      opt.causal = true;
      opt.align = align;
      opt.dropout_p = 0.3;
      opt.dropout_seed = kSeed;
      opt.dropout_offset = 11;
      opt.backend = backend;
      opt.return_lse = true;
      const AttentionResult fwd = qkv::attention(in.q, in.k, in.v, opt);
      const qkv::AttentionGradients whole =
          qkv::attention_backward(in.q, in.k, in.v, fwd.out, dout, fwd.lse, opt);

      Tensor dq(DType::f64, {kB, split.nq, kHq, kD});
      Tensor dk(DType::f64, {kB, split.nk, kHkv, kD});
      Tensor dv(DType::f64, {kB, split.nk, kHkv, kD});
      for (const Block& r : split.rows) {
        for (const Block& c : split.keys) {
          const qkv::AttentionGradients g = qkv::attention_backward(
              in.q.view().slice(1, r.begin, r.size), in.k.view().slice(1, c.begin, c.size),
              in.v.view().slice(1, c.begin, c.size), fwd.out.view().slice(1, r.begin, r.size),
              dout.view().slice(1, r.begin, r.size), fwd.lse.view().slice(2, r.begin, r.size),
              piece_options(opt, split.nq, split.nk, r, c));
          EXPECT_FALSE(qkv::test::has_non_finite(g.dq) || qkv::test::has_non_finite(g.dk) ||
                       qkv::test::has_non_finite(g.dv));
          add_into(dq.view().slice(1, r.begin, r.size), g.dq);
          add_into(dk.view().slice(1, c.begin, c.size), g.dk);
          add_into(dv.view().slice(1, c.begin, c.size), g.dv);
        }
      }

      AttentionOptions ref_opt = opt;
      ref_opt.backend = Backend::reference;
      ref_opt.return_probs = true;
      const AttentionResult ref =
          qkv::attention(qkv::test::f64(in.q), qkv::test::f64(in.k), qkv::test::f64(in.v), ref_opt);
      const qkv::detail::AttentionProblem problem =
          qkv::detail::check_attention_inputs(in.q, in.k, in.v, opt);
      qkv::test::BackwardMagnitudes m;
      m.key_mass = qkv::test::key_mass(ref.probs, problem);
      m.max_out = max_abs(fwd.out);
      m.out_error = max_abs_diff(fwd.out, ref.out);
      int mismatches = 0;
      m.lse_error = finite_diff(fwd.lse, ref.lse, &mismatches);
      EXPECT_EQ(mismatches, 0);
      const double keep = 1.0 / (1.0 - opt.dropout_p);
      const double dout_max = max_abs(dout);
      const double g_max = static_cast<double>(kD) * dout_max * (keep * max_abs(in.v) + m.max_out);
      const double scale = std::fabs(problem.scale);
      m.max_dq = scale * max_abs(in.k) * g_max;
      m.max_dk = scale * max_abs(in.q) * m.key_mass * g_max;
      m.max_dv = keep * dout_max * m.key_mass;
      const qkv::test::BackwardErrorBound bound =
          qkv::test::backward_error_bound(in.q, in.k, in.v, dout, opt, m);
      const auto n_keys = static_cast<double>(split.keys.size());
      const auto n_rows = static_cast<double>(split.rows.size());
      EXPECT_LE(max_abs_diff(dq, whole.dq), (n_keys + 1) * bound.dq) << "dq";
      EXPECT_LE(max_abs_diff(dk, whole.dk), (n_rows + 1) * bound.dk) << "dk";
      EXPECT_LE(max_abs_diff(dv, whole.dv), (n_rows + 1) * bound.dv) << "dv";
    }
  }
}

TEST(ShardBackward, ReferencePieceGradientsSumToTheWhole) { check_backward(Backend::reference); }

TEST(ShardBackward, FastPieceGradientsSumToTheWhole) { check_backward(Backend::fast); }

// ---- Validation -------------------------------------------------------------

struct BadShard {
  std::string name;
  qkv::ShardOffsets shard;
  std::vector<std::string> message;
};

std::vector<BadShard> bad_shards() {
  const std::int64_t far = std::int64_t{1} << 60;
  const std::int64_t max64 = std::numeric_limits<std::int64_t>::max();
  const std::int64_t min64 = std::numeric_limits<std::int64_t>::min();
  const std::string position =
      "options.shard.position: expected a shift in [-2^60 + 1, 2^60 - 1], got ";
  const std::string heads = "options.shard.heads: expected at least head + Hq = ";
  const std::string head_heads =
      "options.shard.head/heads: expected head >= 0 and heads >= 0 (heads > 0 when head > 0), got ";
  return {
      {"row -1", {.row = -1}, {"options.shard.row: expected a row index in [0, 2^60 - 1], got -1"}},
      {"row 2^60", {.row = far}, {"options.shard.row: expected", "got " + std::to_string(far)}},
      {"key -1", {.key = -1}, {"options.shard.key: expected a key index in [0, 2^60 - 1], got -1"}},
      {"key 2^60", {.key = far}, {"options.shard.key: expected", "got " + std::to_string(far)}},
      {"head 1, heads 0", {.head = 1, .heads = 0}, {head_heads + "head 1 and heads 0"}},
      {"head -1", {.head = -1, .heads = 4}, {head_heads + "head -1 and heads 4"}},
      {"heads -1", {.heads = -1}, {head_heads + "head 0 and heads -1"}},
      {"heads below head + Hq",
       {.head = 2, .heads = 5},
       {heads + "2 + 4 heads in the whole problem, got 5"}},
      {"heads below Hq", {.heads = 3}, {heads + "0 + 4 heads in the whole problem, got 3"}},
      {"head beyond heads", {.head = 9, .heads = 8}, {heads + "9 + 4", "got 8"}},
      {"position 2^60", {.position = far}, {position + std::to_string(far)}},
      {"position -2^60", {.position = -far}, {position + std::to_string(-far)}},
      {"position int64 max", {.position = max64}, {position + std::to_string(max64)}},
      {"position int64 min", {.position = min64}, {position + std::to_string(min64)}},
  };
}

// q [2, 5, 4, 8], k and v [2, 7, 2, 8] (as validation_test.cpp's base call).
TEST(ShardValidation, BadOffsetsThrowNamingTheField) {
  const Inputs in = make_inputs(2, 5, 7, 4, 2, 8, 8, DType::f32, 150);
  const Tensor lse(DType::f32, {2, 4, 5});
  for (const BadShard& row : bad_shards()) {
    for (const Backend backend : {Backend::automatic, Backend::reference, Backend::fast}) {
      SCOPED_TRACE(row.name + ", backend " + std::to_string(static_cast<int>(backend)));
      AttentionOptions opt;
      opt.shard = row.shard;
      opt.backend = backend;
      opt.dropout_p = 0.1;
      const std::optional<qkv::Error> forward =
          qkv::test::error_of([&] { (void)qkv::attention(in.q, in.k, in.v, opt); });
      ASSERT_TRUE(forward.has_value()) << "attention accepted it";
      qkv::test::expect_contains(forward->what(), row.message);
      EXPECT_EQ(forward->reasons().size(), 1u) << forward->what();
      const std::optional<qkv::Error> backward = qkv::test::error_of(
          [&] { (void)qkv::attention_backward(in.q, in.k, in.v, in.q, in.q, lse, opt); });
      ASSERT_TRUE(backward.has_value()) << "attention_backward accepted it";
      qkv::test::expect_contains(backward->what(), row.message);
      EXPECT_EQ(backward->reasons().size(), 1u) << backward->what();
    }
  }
}

// The edges of every range are accepted; positions 2^60 - 1 away from the
// keys neither overflow nor wrap: causal rows then see every key (or none),
// windows none.
TEST(ShardValidation, ExtremeOffsetsAreAcceptedAndDoNotOverflow) {
  const Inputs in = make_inputs(1, 6, 9, 4, 2, 8, 8, DType::f32, 160);
  for (const Backend backend : {Backend::reference, Backend::fast}) {
    SCOPED_TRACE(backend_name(backend));
    AttentionOptions plain;
    plain.backend = backend;
    plain.return_lse = true;
    const AttentionResult all_keys = qkv::attention(in.q, in.k, in.v, plain);
    const double out_bound =
        qkv::test::forward_error_bound(in.q, in.k, in.v, plain, max_abs(in.v)).out;

    AttentionOptions far = plain;
    far.shard = {
        .position = kMaxSequence, .row = kMaxSequence, .key = kMaxSequence, .head = 0, .heads = 4};
    far.causal = true;
    const AttentionResult ahead = qkv::attention(in.q, in.k, in.v, far);
    EXPECT_LE(max_abs_diff(ahead.out, all_keys.out), 2 * out_bound) << "causal, far ahead";
    EXPECT_FALSE(qkv::test::has_non_finite(ahead.lse));

    const auto expect_all_empty = [&](const AttentionOptions& o, const char* what) {
      const AttentionResult r = qkv::attention(in.q, in.k, in.v, o);
      EXPECT_EQ(max_abs(r.out), 0.0) << what;
      for (std::int64_t h = 0; h < 4; ++h)
        for (std::int64_t i = 0; i < 6; ++i) EXPECT_EQ(r.lse.get({0, h, i}), kNegInf) << what;
    };
    AttentionOptions behind = plain;
    behind.shard.position = -kMaxSequence;
    behind.causal = true;
    expect_all_empty(behind, "causal, far behind");
    AttentionOptions left = plain;
    left.shard.position = kMaxSequence;
    left.window_left = 3;
    expect_all_empty(left, "window_left, far ahead");
    AttentionOptions right = plain;
    right.shard.position = -kMaxSequence;
    right.window_right = 3;
    expect_all_empty(right, "window_right, far behind");
  }
}

// A relative bias table and sparse patterns read the call's own distances
// and indices: refused for a piece that is moved.
TEST(ShardValidation, RelativeBiasAndSparseRefuseMovedPieces) {
  const Inputs in = make_inputs(2, 5, 7, 4, 2, 8, 8, DType::f32, 151);
  const Tensor table(DType::f32, {4, 8});
  for (const qkv::ShardOffsets shard : {qkv::ShardOffsets{.position = 3},
                                        qkv::ShardOffsets{.row = 2}, qkv::ShardOffsets{.key = 4}}) {
    AttentionOptions bias;
    bias.shard = shard;
    bias.relative_bias.table = table;
    const std::optional<qkv::Error> b =
        qkv::test::error_of([&] { (void)qkv::attention(in.q, in.k, in.v, bias); });
    ASSERT_TRUE(b.has_value());
    qkv::test::expect_contains(
        b->what(),
        {"options.relative_bias: not supported with a nonzero options.shard position, row or key"});
    AttentionOptions sparse;
    sparse.shard = shard;
    sparse.sparse = qkv::SparsePattern::strided(2);
    const std::optional<qkv::Error> s =
        qkv::test::error_of([&] { (void)qkv::attention(in.q, in.k, in.v, sparse); });
    ASSERT_TRUE(s.has_value());
    qkv::test::expect_contains(
        s->what(),
        {"options.sparse: not supported with a nonzero options.shard position, row or key"});
  }
  // Heads alone (all-to-all) keep both.
  AttentionOptions heads;
  heads.shard = {.head = 4, .heads = 8};
  heads.relative_bias.table = table;
  heads.sparse = qkv::SparsePattern::strided(2);
  EXPECT_NO_THROW((void)qkv::attention(in.q, in.k, in.v, heads));
}

TEST(ShardValidation, DecodeRejectsShards) {
  qkv::KvCacheConfig config{.batch = 1, .kv_heads = 2, .head_dim = 8, .capacity = 8};
  qkv::KvCache cache(config);
  const Inputs in = make_inputs(1, 1, 3, 4, 2, 8, 8, DType::f32, 170);
  cache.append(in.k, in.v);
  const std::vector<std::pair<std::string, qkv::ShardOffsets>> shards = {
      {"position", {.position = 3}}, {"row", {.row = 2}},
      {"key", {.key = 5}},           {"head", {.head = 4, .heads = 8}},
      {"heads", {.heads = 4}},       {"partial_keys", {.partial_keys = true}}};
  for (const auto& [name, shard] : shards) {
    SCOPED_TRACE(name);
    for (const Backend backend : {Backend::automatic, Backend::reference, Backend::fast}) {
      AttentionOptions opt;
      opt.shard = shard;
      opt.backend = backend;
      const std::optional<qkv::Error> e =
          qkv::test::error_of([&] { (void)qkv::decode_attention(in.q, cache, opt); });
      ASSERT_TRUE(e.has_value()) << "decode_attention accepted it";
      qkv::test::expect_contains(e->what(), {"options.shard: not supported by decode_attention"});
      EXPECT_EQ(e->reasons().size(), 1u) << e->what();
    }
  }
  // The cache is untouched and a plain call still runs.
  EXPECT_NO_THROW((void)qkv::decode_attention(in.q, cache));
}

}  // namespace
