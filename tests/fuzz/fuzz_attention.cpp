// Fuzzes the forward entry points: qkv::attention, attention_into,
// flex_attention and flex_attention_into, over every option of
// AttentionOptions (scores, scale, causal and both aligns, windows, key
// lengths, packed sequences, bool and float masks, ALiBi, relative bias,
// softcap, dropout, sparse patterns, score_mod / mask_mod from a menu, the
// three backends, matmul_precision medium and int8), any dtype, strided,
// transposed, broadcast and overlapping views, and raw bad input (null or
// undefined views, overflowing extents, out-of-range enums, aliasing
// outputs).
//
// Checks: only qkv::Error escapes; a rejected call leaves its outputs
// bitwise unchanged and a call that must be rejected is; inputs are never
// written, nor output memory outside the views; finite inputs and options
// give finite results (lse may be -inf), fully masked rows give exactly 0
// and probability rows sum to 1; on small problems the fast path is within
// the worst-case error bound of the reference (error_bound.hpp), is not
// finite exactly where the reference is not, and equals,
// bitwise, the same call made another way (allocating, other thread count);
// the reference equals the rounded reference in double; rows that the
// reference computes finite from non-finite inputs are finite.
#include "core/sparse.hpp"
#include "fuzz_common.hpp"

namespace {

using qkv::AttentionOptions;
using qkv::AttentionOutputs;
using qkv::AttentionResult;
using qkv::ConstTensorView;
using qkv::DType;
using qkv::Tensor;
using qkv::fuzz::AttentionCase;
using qkv::fuzz::finding;
using qkv::fuzz::Input;
using qkv::fuzz::require;

// Caller-provided outputs (attention_into).
struct Outputs {
  qkv::fuzz::Arg out, lse, probs;
};

// Makes the outputs of an _into call, sometimes wrong in one way.
Outputs make_outputs(Input& in, AttentionCase& c) {
  const DType stat = c.dtype == DType::f64 ? DType::f64 : DType::f32;
  Outputs o;
  o.out = qkv::fuzz::make_output(in, {c.batch, c.nq, c.hq, c.dv}, c.dtype);
  if (in.coin()) o.lse = qkv::fuzz::make_output(in, {c.batch, c.hq, c.nq}, stat);
  if (in.one_in(3) && qkv::fuzz::small_enough({c.batch, c.hq, c.nq, c.nk}, 1 << 16)) {
    o.probs = qkv::fuzz::make_output(in, {c.batch, c.hq, c.nq, c.nk}, stat);
  }
  if (!in.one_in(8)) return o;
  qkv::fuzz::Arg* const outs[] = {&o.out, &o.lse, &o.probs};
  qkv::fuzz::Arg& victim = *outs[in.range(0, 2)];
  if (!victim.view.defined()) return o;
  const bool empty = victim.view.numel() == 0;
  switch (in.range(0, 3)) {
    case 0: {
      const qkv::fuzz::BadView bad = qkv::fuzz::bad_view(in);
      qkv::fuzz::make_bad(in, victim, bad);
      if (bad == qkv::fuzz::BadView::overflow || victim.aliased ||
          (bad == qkv::fuzz::BadView::undefined && &victim == &o.out) ||
          (bad == qkv::fuzz::BadView::null_data && !empty)) {
        c.reject("bad output view");
      }
      break;
    }
    case 1: {
      const qkv::fuzz::Arg* const inputs[] = {&c.q, &c.k, &c.v, &o.out};
      qkv::fuzz::alias_into(victim, *inputs[in.range(0, 3)]);
      if (victim.aliased) c.reject("output aliasing an input or another output");
      break;
    }
    case 2: {
      // Another dtype.
      const DType other = victim.view.dtype() == DType::f32 ? DType::f16 : DType::f32;
      victim = qkv::fuzz::make_output(in, victim.view.size_span(), other);
      c.reject("output of the wrong dtype");
      break;
    }
    default: {
      std::vector<std::int64_t> sizes(victim.view.size_span().begin(),
                                      victim.view.size_span().end());
      sizes[static_cast<std::size_t>(in.range(0, static_cast<std::int64_t>(sizes.size()) - 1))] +=
          1;
      victim = qkv::fuzz::make_output(in, sizes, victim.view.dtype());
      c.reject("output of the wrong sizes");
      break;
    }
  }
  return o;
}

// The call the case describes, allocating (into == false) or into `outs`.
void call(const AttentionCase& c, bool into, const AttentionOutputs& outs, AttentionResult& r) {
  if (!c.flex) {
    if (into) {
      qkv::attention_into(c.q, c.k, c.v, outs, c.opt);
    } else {
      r = qkv::attention(c.q, c.k, c.v, c.opt);
    }
    return;
  }
  const auto run = [&](auto score_mod, auto mask_mod) {
    if (into) {
      qkv::flex_attention_into(c.q, c.k, c.v, outs, score_mod, mask_mod, c.opt);
    } else {
      r = qkv::flex_attention(c.q, c.k, c.v, score_mod, mask_mod, c.opt);
    }
  };
  const auto score = [id = c.score_mod](float s, std::int64_t b, std::int64_t h, std::int64_t i,
                                        std::int64_t j) {
    return qkv::fuzz::score_mod_menu(id, s, b, h, i, j);
  };
  const auto mask = [id = c.mask_mod](std::int64_t b, std::int64_t h, std::int64_t i,
                                      std::int64_t j) {
    return qkv::fuzz::mask_mod_menu(id, b, h, i, j);
  };
  if (c.score_mod >= 0 && c.mask_mod >= 0) {
    run(score, mask);
  } else if (c.score_mod >= 0) {
    run(score, qkv::no_mask_mod);
  } else {
    run(qkv::no_score_mod, mask);
  }
}

// Rows of lse equal to -inf have out and probs exactly 0; rows with a finite
// lse have probabilities summing to 1 (less a sink's share) up to their
// rounding.
void check_rows(const AttentionCase& c, ConstTensorView out, ConstTensorView lse,
                ConstTensorView probs) {
  // Each probability is rounded once to its dtype.
  const double u = std::ldexp(1.0, probs.defined() && probs.dtype() == DType::f64 ? -53 : -24);
  for (std::int64_t b = 0; b < c.batch; ++b) {
    for (std::int64_t h = 0; h < c.hq; ++h) {
      for (std::int64_t i = 0; i < c.nq; ++i) {
        const double row_lse = lse.get({b, h, i});
        double sum = 0.0;
        bool zero = true;
        for (std::int64_t j = 0; probs.defined() && j < c.nk; ++j) {
          const double p = probs.get({b, h, i, j});
          sum += p;
          zero = zero && p == 0.0;
        }
        if (row_lse == -qkv::fuzz::kInf) {
          for (std::int64_t d = 0; d < c.dv; ++d) zero = zero && out.get({b, i, h, d}) == 0.0;
          require(zero, "fully masked row (b " + std::to_string(b) + ", h " + std::to_string(h) +
                            ", i " + std::to_string(i) + ") is not exactly 0: " + c.text);
        } else if (probs.defined()) {
          // A learned sink takes e^(S_h - lse) of the row's mass (qkv/attention.hpp):
          // the keys' probabilities sum to the rest; lse is rounded to f32 once.
          double want = 1.0, slack = 0.0;
          if (!c.opt.sinks.empty()) {
            const double sink = c.opt.sinks[static_cast<std::size_t>(h)];
            const double mass = std::exp(sink - row_lse);
            if (mass > 0.0) {  // a sink of -inf takes nothing
              want -= mass;
              slack = 4.0 * u * (std::fabs(row_lse) + std::fabs(sink) + 1.0) * mass;
            }
          }
          require(std::fabs(sum - want) <= static_cast<double>(c.nk + 2) * u + slack,
                  "probabilities of row (b " + std::to_string(b) + ", h " + std::to_string(h) +
                      ", i " + std::to_string(i) + ") sum to " + std::to_string(want) + " + " +
                      std::to_string(sum - want) + " (lse " + std::to_string(row_lse) +
                      "): " + c.text);
        }
      }
    }
  }
}

// The reference on the inputs widened to double, rounded to the inputs'
// dtypes, must be what the reference gave (it accumulates in double and
// rounds once).
void check_reference_rounding(const AttentionCase& c, ConstTensorView out, ConstTensorView lse,
                              ConstTensorView probs) {
  AttentionOptions o = c.function_options();
  o.backend = qkv::Backend::reference;
  o.return_lse = true;
  o.return_probs = probs.defined();
  const AttentionResult ref = qkv::attention(
      qkv::test::f64(c.q.cview()), qkv::test::f64(c.k.cview()), qkv::test::f64(c.v.cview()), o);
  require(qkv::fuzz::same_values(qkv::to_dtype(ref.out, c.dtype), out),
          "reference out is not the rounded reference in double: " + c.text);
  if (lse.defined()) {
    require(qkv::fuzz::same_values(qkv::to_dtype(ref.lse, DType::f32), lse),
            "reference lse is not the rounded reference in double: " + c.text);
  }
  if (probs.defined()) {
    require(qkv::fuzz::same_values(qkv::to_dtype(ref.probs, DType::f32), probs),
            "reference probs are not the rounded reference in double: " + c.text);
  }
}

// With NaN or infinities among the inputs, every row the reference (in
// double) computes finite must be finite: those rows never admit a key
// whose values are not.
void check_finite_rows(const AttentionCase& c, ConstTensorView out) {
  AttentionOptions o = c.function_options();
  o.backend = qkv::Backend::reference;
  const AttentionResult ref = qkv::attention(
      qkv::test::f64(c.q.cview()), qkv::test::f64(c.k.cview()), qkv::test::f64(c.v.cview()), o);
  for (std::int64_t b = 0; b < c.batch; ++b) {
    for (std::int64_t i = 0; i < c.nq; ++i) {
      for (std::int64_t h = 0; h < c.hq; ++h) {
        bool ref_finite = true, finite = true;
        for (std::int64_t d = 0; d < c.dv; ++d) {
          ref_finite = ref_finite && std::isfinite(ref.out.get({b, i, h, d}));
          finite = finite && std::isfinite(out.get({b, i, h, d}));
        }
        require(!ref_finite || finite,
                "row (b " + std::to_string(b) + ", i " + std::to_string(i) + ", h " +
                    std::to_string(h) +
                    ") is not finite where the reference is (non-finite values at keys the row "
                    "does not admit?): " +
                    c.text);
      }
    }
  }
}

void check_results(const AttentionCase& c, ConstTensorView out, ConstTensorView lse,
                   ConstTensorView probs) {
  const bool finite = c.finite_expected && c.inputs_finite();
  if (finite) {
    qkv::fuzz::require_finite(out, "out: " + c.text);
    qkv::fuzz::require_finite(lse, "lse: " + c.text, true);
    qkv::fuzz::require_finite(probs, "probs: " + c.text);
  }
  const bool small = qkv::fuzz::small_enough({c.batch, c.hq, c.nq, c.nk, c.dq + c.dv}, 100000);
  if (!small) return;
  ConstTensorView row_lse = lse;
  AttentionResult fast;
  if (c.comparable && c.dtype != DType::f64) {
    if (!qkv::fuzz::accepted("fast path", [&] {
          fast = qkv::test::expect_matches_reference(
              c.q, c.k, c.v, c.function_options(), c.text, qkv::test::Rule::worst_case,
              qkv::fuzz::score_mod_bound(c.score_mod, c.batch, c.hq, c.nq, c.nk));
        })) {
      finding("Backend::fast rejects a call that validation accepted: " + c.text);
    }
    // The dilated-window split does not run when probs are asked for; its
    // tiles round differently.
    const bool split =
        probs.defined() &&
        qkv::detail::dilated_split(qkv::detail::check_attention_inputs(c.q, c.k, c.v, c.opt), c.opt)
                .dilation > 1;
    if (c.runs_fast() && !split) {
      require(qkv::fuzz::same_values(out, fast.out),
              "out differs from the same call made allocating, on another thread count: " + c.text);
      require(!lse.defined() || qkv::fuzz::same_values(lse, fast.lse),
              "lse differs from the same call made allocating: " + c.text);
    }
    if (!row_lse.defined()) row_lse = fast.lse;
  }
  if (finite && row_lse.defined()) check_rows(c, out, row_lse, probs);
  if (!c.runs_fast() && c.dtype != DType::f64 && c.finite_expected) {
    check_reference_rounding(c, out, lse, probs);
  }
  if (!c.inputs_finite() && c.finite_expected) check_finite_rows(c, out);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Input in(data, size);
  qkv::fuzz::fuzz_threads(in);
  AttentionCase c;
  qkv::fuzz::fuzz_case(in, c, false);
  if (c.flex && c.score_mod >= 0 && in.one_in(30)) {
    c.opt.score_mod = [](double s, std::int64_t, std::int64_t, std::int64_t, std::int64_t) {
      return s;
    };
    c.reject("score_mod both in the options and given to flex_attention");
  }
  const bool into = in.coin();
  Outputs o;
  if (into) {
    o = make_outputs(in, c);
  } else {
    c.opt.return_lse = in.coin();
    c.opt.return_probs =
        in.one_in(3) && qkv::fuzz::small_enough({c.batch, c.hq, c.nq, c.nk}, 1 << 16);
  }
  std::vector<const qkv::fuzz::Arg*> args = c.inputs();
  qkv::fuzz::Snapshot inputs;
  for (const qkv::fuzz::Arg* a : args) inputs.add(*a);
  const qkv::fuzz::Snapshot outputs{&o.out, &o.lse, &o.probs};

  AttentionResult r;
  const bool ok = qkv::fuzz::accepted("attention", [&] {
    call(c, into, {o.out, o.lse, o.probs}, r);
  });
  if (ok && !c.must_reject.empty()) finding("attention accepted " + c.must_reject + ": " + c.text);
  inputs.require_unchanged("attention (inputs): " + c.text);
  if (!ok) {
    outputs.require_unchanged("attention that threw qkv::Error (outputs): " + c.text);
    return 0;
  }
  for (const qkv::fuzz::Arg* a : {&o.out, &o.lse, &o.probs}) {
    require(qkv::fuzz::gaps_untouched(*a), "attention wrote outside an output view: " + c.text);
  }
  if (into) {
    check_results(c, o.out.view, o.lse.view, o.probs.view);
  } else {
    check_results(c, r.out, r.lse, r.probs);
  }
  return 0;
}
