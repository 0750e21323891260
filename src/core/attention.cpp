// Entry points of qkv::attention: validate, allocate, dispatch once.
#include "qkv/attention.hpp"

#include "core/validate.hpp"
#include "cpu/flash.hpp"
#include "qkv/flex.hpp"
#include "reference/attention.hpp"

namespace qkv {
namespace {

bool use_fast(const detail::AttentionProblem& p, const AttentionOptions& o) {
  switch (o.backend) {
    case Backend::reference:
      return false;
    case Backend::fast:
      return true;  // validation rejected what it cannot run
    case Backend::automatic:
      return p.dtype != DType::f64;
  }
  return false;
}

// `mods` are the tile hooks of the options' callables; null means "derive
// them from the std::function options".
void run(const detail::AttentionProblem& problem, ConstTensorView q, ConstTensorView k,
         ConstTensorView v, const AttentionOutputs& outputs, const AttentionOptions& options,
         const detail::TileMods* mods) {
  if (!use_fast(problem, options)) {
    reference::attention(problem, q, k, v, outputs, options);
    return;
  }
  // Without inlined callables, tile hooks that call the std::function
  // options (element by element, through std::function).
  const detail::FlexCallables<ScoreMod, MaskMod> functions{options.score_mod, options.mask_mod};
  detail::TileMods function_mods = functions.tile_mods();
  if (!options.score_mod) function_mods.score_mod = nullptr;
  if (!options.mask_mod) {
    function_mods.mask_mod = nullptr;
    function_mods.admitted = nullptr;
  }
  // The probabilities pass needs the lse even when the caller did not ask.
  Tensor lse_scratch;
  TensorView lse = outputs.lse;
  if (!lse.defined()) {
    lse_scratch = Tensor(DType::f32, {problem.batch, problem.hq, problem.nq});
    lse = lse_scratch;
  }
  const cpu::FlashPlan plan =
      cpu::make_plan(problem, options, mods != nullptr ? *mods : function_mods, q, k, v,
                     outputs.out, lse, outputs.probs);
  cpu::flash_forward(plan);
  if (outputs.probs.defined()) cpu::flash_probabilities(plan);
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
