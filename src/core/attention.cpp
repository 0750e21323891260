// Entry points of qkv::attention: validate, allocate, dispatch once.
#include "qkv/attention.hpp"

#include "core/validate.hpp"
#include "reference/attention.hpp"

namespace qkv {
namespace {

void run(const detail::AttentionProblem& problem, ConstTensorView q, ConstTensorView k,
         ConstTensorView v, const AttentionOutputs& outputs, const AttentionOptions& options) {
  // Backend::fast is rejected by validation until the fused kernels exist, so
  // every call runs the reference.
  reference::attention(problem, q, k, v, outputs, options);
}

}  // namespace

AttentionResult attention(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                          const AttentionOptions& options) {
  const detail::AttentionProblem p = detail::check_attention_inputs(q, k, v, options);
  AttentionResult result;
  result.out = Tensor(p.dtype, {p.batch, p.nq, p.hq, p.dv});
  if (options.return_lse) result.lse = Tensor(p.stat_dtype, {p.batch, p.hq, p.nq});
  if (options.return_probs) result.probs = Tensor(p.stat_dtype, {p.batch, p.hq, p.nq, p.nk});
  run(p, q, k, v, {result.out, result.lse.view(), result.probs.view()}, options);
  return result;
}

void attention_into(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                    const AttentionOutputs& outputs, const AttentionOptions& options) {
  const detail::AttentionProblem p = detail::check_attention_inputs(q, k, v, options);
  detail::check_attention_outputs(p, q, k, v, options, outputs);
  run(p, q, k, v, outputs, options);
}

}  // namespace qkv
