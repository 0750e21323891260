// Entry points of qkv::attention: validate, allocate, dispatch once.
#include "qkv/attention.hpp"

#include "api/dispatch.hpp"
#include "api/validate.hpp"
#include "core/isa.hpp"
#include "core/query_maps.hpp"
#include "core/sparse.hpp"
#include "cpu/flash.hpp"
#include "qkv/flex.hpp"
#include "reference/attention.hpp"

namespace qkv {
namespace {

// The fused kernels on a validated call; returns whether every output they
// wrote is finite. `mods` are the tile hooks of the options' callables; null
// means "derive them from the std::function options".
bool run_fast(const detail::AttentionProblem& problem, ConstTensorView q, ConstTensorView k,
              ConstTensorView v, const AttentionOutputs& outputs, const AttentionOptions& options,
              const detail::TileMods* mods) {
  if (const detail::DilatedSplit split = detail::dilated_split(problem, options);
      split.dilation > 1 && mods == nullptr && !outputs.probs.defined() && q.dtype() == k.dtype()) {
    // One dense window problem per residue class (see dilated_split), each
    // validated, which needs q's dtype to be k's (queries mapped in f32 are
    // not, query_maps.hpp).
    const AttentionOptions window = split.window_options(options);
    return split.for_each_class(problem.nq, [&](const auto& rows) {
      const ConstTensorView qc = rows(q, 1), kc = rows(k, 1), vc = rows(v, 1);
      return run_fast(detail::check_attention_inputs(qc, kc, vc, window), qc, kc, vc,
                      {rows(outputs.out, 1), rows(outputs.lse, 2), {}}, window, nullptr);
    });
  }
  // Without inlined callables, tile hooks that call the std::function
  // options (element by element, through std::function).
  const detail::FlexCallables<ScoreMod, MaskMod> functions{options.score_mod, options.mask_mod};
  const detail::TileMods function_mods = detail::function_tile_mods(functions);
  // The probabilities pass needs the lse even when the caller did not ask,
  // and each row's maximum and scale.
  const std::int64_t stat_sizes[] = {problem.batch, problem.hq, problem.nq};
  Tensor lse_scratch, row_max, row_scale;
  TensorView lse = outputs.lse;
  if (!lse.defined()) {
    lse_scratch = Tensor(DType::f32, stat_sizes);
    lse = lse_scratch;
  }
  cpu::FlashPlan plan = cpu::make_plan(problem, cpu::lower(options, problem.scale),
                                       mods != nullptr ? *mods : function_mods, q, k, v,
                                       outputs.out, lse, outputs.probs);
  plan.engine = cpu::products_engine(plan.params, q, k, v);
  plan.int8 = cpu::scores_int8_engine(plan.params, plan.engine);
  detail::note_products_isa(plan.int8     ? cpu::engines::engine_name(*plan.int8)
                            : plan.engine ? cpu::engines::engine_name(*plan.engine)
                                          : "f32");
  if (outputs.probs.defined()) {
    row_max = Tensor(DType::f32, stat_sizes);
    row_scale = Tensor(DType::f32, stat_sizes);
    plan.row_max = row_max;
    plan.row_scale = row_scale;
  }
  const bool finite = cpu::flash_forward(plan);
  if (outputs.probs.defined()) cpu::flash_probabilities(plan);
  return finite;
}

// Runs a validated call on the backend the options choose. A fused result
// that holds a NaN or an infinity is recomputed by the reference, which
// defines it: f32 scores may have overflowed where doubles do not, or a
// weight of exactly 0 met a NaN or inf value (see docs/semantics.md).
void run(const detail::AttentionProblem& problem, ConstTensorView q, ConstTensorView k,
         ConstTensorView v, const AttentionOutputs& outputs, const AttentionOptions& options,
         const detail::TileMods* mods) {
  if (detail::maps_queries(options)) {  // every path runs the mapped queries (query_maps.hpp)
    const AttentionOptions rest = detail::without_query_maps(options);
    if (detail::use_fast_kernels(options, problem.dtype) &&
        run_fast(problem, detail::mapped_queries(problem, q, options, DType::f32), k, v, outputs,
                 rest, mods)) {
      return;
    }
    reference::attention(problem, detail::mapped_queries(problem, q, options, DType::f64), k, v,
                         outputs, rest);
    return;
  }
  if (detail::use_fast_kernels(options, problem.dtype) &&
      run_fast(problem, q, k, v, outputs, options, mods)) {
    return;
  }
  reference::attention(problem, q, k, v, outputs, options);
}

AttentionResult allocate_and_run(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                                 const AttentionOptions& options, const detail::TileMods* mods) {
  const detail::AttentionProblem p = detail::check_attention_inputs(q, k, v, options);
  AttentionResult result;
  result.out = Tensor(p.dtype, {p.batch, p.nq, p.hq, p.dv});
  if (options.return_lse) result.lse = Tensor(p.stat_dtype, {p.batch, p.hq, p.nq});
  if (options.return_probs) result.probs = Tensor(p.stat_dtype, {p.batch, p.hq, p.nq, p.nk});
  run(p, q, k, v, {result.out, result.lse.view(), result.probs.view()}, options, mods);
  return result;
}

void run_into(ConstTensorView q, ConstTensorView k, ConstTensorView v,
              const AttentionOutputs& outputs, const AttentionOptions& options,
              const detail::TileMods* mods) {
  const detail::AttentionProblem p = detail::check_attention_inputs(q, k, v, options);
  detail::check_attention_outputs(p, q, k, v, options, outputs);
  run(p, q, k, v, outputs, options, mods);
}

}  // namespace

AttentionResult attention(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                          const AttentionOptions& options) {
  return allocate_and_run(q, k, v, options, nullptr);
}

void attention_into(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                    const AttentionOutputs& outputs, const AttentionOptions& options) {
  run_into(q, k, v, outputs, options, nullptr);
}

namespace detail {

void attention_with_mods(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                         const AttentionOutputs& outputs, const AttentionOptions& options,
                         const TileMods& mods) {
  run_into(q, k, v, outputs, options, &mods);
}

AttentionResult attention_with_mods(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                                    const AttentionOptions& options, const TileMods& mods) {
  return allocate_and_run(q, k, v, options, &mods);
}

}  // namespace detail
}  // namespace qkv
