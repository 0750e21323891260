// Maps of the queries (core/query_maps.hpp) chained: the library has one
// (score_scale, tested end to end in score_scale_test.cpp); a second map,
// defined here, checks that the maps apply in the list's order and that
// their gradients pull back through each other by the chain rule.
#include "core/query_maps.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <span>
#include <vector>

#include "api/validate.hpp"
#include "core/elements.hpp"
#include "core/score_scale.hpp"
#include "qkv/attention.hpp"
#include "qkv/backward.hpp"
#include "test_util.hpp"

namespace {

using qkv::AttentionGradients;
using qkv::AttentionOptions;
using qkv::ConstTensorView;
using qkv::DType;
using qkv::GradientOutputs;
using qkv::Tensor;
using qkv::TensorView;
using qkv::detail::QueryMap;
using qkv::detail::QueryRow;

constexpr std::int64_t kB = 2, kN = 3, kH = 2, kD = 4;

std::int64_t at(ConstTensorView t, std::int64_t b, std::int64_t i, std::int64_t h, std::int64_t d) {
  return b * t.stride(0) + i * t.stride(1) + h * t.stride(2) + d * t.stride(3);
}

double get(ConstTensorView t, std::int64_t b, std::int64_t i, std::int64_t h, std::int64_t d) {
  return qkv::detail::load(t.data(), t.dtype(), at(t, b, i, h, d));
}

// A test map: each query row of head h plus shift[h], its parameter held in
// options.sinks (a stand-in: any [Hq] span) and its gradient in d_sinks.
const QueryMap kShift{
    .used = [](const AttentionOptions& o) { return !o.sinks.empty(); },
    .check = [](const AttentionOptions&, std::int64_t, qkv::detail::Reasons&) {},
    .remove = [](AttentionOptions& o) { o.sinks = {}; },
    .select_heads = [](AttentionOptions&, std::int64_t, std::int64_t) {},
    .apply =
        [](ConstTensorView q, std::span<const QueryRow> rows, const AttentionOptions& o,
           TensorView out) {
          for (const QueryRow& r : rows) {
            for (std::int64_t h = 0; h < q.size(2); ++h) {
              for (std::int64_t d = 0; d < q.size(3); ++d) {
                qkv::detail::store(out.data(), out.dtype(), at(out, r.batch, r.row, h, d),
                                   get(q, r.batch, r.row, h, d) + o.sinks[h]);
              }
            }
          }
        },
    .pull_back =
        [](ConstTensorView q, ConstTensorView g, std::span<const QueryRow> rows,
           const AttentionOptions&, TensorView dq, TensorView d_shift) {
          std::vector<double> sums(static_cast<std::size_t>(q.size(2)), 0.0);
          for (const QueryRow& r : rows) {
            for (std::int64_t h = 0; h < q.size(2); ++h) {
              for (std::int64_t d = 0; d < q.size(3); ++d) {
                const double x = get(g, r.batch, r.row, h, d);
                sums[static_cast<std::size_t>(h)] += x;
                qkv::detail::store(dq.data(), dq.dtype(), at(dq, r.batch, r.row, h, d), x);
              }
            }
          }
          for (std::int64_t h = 0; h < q.size(2); ++h) {
            qkv::detail::store(d_shift.data(), d_shift.dtype(), h * d_shift.stride(0),
                               sums[static_cast<std::size_t>(h)]);
          }
        },
    .gradient = &AttentionGradients::d_sinks,
    .gradient_view = &GradientOutputs::d_sinks};

struct Chain {
  const QueryMap* maps[2];
  bool shift_first;
};

TEST(QueryMaps, ChainAppliesInOrderAndPullsBackByTheChainRule) {
  const Tensor q = qkv::test::random_tensor(DType::f64, {kB, kN, kH, kD}, 3);
  const Tensor g = qkv::test::random_tensor(DType::f64, {kB, kN, kH, kD}, 4);
  const std::vector<float> scales = {0.5f, -1.25f}, shifts = {0.75f, 2.0f};
  AttentionOptions o;
  o.score_scale = scales;
  o.sinks = shifts;
  std::vector<QueryRow> rows;
  for (std::int64_t b = 0; b < kB; ++b) {
    for (std::int64_t i = 0; i < kN; ++i) rows.push_back({b, i, kN});
  }
  for (const Chain& chain : {Chain{{&kShift, &qkv::detail::kScoreScaleMap}, true},
                             Chain{{&qkv::detail::kScoreScaleMap, &kShift}, false}}) {
    SCOPED_TRACE(chain.shift_first ? "c (q + t)" : "c q + t");
    const std::span<const QueryMap* const> maps(chain.maps);
    const Tensor mapped = qkv::detail::mapped_queries(q, rows, o, DType::f64, maps);
    Tensor dq(DType::f64, {kB, kN, kH, kD}), d_scale(DType::f64, {kH}), d_shift(DType::f64, {kH});
    GradientOutputs grads;
    grads.d_score_scale = d_scale;
    grads.d_sinks = d_shift;
    qkv::detail::query_map_gradients(q, g, rows, o, DType::f64, dq, grads, maps);
    // L = <g, mapped>: dL/dq = c g; dL/dt = sum of g (times c when the shift
    // comes first); dL/dc = sum of <g, q + t> or of <g, q>.
    std::vector<double> want_scale(kH, 0.0), want_shift(kH, 0.0);
    for (std::int64_t b = 0; b < kB; ++b) {
      for (std::int64_t i = 0; i < kN; ++i) {
        for (std::int64_t h = 0; h < kH; ++h) {
          const double c = scales[h], t = shifts[h];
          for (std::int64_t d = 0; d < kD; ++d) {
            const double x = get(q, b, i, h, d), gx = get(g, b, i, h, d);
            EXPECT_DOUBLE_EQ(get(mapped, b, i, h, d), chain.shift_first ? c * (x + t) : c * x + t);
            EXPECT_DOUBLE_EQ(get(dq, b, i, h, d), c * gx);
            want_scale[h] += gx * (chain.shift_first ? x + t : x);
            want_shift[h] += chain.shift_first ? c * gx : gx;
          }
        }
      }
    }
    for (std::int64_t h = 0; h < kH; ++h) {
      EXPECT_NEAR(d_scale.data<double>()[h], want_scale[h], 1e-12);
      EXPECT_NEAR(d_shift.data<double>()[h], want_shift[h], 1e-12);
    }
  }
}

TEST(QueryMaps, InPlaceAndWithoutTheParameterGradient) {
  // As the ring's finish calls it: dq written over dq' itself, with and
  // without d_score_scale (a caller that did not ask for it).
  const Tensor q = qkv::test::random_tensor(DType::f64, {kB, kN, kH, kD}, 5);
  const Tensor g = qkv::test::random_tensor(DType::f64, {kB, kN, kH, kD}, 6);
  const std::vector<float> scales = {0.5f, -1.25f};
  AttentionOptions o;
  o.score_scale = scales;
  const std::vector<QueryRow> rows =
      qkv::detail::query_rows(qkv::detail::check_attention_inputs(q, q, q, o), o);
  ASSERT_EQ(rows.size(), static_cast<std::size_t>(kB * kN));
  for (const bool with_gradient : {false, true}) {
    Tensor dq = g;  // a copy, pulled back in place
    Tensor d_scale(DType::f64, {kH});
    GradientOutputs grads;
    if (with_gradient) grads.d_score_scale = d_scale;
    qkv::detail::query_map_gradients(q, dq, rows, o, DType::f64, dq, grads);
    std::vector<double> want(kH, 0.0);
    for (std::int64_t b = 0; b < kB; ++b) {
      for (std::int64_t i = 0; i < kN; ++i) {
        for (std::int64_t h = 0; h < kH; ++h) {
          for (std::int64_t d = 0; d < kD; ++d) {
            EXPECT_EQ(get(dq, b, i, h, d), scales[h] * get(g, b, i, h, d));
            want[h] += get(g, b, i, h, d) * get(q, b, i, h, d);
          }
        }
      }
    }
    for (std::int64_t h = 0; h < kH && with_gradient; ++h) {
      EXPECT_NEAR(d_scale.data<double>()[h], want[h], 1e-12);
    }
  }
}

TEST(QueryMaps, WithoutMapsNothingIsMappedAndTheOptionsLoseThem) {
  const std::vector<float> scales = {2.0f};
  AttentionOptions o;
  EXPECT_FALSE(qkv::detail::maps_queries(o));
  o.score_scale = scales;
  o.score_scale_log_n = true;
  EXPECT_TRUE(qkv::detail::maps_queries(o));
  const AttentionOptions rest = qkv::detail::without_query_maps(o);
  EXPECT_FALSE(qkv::detail::maps_queries(rest));
  EXPECT_FALSE(rest.score_scale_log_n);
}

}  // namespace
