// Additive (Bahdanau) attention, one decoder step, as one call of
// qkv::attention with Score::additive (forward) and one of
// qkv::attention_backward (backward): the score, the softmax, the masking of
// padded positions and every derivative are the library's.
#include "qkv/modules/additive.hpp"

#include <limits>
#include <string>
#include <vector>

#include "modules/common.hpp"
#include "qkv/attention.hpp"
#include "qkv/backward.hpp"
#include "qkv/error.hpp"

namespace qkv::nn {

namespace {

struct Geometry {
  std::int64_t batch = 0;
  std::int64_t source = 0;
  std::int64_t hidden = 0;
  std::vector<std::int64_t> lengths;  // [B], resolved (all S when none were given)
  bool known = false;                 // B and S are known (encoder_outputs is usable)
};

Geometry check_inputs(ConstTensorView hidden, ConstTensorView enc,
                      std::span<const std::int64_t> lengths, std::int64_t H, detail::Reasons& r) {
  Geometry g;
  g.hidden = H;
  const bool hid_ok = detail::check_input("decoder_hidden", hidden, 2, "[B, H]", r);
  const bool enc_ok = detail::check_input("encoder_outputs", enc, 3, "[B, S, H]", r);
  if (hid_ok && hidden.size(1) != H) {
    r.push_back("decoder_hidden: expected H = hidden_size = " + std::to_string(H) +
                " in [B, H], got " + shape_string(hidden.size_span()));
  }
  if (enc_ok && enc.size(2) != H) {
    r.push_back("encoder_outputs: expected H = hidden_size = " + std::to_string(H) +
                " in [B, S, H], got " + shape_string(enc.size_span()));
  }
  if (hid_ok && enc_ok && hidden.size(0) != enc.size(0)) {
    r.push_back("encoder_outputs: expected the batch size B = " + std::to_string(hidden.size(0)) +
                " of decoder_hidden, got " + shape_string(enc.size_span()));
  }
  // Only between floating dtypes: check_input has named any other.
  if (hid_ok && enc_ok && hidden.dtype() != enc.dtype() && is_floating(hidden.dtype()) &&
      is_floating(enc.dtype())) {
    r.push_back("decoder_hidden: expected the dtype of encoder_outputs (" +
                detail::str(enc.dtype()) + "), got " + detail::str(hidden.dtype()));
  }
  if (!enc_ok) return g;
  g.known = true;
  g.batch = enc.size(0);
  g.source = enc.size(1);
  if (lengths.empty()) {
    g.lengths.assign(static_cast<std::size_t>(g.batch), g.source);
    return g;
  }
  if (static_cast<std::int64_t>(lengths.size()) != g.batch) {
    r.push_back("source_lengths: expected B = " + std::to_string(g.batch) +
                " entries (or none for all S), got " + std::to_string(lengths.size()));
    return g;
  }
  for (std::size_t b = 0; b < lengths.size(); ++b) {
    if (lengths[b] < 0 || lengths[b] > g.source) {
      r.push_back("source_lengths[" + std::to_string(b) + "]: expected 0 to S = " +
                  std::to_string(g.source) + ", got " + std::to_string(lengths[b]));
    }
  }
  g.lengths.assign(lengths.begin(), lengths.end());
  return g;
}

void check_gradient(const char* name, ConstTensorView d, std::int64_t rows, std::int64_t cols,
                    const char* shape, detail::Reasons& r) {
  if (!detail::check_input(name, d, 2, shape, r)) return;
  if (d.size(0) != rows || d.size(1) != cols) {
    r.push_back(std::string(name) + ": expected " + shape + " = [" + std::to_string(rows) + ", " +
                std::to_string(cols) + "], got " + shape_string(d.size_span()));
  }
}

// The parameters as contiguous values of the compute dtype: w [H, 2H],
// bias [H], v [1, H].
struct Weights {
  detail::Dense w, bias, v;
  Weights(const AdditiveAttention& m, DType dtype)
      : w(detail::dense(m.attn_weight.value, dtype)),
        bias(detail::dense(m.attn_bias.value, dtype)),
        v(detail::dense(m.v_weight.value, dtype)) {}
};

// One step as a call of the library's attention: the decoder state is the
// single query, the encoder outputs are keys and values, the score is
// Score::additive with W_q = columns [H, 2H) of attn.weight and W_k =
// columns [0, H), and the source lengths are the key lengths (views of
// the compute dtype into `hid`, `enc` and `p`, which must outlive the call).
struct Call {
  ConstTensorView q;  // [B, 1, 1, H], the decoder state
  ConstTensorView k;  // [B, S, 1, H], the encoder outputs
  AttentionOptions options;
};

Call make_call(const Weights& p, const Geometry& g, DType dtype, const detail::Dense& hid,
               const detail::Dense& enc) {
  const std::int64_t B = g.batch, S = g.source, H = g.hidden;
  const auto* w = static_cast<const char*>(p.w.data);
  const std::int64_t row[] = {2 * H, 1}, size_h[] = {H, H}, size_v[] = {H};
  Call c;
  c.q = ConstTensorView(hid.data, dtype, {B, 1, 1, H});
  c.k = ConstTensorView(enc.data, dtype, {B, S, 1, H});
  c.options.score = Score::additive;
  c.options.additive.w_q =
      ConstTensorView(w + H * static_cast<std::int64_t>(dtype_size(dtype)), dtype, size_h, row);
  c.options.additive.w_k = ConstTensorView(w, dtype, size_h, row);
  c.options.additive.v = ConstTensorView(p.v.data, dtype, size_v);
  c.options.additive.bias = ConstTensorView(p.bias.data, dtype, size_v);
  c.options.key_lengths = g.lengths;
  return c;
}

// to[r * to_ld + c] += from[r * from_ld + c] for r < rows, c < cols:
// gradients accumulate across backward calls.
template <class T>
void add_block(const Tensor& from, std::int64_t from_ld, std::int64_t rows, std::int64_t cols,
               T* to, std::int64_t to_ld) {
  const T* f = from.data<T>();
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < cols; ++c) to[r * to_ld + c] += f[r * from_ld + c];
  }
}

}  // namespace

AdditiveAttention::AdditiveAttention(std::int64_t hidden_size, DType dtype) : hidden_(hidden_size) {
  detail::Reasons r;
  if (hidden_size < 1 || hidden_size > std::numeric_limits<std::int64_t>::max() / 2) {
    r.push_back("hidden_size: expected >= 1 (and 2 * hidden_size within int64), got " +
                std::to_string(hidden_size));
  }
  detail::check_floating("dtype", dtype, r);
  detail::throw_if(r);
  attn_weight = make_parameter(dtype, {hidden_, 2 * hidden_});
  attn_bias = make_parameter(dtype, {hidden_});
  v_weight = make_parameter(dtype, {1, hidden_});
}

namespace {

// Reasons the public parameters no longer have this module's shapes.
void check_additive_parameters(const AdditiveAttention& m, detail::Reasons& r) {
  const std::int64_t h = m.hidden_size();
  detail::check_parameter("attn.weight", m.attn_weight, {h, 2 * h}, r);
  detail::check_parameter("attn.bias", m.attn_bias, {h}, r);
  detail::check_parameter("v.weight", m.v_weight, {1, h}, r);
}

}  // namespace

AdditiveAttentionOutput AdditiveAttention::forward(
    ConstTensorView decoder_hidden, ConstTensorView encoder_outputs,
    std::span<const std::int64_t> source_lengths) const {
  detail::Reasons r;
  const Geometry g = check_inputs(decoder_hidden, encoder_outputs, source_lengths, hidden_, r);
  check_additive_parameters(*this, r);
  detail::throw_if(r);

  const DType in = encoder_outputs.dtype(), ct = detail::compute_dtype(in);
  const detail::Dense hid = detail::dense(decoder_hidden, ct);
  const detail::Dense enc = detail::dense(encoder_outputs, ct);
  AdditiveAttentionOutput out{Tensor(ct, {g.batch, hidden_}), Tensor(ct, {g.batch, g.source})};
  const Weights p(*this, ct);
  const Call c = make_call(p, g, ct, hid, enc);
  // context [B, H] is out [B, 1, 1, H]; weights [B, S] are probs [B, 1, 1, S].
  attention_into(c.q, c.k, c.k,
                 {TensorView(out.context.view().data(), ct, {g.batch, 1, 1, hidden_}),
                  {},
                  TensorView(out.weights.view().data(), ct, {g.batch, 1, 1, g.source})},
                 c.options);
  if (in != ct) {
    out.context = to_dtype(out.context, in);
    out.weights = to_dtype(out.weights, in);
  }
  return out;
}

AdditiveAttentionGradients AdditiveAttention::backward(ConstTensorView decoder_hidden,
                                                       ConstTensorView encoder_outputs,
                                                       std::span<const std::int64_t> source_lengths,
                                                       ConstTensorView d_context,
                                                       ConstTensorView d_weights) {
  detail::Reasons r;
  const Geometry g = check_inputs(decoder_hidden, encoder_outputs, source_lengths, hidden_, r);
  if (g.known) {
    check_gradient("d_context", d_context, g.batch, hidden_, "[B, H]", r);
    if (d_weights.defined()) check_gradient("d_weights", d_weights, g.batch, g.source, "[B, S]", r);
  }
  check_additive_parameters(*this, r);
  const DType in = encoder_outputs.dtype(), ct = detail::compute_dtype(in);
  if (g.known) detail::check_grads(named_parameters(), ct, r);
  detail::throw_if(r);

  const std::int64_t B = g.batch, S = g.source, H = hidden_;
  const detail::Dense hid = detail::dense(decoder_hidden, ct);
  const detail::Dense enc = detail::dense(encoder_outputs, ct);
  const Weights p(*this, ct);
  const Call c = make_call(p, g, ct, hid, enc);
  // Values: the encoder outputs, and with d_weights also the identity
  // [B, S, 1, H + S] = [enc | I_S], whose output columns are the weights
  // themselves, so that d_weights enters as their dout; d_context and
  // d_weights form dout [B, 1, 1, Dv].
  const std::int64_t Dv = d_weights.defined() ? H + S : H;
  Tensor douts(ct, {B, Dv}), values_storage;
  copy(d_context, douts.view().slice(1, 0, H));
  ConstTensorView values = c.k;
  if (d_weights.defined()) {
    copy(d_weights, douts.view().slice(1, H, S));
    values_storage = Tensor(ct, {B, S, Dv});
    copy(ConstTensorView(enc.data, ct, {B, S, H}), values_storage.view().slice(2, 0, H));
    for (std::int64_t b = 0; b < B; ++b) {
      for (std::int64_t s = 0; s < S; ++s) values_storage.set({b, s, H + s}, 1.0);
    }
    values = ConstTensorView(values_storage.view().data(), ct, {B, S, 1, Dv});
  }
  const ConstTensorView dout(douts.view().data(), ct, {B, 1, 1, Dv});
  // dq is d_decoder_hidden [B, H] and dk the key part of d_encoder_outputs;
  // the value part (the first H columns of dv) is added to it.
  AdditiveAttentionGradients out{Tensor(ct, {B, H}), Tensor(ct, {B, S, H})};
  Tensor dv(ct, {B, S, 1, Dv}), d_w_q(ct, {H, H}), d_w_k(ct, {H, H}), d_v(ct, {H});
  Tensor d_bias(ct, {H});
  // Without the forward's out and lse: the fast additive backward computes
  // the weights from its own projections (no separate forward pass).
  attention_backward_into(c.q, c.k, values, {}, dout, {},
                          {TensorView(out.d_decoder_hidden.view().data(), ct, {B, 1, 1, H}),
                           TensorView(out.d_encoder_outputs.view().data(), ct, {B, S, 1, H}),
                           dv,
                           {},
                           d_w_q,
                           d_w_k,
                           d_v,
                           d_bias},
                          c.options);
  const auto run = [&](auto zero) {
    using T = decltype(zero);
    add_block<T>(dv, Dv, B * S, H, out.d_encoder_outputs.data<T>(), H);
    T* g_w = detail::grad_of(attn_weight, ct).data<T>();
    add_block<T>(d_w_k, H, H, H, g_w, 2 * H);
    add_block<T>(d_w_q, H, H, H, g_w + H, 2 * H);
    add_block<T>(d_bias, H, 1, H, detail::grad_of(attn_bias, ct).data<T>(), H);
    add_block<T>(d_v, H, 1, H, detail::grad_of(v_weight, ct).data<T>(), H);
  };
  if (ct == DType::f64) {
    run(0.0);
  } else {
    run(0.0f);
  }
  if (in != ct) {
    out.d_decoder_hidden = to_dtype(out.d_decoder_hidden, in);
    out.d_encoder_outputs = to_dtype(out.d_encoder_outputs, in);
  }
  return out;
}

NamedParameters AdditiveAttention::named_parameters(std::string_view prefix) {
  const std::string p(prefix);
  return {{p + "attn.weight", &attn_weight},
          {p + "attn.bias", &attn_bias},
          {p + "v.weight", &v_weight}};
}

}  // namespace qkv::nn
