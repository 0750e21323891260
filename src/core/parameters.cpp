#include "core/parameters.hpp"

// A row's parenthesized sizes as a vector.
#define QKV_PARAMETER_SIZES(...) shape_of(__VA_ARGS__)

namespace qkv::detail {
namespace {

// A row's sizes: a list of sizes, or one vector of them.
template <class... Sizes>
std::vector<std::int64_t> shape_of(Sizes... sizes) {
  return {sizes...};
}
std::vector<std::int64_t> shape_of(const std::vector<std::int64_t>& sizes) { return sizes; }

}  // namespace

std::vector<ParameterRow> parameter_rows(const AttentionProblem& p, const AttentionOptions& o) {
  const ParameterSizes s{
      .hq = p.hq,
      .dq = p.dq,
      .dk = p.dk,
      .attention_size = p.attention_size,
      .num_buckets = o.relative_bias.table.defined() ? o.relative_bias.table.size(1) : 0,
      .mask = {o.mask.size_span().begin(), o.mask.size_span().end()}};
  std::vector<ParameterRow> rows;
#define QKV_PARAMETER_ROW(gradient, sizes, used, option, doc)         \
  rows.push_back({#gradient, QKV_PARAMETER_SIZES sizes, used, option, \
                  &AttentionGradients::gradient, &GradientOutputs::gradient});
  QKV_ATTENTION_PARAMETERS(QKV_PARAMETER_ROW)
#undef QKV_PARAMETER_ROW
  return rows;
}

void allocate_parameter_gradients(const AttentionProblem& p, const AttentionOptions& o,
                                  AttentionGradients& g) {
  for (const ParameterRow& row : parameter_rows(p, o)) {
    if (row.used) g.*row.tensor = Tensor(p.stat_dtype, row.sizes);
  }
}

GradientOutputs views_of(AttentionGradients& g) {
  GradientOutputs views{.dq = g.dq, .dk = g.dk, .dv = g.dv};
#define QKV_PARAMETER_VIEW_OF(gradient, sizes, used, option, doc) \
  views.gradient = g.gradient.view();
  QKV_ATTENTION_PARAMETERS(QKV_PARAMETER_VIEW_OF)
#undef QKV_PARAMETER_VIEW_OF
  return views;
}

}  // namespace qkv::detail
