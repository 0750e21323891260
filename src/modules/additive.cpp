// Additive (Bahdanau) attention, one decoder step: two GEMMs on the split
// attn.weight (W_e over all B * S encoder rows, W_h over the B hidden
// states), then per row tanh, the v projection, a softmax over the valid
// positions and the weighted sum of encoder outputs.
#include "qkv/modules/additive.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "modules/common.hpp"
#include "qkv/error.hpp"

namespace qkv::nn {

namespace {

struct Geometry {
  std::int64_t batch = 0;
  std::int64_t source = 0;
  std::int64_t hidden = 0;
  std::vector<std::int64_t> lengths;  // [B], resolved (all S when none were given)
  bool known = false;                 // B and S are known (encoder_outputs is usable)

  // Whether the per-row loops use OpenMP threads: below 2^14 encoder
  // elements waking the team costs more than the loops.
  bool threaded() const { return batch * source * hidden >= (1 << 14); }
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

// What the forward computes and the backward reuses.
template <class T>
struct Step {
  std::vector<T> energy;   // [B * S, H] tanh(...) at valid positions
  std::vector<T> weights;  // [B * S], 0 at padded positions
};

// The parameters as contiguous values of T: w [H, 2H], bias [H], v [H].
template <class T>
struct Weights {
  detail::Dense w, bias, v;
  explicit Weights(const AdditiveAttention& m)
      : w(detail::dense(m.attn_weight.value, dtype_of_v<T>)),
        bias(detail::dense(m.attn_bias.value, dtype_of_v<T>)),
        v(detail::dense(m.v_weight.value, dtype_of_v<T>)) {}
  const T* we() const { return static_cast<const T*>(w.data); }  // columns [0, H)
  const T* wh(std::int64_t H) const { return we() + H; }         // columns [H, 2H)
  const T* b() const { return static_cast<const T*>(bias.data); }
  const T* vv() const { return static_cast<const T*>(v.data); }
};

// Energies, weights and (when context is not null) the context [B, H].
template <class T>
Step<T> step_forward(const Weights<T>& p, const Geometry& g, const T* hid, const T* enc,
                     T* context) {
  constexpr DType dt = dtype_of_v<T>;
  const std::int64_t B = g.batch, S = g.source, H = g.hidden;
  Step<T> st{std::vector<T>(static_cast<std::size_t>(B * S * H)),
             std::vector<T>(static_cast<std::size_t>(B * S))};
  // energy = enc W_e^T (one GEMM over all rows); q = hidden W_h^T + bias.
  detail::gemm(dtype_of_v<T>, false, true, B * S, H, H, 1.0, enc, H, p.we(), 2 * H, 0.0,
               st.energy.data(), H);
  std::vector<T> q(static_cast<std::size_t>(B * H));
  detail::add_row(dt, q.data(), B, H, p.b());
  detail::gemm(dtype_of_v<T>, false, true, B, H, H, 1.0, hid, H, p.wh(H), 2 * H, 1.0, q.data(), H);

  const T* v = p.vv();
#pragma omp parallel for schedule(static) if (g.threaded())
  for (std::int64_t b = 0; b < B; ++b) {
    const std::int64_t len = g.lengths[static_cast<std::size_t>(b)];
    T* w = st.weights.data() + b * S;
    T top = -std::numeric_limits<T>::infinity();
    for (std::int64_t s = 0; s < len; ++s) {
      T* e = st.energy.data() + (b * S + s) * H;
      const T* qb = q.data() + b * H;
      T score = 0;
      for (std::int64_t h = 0; h < H; ++h) {
        e[h] = std::tanh(e[h] + qb[h]);
        score += v[h] * e[h];
      }
      w[s] = score;
      top = std::max(top, score);
    }
    // Max-subtracted softmax over the valid positions; padded ones stay 0.
    T sum = 0;
    for (std::int64_t s = 0; s < len; ++s) {
      w[s] = std::exp(w[s] - top);
      sum += w[s];
    }
    for (std::int64_t s = 0; s < len; ++s) w[s] /= sum;
    if (context == nullptr) continue;
    T* ctx = context + b * H;
    for (std::int64_t s = 0; s < len; ++s) {
      const T* es = enc + (b * S + s) * H;
      for (std::int64_t h = 0; h < H; ++h) ctx[h] += w[s] * es[h];
    }
  }
  return st;
}

template <class T>
void step_backward(AdditiveAttention& m, const Geometry& g, const T* hid, const T* enc,
                   const T* d_context, const T* d_weights, T* d_hid, T* d_enc) {
  constexpr DType dt = dtype_of_v<T>;
  const std::int64_t B = g.batch, S = g.source, H = g.hidden;
  const Weights<T> p(m);
  const Step<T> st = step_forward(p, g, hid, enc, static_cast<T*>(nullptr));
  const T* v = p.vv();
  T* g_w = static_cast<T*>(detail::grad_of(m.attn_weight, dt).view().data());
  T* g_b = static_cast<T*>(detail::grad_of(m.attn_bias, dt).view().data());
  T* g_v = static_cast<T*>(detail::grad_of(m.v_weight, dt).view().data());

  // Per row: d weights (the context's and the caller's), the softmax's
  // d score, then d_pre = d score * v * (1 - e^2) [B * S, H] (0 at padded
  // positions), d_enc's context path w * d_context, and dq = sum_s d_pre.
  std::vector<T> d_score(static_cast<std::size_t>(B * S));
  std::vector<T> d_pre(static_cast<std::size_t>(B * S * H));
  std::vector<T> dq(static_cast<std::size_t>(B * H));
#pragma omp parallel for schedule(static) if (g.threaded())
  for (std::int64_t b = 0; b < B; ++b) {
    const std::int64_t len = g.lengths[static_cast<std::size_t>(b)];
    const T* w = st.weights.data() + b * S;
    const T* dc = d_context + b * H;
    T* ds = d_score.data() + b * S;
    T dot = 0;
    for (std::int64_t s = 0; s < len; ++s) {
      const T* es = enc + (b * S + s) * H;
      T dw = d_weights != nullptr ? d_weights[b * S + s] : T(0);
      for (std::int64_t h = 0; h < H; ++h) dw += dc[h] * es[h];
      ds[s] = dw;
      dot += w[s] * dw;
    }
    T* dqb = dq.data() + b * H;
    for (std::int64_t s = 0; s < len; ++s) {
      ds[s] = w[s] * (ds[s] - dot);
      const T* e = st.energy.data() + (b * S + s) * H;
      T* dp = d_pre.data() + (b * S + s) * H;
      T* de = d_enc + (b * S + s) * H;
      for (std::int64_t h = 0; h < H; ++h) {
        dp[h] = ds[s] * v[h] * (T(1) - e[h] * e[h]);
        dqb[h] += dp[h];
        de[h] = w[s] * dc[h];
      }
    }
  }
  // v.weight and attn.bias, rows in order.
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t s = 0; s < g.lengths[static_cast<std::size_t>(b)]; ++s) {
      const T* e = st.energy.data() + (b * S + s) * H;
      const T* dp = d_pre.data() + (b * S + s) * H;
      const T d = d_score[b * S + s];
      for (std::int64_t h = 0; h < H; ++h) {
        g_v[h] += d * e[h];
        g_b[h] += dp[h];
      }
    }
  }
  // W_e (columns [0, H) of the [H, 2H] gradient) over each row's valid
  // positions only, so that whatever padded positions hold never enters;
  // W_h (columns [H, 2H)) from dq and the hidden states.
  for (std::int64_t b = 0; b < B; ++b) {
    detail::gemm(dtype_of_v<T>, true, false, H, H, g.lengths[static_cast<std::size_t>(b)], 1.0,
                 d_pre.data() + b * S * H, H, enc + b * S * H, H, 1.0, g_w, 2 * H);
  }
  detail::gemm(dtype_of_v<T>, true, false, H, H, B, 1.0, dq.data(), H, hid, H, 1.0, g_w + H, 2 * H);
  // d_hidden = dq W_h; d_enc += d_pre W_e (adds 0 at padded positions).
  detail::gemm(dtype_of_v<T>, false, false, B, H, H, 1.0, dq.data(), H, p.wh(H), 2 * H, 0.0, d_hid,
               H);
  detail::gemm(dtype_of_v<T>, false, false, B * S, H, H, 1.0, d_pre.data(), H, p.we(), 2 * H, 1.0,
               d_enc, H);
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
  const auto run = [&](auto zero) {
    using T = decltype(zero);
    const Step<T> st = step_forward(Weights<T>(*this), g, static_cast<const T*>(hid.data),
                                    static_cast<const T*>(enc.data), out.context.data<T>());
    std::copy(st.weights.begin(), st.weights.end(), out.weights.data<T>());
  };
  if (ct == DType::f64) {
    run(0.0);
  } else {
    run(0.0f);
  }
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

  const detail::Dense hid = detail::dense(decoder_hidden, ct);
  const detail::Dense enc = detail::dense(encoder_outputs, ct);
  const detail::Dense dc = detail::dense(d_context, ct);
  const detail::Dense dw = d_weights.defined() ? detail::dense(d_weights, ct) : detail::Dense{};
  AdditiveAttentionGradients out{Tensor(ct, {g.batch, hidden_}),
                                 Tensor(ct, {g.batch, g.source, hidden_})};
  const auto run = [&](auto zero) {
    using T = decltype(zero);
    step_backward(*this, g, static_cast<const T*>(hid.data), static_cast<const T*>(enc.data),
                  static_cast<const T*>(dc.data), static_cast<const T*>(dw.data),
                  out.d_decoder_hidden.data<T>(), out.d_encoder_outputs.data<T>());
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
