#include "qkv/modules/multihead_attention.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "core/elements.hpp"
#include "modules/common.hpp"
#include "qkv/attention.hpp"
#include "qkv/backward.hpp"
#include "qkv/decode.hpp"
#include "qkv/error.hpp"
#include "qkv/positional.hpp"

namespace qkv::nn {

namespace {

using detail::Reasons;
using std::to_string;

const MultiHeadAttentionConfig& checked(const MultiHeadAttentionConfig& c) {
  Reasons r;
  if (c.embed_dim < 1) r.push_back("embed_dim: expected >= 1, got " + to_string(c.embed_dim));
  if (c.num_heads < 1) {
    r.push_back("num_heads: expected >= 1, got " + to_string(c.num_heads));
  } else if (c.embed_dim >= 1 && c.embed_dim % c.num_heads != 0) {
    r.push_back("num_heads: " + to_string(c.num_heads) + " does not divide embed_dim " +
                to_string(c.embed_dim));
  }
  if (c.num_kv_heads < 0 ||
      (c.num_kv_heads > 0 && c.num_heads >= 1 && c.num_heads % c.num_kv_heads != 0)) {
    r.push_back("num_kv_heads: expected 0 (= num_heads) or a divisor of num_heads " +
                to_string(c.num_heads) + ", got " + to_string(c.num_kv_heads));
  }
  if (c.kdim < 0) r.push_back("kdim: expected >= 0 (0 = embed_dim), got " + to_string(c.kdim));
  if (c.vdim < 0) r.push_back("vdim: expected >= 0 (0 = embed_dim), got " + to_string(c.vdim));
  if (!(c.dropout >= 0.0 && c.dropout < 1.0)) {
    r.push_back("dropout: expected a probability in [0, 1), got " + detail::num(c.dropout));
  }
  if (c.position > Position::relative_bias) {
    r.push_back("position: unknown value " + to_string(static_cast<int>(c.position)));
  } else if (c.position == Position::rope) {
    // Checked here rather than by the first forward or backward: a backward
    // finds out only after it has added to some gradients.
    const bool heads_ok = c.embed_dim >= 1 && c.num_heads >= 1 && c.embed_dim % c.num_heads == 0;
    qkv::detail::check_rope(c.rope, heads_ok ? c.embed_dim / c.num_heads : -1, "Dh", r);
  }
  detail::check_floating("dtype", c.dtype, r);
  detail::throw_if(r);
  return c;
}

// Row-major [rows, cols] view of a contiguous tensor's elements.
struct Rows {
  const void* data;
  std::int64_t rows;
};

// dst = x W^T + b for x [rows, in] (contiguous, compute dtype), W [out, in]
// given by its first element (rows of a stacked weight), b [out] or null.
Tensor project(DType ct, const void* x, std::int64_t rows, std::int64_t in, const void* w,
               const void* b, std::int64_t out, std::initializer_list<std::int64_t> sizes) {
  Tensor y(ct, sizes);
  detail::gemm(ct, false, true, rows, out, in, 1.0, x, in, w, in, 0.0, y.view().data(), out, b);
  return y;
}

const void* offset(const void* data, DType dtype, std::int64_t elements) {
  return static_cast<const char*>(data) + elements * static_cast<std::int64_t>(dtype_size(dtype));
}
void* offset(void* data, DType dtype, std::int64_t elements) {
  return static_cast<char*>(data) + elements * static_cast<std::int64_t>(dtype_size(dtype));
}

// A bool mask in torch's sense (true = masked) turned into qkv's (true = attend).
Tensor inverted(ConstTensorView mask) {
  Tensor t(DType::boolean, mask.size_span());
  const TensorView v = t.view();
  qkv::detail::for_each_index(mask.sizes(), mask.rank(), [&](const Shape& idx) {
    const double m = qkv::detail::load(mask.data(), mask.dtype(),
                                       qkv::detail::offset(idx, mask.strides(), mask.rank()));
    qkv::detail::store(v.data(), DType::boolean, qkv::detail::offset(idx, v.strides(), v.rank()),
                       m != 0.0 ? 0.0 : 1.0);
  });
  return t;
}

// The masks of one call in qkv's terms, with the storage they need.
struct MaskPlan {
  Tensor storage;
  ConstTensorView mask;
  std::vector<std::int64_t> key_lengths;
};

// key_padding_mask [B, Nk] as a view broadcasting over heads and queries.
ConstTensorView padding_view(ConstTensorView m) {
  const std::int64_t sizes[4] = {m.size(0), 1, 1, m.size(1)};
  const std::int64_t strides[4] = {m.stride(0), 0, 0, m.stride(1)};
  return ConstTensorView(m.data(), m.dtype(), sizes, strides);
}

// attn_mask [Nq, Nk] or [B * H, Nq, Nk] as a view broadcasting to [B, H, Nq, Nk].
ConstTensorView attn_view(ConstTensorView m, std::int64_t batch, std::int64_t heads) {
  if (m.rank() == 2) return m;
  const std::int64_t sizes[4] = {batch, heads, m.size(1), m.size(2)};
  const std::int64_t strides[4] = {heads * m.stride(0), m.stride(0), m.stride(1), m.stride(2)};
  return ConstTensorView(m.data(), m.dtype(), sizes, strides);
}

// A bool padding mask whose rows are "n valid keys, then padding" becomes
// key lengths, which the kernels skip by whole tiles.
bool as_lengths(ConstTensorView m, std::vector<std::int64_t>& lengths) {
  lengths.assign(static_cast<std::size_t>(m.size(0)), 0);
  for (std::int64_t b = 0; b < m.size(0); ++b) {
    std::int64_t n = 0;
    while (n < m.size(1) && m.get({b, n}) == 0.0) ++n;
    for (std::int64_t j = n; j < m.size(1); ++j) {
      if (m.get({b, j}) == 0.0) {
        lengths.clear();
        return false;
      }
    }
    lengths[static_cast<std::size_t>(b)] = n;
  }
  return true;
}

MaskPlan plan_masks(const MultiHeadAttentionOptions& o, std::int64_t batch, std::int64_t heads,
                    std::int64_t nq, std::int64_t nk, DType ct) {
  MaskPlan plan;
  const ConstTensorView kpm = o.key_padding_mask, am = o.attn_mask;
  if (kpm.defined() && !am.defined()) {
    if (kpm.dtype() != DType::boolean) {
      plan.mask = padding_view(kpm);
    } else if (!as_lengths(kpm, plan.key_lengths)) {
      plan.storage = inverted(kpm);
      plan.mask = padding_view(plan.storage);
    }
  } else if (am.defined() && !kpm.defined()) {
    if (am.dtype() == DType::boolean) {
      plan.storage = inverted(am);
      plan.mask = attn_view(plan.storage, batch, heads);
    } else {
      plan.mask = attn_view(am, batch, heads);
    }
  } else if (am.defined() && kpm.defined()) {
    // One additive mask [B, H, Nq, Nk]: -inf where either mask forbids.
    const double inf = std::numeric_limits<double>::infinity();
    plan.storage = Tensor(ct, {batch, heads, nq, nk});
    const TensorView s = plan.storage.view();
    const ConstTensorView a = attn_view(am, batch, heads);
    const ConstTensorView p = padding_view(kpm);
    auto term = [&](ConstTensorView m, const Shape& idx) {
      const Shape at = {m.size(0) == 1 ? 0 : idx[0], m.size(1) == 1 ? 0 : idx[1],
                        m.size(2) == 1 ? 0 : idx[2], idx[3]};
      const double x =
          qkv::detail::load(m.data(), m.dtype(), qkv::detail::offset(at, m.strides(), 4));
      return m.dtype() == DType::boolean ? (x != 0.0 ? -inf : 0.0) : x;
    };
    const ConstTensorView a4 = a.rank() == 4 ? a
                                             : ConstTensorView(a.data(), a.dtype(), {1, 1, nq, nk},
                                                               {0, 0, a.stride(0), a.stride(1)});
    qkv::detail::for_each_index(s.sizes(), 4, [&](const Shape& idx) {
      qkv::detail::store(s.data(), ct, qkv::detail::offset(idx, s.strides(), 4),
                         term(a4, idx) + term(p, idx));
    });
    plan.mask = plan.storage;
  }
  return plan;
}

}  // namespace

MultiHeadAttention::MultiHeadAttention(const MultiHeadAttentionConfig& config)
    : out_proj(checked(config).embed_dim, config.embed_dim, config.bias, config.dtype),
      config_(config) {
  const std::int64_t e = config.embed_dim;
  if (config_.num_kv_heads == 0) config_.num_kv_heads = config.num_heads;
  if (config_.kdim == 0) config_.kdim = e;
  if (config_.vdim == 0) config_.vdim = e;
  head_dim_ = e / config.num_heads;
  kv_dim_ = config_.num_kv_heads * head_dim_;
  const DType dt = config.dtype;
  if (config_.kdim == e && config_.vdim == e) {
    in_proj_weight = make_parameter(dt, {e + 2 * kv_dim_, e});
  } else {
    q_proj_weight = make_parameter(dt, {e, e});
    k_proj_weight = make_parameter(dt, {kv_dim_, config_.kdim});
    v_proj_weight = make_parameter(dt, {kv_dim_, config_.vdim});
  }
  if (config.bias) in_proj_bias = make_parameter(dt, {e + 2 * kv_dim_});
  if (config.position == Position::relative_bias) {
    relative_bias.emplace(config.num_heads, config.num_buckets, config.max_distance,
                          config.bidirectional, dt);
  }
  if (config.position == Position::alibi) alibi_ = alibi_slopes(config.num_heads);
}

NamedParameters MultiHeadAttention::named_parameters(std::string_view prefix) {
  const std::string p(prefix);
  NamedParameters out;
  if (packed()) {
    out.push_back({p + "in_proj_weight", &in_proj_weight});
  } else {
    out.push_back({p + "q_proj_weight", &q_proj_weight});
    out.push_back({p + "k_proj_weight", &k_proj_weight});
    out.push_back({p + "v_proj_weight", &v_proj_weight});
  }
  if (in_proj_bias.defined()) out.push_back({p + "in_proj_bias", &in_proj_bias});
  for (const NamedParameter& n : out_proj.named_parameters(p + "out_proj.")) out.push_back(n);
  if (relative_bias) {
    for (const NamedParameter& n : relative_bias->named_parameters(p)) out.push_back(n);
  }
  return out;
}

namespace {

struct Call {
  std::int64_t batch = 0, nq = 0, nk = 0;
  DType ct = DType::f32;
  bool known = false;  // query, key and value have readable sizes
};

bool has_sizes(ConstTensorView t, std::initializer_list<std::int64_t> sizes) {
  return std::equal(t.size_span().begin(), t.size_span().end(), sizes.begin(), sizes.end());
}

// A mask of the options: bool or floating, addressable. Returns whether its
// sizes may be read.
bool check_mask(const char* name, ConstTensorView m, const detail::ViewSpec& spec, Reasons& r) {
  if (m.dtype() != DType::boolean && !is_floating(m.dtype())) {
    r.push_back(std::string(name) + ": expected bool or a floating dtype, got " +
                detail::str(m.dtype()));
  }
  return detail::check_view(name, m, spec, r);
}

Call check_call(const MultiHeadAttentionConfig& c, ConstTensorView query, ConstTensorView key,
                ConstTensorView value, const MultiHeadAttentionOptions& o, Reasons& r) {
  // Every input is checked, so that one error names all bad ones.
  bool ok = detail::check_input("query", query, 3, "[B, Nq, E]", r);
  ok = detail::check_input("key", key, 3, "[B, Nk, kdim]", r) && ok;
  ok = detail::check_input("value", value, 3, "[B, Nk, vdim]", r) && ok;
  Call call;
  if (!ok) return call;
  call.known = true;
  call.batch = query.size(0);
  call.nq = query.size(1);
  call.nk = key.size(1);
  call.ct = detail::compute_dtype(query.dtype());
  // Only between floating dtypes: check_input has named any other, and
  // asking key and value to match a query that is not floating would
  // suggest the wrong fix.
  if (is_floating(query.dtype()) && is_floating(key.dtype()) && is_floating(value.dtype()) &&
      (key.dtype() != query.dtype() || value.dtype() != query.dtype())) {
    r.push_back("key, value: expected query's dtype " + detail::str(query.dtype()) + ", got " +
                detail::str(key.dtype()) + " and " + detail::str(value.dtype()));
  }
  const std::string qb = "query's batch " + to_string(call.batch);
  detail::check_dim("query", query, 2, "embed dim E", c.embed_dim, "the module's embed_dim", r);
  detail::check_dim("key", key, 0, "batch size", call.batch, qb, r);
  detail::check_dim("key", key, 2, "features", c.kdim, "the module's kdim", r);
  detail::check_dim("value", value, 0, "batch size", call.batch, qb, r);
  detail::check_dim("value", value, 1, "sequence length Nk", call.nk, "key's " + to_string(call.nk),
                    r);
  detail::check_dim("value", value, 2, "features", c.vdim, "the module's vdim", r);
  if (o.key_padding_mask.defined()) {
    const std::int64_t sizes[] = {call.batch, call.nk};
    check_mask("key_padding_mask", o.key_padding_mask, {.sizes = sizes, .layout = "[B, Nk]"}, r);
  }
  // B * H overflows only for an empty query ([B, 0, E]), which no mask of
  // B * H rows could match.
  std::int64_t bh = 0;
  const bool bh_fits = qkv::detail::checked_product({call.batch, c.num_heads}, bh);
  if (o.attn_mask.defined() && check_mask("attn_mask", o.attn_mask, {}, r) &&
      !has_sizes(o.attn_mask, {call.nq, call.nk}) &&
      !(bh_fits && has_sizes(o.attn_mask, {bh, call.nq, call.nk}))) {
    r.push_back("attn_mask: expected [Nq, Nk] = " +
                shape_string(std::vector<std::int64_t>{call.nq, call.nk}) +
                " or [B * H, Nq, Nk] = [" + to_string(call.batch) + " * " + to_string(c.num_heads) +
                ", " + to_string(call.nq) + ", " + to_string(call.nk) + "], got " +
                detail::shape_of(o.attn_mask));
  }
  return call;
}

// The projection weights and biases in the compute dtype, by block.
struct Weights {
  detail::Dense w_in, w_k, w_v, b_in;
  const void *wq = nullptr, *wk = nullptr, *wv = nullptr;
  const void *bq = nullptr, *bk = nullptr, *bv = nullptr;
};

Weights weights_of(const MultiHeadAttention& m, DType ct) {
  const std::int64_t e = m.config().embed_dim;
  const std::int64_t kv = m.config().num_kv_heads * m.head_dim();
  Weights w;
  if (m.in_proj_weight.defined()) {
    w.w_in = detail::dense(m.in_proj_weight.value, ct);
    w.wq = w.w_in.data;
    w.wk = offset(w.w_in.data, ct, e * e);
    w.wv = offset(w.w_in.data, ct, (e + kv) * e);
  } else {
    w.w_in = detail::dense(m.q_proj_weight.value, ct);
    w.w_k = detail::dense(m.k_proj_weight.value, ct);
    w.w_v = detail::dense(m.v_proj_weight.value, ct);
    w.wq = w.w_in.data;
    w.wk = w.w_k.data;
    w.wv = w.w_v.data;
  }
  if (m.in_proj_bias.defined()) {
    w.b_in = detail::dense(m.in_proj_bias.value, ct);
    w.bq = w.b_in.data;
    w.bk = offset(w.b_in.data, ct, e);
    w.bv = offset(w.b_in.data, ct, e + kv);
  }
  return w;
}

// The inputs in the compute dtype; key and value reuse query's conversion
// when they are the same view (self-attention).
struct Inputs {
  detail::Dense q, k, v;
  const void *qd = nullptr, *kd = nullptr, *vd = nullptr;
};

bool same_view(ConstTensorView a, ConstTensorView b) {
  return a.data() == b.data() && a.dtype() == b.dtype() && a.sizes() == b.sizes() &&
         a.strides() == b.strides() && a.rank() == b.rank();
}

Inputs inputs_of(ConstTensorView query, ConstTensorView key, ConstTensorView value, DType ct) {
  Inputs in;
  in.q = detail::dense(query, ct);
  in.qd = in.q.data;
  if (same_view(key, query)) {
    in.kd = in.qd;
  } else {
    in.k = detail::dense(key, ct);
    in.kd = in.k.data;
  }
  if (same_view(value, query)) {
    in.vd = in.qd;
  } else if (same_view(value, key)) {
    in.vd = in.kd;
  } else {
    in.v = detail::dense(value, ct);
    in.vd = in.v.data;
  }
  return in;
}

// The kernel options of one call. `alibi` holds the module's slopes.
AttentionOptions attention_options(const MultiHeadAttention& m, std::span<const float> alibi,
                                   const MultiHeadAttentionOptions& o, const MaskPlan& plan) {
  const MultiHeadAttentionConfig& config = m.config();
  AttentionOptions a;
  a.causal = o.causal;
  a.align = Align::top_left;  // torch's is_causal
  a.mask = plan.mask;
  a.key_lengths = plan.key_lengths;
  a.alibi_slopes = alibi;
  if (m.relative_bias) a.relative_bias = m.relative_bias->options();
  if (o.training && config.dropout > 0.0) {
    a.dropout_p = config.dropout;
    a.dropout_seed = o.dropout_seed;
    a.dropout_offset = o.dropout_offset;
  }
  return a;
}

// Reasons the parameters no longer have the module's shapes (they are
// public members), all checked before anything is computed: out_proj and
// relative_bias would otherwise find out only after a backward had added to
// the other gradients.
void check_projections(const MultiHeadAttention& m, Reasons& r) {
  const MultiHeadAttentionConfig& c = m.config();
  const std::int64_t e = c.embed_dim, kv = c.num_kv_heads * m.head_dim();
  detail::check_parameter("out_proj.weight", m.out_proj.weight, {e, e}, r);
  if (m.out_proj.bias.defined()) detail::check_parameter("out_proj.bias", m.out_proj.bias, {e}, r);
  if (m.relative_bias) {
    detail::check_parameter("relative_attention_bias.weight", m.relative_bias->weight,
                            {c.num_buckets, c.num_heads}, r);
  }
  if (m.in_proj_weight.defined()) {
    detail::check_parameter("in_proj_weight", m.in_proj_weight, {e + 2 * kv, e}, r);
  } else {
    detail::check_parameter("q_proj_weight", m.q_proj_weight, {e, e}, r);
    detail::check_parameter("k_proj_weight", m.k_proj_weight, {kv, c.kdim}, r);
    detail::check_parameter("v_proj_weight", m.v_proj_weight, {kv, c.vdim}, r);
  }
  if (m.in_proj_bias.defined()) {
    detail::check_parameter("in_proj_bias", m.in_proj_bias, {e + 2 * kv}, r);
  }
}

}  // namespace

MultiHeadAttentionResult MultiHeadAttention::forward(ConstTensorView query, ConstTensorView key,
                                                     ConstTensorView value,
                                                     const MultiHeadAttentionOptions& o) const {
  Reasons r;
  const Call c = check_call(config_, query, key, value, o, r);
  check_projections(*this, r);
  detail::throw_if(r);
  const DType ct = c.ct;
  const std::int64_t e = config_.embed_dim, h = config_.num_heads, hkv = config_.num_kv_heads;
  const std::int64_t dh = head_dim_;

  const Weights w = weights_of(*this, ct);
  const Inputs in = inputs_of(query, key, value, ct);
  Tensor q = project(ct, in.qd, c.batch * c.nq, e, w.wq, w.bq, e, {c.batch, c.nq, h, dh});
  Tensor k = project(ct, in.kd, c.batch * c.nk, config_.kdim, w.wk, w.bk, kv_dim_,
                     {c.batch, c.nk, hkv, dh});
  Tensor v = project(ct, in.vd, c.batch * c.nk, config_.vdim, w.wv, w.bv, kv_dim_,
                     {c.batch, c.nk, hkv, dh});
  if (config_.position == Position::rope) {
    const std::vector<std::int64_t> start(static_cast<std::size_t>(c.batch), 0);
    apply_rope(q, start, config_.rope);
    apply_rope(k, start, config_.rope);
  }

  const MaskPlan plan = plan_masks(o, c.batch, h, c.nq, c.nk, ct);
  MultiHeadAttentionResult result;
  Tensor attn(ct, {c.batch, c.nq, h, dh});
  Tensor lse = o.save_for_backward ? Tensor(ct, {c.batch, h, c.nq}) : Tensor();
  Tensor probs = o.need_weights ? Tensor(ct, {c.batch, h, c.nq, c.nk}) : Tensor();
  attention_into(q, k, v, {attn.view(), lse.view(), probs.view()},
                 attention_options(*this, alibi_, o, plan));

  Tensor out = out_proj.forward(TensorView(attn.view().data(), ct, {c.batch, c.nq, e}));
  result.out = detail::in_dtype(std::move(out), query.dtype());
  if (o.need_weights && o.average_attn_weights) {
    // Mean over heads in a fixed order: [B, H, Nq, Nk] -> [B, Nq, Nk].
    result.weights = Tensor(ct, {c.batch, c.nq, c.nk});
    const std::int64_t plane = c.nq * c.nk;
    for (std::int64_t b = 0; b < c.batch; ++b) {
      for (std::int64_t i = 0; i < plane; ++i) {
        double s = 0.0;
        for (std::int64_t hh = 0; hh < h; ++hh) {
          s += qkv::detail::load(probs.view().data(), ct, (b * h + hh) * plane + i);
        }
        qkv::detail::store(result.weights.view().data(), ct, b * plane + i, s / double(h));
      }
    }
  } else if (o.need_weights) {
    result.weights = std::move(probs);
  }
  if (o.save_for_backward) {
    result.saved = {std::move(q), std::move(k), std::move(v), std::move(attn), std::move(lse)};
  }
  return result;
}

MultiHeadAttentionGradients MultiHeadAttention::backward(ConstTensorView query, ConstTensorView key,
                                                         ConstTensorView value,
                                                         const MultiHeadAttentionSaved& saved,
                                                         ConstTensorView dout,
                                                         const MultiHeadAttentionOptions& o) {
  Reasons r;
  const Call c = check_call(config_, query, key, value, o, r);
  const std::int64_t e = config_.embed_dim, h = config_.num_heads, hkv = config_.num_kv_heads;
  const std::int64_t dh = head_dim_;
  const std::int64_t dout_sizes[] = {c.batch, c.nq, e};
  detail::check_view("dout", dout,
                     {.rank = 3,
                      .sizes = c.known ? std::span<const std::int64_t>(dout_sizes)
                                       : std::span<const std::int64_t>(),
                      .layout = "[B, Nq, E]",
                      .floating = true},
                     r);
  const DType ct = c.ct;
  const auto saved_ok = [&](const char* name, const Tensor& t,
                            std::initializer_list<std::int64_t> sizes) {
    if (!t.defined() || t.dtype() != ct || !has_sizes(t, sizes)) {
      r.push_back(
          std::string("saved.") + name + ": expected " +
          shape_string(std::vector<std::int64_t>(sizes)) + " in " + detail::str(ct) +
          " from forward with save_for_backward and the same inputs, got " +
          (t.defined() ? detail::str(t.dtype()) + " " + detail::shape_of(t) : std::string("none")));
    }
  };
  if (r.empty()) {
    saved_ok("q", saved.q, {c.batch, c.nq, h, dh});
    saved_ok("k", saved.k, {c.batch, c.nk, hkv, dh});
    saved_ok("v", saved.v, {c.batch, c.nk, hkv, dh});
    saved_ok("attn", saved.attn, {c.batch, c.nq, h, dh});
    saved_ok("lse", saved.lse, {c.batch, h, c.nq});
  }
  check_projections(*this, r);
  detail::check_grads(named_parameters(), ct, r);
  detail::throw_if(r);
  // Every gradient buffer first (check_grads has ruled out a dtype clash).
  for (const NamedParameter& p : named_parameters()) detail::grad_of(*p.parameter, ct);

  // Output projection: dA = dout Wo, and Wo's gradients.
  const ConstTensorView attn3(saved.attn.view().data(), ct, {c.batch, c.nq, e});
  const Tensor da = out_proj.backward(attn3, dout);

  // The attention itself.
  const MaskPlan plan = plan_masks(o, c.batch, h, c.nq, c.nk, ct);
  const AttentionOptions ao = attention_options(*this, alibi_, o, plan);
  Tensor dq(ct, {c.batch, c.nq, h, dh}), dk(ct, {c.batch, c.nk, hkv, dh});
  Tensor dv(ct, {c.batch, c.nk, hkv, dh});
  Tensor dtable = relative_bias ? Tensor(ct, {h, config_.num_buckets}) : Tensor();
  attention_backward_into(saved.q, saved.k, saved.v, saved.attn,
                          ConstTensorView(da.view().data(), ct, {c.batch, c.nq, h, dh}), saved.lse,
                          {dq.view(), dk.view(), dv.view(), dtable.view()}, ao);
  if (config_.position == Position::rope) {
    const std::vector<std::int64_t> start(static_cast<std::size_t>(c.batch), 0);
    apply_rope_backward(dq, start, config_.rope);
    apply_rope_backward(dk, start, config_.rope);
  }
  if (relative_bias) relative_bias->backward(dtable);

  // Input projections: dX = dY W, dW += dY^T X, db += column sums of dY.
  const Weights w = weights_of(*this, ct);
  const Inputs in = inputs_of(query, key, value, ct);
  const std::int64_t rq = c.batch * c.nq, rk = c.batch * c.nk;
  MultiHeadAttentionGradients grads;
  const auto input_grad = [&](const Tensor& dy, std::int64_t rows, std::int64_t out,
                              std::int64_t features, const void* weight, std::int64_t length) {
    Tensor dx(ct, {c.batch, length, features});
    detail::gemm(ct, false, false, rows, features, out, 1.0, dy.view().data(), out, weight,
                 features, 0.0, dx.view().data(), features);
    return dx;
  };
  grads.dquery = input_grad(dq, rq, e, e, w.wq, c.nq);
  grads.dkey = input_grad(dk, rk, kv_dim_, config_.kdim, w.wk, c.nk);
  grads.dvalue = input_grad(dv, rk, kv_dim_, config_.vdim, w.wv, c.nk);
  const auto weight_grad = [&](const Tensor& dy, std::int64_t rows, std::int64_t out,
                               std::int64_t features, const void* x, void* g) {
    detail::gemm(ct, true, false, out, features, rows, 1.0, dy.view().data(), out, x, features, 1.0,
                 g, features);
  };
  if (packed()) {
    void* g = detail::grad_of(in_proj_weight, ct).view().data();
    weight_grad(dq, rq, e, e, in.qd, g);
    weight_grad(dk, rk, kv_dim_, e, in.kd, offset(g, ct, e * e));
    weight_grad(dv, rk, kv_dim_, e, in.vd, offset(g, ct, (e + kv_dim_) * e));
  } else {
    weight_grad(dq, rq, e, e, in.qd, detail::grad_of(q_proj_weight, ct).view().data());
    weight_grad(dk, rk, kv_dim_, config_.kdim, in.kd,
                detail::grad_of(k_proj_weight, ct).view().data());
    weight_grad(dv, rk, kv_dim_, config_.vdim, in.vd,
                detail::grad_of(v_proj_weight, ct).view().data());
  }
  if (in_proj_bias.defined()) {
    void* g = detail::grad_of(in_proj_bias, ct).view().data();
    detail::add_column_sums(ct, dq.view().data(), rq, e, g);
    detail::add_column_sums(ct, dk.view().data(), rk, kv_dim_, offset(g, ct, e));
    detail::add_column_sums(ct, dv.view().data(), rk, kv_dim_, offset(g, ct, e + kv_dim_));
  }
  if (query.dtype() != ct) {
    grads.dquery = to_dtype(grads.dquery, query.dtype());
    grads.dkey = to_dtype(grads.dkey, query.dtype());
    grads.dvalue = to_dtype(grads.dvalue, query.dtype());
  }
  return grads;
}

Tensor MultiHeadAttention::forward_step(ConstTensorView x_new, KvCache& cache) const {
  Reasons r;
  const std::int64_t e = config_.embed_dim, h = config_.num_heads, hkv = config_.num_kv_heads;
  const std::int64_t dh = head_dim_;
  if (detail::check_input("x_new", x_new, 3, "[B, n, E]", r)) {
    if (x_new.size(2) != e || x_new.size(1) < 1 || x_new.size(1) > 16) {
      r.push_back("x_new: expected [B, n, E = " + to_string(e) + "] with 1 <= n <= 16, got " +
                  shape_string(x_new.size_span()));
    }
    if (cache.config().batch != x_new.size(0)) {
      r.push_back("cache: holds " + to_string(cache.config().batch) +
                  " sequences, x_new has B = " + to_string(x_new.size(0)));
    }
  }
  const KvCacheConfig& kc = cache.config();
  if (kc.kv_heads != hkv || kc.head_dim != dh || cache.value_dim() != dh) {
    r.push_back("cache: expected kv_heads = " + to_string(hkv) +
                " and head_dim = value_dim = " + to_string(dh) + ", got " + to_string(kc.kv_heads) +
                ", " + to_string(kc.head_dim) + " and " + to_string(cache.value_dim()));
  }
  if (!packed()) {
    r.push_back("forward_step: self-attention only (kdim == vdim == embed_dim)");
  }
  if (config_.position == Position::relative_bias) {
    r.push_back("forward_step: Position::relative_bias is not supported with a KV cache");
  }
  check_projections(*this, r);
  detail::throw_if(r);

  const std::int64_t b = x_new.size(0), n = x_new.size(1);
  const DType ct = detail::compute_dtype(x_new.dtype());
  const Weights w = weights_of(*this, ct);
  const detail::Dense x = detail::dense(x_new, ct);
  Tensor q = project(ct, x.data, b * n, e, w.wq, w.bq, e, {b, n, h, dh});
  const Tensor k = project(ct, x.data, b * n, e, w.wk, w.bk, kv_dim_, {b, n, hkv, dh});
  const Tensor v = project(ct, x.data, b * n, e, w.wv, w.bv, kv_dim_, {b, n, hkv, dh});
  // New token t of sequence s sits at position position(s) + t.
  std::vector<std::int64_t> start(static_cast<std::size_t>(b));
  for (std::int64_t s = 0; s < b; ++s) start[static_cast<std::size_t>(s)] = cache.position(s);
  const bool rope = config_.position == Position::rope;
  if (rope) apply_rope(q, start, config_.rope);
  // Allocated before the append, which is the step's last change of state
  // that a failure could leave behind.
  Tensor attn(ct, {b, n, h, dh});
  cache.append(k, v, {}, rope ? &config_.rope : nullptr);

  AttentionOptions ao;
  ao.alibi_slopes = alibi_;
  decode_attention_into(q, cache, attn, {}, ao);
  Tensor out = out_proj.forward(TensorView(attn.view().data(), ct, {b, n, e}));
  return detail::in_dtype(std::move(out), x_new.dtype());
}

}  // namespace qkv::nn
