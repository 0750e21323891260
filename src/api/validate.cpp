// Each check_* function looks at one aspect of a call and appends a reason per
// problem (argument, expected, actual). Checks run even after earlier ones
// fail, unless they depend on a shape that is already known to be wrong.
#include "api/validate.hpp"

#include <cmath>
#include <limits>
#include <string>

#include "core/capabilities.hpp"
#include "core/elements.hpp"
#include "core/parameters.hpp"
#include "core/query_maps.hpp"
#include "core/sparse.hpp"

namespace qkv::detail {

using std::to_string;

void check_head_groups(ConstTensorView k, std::int64_t hq, std::int64_t hkv, Reasons& r) {
  if (hkv == 0 && hq > 0) {
    r.push_back("k: expected at least 1 KV head for " + to_string(hq) +
                " query heads, got 0 (sizes " + shape_of(k) + ")");
  } else if (hkv > 0 && hq % hkv != 0) {
    r.push_back("q: query heads Hq = " + to_string(hq) +
                " must be a multiple of the KV heads Hkv = " + to_string(hkv) +
                " (grouped-query attention shares each KV head among Hq / Hkv query heads)");
  }
}

namespace {

// The largest finite f32 number and the smallest normal one, 2^-126.
constexpr double kMaxF32 = std::numeric_limits<float>::max();
constexpr double kMinNormal = std::numeric_limits<float>::min();

// A tensor argument of the given rank (-1: any).
bool check_tensor(const char* name, ConstTensorView t, int rank, Reasons& r) {
  return check_view(name, t, {.rank = rank}, r);
}

void check_same_dtype(const char* name, ConstTensorView t, DType expected, Reasons& r) {
  if (t.dtype() != expected) {
    r.push_back(std::string(name) + ": expected dtype " + str(expected) +
                " (the dtype of q), got " + str(t.dtype()));
  }
}

void check_qkv(ConstTensorView q, ConstTensorView k, ConstTensorView v, const AttentionOptions& o,
               AttentionProblem& p, Reasons& r) {
  const bool q_ok = check_tensor("q", q, 4, r);
  const bool k_ok = check_tensor("k", k, 4, r);
  const bool v_ok = check_tensor("v", v, 4, r);
  // k and v must match a floating q; when q is not floating, asking them to
  // match it would suggest the wrong fix, so they are only checked alone.
  const bool q_floating = q.defined() && check_floating("q", q.dtype(), r);
  for (auto [name, t] : {std::pair{"k", k}, {"v", v}}) {
    if (!t.defined()) continue;
    if (q_floating) {
      check_same_dtype(name, t, q.dtype(), r);
    } else {
      check_floating(name, t.dtype(), r);
    }
  }
  if (!(q_ok && k_ok && v_ok)) return;

  p.batch = q.size(0);
  p.nq = q.size(1);
  p.hq = q.size(2);
  p.dq = q.size(3);
  p.nk = k.size(1);
  p.hkv = k.size(2);
  p.dk = k.size(3);
  p.dv = v.size(3);
  p.dtype = q.dtype();
  p.stat_dtype = q.dtype() == DType::f64 ? DType::f64 : DType::f32;

  const std::string qb = "q's batch " + to_string(p.batch);
  for (auto [name, n] : {std::pair{"q", p.nq}, {"k", p.nk}}) {
    if (n > kMaxSequence) {
      r.push_back(std::string(name) + ": expected a sequence length (dim 1) below 2^60, got " +
                  to_string(n) + " (positions and their differences are int64)");
    }
  }
  check_dim("k", k, 0, "batch size", p.batch, qb, r);
  check_dim("v", v, 0, "batch size", p.batch, qb, r);
  check_dim("v", v, 1, "sequence length", p.nk, "k's " + to_string(p.nk), r);
  check_dim("v", v, 2, "KV heads", p.hkv, "k's " + to_string(p.hkv), r);
  check_head_groups(k, p.hq, p.hkv, r);
  if (o.score != Score::additive && p.dq != p.dk) {
    r.push_back("k: expected head dim (dim 3) " + to_string(p.dq) + " to match q's, got " +
                to_string(p.dk) + " (only Score::additive allows different q and k dims)");
  }
}

void check_score(const AttentionOptions& o, AttentionProblem& p, Reasons& r) {
  p.scale = check_scale(o, p.dk, r);
  const AdditiveScore& a = o.additive;
  if (o.score != Score::additive) {
    if (a.w_q.defined() || a.w_k.defined() || a.v.defined() || a.bias.defined()) {
      r.push_back("options.additive: parameters given but score is not Score::additive");
    }
    return;
  }
  const bool wq_ok = check_tensor("options.additive.w_q", a.w_q, 2, r);
  const bool wk_ok = check_tensor("options.additive.w_k", a.w_k, 2, r);
  const bool v_ok = check_tensor("options.additive.v", a.v, 1, r);
  const bool b_ok = !a.bias.defined() || check_tensor("options.additive.bias", a.bias, 1, r);
  for (auto [name, t] : {std::pair{"options.additive.w_q", a.w_q},
                         {"options.additive.w_k", a.w_k},
                         {"options.additive.v", a.v},
                         {"options.additive.bias", a.bias}}) {
    // Parameters may use any floating dtype, independent of the activations'
    // (e.g. f32 weights with bf16 inputs).
    if (t.defined()) check_floating(name, t.dtype(), r);
  }
  if (!(wq_ok && wk_ok && v_ok && b_ok)) return;
  p.attention_size = a.w_q.size(0);
  if (p.attention_size < 1) {
    r.push_back("options.additive.w_q: expected attention size (dim 0) A >= 1, got 0 (sizes " +
                shape_of(a.w_q) + ")");
  }
  const std::string src = "w_q's attention size " + to_string(p.attention_size);
  check_dim("options.additive.w_q", a.w_q, 1, "input size", p.dq, "q's head dim", r);
  check_dim("options.additive.w_k", a.w_k, 0, "attention size", p.attention_size, src, r);
  check_dim("options.additive.w_k", a.w_k, 1, "input size", p.dk, "k's head dim", r);
  check_dim("options.additive.v", a.v, 0, "attention size", p.attention_size, src, r);
  if (a.bias.defined()) {
    check_dim("options.additive.bias", a.bias, 0, "attention size", p.attention_size, src, r);
  }
}

void check_offsets(const char* name, std::span<const std::int64_t> cu, std::int64_t total,
                   const char* tensor, Reasons& r) {
  if (cu.size() < 2) {
    r.push_back(std::string(name) + ": expected at least 2 offsets (S + 1 for S sequences), got " +
                to_string(cu.size()));
    return;
  }
  if (cu[0] != 0) r.push_back(std::string(name) + "[0]: expected 0, got " + to_string(cu[0]));
  for (std::size_t s = 1; s < cu.size(); ++s) {
    if (cu[s] < cu[s - 1]) {
      r.push_back(std::string(name) + ": expected non-decreasing offsets, but [" + to_string(s) +
                  "] = " + to_string(cu[s]) + " < [" + to_string(s - 1) +
                  "] = " + to_string(cu[s - 1]));
      return;
    }
  }
  if (cu.back() != total) {
    r.push_back(std::string(name) + ": expected the last offset to equal " + tensor +
                "'s packed length " + to_string(total) + ", got " + to_string(cu.back()));
  }
}

void check_sequences(const AttentionOptions& o, AttentionProblem& p, Reasons& r) {
  const bool has_q = !o.cu_seqlens_q.empty();
  const bool has_k = !o.cu_seqlens_k.empty();
  p.sequences = p.batch;
  p.cu_seqlens_q = o.cu_seqlens_q;
  p.cu_seqlens_k = o.cu_seqlens_k;
  p.key_lengths = o.key_lengths;
  if (has_q != has_k) {
    r.push_back(std::string("options.cu_seqlens_") + (has_q ? "k" : "q") +
                ": expected together with cu_seqlens_" + (has_q ? "q" : "k") +
                " (packed batches need both), got none");
    return;
  }
  if (has_q) {
    p.varlen = true;
    if (p.batch != 1) {
      r.push_back("q: packed sequences (cu_seqlens) expect batch size 1, got " +
                  to_string(p.batch));
    }
    // Any problem with the offsets, their count included, stops here: the
    // key-length check below indexes cu_seqlens_k by cu_seqlens_q's sequences.
    const std::size_t before = r.size();
    if (o.cu_seqlens_q.size() != o.cu_seqlens_k.size()) {
      r.push_back("options.cu_seqlens_k: expected " + to_string(o.cu_seqlens_q.size()) +
                  " offsets like cu_seqlens_q, got " + to_string(o.cu_seqlens_k.size()));
    }
    check_offsets("options.cu_seqlens_q", o.cu_seqlens_q, p.nq, "q", r);
    check_offsets("options.cu_seqlens_k", o.cu_seqlens_k, p.nk, "k", r);
    if (r.size() != before) return;
    p.sequences = static_cast<std::int64_t>(o.cu_seqlens_q.size()) - 1;
  }
  if (o.key_lengths.empty()) return;
  if (static_cast<std::int64_t>(o.key_lengths.size()) != p.sequences) {
    r.push_back("options.key_lengths: expected one length per sequence (" + to_string(p.sequences) +
                "), got " + to_string(o.key_lengths.size()));
    return;
  }
  for (std::int64_t s = 0; s < p.sequences; ++s) {
    const std::int64_t rows = p.varlen ? o.cu_seqlens_k[s + 1] - o.cu_seqlens_k[s] : p.nk;
    const std::int64_t len = o.key_lengths[static_cast<std::size_t>(s)];
    if (len < 0 || len > rows) {
      r.push_back("options.key_lengths[" + to_string(s) + "]: expected a length in [0, " +
                  to_string(rows) + "] (the keys of that sequence), got " + to_string(len));
    }
  }
}

void check_mask(const AttentionOptions& o, const AttentionProblem& p, Reasons& r) {
  if (o.mask_requires_grad && !(o.mask.defined() && is_floating(o.mask.dtype()))) {
    r.push_back(std::string("options.mask_requires_grad: expected a float options.mask, got ") +
                (o.mask.defined() ? "a bool mask" : "none"));
  }
  if (!o.mask.defined()) return;
  if (!check_tensor("options.mask", o.mask, -1, r)) return;
  const std::int64_t target[4] = {p.batch, p.hq, p.nq, p.nk};
  const int rank = o.mask.rank();
  for (int d = 0; d < rank; ++d) {
    const std::int64_t want = target[4 - rank + d];
    const std::int64_t got = o.mask.size(d);
    if (got != want && got != 1) {
      r.push_back("options.mask: sizes " + shape_of(o.mask) +
                  " do not broadcast to [B, Hq, Nq, Nk] = " + shape_string(target) + ": dim " +
                  to_string(d) + " is " + to_string(got) + ", expected " + to_string(want) +
                  " or 1");
      return;
    }
  }
}

void check_positions(const AttentionOptions& o, const AttentionProblem& p, Reasons& r) {
  check_alibi(o, p.hq, p.sequences, p.varlen, r);
  check_sinks(o, p.hq, r);
  check_query_maps(o, p.hq, r);
  if (o.shard.heads > 0 && o.shard.head >= 0 &&
      (o.shard.head > o.shard.heads || o.shard.heads - o.shard.head < p.hq)) {
    r.push_back("options.shard.heads: expected at least head + Hq = " + to_string(o.shard.head) +
                " + " + to_string(p.hq) + " heads in the whole problem, got " +
                to_string(o.shard.heads));
  }
  // The kernels tabulate the relative bias over the call's own distances,
  // and sparse patterns also read the call's own row and key indices: a
  // piece of a larger call would see other distances and indices.
  const ShardOffsets& sh = o.shard;
  const bool moved = sh.position != 0 || sh.row != 0 || sh.key != 0;
  if (moved && o.relative_bias.table.defined()) {
    r.push_back(
        "options.relative_bias: not supported with a nonzero options.shard position, row "
        "or key");
  }
  if (moved && o.sparse.defined()) {
    r.push_back("options.sparse: not supported with a nonzero options.shard position, row or key");
  }
  const RelativePositionBias& rb = o.relative_bias;
  if (!rb.table.defined()) return;
  if (!check_tensor("options.relative_bias.table", rb.table, 2, r)) return;
  check_floating("options.relative_bias.table", rb.table.dtype(), r);
  check_dim("options.relative_bias.table", rb.table, 0, "heads", p.hq, "q's Hq", r);
  const std::int64_t buckets = rb.table.size(1);
  const std::int64_t per_side = rb.bidirectional ? buckets / 2 : buckets;
  if (per_side < 2) {
    r.push_back("options.relative_bias.table: expected at least " +
                to_string(rb.bidirectional ? 4 : 2) + " buckets (dim 1), got " +
                to_string(buckets));
  } else if (rb.max_distance <= per_side / 2) {
    r.push_back("options.relative_bias.max_distance: expected more than " +
                to_string(per_side / 2) + " (the exact buckets), got " +
                to_string(rb.max_distance));
  }
}

// The dropout generator's counter holds i, j / 4 and b * Hq + h in 32 bits each.
void check_dropout(const AttentionOptions& o, const AttentionProblem& p, Reasons& r) {
  if (o.dropout_p == 0.0) return;
  constexpr std::int64_t kWord = std::int64_t{1} << 32;
  if (p.nq >= kWord || p.nk / 4 >= kWord || (p.hq > 0 && p.sequences >= kWord / p.hq)) {
    r.push_back(
        "options.dropout_p: dropout needs Nq < 2^32, Nk < 2^34 and sequences * Hq < 2^32 "
        "(the generator's counter words), got Nq = " +
        to_string(p.nq) + ", Nk = " + to_string(p.nk) + ", " + to_string(p.sequences) +
        " sequences of " + to_string(p.hq) + " heads");
  }
}

}  // namespace

double check_scale(const AttentionOptions& o, std::int64_t dk, Reasons& r) {
  // An unknown score is reported by check_scalar_options.
  if ((o.score == Score::dot || o.score == Score::additive) && o.scale.has_value()) {
    r.push_back("options.scale: only used by Score::scaled_dot, but score is " +
                std::string(o.score == Score::dot ? "Score::dot" : "Score::additive") +
                " (unset scale, or use Score::scaled_dot)");
  }
  if (o.score != Score::scaled_dot) return 1.0;
  if (o.scale.has_value()) {
    // The fast kernels fold the scale into Q in f32.
    if (!(std::fabs(*o.scale) <= kMaxF32)) {
      r.push_back("options.scale: expected a finite number within the f32 range (|scale| <= " +
                  num(kMaxF32) + "), got " + num(*o.scale));
    }
    return *o.scale;
  }
  if (dk < 1) {
    r.push_back("options.scale: the default 1/sqrt(Dk) needs Dk >= 1, got Dk = " + to_string(dk) +
                " (pass an explicit scale)");
    return 1.0;
  }
  return 1.0 / std::sqrt(static_cast<double>(dk));
}

// Options that need no tensor shape. They run even when q, k or v are wrong,
// so that one error lists these problems too.
void check_scalar_options(const AttentionOptions& o, Reasons& r) {
  // Enum values come from casts in bindings and config parsers; an unknown one
  // would otherwise silently run as some other mode.
  if (o.score > Score::additive) {
    r.push_back(
        "options.score: expected Score::scaled_dot, Score::dot or Score::additive, got value " +
        to_string(static_cast<int>(o.score)));
  }
  if (o.align > Align::bottom_right) {
    r.push_back("options.align: expected Align::top_left or Align::bottom_right, got value " +
                to_string(static_cast<int>(o.align)));
  }
  if (o.window_left < -1) {
    r.push_back("options.window_left: expected -1 (unbounded) or a size >= 0, got " +
                to_string(o.window_left));
  }
  if (o.window_right < -1) {
    r.push_back("options.window_right: expected -1 (unbounded) or a size >= 0, got " +
                to_string(o.window_right));
  }
  // The kernels compute c tanh(s / c) in f32: c and 1 / c must both be normal
  // f32 numbers, else one of them is inf or 0 there and the product NaN.
  if (!(o.softcap == 0.0 || (o.softcap >= kMinNormal && o.softcap <= 1.0 / kMinNormal))) {
    r.push_back(
        "options.softcap: expected 0 (off) or a value in [2^-126, 2^126] (about 1.2e-38 to "
        "8.5e37, so that the cap and its inverse are normal f32 numbers), got " +
        num(o.softcap));
  }
  // Shifted positions stay inside +-2^61, and shifted indices inside the
  // ranges the position arithmetic and the dropout counters were built for.
  const ShardOffsets& sh = o.shard;
  if (sh.position < -kMaxSequence || sh.position > kMaxSequence) {
    r.push_back("options.shard.position: expected a shift in [-2^60 + 1, 2^60 - 1], got " +
                to_string(sh.position));
  }
  if (sh.row < 0 || sh.row > kMaxSequence) {
    r.push_back("options.shard.row: expected a row index in [0, 2^60 - 1], got " +
                to_string(sh.row));
  }
  if (sh.key < 0 || sh.key > kMaxSequence) {
    r.push_back("options.shard.key: expected a key index in [0, 2^60 - 1], got " +
                to_string(sh.key));
  }
  if (sh.head < 0 || sh.heads < 0 || (sh.heads == 0 && sh.head != 0)) {
    r.push_back(
        "options.shard.head/heads: expected head >= 0 and heads >= 0 (heads > 0 when head "
        "> 0), got head " +
        to_string(sh.head) + " and heads " + to_string(sh.heads));
  }
  if (!(o.dropout_p >= 0.0 && o.dropout_p < 1.0)) {
    r.push_back("options.dropout_p: expected a probability in [0, 1), got " + num(o.dropout_p));
  }
  if (o.backend > Backend::fast) {
    r.push_back(
        "options.backend: expected Backend::automatic, Backend::reference or Backend::fast, got "
        "value " +
        to_string(static_cast<int>(o.backend)));
  }
  if (o.matmul_precision > MatmulPrecision::int8) {
    r.push_back(
        "options.matmul_precision: expected MatmulPrecision::highest, MatmulPrecision::medium or "
        "MatmulPrecision::int8, got value " +
        to_string(static_cast<int>(o.matmul_precision)));
  }
}

void check_alibi(const AttentionOptions& o, std::int64_t hq, std::int64_t sequences, bool varlen,
                 Reasons& r) {
  if (o.alibi_slopes.empty()) return;
  // Per-sequence slopes follow the sequence index (the packed sequence in
  // varlen mode). Divided rather than multiplied: with Nq = 0, B * Hq is not
  // bounded by q's element count and may overflow.
  const auto n = static_cast<std::int64_t>(o.alibi_slopes.size());
  const bool per_sequence = hq > 0 && n % hq == 0 && n / hq == sequences;
  if (n != hq && !per_sequence) {
    r.push_back("options.alibi_slopes: expected Hq = " + to_string(hq) + " or " +
                (varlen ? "S" : "B") + " * Hq = " + to_string(sequences) + " * " + to_string(hq) +
                " slopes, got " + to_string(n));
  }
  for (std::size_t h = 0; h < o.alibi_slopes.size(); ++h) {
    if (!std::isfinite(o.alibi_slopes[h])) {
      r.push_back("options.alibi_slopes[" + to_string(h) + "]: expected a finite slope, got " +
                  num(o.alibi_slopes[h]));
      break;
    }
  }
}

void check_sinks(const AttentionOptions& o, std::int64_t hq, Reasons& r) {
  if (o.sinks.empty()) return;
  if (static_cast<std::int64_t>(o.sinks.size()) != hq) {
    r.push_back("options.sinks: expected Hq = " + to_string(hq) + " logits, got " +
                to_string(static_cast<std::int64_t>(o.sinks.size())));
  }
  for (std::size_t h = 0; h < o.sinks.size(); ++h) {
    const float s = o.sinks[h];
    if (std::isnan(s) || s == std::numeric_limits<float>::infinity()) {
      r.push_back("options.sinks[" + to_string(h) + "]: expected a finite logit or -inf, got " +
                  num(s));
      break;
    }
  }
}

AttentionProblem check_attention_inputs(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                                        const AttentionOptions& options) {
  AttentionProblem p;
  Reasons r;
  check_qkv(q, k, v, options, p, r);
  const bool shapes_ok = r.empty();
  check_scalar_options(options, r);
  if (!shapes_ok) throw Error(r);  // everything below reads the sizes of q, k and v
  check_score(options, p, r);
  const std::size_t before_sequences = r.size();
  check_sequences(options, p, r);
  if (r.size() == before_sequences && options.sparse.defined()) {
    // Block layouts must cover every sequence (read once the offsets are valid).
    std::vector<std::int64_t> nq, nk;
    for (std::int64_t s = 0; s < p.sequences; ++s) {
      const SequenceExtent e = p.sequence(s);
      nq.push_back(e.nq);
      nk.push_back(e.nk_rows);
    }
    check_sparse(options.sparse, p.hq, nq, nk, r);
  }
  check_mask(options, p, r);
  check_positions(options, p, r);
  check_dropout(options, p, r);
  check_fast_dtype(options.backend, p.dtype, r);
  throw_if(r);
  return p;
}

namespace {

// The views an attention call reads: q, k, v and the options' tensors.
Aliasing attention_inputs(ConstTensorView q, ConstTensorView k, ConstTensorView v,
                          const AttentionOptions& o) {
  Aliasing a;
  a.input("q", q);
  a.input("k", k);
  a.input("v", v);
  a.input("options.mask", o.mask);
  a.input("options.additive.w_q", o.additive.w_q);
  a.input("options.additive.w_k", o.additive.w_k);
  a.input("options.additive.v", o.additive.v);
  a.input("options.additive.bias", o.additive.bias);
  a.input("options.relative_bias.table", o.relative_bias.table);
  return a;
}

}  // namespace

void check_attention_outputs(const AttentionProblem& p, ConstTensorView q, ConstTensorView k,
                             ConstTensorView v, const AttentionOptions& o,
                             const AttentionOutputs& outputs) {
  Reasons r;
  Aliasing aliasing = attention_inputs(q, k, v, o);
  const std::int64_t out_sizes[] = {p.batch, p.nq, p.hq, p.dv};
  const std::int64_t lse_sizes[] = {p.batch, p.hq, p.nq};
  const std::int64_t probs_sizes[] = {p.batch, p.hq, p.nq, p.nk};
  check_output("out", outputs.out, {.sizes = out_sizes, .dtype = p.dtype}, aliasing, r);
  if (outputs.lse.defined()) {
    check_output("lse", outputs.lse, {.sizes = lse_sizes, .dtype = p.stat_dtype}, aliasing, r);
  }
  if (outputs.probs.defined()) {
    check_output("probs", outputs.probs, {.sizes = probs_sizes, .dtype = p.stat_dtype}, aliasing,
                 r);
  }
  throw_if(r);
}

void check_backward_inputs(const AttentionProblem& p, ConstTensorView out, ConstTensorView dout,
                           ConstTensorView lse, const AttentionOptions& o) {
  Reasons r;
  const std::int64_t out_sizes[] = {p.batch, p.nq, p.hq, p.dv};
  const std::int64_t lse_sizes[] = {p.batch, p.hq, p.nq};
  // out and lse may be left out together (the backward computes them),
  // except for a piece of a larger problem, whose rows' lse covers keys the
  // call does not have.
  const bool recompute = !out.defined() && !lse.defined();
  if (recompute && o.shard.partial_keys) {
    r.push_back(
        "out, lse: required with options.shard.partial_keys (the whole rows' lse), got neither");
  }
  if (!recompute) check_view("out", out, {.sizes = out_sizes, .dtype = p.dtype}, r);
  check_view("dout", dout, {.sizes = out_sizes, .dtype = p.dtype}, r);
  if (!recompute) check_view("lse", lse, {.sizes = lse_sizes, .dtype = p.stat_dtype}, r);
  refuse_unsupported(Path::backward, o, "qkv::attention_backward",
                     " (it cannot differentiate a callable: express the modification with the "
                     "built-in biases, softcap or a float mask, or use mask_mod for masking)",
                     r);
  if (o.backend == Backend::fast && o.score == Score::additive) {
    refuse_unsupported(Path::additive_backward, o, "Backend::fast's backward of Score::additive",
                       " (Backend::automatic runs the reference backward for it)", r);
  }
  throw_if(r);
}

void check_gradient_outputs(const AttentionProblem& p, ConstTensorView q, ConstTensorView k,
                            ConstTensorView v, ConstTensorView out, ConstTensorView dout,
                            ConstTensorView lse, const AttentionOptions& o,
                            const GradientOutputs& g) {
  Reasons r;
  Aliasing aliasing = attention_inputs(q, k, v, o);
  aliasing.input("out", out);
  aliasing.input("dout", dout);
  aliasing.input("lse", lse);
  // Each gradient is compared with the inputs and with the gradients before it.
  auto output = [&](const char* name, TensorView t, std::vector<std::int64_t> sizes, DType dtype,
                    bool used, const char* what) {
    if (!used) {
      if (t.defined()) {
        r.push_back(std::string(name) + ": given, but the options have no " + what);
      }
      return;
    }
    if (!t.defined()) {
      r.push_back(std::string(name) + ": required because the options use " + what);
      return;
    }
    check_output(name, t, {.sizes = sizes, .dtype = dtype}, aliasing, r);
  };
  output("dq", g.dq, {p.batch, p.nq, p.hq, p.dq}, p.dtype, true, "q");
  output("dk", g.dk, {p.batch, p.nk, p.hkv, p.dk}, p.dtype, true, "k");
  output("dv", g.dv, {p.batch, p.nk, p.hkv, p.dv}, p.dtype, true, "v");
  for (const ParameterRow& row : parameter_rows(p, o)) {
    output(row.name, g.*row.output, row.sizes, p.stat_dtype, row.used, row.option);
  }
  throw_if(r);
}

}  // namespace qkv::detail
