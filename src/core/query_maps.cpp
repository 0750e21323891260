#include "core/query_maps.hpp"

#include <algorithm>
#include <vector>

#include "core/key_range.hpp"
#include "core/score_scale.hpp"

namespace qkv::detail {
namespace {

// The maps, in the order they apply to the queries.
const QueryMap* const kQueryMaps[] = {&kScoreScaleMap};

Tensor like(ConstTensorView q, DType dtype) {
  return Tensor(dtype, {q.size(0), q.size(1), q.size(2), q.size(3)});
}

}  // namespace

std::span<const QueryMap* const> query_maps() { return kQueryMaps; }

std::vector<const QueryMap*> used_query_maps(const AttentionOptions& o,
                                             std::span<const QueryMap* const> maps) {
  std::vector<const QueryMap*> used;
  for (const QueryMap* m : maps) {
    if (m->used(o)) used.push_back(m);
  }
  return used;
}

bool maps_queries(const AttentionOptions& o) {
  return std::ranges::any_of(kQueryMaps, [&](const QueryMap* m) { return m->used(o); });
}

void check_query_maps(const AttentionOptions& o, std::int64_t hq, Reasons& r) {
  for (const QueryMap* m : kQueryMaps) m->check(o, hq, r);
}

AttentionOptions without_query_maps(const AttentionOptions& o) {
  AttentionOptions rest = o;
  for (const QueryMap* m : kQueryMaps) m->remove(rest);
  return rest;
}

void select_query_map_heads(AttentionOptions& o, std::int64_t h0, std::int64_t n) {
  for (const QueryMap* m : kQueryMaps) {
    if (m->used(o)) m->select_heads(o, h0, n);
  }
}

std::vector<QueryRow> query_rows(const AttentionProblem& p, const AttentionOptions& o) {
  std::vector<QueryRow> rows;
  rows.reserve(static_cast<std::size_t>(p.sequences > 0 ? p.sequence(0).nq * p.sequences : 0));
  const KeyRule rule = key_rule(o);
  for (std::int64_t s = 0; s < p.sequences; ++s) {
    const SequenceExtent e = p.sequence(s);
    const std::int64_t offset = rule.offset(e.nq, e.nk);
    for (std::int64_t i = 0; i < e.nq; ++i) {
      rows.push_back({e.batch, e.q_begin + i, rule.range(i + offset, e.nk).size()});
    }
  }
  return rows;
}

Tensor mapped_queries(ConstTensorView q, std::span<const QueryRow> rows, const AttentionOptions& o,
                      DType dtype, std::span<const QueryMap* const> maps) {
  Tensor mapped;
  for (const QueryMap* m : used_query_maps(o, maps)) {
    Tensor next = like(q, dtype);
    m->apply(mapped.defined() ? ConstTensorView(mapped) : q, rows, o, next);
    mapped = std::move(next);
  }
  return mapped;
}

Tensor mapped_queries(const AttentionProblem& p, ConstTensorView q, const AttentionOptions& o,
                      DType dtype) {
  return mapped_queries(q, query_rows(p, o), o, dtype);
}

GradientOutputs mapped_gradients(const GradientOutputs& grads, TensorView dq_mapped) {
  GradientOutputs inner = grads;
  inner.dq = dq_mapped;
  for (const QueryMap* m : kQueryMaps) inner.*m->gradient_view = {};
  return inner;
}

void query_map_gradients(ConstTensorView q, ConstTensorView dq_mapped,
                         std::span<const QueryRow> rows, const AttentionOptions& o, DType dtype,
                         TensorView dq, const GradientOutputs& grads,
                         std::span<const QueryMap* const> maps) {
  const std::vector<const QueryMap*> used = used_query_maps(o, maps);
  // inputs[m]: what map m read (q, then each map's output but the last's).
  std::vector<Tensor> inputs(used.size());
  for (std::size_t m = 1; m < used.size(); ++m) {
    inputs[m] = like(q, dtype);
    used[m - 1]->apply(m == 1 ? q : ConstTensorView(inputs[m - 1]), rows, o, inputs[m]);
  }
  Tensor below;  // the gradient of the map below's output, while there is one
  ConstTensorView g = dq_mapped;
  for (std::size_t m = used.size(); m-- > 1;) {
    Tensor next = like(q, dq_mapped.dtype());
    used[m]->pull_back(inputs[m], g, rows, o, next, grads.*used[m]->gradient_view);
    below = std::move(next);
    g = below;
  }
  if (!used.empty()) used[0]->pull_back(q, g, rows, o, dq, grads.*used[0]->gradient_view);
}

}  // namespace qkv::detail
