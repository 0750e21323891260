// Entry points of qkv::attention_backward: validate, allocate, dispatch once.
#include "qkv/backward.hpp"

#include <vector>

#include "api/dispatch.hpp"
#include "api/validate.hpp"
#include "core/capabilities.hpp"
#include "core/elements.hpp"
#include "core/isa.hpp"
#include "core/parameters.hpp"
#include "core/philox.hpp"
#include "core/query_maps.hpp"
#include "core/sparse.hpp"
#include "cpu/additive_backward.hpp"
#include "cpu/flash.hpp"
#include "qkv/flex.hpp"
#include "reference/backward.hpp"

namespace qkv {
namespace {

// The fused backward on a validated call; returns whether every gradient it
// wrote is finite.
bool run_fast(const detail::AttentionProblem& p, ConstTensorView q, ConstTensorView k,
              ConstTensorView v, ConstTensorView out, ConstTensorView dout, ConstTensorView lse,
              const GradientOutputs& grads, const AttentionOptions& o) {
  if (const detail::DilatedSplit split = detail::dilated_split(p, o);
      split.dilation > 1 && q.dtype() == k.dtype()) {
    // One dense window problem per residue class (see dilated_split), each
    // validated, which needs q's dtype to be k's (queries mapped in f32 are
    // not, query_maps.hpp).
    const AttentionOptions window = split.window_options(o);
    return split.for_each_class(p.nq, [&](const auto& rows) {
      const ConstTensorView qc = rows(q, 1), kc = rows(k, 1), vc = rows(v, 1);
      GradientOutputs gc = grads;
      gc.dq = rows(grads.dq, 1);
      gc.dk = rows(grads.dk, 1);
      gc.dv = rows(grads.dv, 1);
      return run_fast(detail::check_attention_inputs(qc, kc, vc, window), qc, kc, vc, rows(out, 1),
                      rows(dout, 1), rows(lse, 2), gc, window);
    });
  }
  // mask_mod through std::function, one call per element of partial tiles.
  const detail::FlexCallables<ScoreMod, MaskMod> functions{o.score_mod, o.mask_mod};
  const detail::TileMods mods = detail::function_tile_mods(functions);
  cpu::FlashPlan plan = cpu::make_plan(p, cpu::lower(o, p.scale), mods, q, k, v, {}, {}, {},
                                       cpu::flash_backward_config());
  plan.engine = cpu::products_engine(plan.params, q, k, v);
  detail::note_products_isa(plan.engine ? cpu::engines::engine_name(*plan.engine) : "f32");
  return cpu::flash_backward(plan, {out, dout, lse, grads});
}

// The fast backward of Score::additive on a validated call: the forward's
// probabilities pass gives the weights P = exp(s - lse) with every mask and
// bias applied (the caller's lse as the row maximum, 1 as the row scale, as
// the fused backward recomputes P from lse), and cpu::additive_backward
// differentiates the score. A call whose one mask is key_lengths skips the
// probabilities pass: the kernel computes P from its own projections,
// normalized by its own lse (one key projection fewer). Returns whether
// every gradient it wrote is finite.
bool run_fast_additive(const detail::AttentionProblem& p, ConstTensorView q, ConstTensorView k,
                       ConstTensorView v, ConstTensorView out, ConstTensorView dout,
                       ConstTensorView lse, const GradientOutputs& grads,
                       const AttentionOptions& o) {
  if (detail::supports_all(detail::Path::additive_own_weights, o)) {
    return cpu::additive_backward(p, cpu::lower(o, p.scale), q, k, v, out, dout, {}, grads);
  }
  const detail::FlexCallables<ScoreMod, MaskMod> functions{o.score_mod, o.mask_mod};
  const detail::TileMods mods = detail::function_tile_mods(functions);
  Tensor probs(DType::f32, {p.batch, p.hq, p.nq, p.nk});
  const cpu::KernelParams params = cpu::lower(o, p.scale);
  cpu::FlashPlan plan = cpu::make_plan(p, params, mods, q, k, v, {}, {}, probs);
  Tensor row_max = to_dtype(lse, DType::f32), row_scale(DType::f32, {p.batch, p.hq, p.nq});
  detail::fill(row_scale, 1.0);
  plan.row_max = row_max;
  plan.row_scale = row_scale;
  cpu::flash_probabilities(plan);
  return cpu::additive_backward(p, params, q, k, v, out, dout, probs, grads);
}

// out and lse of the forward with options o, into forward_out and
// forward_lse, for a backward whose caller gave neither.
void run_forward(const detail::AttentionProblem& p, ConstTensorView q, ConstTensorView k,
                 ConstTensorView v, const AttentionOptions& o, ConstTensorView& out,
                 ConstTensorView& lse, Tensor& forward_out, Tensor& forward_lse) {
  forward_out = Tensor(p.dtype, {p.batch, p.nq, p.hq, p.dv});
  forward_lse = Tensor(p.stat_dtype, {p.batch, p.hq, p.nq});
  attention_into(q, k, v, {forward_out, forward_lse, {}}, o);
  out = forward_out;
  lse = forward_lse;
}

// Runs a validated call on the backend the options choose: the fused
// backward for dot-product scores, cpu::additive_backward for the additive
// score without dropout, softcap or relative bias, else the reference. A
// fast result holding a NaN or an infinity is recomputed by the reference,
// which defines it (see docs/semantics.md). Without out and lse, an
// additive call whose one mask is key_lengths computes them inside the fast
// backward; any other call runs the forward for them first.
void run_backend(const detail::AttentionProblem& p, ConstTensorView q, ConstTensorView k,
                 ConstTensorView v, ConstTensorView& out, ConstTensorView dout,
                 ConstTensorView& lse, Tensor& forward_out, Tensor& forward_lse,
                 const GradientOutputs& grads, const AttentionOptions& o) {
  const bool additive = o.score == Score::additive;
  const bool fast = detail::use_fast_kernels(
      o, p.dtype, !additive || detail::supports_all(detail::Path::additive_backward, o));
  bool tried_fast = false;
  if (!out.defined()) {
    if (fast && additive && detail::supports_all(detail::Path::additive_own_weights, o)) {
      if (cpu::additive_backward(p, cpu::lower(o, p.scale), q, k, v, {}, dout, {}, grads)) {
        return;
      }
      tried_fast = true;
    }
    run_forward(p, q, k, v, o, out, lse, forward_out, forward_lse);
  }
  if (fast && !tried_fast &&
      (additive ? run_fast_additive(p, q, k, v, out, dout, lse, grads, o)
                : run_fast(p, q, k, v, out, dout, lse, grads, o))) {
    return;
  }
  reference::attention_backward(p, q, k, v, out, dout, lse, grads, o);
}

// The backend's gradients, then the sinks' from out, dout and lse (the
// forward's when the caller gave neither).
void run(const detail::AttentionProblem& p, ConstTensorView q, ConstTensorView k, ConstTensorView v,
         ConstTensorView out, ConstTensorView dout, ConstTensorView lse,
         const GradientOutputs& grads, const AttentionOptions& o) {
  Tensor forward_out, forward_lse;
  if (detail::maps_queries(o)) {  // the gradients of the mapped queries (query_maps.hpp)
    // The forward's out and lse with the maps (the mapped queries are wider).
    if (!out.defined()) run_forward(p, q, k, v, o, out, lse, forward_out, forward_lse);
    const DType wide = detail::use_fast_kernels(o, p.dtype) ? DType::f32 : DType::f64;
    const std::vector<detail::QueryRow> rows = detail::query_rows(p, o);
    Tensor d_mapped(wide, {p.batch, p.nq, p.hq, p.dq});
    run(p, detail::mapped_queries(q, rows, o, wide), k, v, out, dout, lse,
        detail::mapped_gradients(grads, d_mapped), detail::without_query_maps(o));
    detail::query_map_gradients(q, d_mapped, rows, o, wide, grads.dq, grads);
    return;
  }
  run_backend(p, q, k, v, out, dout, lse, forward_out, forward_lse, grads, o);
  if (grads.d_sinks.defined()) reference::sink_gradients(p, out, dout, lse, o, grads.d_sinks);
}

detail::AttentionProblem check_inputs(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                                      ConstTensorView out, ConstTensorView dout,
                                      ConstTensorView lse, const AttentionOptions& o) {
  const detail::AttentionProblem p = detail::check_attention_inputs(q, k, v, o);
  detail::check_backward_inputs(p, out, dout, lse, o);
  return p;
}

}  // namespace

AttentionGradients attention_backward(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                                      ConstTensorView out, ConstTensorView dout,
                                      ConstTensorView lse, const AttentionOptions& o) {
  const detail::AttentionProblem p = check_inputs(q, k, v, out, dout, lse, o);
  AttentionGradients g;
  g.dq = Tensor(p.dtype, {p.batch, p.nq, p.hq, p.dq});
  g.dk = Tensor(p.dtype, {p.batch, p.nk, p.hkv, p.dk});
  g.dv = Tensor(p.dtype, {p.batch, p.nk, p.hkv, p.dv});
  detail::allocate_parameter_gradients(p, o, g);
  run(p, q, k, v, out, dout, lse, detail::views_of(g), o);
  return g;
}

void attention_backward_into(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                             ConstTensorView out, ConstTensorView dout, ConstTensorView lse,
                             const GradientOutputs& grads, const AttentionOptions& o) {
  const detail::AttentionProblem p = check_inputs(q, k, v, out, dout, lse, o);
  detail::check_gradient_outputs(p, q, k, v, out, dout, lse, o, grads);
  run(p, q, k, v, out, dout, lse, grads, o);
}

bool dropout_keep(std::uint64_t seed, std::uint32_t offset, double p, std::int64_t hq,
                  std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) {
  const detail::PhiloxCounter words = detail::dropout_words(seed, offset, b * hq + h, i, j);
  return (words[static_cast<std::size_t>(j % 4)] >> 8) >= detail::dropout_threshold(p);
}

std::vector<ParameterGradient> parameter_gradients(ConstTensorView q, ConstTensorView k,
                                                   ConstTensorView v, const AttentionOptions& o) {
  const detail::AttentionProblem p = detail::check_attention_inputs(q, k, v, o);
  std::vector<ParameterGradient> used;
  for (const detail::ParameterRow& row : detail::parameter_rows(p, o)) {
    if (row.used) used.push_back({row.name, row.sizes, p.stat_dtype});
  }
  return used;
}

}  // namespace qkv
